"""The end-to-end benchmarks cannot rot: benchmarks/glue.py (--budget small, one task, every
stage including the DA wiring with a random tiny MLM) and benchmarks/inference.py (--smoke) run
in subprocesses, as users run them. Results are checked for shape, never for quality."""
import json
import os
import pathlib
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from helpers import tiny_run  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]


def _run(args, tmp_path, timeout):
    # Shapes, not speed, are checked: the test process's XLA_FLAGS, which tests/conftest.py gave
    # XLA's cheapest backend optimisation (compiling is most of these runs).
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable] + args, cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    return p.stdout


def test_glue_small_budget_end_to_end(tmp_path, glue_dir, shared_dir, teacher_dir):
    """Every stage of the benchmark's pipeline, wired: a tiny random 3-layer teacher (PKD's
    student takes its layers 1-3) and the tiny student (with the packaged MiniLM and the small
    student: 133 s instead of 77 s on one core, the same stages)."""
    out = tmp_path / "glue.md"
    wd = tmp_path / "wd"
    teacher = tiny_run.tiny_teacher(tmp_path / "tiny-teacher", layers=3)
    args = [str(REPO / "benchmarks" / "glue.py"), "--budget", "small", "--tasks", "sst2",
            "--glue_dir", str(glue_dir), "--corpus", str(shared_dir / "data" / "corpus"),
            "--workdir", str(wd), "--mlm", "random-tiny", "--train_subset", "24",
            "--eval_subset", "16", "--teacher", teacher, "--student", "tiny", "--out", str(out)]
    stdout = _run(args, tmp_path, timeout=600)
    table = out.read_text()
    assert table in stdout
    rows = [line for line in table.splitlines() if line.startswith("| SST-2")]
    names = " ".join(rows)
    for model in ("teacher tiny-teacher (fine-tuned)", "no DA", "with DA", "plain KD", "PKD"):
        assert model in names, (model, table)
    assert "student = 2 layers, d 32, d_ff 64, 4 heads (configs/general_distill.py:tiny); " \
           "teacher = tiny-teacher fine-tuned per task" in table, table
    assert "skipped" not in names
    res = json.loads((wd / "results.json").read_text())
    stages = res["tasks"]["sst2"]
    for s in ("teacher", "inter", "pred", "inter_da", "pred_da", "kd", "pkd"):
        assert stages[s]["steps"] >= 1 and stages[s]["wall_s"] > 0, s
    inf = res["inference"]["sst2"]
    assert inf["teacher_ms"] > 0 and inf["student_ms"] > 0
    # Finished stages are skipped on rerun.
    stdout = _run(args, tmp_path, timeout=300)
    assert stdout.count("] already done in") == 8, stdout


def test_inference_smoke(tmp_path):
    js = tmp_path / "inf.json"
    stdout = _run([str(REPO / "benchmarks" / "inference.py"), "--smoke", "--repeats", "1",
                   "--lengths", "16,32", "--json", str(js)], tmp_path, timeout=300)
    rows = json.loads(js.read_text())
    assert len(rows) == 4 and all(r["latency_ms"] > 0 and r["throughput"] > 0 for r in rows)
    assert stdout.count("| student") == 2 and stdout.count("| teacher") == 2


def test_glue_cpu_budget_takes_the_position_tasks(tmp_path):
    """--budget cpu --tasks conll2003: the teacher and labels-only rows wired (one step each on
    40 sentences), results.json rows with the entity F1 as the metric and no majority row. The
    teacher is a tiny random 3-layer BERT: its students start from its layers 1, 2, 3."""
    wd = tmp_path / "wd"
    teacher = tiny_run.tiny_teacher(tmp_path / "tiny-teacher", layers=3, max_positions=128)
    args = [str(REPO / "benchmarks" / "glue.py"), "--budget", "cpu", "--tasks", "conll2003",
            "--rows", "teacher,labels-only", "--max_steps", "1", "--train_subset", "40",
            "--eval_subset", "8", "--workdir", str(wd), "--teacher", teacher]
    stdout = _run(args, tmp_path, timeout=600)
    assert "| conll2003 | labels-only |" in stdout, stdout[-3000:]
    assert "teacher = tiny-teacher fine-tuned" in stdout, stdout[-3000:]
    rows = json.loads((wd / "results.json").read_text())
    assert [r["model"] for r in rows] == ["teacher", "labels-only"], rows
    assert all(r["metric"] == "f1" and 0.0 <= r["dev"] <= 1.0 for r in rows), rows
    # The student is 3 layers of the teacher's width: here the whole 3-layer teacher.
    assert rows[1]["params"] == rows[0]["params"], rows
    stages = json.loads((wd / "stages.json").read_text())["conll2003"]
    assert stages["recipe"]["init_layers"] == [1, 2, 3], stages["recipe"]


def test_torch_finetune_reference_runs_both_sides(tmp_path):
    """benchmarks/torch_finetune.py: ours and the PyTorch fine-tune of one HF folder (a tiny
    random BERT: the wiring is checked, not the packaged MiniLM's F1) on 32 CoNLL sentences, one
    row each with an entity F1."""
    model = tiny_run.tiny_teacher(tmp_path / "tiny")
    stdout = _run([str(REPO / "benchmarks" / "torch_finetune.py"), "--task", "conll2003",
                   "--model", model,
                   "--seeds", "0", "--epochs", "1", "--train_subset", "32", "--eval_subset", "8",
                   "--max_len", "32", "--workdir", str(tmp_path / "wd")], tmp_path, timeout=600)
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith('{"task"')]
    assert [r["side"] for r in rows] == ["ours", "torch"], stdout[-2000:]
    assert all(0.0 <= r["f1"] <= 1.0 and r["steps"] == 1 for r in rows), rows
