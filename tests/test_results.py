"""benchmarks/results.py: the results store, RESULTS.md's tables against their JSON files, and
every `X.md#anchor` link of the repository against the headings it names (no JAX here)."""
import json
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))

import results  # noqa: E402


def _check(*args):
    return subprocess.run([sys.executable, str(BENCH / "results.py"), "check", *args],
                          capture_output=True, text=True, timeout=120)


def test_results_md_agrees_with_its_json_files():
    p = _check()
    assert p.returncode == 0, p.stderr


@pytest.fixture
def copies(tmp_path):
    """RESULTS.md and benchmarks/results/ copied, for altering."""
    shutil.copy(BENCH / "RESULTS.md", tmp_path / "RESULTS.md")
    shutil.copytree(BENCH / "results", tmp_path / "results")
    return tmp_path / "RESULTS.md", tmp_path / "results"


def test_check_fails_when_a_json_value_changes(copies):
    doc, res = copies
    path = res / "epoch-cpu-zen4.json"
    data = json.loads(path.read_text())
    data["rows"][0]["ratio"] = 0.01
    path.write_text(json.dumps(data))
    p = _check("--doc", str(doc), "--results", str(res))
    assert p.returncode == 1 and "table epoch: differs from its JSON files" in p.stderr, p.stderr
    assert "0.01x" in p.stderr


def test_check_fails_when_a_table_is_edited_by_hand(copies):
    doc, res = copies
    text = doc.read_text()
    doc.write_text(text.replace("| fine-tuning epoch |", "| fine-tuning epoch (edited) |", 1))
    p = _check("--doc", str(doc), "--results", str(res))
    assert p.returncode == 1 and "table epoch" in p.stderr, p.stderr
    assert _check("--doc", str(BENCH / "RESULTS.md"), "--results", str(res)).returncode == 0


def test_check_fails_on_a_result_file_no_table_shows(copies):
    doc, res = copies
    results.record("new_bench", "cpu-zen4", [{"case": "a", "s": 1.5}], ["case"], root=str(res))
    p = _check("--doc", str(doc), "--results", str(res))
    assert p.returncode == 1 and "new_bench-cpu-zen4.json: no table" in p.stderr, p.stderr


def test_render_rewrites_the_tables_from_the_files(copies):
    doc, res = copies
    doc.write_text(re.sub(r"(<!-- table:inference [^\n]*-->\n).*?(<!-- end -->)", r"\1\2",
                          doc.read_text(), flags=re.S))
    assert _check("--doc", str(doc), "--results", str(res)).returncode == 1
    p = subprocess.run([sys.executable, str(BENCH / "results.py"), "render", "--doc", str(doc),
                        "--results", str(res)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert doc.read_text() == (BENCH / "RESULTS.md").read_text()


def _rows(path):
    return {r["task"]: r for r in json.loads(pathlib.Path(path).read_text())["rows"]}


def test_record_replaces_only_the_rows_with_its_keys(tmp_path):
    meta = {"command": "python benchmarks/x.py", "cpu": "CPU A", "date": "2026-01-01"}
    p = results.record("x", "cpu-zen4", [{"task": "mrpc", "s": 1.0}, {"task": "sst2", "s": 2.0}],
                       ["task"], meta, root=str(tmp_path))
    assert pathlib.Path(p) == tmp_path / "x-cpu-zen4.json"
    results.record("x", "cpu-zen4", [{"task": "mrpc", "s": 0.5}, {"task": "stsb", "s": 3.0}],
                   ["task"], dict(meta, date="2026-01-02"), root=str(tmp_path))
    rows = _rows(p)
    assert [t for t in rows] == ["mrpc", "sst2", "stsb"]   # replaced in place, new keys last
    assert (rows["mrpc"]["s"], rows["mrpc"]["run"]) == (0.5, 2)
    assert (rows["sst2"]["s"], rows["sst2"]["run"]) == (2.0, 1)
    assert [r["date"] for r in json.loads(pathlib.Path(p).read_text())["runs"]] == \
        ["2026-01-01", "2026-01-02"]
    # A run whose rows were all replaced leaves the file.
    results.record("x", "cpu-zen4", [{"task": "sst2", "s": 1.9}], ["task"], meta,
                   root=str(tmp_path))
    data = json.loads(pathlib.Path(p).read_text())
    assert [r["id"] for r in data["runs"]] == [2, 3]
    assert not [f for f in tmp_path.iterdir() if f.name.startswith(".tmp")]   # atomic writes
    other = results.record("x", "gpu-h200", [{"task": "mrpc", "s": 0.1}], ["task"], meta,
                           root=str(tmp_path))
    assert _rows(other)["mrpc"]["s"] == 0.1 and _rows(p)["mrpc"]["s"] == 0.5


@pytest.mark.parametrize("rows,key,msg", [
    ([{"task": "a", "s": [1, 2]}], ["task"], "JSON scalars"),
    ([{"s": 1.0}], ["task"], "lacks its key field"),
    ([{"task": "a"}, {"task": "a"}], ["task"], "two rows of one measurement"),
    ([], ["task"], "no rows"),
    ([{"task": "a", "run": 3}], ["task"], "'run' is the store's own field"),
])
def test_record_refuses_bad_rows_in_one_line(tmp_path, rows, key, msg):
    with pytest.raises(results.ResultsError, match=msg) as e:
        results.record("x", "cpu-zen4", rows, key, root=str(tmp_path))
    assert "\n" not in str(e.value)
    assert not list(tmp_path.iterdir())


def test_record_refuses_another_key_and_bad_names(tmp_path):
    results.record("x", "cpu-zen4", [{"task": "a", "s": 1}], ["task"], root=str(tmp_path))
    with pytest.raises(results.ResultsError, match=r"keys its rows by \['task'\]"):
        results.record("x", "cpu-zen4", [{"task": "a", "dtype": "f", "s": 1}], ["task", "dtype"],
                       root=str(tmp_path))
    with pytest.raises(results.ResultsError, match="machine kind 'CPU Zen4'"):
        results.record("x", "CPU Zen4", [{"task": "a"}], ["task"], root=str(tmp_path))


def test_merge_records_each_run_of_a_file_made_elsewhere(tmp_path):
    there, here = tmp_path / "there", tmp_path / "here"
    results.record("x", "gpu-h200", [{"task": "a", "s": 1}, {"task": "b", "s": 2}], ["task"],
                   {"date": "d1"}, root=str(there))
    results.record("x", "gpu-h200", [{"task": "a", "s": 3}], ["task"], {"date": "d2"},
                   root=str(there))
    results.record("x", "gpu-h200", [{"task": "c", "s": 9}], ["task"], {"date": "d0"},
                   root=str(here))
    results.merge([str(there / "x-gpu-h200.json")], root=str(here))
    data = json.loads((here / "x-gpu-h200.json").read_text())
    assert {r["task"]: r["s"] for r in data["rows"]} == {"c": 9, "a": 3, "b": 2}
    assert [r["date"] for r in data["runs"]] == ["d0", "d1", "d2"]


def test_tables_pivot_order_and_show_their_runs(tmp_path):
    meta = {"date": "2026-01-01", "command": "python benchmarks/x.py", "cpu": "CPU A"}
    for dtype, s in (("bfloat16", 0.5), ("float32", 1.25)):
        results.record("x", "cpu-zen4", [{"task": "mrpc", "dtype": dtype, "s": s, "ok": True},
                                         {"task": "sst2", "dtype": dtype, "s": None, "ok": False}],
                       ["task", "dtype"], meta, root=str(tmp_path))
    doc = ("<!-- table:x order=dtype:float32/bfloat16 rows=task pivot=machine,dtype "
           'cell="{s} s" -->\n<!-- end -->\n<!-- table:x where=dtype:float32 cols=task,s,ok -->\n'
           "<!-- end -->\n")
    out = results.render_doc(doc, root=str(tmp_path))
    assert "| task | cpu-zen4 float32 | cpu-zen4 bfloat16 |\n|---|---:|---:|\n" \
           "| mrpc | 1.25 s | 0.5 s |\n| sst2 |  |  |\n" in out
    assert "| task | s | ok |\n|---|---:|---|\n| mrpc | 1.25 | yes |\n| sst2 |  | no |\n" in out
    assert "- cpu-zen4#2: 2026-01-01; CPU A; `python benchmarks/x.py`." in out
    assert results.check_doc(out, root=str(tmp_path)) == []
    with pytest.raises(results.ResultsError, match="option 'colls=task'"):
        results.render_doc("<!-- table:x colls=task -->\n<!-- end -->\n", root=str(tmp_path))


@pytest.mark.parametrize("vendor,family,model,kind", [
    ("AuthenticAMD", 25, 1, "cpu-zen3"), ("AuthenticAMD", 25, 17, "cpu-zen4"),
    ("AuthenticAMD", 25, 97, "cpu-zen4"), ("AuthenticAMD", 26, 2, "cpu-zen5"),
    ("AuthenticAMD", 23, 49, "cpu-zen2"), ("GenuineIntel", 6, 143, "cpu-intel-spr"),
    ("GenuineIntel", 6, 207, "cpu-intel-emr"), ("GenuineIntel", 6, 173, "cpu-intel-gnr"),
    ("GenuineIntel", 6, 167, "cpu-intel-f6m167"), ("CentaurHauls", 7, 1, "cpu-centaurhauls-f7m1"),
])
def test_machine_kind_from_cpuinfo(tmp_path, monkeypatch, vendor, family, model, kind):
    monkeypatch.delenv("JTB_MACHINE_KIND", raising=False)
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\n"
                    f"model\t\t: {model}\nmodel name\t: Some CPU\n\nprocessor\t: 1\n")
    assert results.machine_kind(info=results.cpuinfo(str(info))) == kind
    assert results.machine_kind("cpu", results.cpuinfo(str(info))) == kind
    assert results.cpu_description(results.cpuinfo(str(info))).startswith(
        f"Some CPU (family {family} model {model}, ")


def test_machine_kind_of_accelerators_and_the_override(monkeypatch):
    monkeypatch.delenv("JTB_MACHINE_KIND", raising=False)
    assert results.machine_kind("NVIDIA H200") == "gpu-h200"
    assert results.machine_kind("NVIDIA H100 80GB HBM3") == "gpu-h100"
    assert results.machine_kind("TPU v4") == "tpu-v4"
    assert results.machine_kind(info={}) == "cpu-unknown"
    monkeypatch.setenv("JTB_MACHINE_KIND", "cpu-zen4")
    assert results.machine_kind("NVIDIA H200") == "cpu-zen4"


def test_command_line_leaves_out_where_the_output_went():
    argv = ["benchmarks/epoch.py", "--tasks", "mrpc", "--json", "x.json", "--record",
            "--override=--config.a=[(0,0)]"]
    assert results.command_line(argv) == \
        "python benchmarks/epoch.py --tasks mrpc '--override=--config.a=[(0,0)]'"


def _epoch_run(device=None):
    run = lambda wall, steps: {"wall_s": wall, "cpu_s": 2 * wall, "steps": steps,  # noqa: E731
                               "marks": {}, "load_before": 1.0, "load_after": 1.0}
    steps = [{"stage": "tinybert_pred", "s_per_step": 0.5, "torch_s_per_step": 0.6,
              "gflop_per_step": 100.0}]
    task = {"num_train": 3200, "train_subset": 0, "seq": 64,
            "official": [{"prediction": 0.8, "intermediate": 0.9}] if not device else [],
            "step_bench": [] if device else [{"results": steps,
                                               "matmul_peak": {"jax_flop_s": 300e9}}],
            "ours": {"finetune": run(100.0, 100), "pred": run(25.0, 99)}}
    machine = {"cpu": "AMD EPYC", "cpu_family": "25", "cpu_model": "17", "nproc": 2}
    if device:
        machine["device"] = device
    return {"date": "2026-01-02T03:04:05+00:00", "machine": machine, "dtype": "float32",
            "command": "benchmarks/epoch.py --tasks sst2 --json e.json --scratch /tmp/s --record",
            "load_start": 1.0, "load_end": 1.0, "tasks": {"sst2": task}}


def test_epoch_records_the_rows_of_its_table(tmp_path, monkeypatch):
    """benchmarks/epoch.py --record: a row per row of its table (the ratio as the table shows
    it), under the machine kind of the run's CPU; a GPU run, with no reference timed there,
    keeps its epochs' wall times under the GPU's kind."""
    import epoch

    monkeypatch.setenv("JTB_RESULTS_DIR", str(tmp_path))
    monkeypatch.delenv("JTB_MACHINE_KIND", raising=False)
    path = epoch.record(_epoch_run())
    assert pathlib.Path(path).name == "epoch-cpu-zen4.json"
    data = json.loads(pathlib.Path(path).read_text())
    rows = {r["measure"]: r for r in data["rows"]}
    table = {r["measure"] for r in epoch.summarise(_epoch_run())}
    assert set(rows) == table | {"fine-tuning epoch"}   # no PyTorch loop timed: its wall alone
    pred = rows["prediction after intermediate"]
    assert (pred["reference_s"], pred["ratio"], pred["unit"], pred["target"], pred["met"]) == \
        (80.0, 3.2, "x", ">= 6x", False)   # 100 official steps of 0.8 s against 25 s
    assert rows["pred step, T 64, % of best matmul"]["ratio"] == 67   # 200 of 300 GFLOP/s
    assert (rows["fine-tuning epoch"]["ours_s"], rows["fine-tuning epoch"]["ratio"]) == (100.0, None)
    assert data["runs"][0]["command"] == "python benchmarks/epoch.py --tasks sst2"
    assert data["runs"][0]["date"] == "2026-01-02 03:04 UTC"
    gpu = json.loads(pathlib.Path(epoch.record(_epoch_run("NVIDIA H200"))).read_text())
    assert gpu["machine"] == "gpu-h200"
    assert {r["measure"]: (r["ours_s"], r["ratio"]) for r in gpu["rows"]} == \
        {"fine-tuning epoch": (100.0, None), "prediction after intermediate": (25.0, None)}


# --------------------------------------------------------------------------- links

def anchors(markdown: str) -> set:
    """The anchors GitHub gives a markdown file's headings: the text lower-cased, punctuation
    but hyphens and underscores removed, spaces to hyphens; a repeated one gets -1, -2, ..."""
    out, seen, fence = set(), {}, False
    for line in markdown.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fence = not fence
            continue
        m = None if fence else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))   # a link: its text
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_anchors_follow_githubs_rule():
    text = ("# Benchmark results\n## The recipe's accuracy choices\n## Train step (CPU)\n"
            "```\n# not a heading\n```\n## Start-up, exit, and `gs://` tiers\n## Train step (CPU)\n")
    assert anchors(text) == {"benchmark-results", "the-recipes-accuracy-choices",
                             "train-step-cpu", "start-up-exit-and-gs-tiers", "train-step-cpu-1"}


_LINK = re.compile(r"([\w./-]*\.md)#([\w-]+)")


def _tracked_text_files():
    try:
        out = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the link check reads `git ls-files`")
    for name in filter(None, out.decode().split("\0")):
        path = REPO / name
        if path == pathlib.Path(__file__) or not path.is_file():
            continue
        try:
            yield path, path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue


def _target(source: pathlib.Path, link: str):
    """The file a link names: beside its source, from the repository root, or, for a bare
    name as code writes it (`RESULTS.md#...`), under benchmarks/ or docs/."""
    for base in (source.parent, REPO, REPO / "benchmarks", REPO / "docs"):
        if (base / link).is_file():
            return (base / link).resolve()
    return None


def test_every_anchored_markdown_link_resolves():
    """`RESULTS.md#heading`, `docs/data.md#heading`, `design.md#heading` ... in every tracked
    file (code, docs, tests, configs): the file exists and has that heading."""
    bad, seen = [], 0
    cache = {}
    for path, text in _tracked_text_files():
        for m in _LINK.finditer(text):
            start = text.rfind(" ", 0, m.start()) + 1
            if "://" in text[start:m.start()]:
                continue   # a URL elsewhere
            seen += 1
            where = f"{path.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}"
            target = _target(path, m.group(1))
            if target is None:
                bad.append(f"{where}: {m.group(0)}: no file {m.group(1)}")
                continue
            if target not in cache:
                cache[target] = anchors(target.read_text(encoding="utf-8"))
            if m.group(2) not in cache[target]:
                bad.append(f"{where}: {m.group(0)}: no such heading in "
                           f"{target.relative_to(REPO)}")
    assert seen > 0
    assert not bad, "\n".join(bad)


# Work-log labels (a numbered work session or issue) mean nothing to a reader of the repository.
_LABEL = re.compile("sess" + r"ions? [0-9]+|" + "iss" + r"ues? #?[0-9]+", re.I)
LABEL_FREE = ("benchmarks/", "docs/", "README.md", "configs/", "launch/", "Makefile", ".ci/",
              "pyproject.toml")


def test_no_work_log_labels_in_results_docs_and_configs():
    bad = []
    for path, text in _tracked_text_files():
        name = str(path.relative_to(REPO))
        if not name.startswith(LABEL_FREE) or name == "docs/design.md":
            continue
        for m in _LABEL.finditer(text):
            bad.append(f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}")
        if _LABEL.search(name.replace("_", " ")):
            bad.append(f"{name}: a file named after one")
    assert not bad, "\n".join(bad)
