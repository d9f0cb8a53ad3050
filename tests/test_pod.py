"""Dev metrics on a pod do not depend on the order of its devices (the multi-host tier:
`make test-multihost`).

A TPU torus orders a host's chips by their coordinates, so a host's rows of a batch need not be
one block of the mesh's batch axis. JTB_TEST_DEVICE_ORDER=interleaved gives CPU processes that
order (process 0's first device, process 1's first, ...). Under it, and in plain order, with
4 processes x 2 CPU devices and 2 x 4, on SST-2 (real data, a small random-init BERT that
learns to ~0.6 in 80 steps, so that a score paired with the wrong examples falls to ~0.5):

- fine-tuning reports the dev accuracy a 1-process run reports (the same model up to float
  reductions) and its export scores the same in PyTorch `transformers`;
- task distillation (the intermediate layers with the teacher's per-token cache, then the
  prediction layer) does the same against 1-process stages;
- fine-tuning a span head on SQuAD v1.1 (several windows per question, paired to their question
  through the batch's example_id) and a token head on CoNLL-2003 reports the dev score its
  export scores in PyTorch (run_qa's windows and n-best search; seqeval), and a 1-process run's.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess

import numpy as np
import pytest

from helpers import tiny_run as T
from jax_tinybert.teacher import cache as tc
from helpers import torch_rescore as R

pytestmark = pytest.mark.multihost

REPO = T.REPO
N_DEV = 872                                  # SST-2's dev set
# Different float reductions (8 devices vs 1) may flip an example that sits on the boundary.
ONE_PROCESS_SLACK = 3 / N_DEV
TIMEOUT = 400


def _glue(shared_dir) -> str:
    return str(shared_dir / "data" / "glue")


def _finetune_args(wd, teacher, glue):
    return ["--config=configs/finetune_teacher.py:sst2", f"--workdir={wd}",
            f"--config.teacher.path={teacher}", f"--config.data.glue_dir={glue}",
            "--config.data.train_subset=3000", "--config.train.num_steps=80",
            "--config.student.dropout=False", "--config.optim.learning_rate=3e-3",
            "--config.train.log_every=40", "--config.train.checkpoint_every=40"]


def _intermediate_args(wd, teacher, glue):
    return ["--config=configs/task_distill.py:sst2_intermediate", f"--workdir={wd}",
            f"--config.teacher.path={teacher}", f"--config.data.glue_dir={glue}",
            "--config.data.train_subset=3000", "--config.train.num_steps=40",
            "--config.student.init=random", "--config.student.num_hidden_layers=1",
            "--config.student.hidden_size=32", "--config.student.intermediate_size=64",
            "--config.student.num_attention_heads=4", "--config.student.dropout=False",
            "--config.teacher.cache_tokens=always", "--config.optim.learning_rate=3e-3",
            "--config.train.log_every=20", "--config.train.checkpoint_every=20"]


def _pred_args(wd, teacher, student, glue):
    return ["--config=configs/task_distill.py:sst2_pred", f"--workdir={wd}",
            f"--config.teacher.path={teacher}", f"--config.student.path={student}",
            f"--config.data.glue_dir={glue}", "--config.data.train_subset=3000",
            "--config.train.num_steps=80", "--config.student.dropout=False",
            "--config.optim.learning_rate=3e-3", "--config.train.log_every=40",
            "--config.train.checkpoint_every=40"]


def _env(cache, order="plain"):
    return T.env(**T.cache_env(cache), JTB_TEST_DEVICE_ORDER=order)


def _one(args, env):
    res = subprocess.run([T.PYTHON, "-m", "jax_tinybert.main", *map(str, args)], env=env,
                         cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout + res.stderr


def _many(n, d, args, env, logs):
    res = subprocess.run(["bash", str(REPO / "launch" / "local_multiprocess.sh"), "-n", str(n),
                          "-d", str(d), "-q", "-t", str(TIMEOUT), "-l", str(logs), "--",
                          *map(str, args)], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=TIMEOUT + 60)
    assert res.returncode == 0, res.stderr[-4000:]
    return (pathlib.Path(logs) / "process_0.log").read_text()


def _acc(wd) -> float:
    with open(os.path.join(wd, "summary.json")) as fh:
        return json.load(fh)["best"]["acc"]


def _check_against(wd, ref_acc, glue, log0, n, order):
    """The run's own dev accuracy = its export's in PyTorch, and = the 1-process run's."""
    hosts = {"interleaved": " ".join(str(i % n) for i in range(8)),
             "plain": " ".join(str(i * n // 8) for i in range(8))}[order]
    assert f"the batch's slices by process: {hosts}" in log0, log0[-3000:]
    reported = _acc(wd)
    torch_acc, pred = R.sst2_accuracy(os.path.join(wd, "export"), glue)
    # The check has teeth only if the model tells the classes apart (else any pairing scores
    # the majority rate).
    assert 0.1 < pred.mean() < 0.9, pred.mean()
    assert abs(reported - torch_acc) < 0.5 / N_DEV, (reported, torch_acc)
    assert abs(reported - ref_acc) <= ONE_PROCESS_SLACK, (reported, ref_acc)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return T.shared_dirs(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(setup, shared_dir, tmp_path_factory):
    """1 process, 1 device: the teacher fine-tuned, then both distillation stages."""
    teacher, cache = setup
    glue, base = _glue(shared_dir), tmp_path_factory.mktemp("pod_1p")
    _one(_finetune_args(base / "ft", teacher, glue), _env(cache))
    ref = {"ft": base / "ft"}
    _one(_intermediate_args(base / "int", base / "ft" / "export", glue), _env(cache))
    _one(_pred_args(base / "pred", base / "ft" / "export", base / "int" / "export", glue),
         _env(cache))
    ref.update(int=base / "int", pred=base / "pred")
    assert _acc(ref["ft"]) > 0.55 and _acc(ref["pred"]) > 0.52, (_acc(ref["ft"]), _acc(ref["pred"]))
    return ref


@pytest.mark.timeout(900)
@pytest.mark.parametrize("n,d,order", [(4, 2, "interleaved"), (2, 4, "interleaved"),
                                       (2, 4, "plain")])
def test_finetune_dev_metrics_do_not_depend_on_device_order(n, d, order, setup, reference,
                                                            shared_dir, tmp_path):
    _, cache = setup
    glue = _glue(shared_dir)
    log0 = _many(n, d, _finetune_args(tmp_path / "wd", setup[0], glue), _env(cache, order),
                 tmp_path / "logs")
    _check_against(tmp_path / "wd", _acc(reference["ft"]), glue, log0, n, order)


@pytest.mark.timeout(900)
def test_task_distillation_dev_metrics_on_an_interleaved_mesh(setup, reference, shared_dir,
                                                              tmp_path):
    _, cache = setup
    glue, teacher = _glue(shared_dir), reference["ft"] / "export"
    env = _env(cache, "interleaved")
    log0 = _many(2, 4, _intermediate_args(tmp_path / "int", teacher, glue), env, tmp_path / "l1")
    assert "teacher per-token cache: yes" in log0, log0[-3000:]
    # One pass split over both processes, read by both: no per-process copy, no part left (the
    # per-token cache itself is removed by process 0 once the run is done).
    assert "one pass split over the 2 processes" in log0, log0[-3000:]
    assert not _teacher_caches(tmp_path / "int" / "cache"), os.listdir(tmp_path / "int" / "cache")
    # The store off: the prediction stage's cache is forwarded here, split over the processes.
    log0 = _many(2, 4, _pred_args(tmp_path / "pred", teacher, tmp_path / "int" / "export", glue),
                 dict(env, JTB_TEACHER_STORE="off"), tmp_path / "l2")
    assert "one pass split over the 2 processes" in log0, log0[-3000:]
    _same_cache(tmp_path / "pred" / "cache", reference["pred"] / "cache" / "teacher")
    _check_against(tmp_path / "pred", _acc(reference["pred"]), glue, log0, 2, "interleaved")


def _teacher_caches(folder):
    return sorted(n for n in os.listdir(folder) if n.startswith(("teacher", ".teacher")))


def _same_cache(folder, one_process):
    """The cache the processes split the pass of is one folder (no per-process copy, no part
    left), and it equals the 1-process run's row for row (whose rows may come from the teacher
    store's entry of the intermediate stage, forwarded unpacked: float rounding apart)."""
    assert _teacher_caches(folder) == ["teacher"], os.listdir(folder)
    split, one = tc.open_cache(str(folder / "teacher")), tc.open_cache(str(one_process))
    rows = np.flatnonzero(split.filled)   # the rows the run's steps read
    assert len(rows) > 0 and one.filled[rows].all()
    a, b = split.lookup(rows), one.lookup(rows)
    assert set(a) == set(b) and "teacher_logits" in a, (set(a), set(b))
    for k in b:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-4, err_msg=k)


@pytest.mark.timeout(600)
def test_preflight_check_reports_every_host(setup, shared_dir, tmp_path):
    """`--check` on 4 processes x 2 devices, interleaved: one line per host with its devices
    and its slices of the batch axis, exit 0, nothing of the check's run left behind."""
    teacher, cache = setup
    log0 = _many(4, 2, _finetune_args(tmp_path / "wd", teacher, _glue(shared_dir)) + ["--check"],
                 _env(cache, "interleaved"), tmp_path / "logs")
    assert "[check] 4 process(es), 8 device(s)" in log0, log0[-3000:]
    for pid in range(4):
        assert (f"[check] process {pid}: 2 local device(s) ") in log0, log0[-3000:]
        assert (f"batch slices [{pid}, {pid + 4}], 8 train rows a step") in log0, log0[-3000:]
    assert "resumed from step 1" in log0 and "[check] passed" in log0
    assert "learning-rate schedule" not in log0          # the check's own resume, not news
    assert not (tmp_path / "wd" / "check").exists()


# Small slices: SQuAD's 40 dev questions are ~200 windows of 64 tokens (a last batch that does
# not fill the 8 devices); CoNLL's tiny model learns entities (dev F1 ~0.5) in 300 steps, run
# by one process first: the pod and a second process go on from its export for a few steps.
POSITION = {
    "squad11": dict(data="squad/v1.1", slack=5.0, steps=40, lr=3e-3, fields=dict(
        max_len=64, max_query_len=16, doc_stride=16, train_subset=300, eval_subset=40)),
    "conll2003": dict(data="conll2003", slack=0.03, steps=300, lr=5e-3, fields=dict(
        max_len=32, train_subset=2000, eval_subset=100)),
}


def _position_args(task, wd, teacher, shared_dir, steps):
    p = POSITION[task]
    return [f"--config=configs/finetune_teacher.py:{task}", f"--workdir={wd}",
            f"--config.teacher.path={teacher}",
            f"--config.data.data_dir={shared_dir / 'data' / p['data']}",
            "--config.train.batch_size=32", "--config.train.eval_batch_size=16",
            "--config.student.dropout=False", "--config.train.log_every=100",
            f"--config.train.num_steps={steps}", "--config.train.checkpoint_every=100",
            f"--config.optim.learning_rate={p['lr']}",
            *(f"--config.data.{k}={v}" for k, v in p["fields"].items())]


def _rescored(task, export, shared_dir):
    f = POSITION[task]["fields"]
    if task == "squad11":
        return R.squad(export, shared_dir / "data" / "squad" / "v1.1", task,
                       max_len=f["max_len"], doc_stride=f["doc_stride"],
                       max_query_len=f["max_query_len"], subset=f["eval_subset"])["f1"]
    return R.conll_f1(export, shared_dir / "data" / "conll2003" / "dev.txt",
                      subset=f["eval_subset"], max_len=f["max_len"])


def _f1(wd) -> float:
    with open(os.path.join(wd, "summary.json")) as fh:
        return json.load(fh)["best"]["f1"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("task", ["squad11", "conll2003"])
def test_span_and_token_dev_metrics_on_an_interleaved_mesh(task, setup, shared_dir, tmp_path):
    teacher, cache = setup
    base = tmp_path / "base"
    _one(_position_args(task, base, teacher, shared_dir, POSITION[task]["steps"]), _env(cache))
    start = base / "export"     # a fine-tuned span / token head, loaded as the run's start
    _one(_position_args(task, tmp_path / "one", start, shared_dir, 8), _env(cache))
    log0 = _many(2, 4, _position_args(task, tmp_path / "pod", start, shared_dir, 8),
                 _env(cache, "interleaved"), tmp_path / "logs")
    assert "the batch's slices by process: 0 1 0 1 0 1 0 1" in log0, log0[-3000:]
    reported, one, slack = _f1(tmp_path / "pod"), _f1(tmp_path / "one"), POSITION[task]["slack"]
    # Teeth: a model that scores 0 scores 0 under any pairing of windows and examples.
    assert reported > slack, reported
    assert reported == pytest.approx(_rescored(task, tmp_path / "pod" / "export", shared_dir),
                                     abs=1e-3 if task == "squad11" else 1e-6)
    assert abs(reported - one) <= slack, (reported, one)
