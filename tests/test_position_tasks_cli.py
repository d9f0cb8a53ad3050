"""SQuAD and CoNLL-2003 through the command line on small slices of ../shared/data: teacher
fine-tuning, TinyBERT's two task stages and PKD (SQuAD v2.0), the teacher, KD and the
prediction stage on augmented data (CoNLL), each exported as an HF *ForQuestionAnswering / *ForTokenClassification;
the last exports re-scored by transformers' PyTorch classes apart from the package's data and
metric code (helpers/torch_rescore.py: run_qa's windows and n-best; seqeval), and the bad inputs a user makes (their own processes: the exit
status). A task's stages run in one process (helpers/cli_stages.py)."""
import json
import pathlib
import shutil
import subprocess

import pytest

from helpers import cli_stages, tiny_run as T, torch_rescore as R

REPO = pathlib.Path(__file__).resolve().parents[1]
SHORT = ["--config.train.num_steps=3", "--config.train.batch_size=8",
         "--config.train.eval_batch_size=8", "--config.train.log_every=1"]
SQUAD = ["--config.data.max_len=64", "--config.data.max_query_len=16",
         "--config.data.doc_stride=16", "--config.data.train_subset=24",
         "--config.data.eval_subset=12"]
CONLL = ["--config.data.max_len=48", "--config.data.train_subset=48",
         "--config.data.eval_subset=40"]
FROM_TEACHER = ["--config.student.init=teacher_layers", "--config.student.teacher_layers=2"]


def _run(args, ok=True):
    res = subprocess.run([T.PYTHON, "-m", "jax_tinybert.main", *args], cwd=REPO, env=T.env(),
                         capture_output=True, text=True, timeout=400)
    if ok:
        assert res.returncode == 0, res.stderr[-3000:]
    return res


def _summary(workdir):
    with open(pathlib.Path(workdir) / "summary.json") as fh:
        return json.load(fh)


def _architecture(export):
    with open(pathlib.Path(export) / "config.json") as fh:
        return json.load(fh)["architectures"][0]


def test_squad_v2_every_stage(tmp_path, shared_dir):
    """teacher -> intermediate -> prediction layer and PKD on SQuAD v2.0 windows (KD: the CoNLL
    test and benchmarks/glue.py's rows); every
    export a BertForQuestionAnswering; the prediction stage's export re-scored in PyTorch gives
    the run's own best_f1."""
    data = [f"--config.data.data_dir={shared_dir / 'data' / 'squad' / 'v2.0'}",
            f"--config.data.cache_dir={tmp_path / 'cache'}", *SQUAD, *SHORT]
    base = T.tiny_teacher(tmp_path / "base")
    w = {k: tmp_path / k for k in ("teacher", "inter", "pred", "pkd")}
    teacher = [f"--config.teacher.path={w['teacher'] / 'export'}"]
    student = [f"--config.student.path={w['inter'] / 'export'}"]
    out = cli_stages.run([
        ["--config=configs/finetune_teacher.py:squad20", f"--workdir={w['teacher']}",
         f"--config.teacher.path={base}", *data],
        # cache_tokens=always: a span task's teacher runs in the step (its per-token cache
        # would store per-example logits of one shape beside the features), the run goes on
        ["--config=configs/task_distill.py:squad20_intermediate", f"--workdir={w['inter']}",
         "--config.teacher.cache_tokens=always", *teacher, *FROM_TEACHER, *data],
        ["--config=configs/task_distill.py:squad20_pred", f"--workdir={w['pred']}", *teacher,
         *student, *data],
        # ... the same losses as the teacher run in every step
        ["--config=configs/task_distill.py:squad20_pred", f"--workdir={tmp_path / 'uncached'}",
         *teacher, *student, *data, "--config.teacher.cache=False",
         "--config.export.enabled=False"],
        # two student layers: the patience term reads the teacher's [CLS] of layer 1 (cached)
        ["--config=configs/pkd.py:squad20", f"--workdir={w['pkd']}", *teacher,
         "--config.student.teacher_layers=(1,2)", *data],
    ]).outputs
    assert "teacher per-token cache: no (not cacheable)" in out[1]
    assert "the steps run no teacher" in out[2]   # teacher/positions.py's logits
    cached, live = T.read_metrics(w["pred"]), T.read_metrics(tmp_path / "uncached")
    assert sorted(cached) == sorted(live) == [1, 2, 3]
    for step in cached:
        assert cached[step][-1] == pytest.approx(live[step][-1], rel=1e-5), step
    assert "pt" in _summary(w["pkd"])["last_train"], _summary(w["pkd"])["last_train"]
    for k, d in w.items():
        assert _architecture(d / "export") == "BertForQuestionAnswering", k
        if k != "inter":
            best = _summary(d)["best"]
            assert {"exact", "f1", "best_f1", "HasAns_f1", "NoAns_f1"} <= set(best), best
            assert 0.0 <= best["main"] <= 100.0
    rescored = R.squad(w["pred"] / "export", shared_dir / "data" / "squad" / "v2.0", "squad20",
                       max_len=64, doc_stride=16, max_query_len=16, subset=12)
    assert rescored["best_f1"] == pytest.approx(_summary(w["pred"])["best"]["best_f1"], abs=1e-3)


def test_conll_teacher_and_prediction_stage(tmp_path, shared_dir):
    """NER teacher and TinyBERT prediction stage (on augmented sentences); the export (BertForTokenClassification with
    the train file's labels as id2label) re-scored by transformers and seqeval gives the run's
    own entity F1."""
    data = [f"--config.data.data_dir={shared_dir / 'data' / 'conll2003'}",
            f"--config.data.cache_dir={tmp_path / 'cache'}", *CONLL, *SHORT]
    base = T.tiny_teacher(tmp_path / "base")
    # TinyBERT's augmentation of the words tagged O (the teacher's embedding neighbours) on a
    # slice of the train file, read by the prediction stage as its train_file
    lines = (shared_dir / "data" / "conll2003" / "train.txt").read_text().splitlines()[:400]
    (tmp_path / "slice.txt").write_text("\n".join(lines) + "\n")
    teacher = tmp_path / "teacher" / "export"
    export = tmp_path / "pred" / "export"
    cli_stages.run([
        ["--config=configs/finetune_teacher.py:conll2003", f"--workdir={tmp_path / 'teacher'}",
         f"--config.teacher.path={base}", "--config.optim.learning_rate=1e-3", *data],
        ["-m", "jax_tinybert.data.augment", "--task", "conll2003", "--train_file",
         tmp_path / "slice.txt", "--mode", "embedding", "--encoder", teacher, "--N", "2",
         "--out", tmp_path / "aug"],
        ["--config=configs/task_distill.py:conll2003_pred", f"--workdir={tmp_path / 'pred'}",
         f"--config.teacher.path={teacher}", *FROM_TEACHER, *data,
         f"--config.data.train_file={tmp_path / 'aug' / 'train_aug.txt'}"],
        ["--config=configs/task_distill.py:conll2003_pred", f"--workdir={tmp_path / 'kd'}",
         f"--config.teacher.path={teacher}", *FROM_TEACHER, *data,
         "--config.objective.name=kd", "--config.export.enabled=False"],
        # the export command rebuilds the same folder from the run's best checkpoint
        ["-m", "jax_tinybert.cli.export", "--workdir", tmp_path / "pred", "--out",
         tmp_path / "again"],
    ])
    assert 0.0 <= _summary(tmp_path / "kd")["best"]["f1"] <= 1.0
    assert _architecture(export) == "BertForTokenClassification"
    with open(export / "config.json") as fh:
        assert json.load(fh)["id2label"]["1"] == "B-PER"
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == \
        json.loads((export / "config.json").read_text())
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == \
        (export / "model.safetensors").read_bytes()
    f1 = _summary(tmp_path / "pred")["best"]["f1"]
    assert R.conll_f1(export, shared_dir / "data" / "conll2003" / "dev.txt", subset=40,
                      max_len=48) == pytest.approx(f1, abs=1e-6)


def test_bad_inputs_one_line_each(tmp_path, shared_dir):
    """No data_dir, a misspelt task, an answer that is not at its answer_start: one line
    naming the problem, exit 2, nothing trained."""
    base = T.tiny_teacher(tmp_path / "base")
    common = [f"--config.teacher.path={base}", "--config.data.max_len=64", *SHORT]
    res = _run(["--config=configs/finetune_teacher.py:squad11", f"--workdir={tmp_path / 'a'}",
                *common], ok=False)
    assert res.returncode == 2 and "--config.data.data_dir" in res.stderr.strip().splitlines()[-1]
    res = _run(["--config=configs/finetune_teacher.py", f"--workdir={tmp_path / 'b'}",
                "--config.data.task=squad3", *common], ok=False)
    assert res.returncode == 2 and "squad11, squad20, conll2003" in res.stderr
    bad = tmp_path / "bad"
    shutil.copytree(shared_dir / "data" / "squad" / "v1.1", bad)
    doc = json.loads((bad / "train.json").read_text())
    qa = doc["data"][0]["paragraphs"][0]["qas"][0]
    qa["answers"][0]["answer_start"] += 3
    (bad / "train.json").write_text(json.dumps(doc))
    res = _run(["--config=configs/finetune_teacher.py:squad11", f"--workdir={tmp_path / 'c'}",
                f"--config.data.data_dir={bad}", *common], ok=False)
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 2 and "train.json" in last and qa["id"] in last, last
    assert not (tmp_path / "c" / "checkpoints").exists()
