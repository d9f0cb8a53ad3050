"""A real short run on GLUE SST-2 with the packaged MiniLM teacher: fine-tune it, then task-distil
a small student (intermediate layers, then the prediction layer from the teacher cache).

Its own file: the suite's longest fixture, so that `--dist loadfile` can run it beside the rest of
tests/test_train.py (it is first in tests/conftest.py's LONGEST_FIRST).
"""
import logging
import os

import numpy as np
import pytest

from helpers import run_files
from jax_tinybert import fs, train


_cfg, _records = run_files.config, run_files.records


# --------------------------------------------------------------------------- real SST-2 run

@pytest.fixture(scope="module")
def sst2_runs(tmp_path_factory, glue_dir):
    """Fine-tune the MiniLM teacher on an SST-2 subset, then task-distil a small random student
    (intermediate layers, then prediction layer from the cached teacher)."""
    root = tmp_path_factory.mktemp("sst2")
    # The teacher's buckets (16, 32, 64) pad its 8,000 examples to 22.4 tokens per example
    # against 33.9 with (32, 64): a third less work for one more compilation per step function.
    # The student's steps are cheap (2 layers, teacher cached) and compiling is most of its
    # stages: two buckets, one fewer compilation each of the teacher's forward, the gradient
    # and the eval step.
    common = dict(glue_dir=str(glue_dir), max_len=64)
    small = dict(common, train_subset=2000, buckets=(32, 64))

    t = _cfg("finetune_teacher.py", "sst2")
    t.data.update(common, train_subset=8000, buckets=(16, 32, 64))
    t.train.update(num_steps=120, eval_every=120, log_every=20, checkpoint_every=1000)
    t.optim.learning_rate = 1e-4
    teacher = train.train_and_evaluate(t, str(root / "teacher"))

    student = dict(init="random", num_hidden_layers=2, hidden_size=192, intermediate_size=768,
                   num_attention_heads=12)
    # 150 steps of 32 are 2.4 epochs of the 2,000 examples: the teacher's hidden states and
    # attention scores are cached (train.py's auto rule, the recipe's 10-20 epochs), and the
    # cache build publishes the teacher's logits to the teacher store (tests/conftest.py: the
    # session's own) for the prediction stage.
    i = _cfg("task_distill.py", "sst2_intermediate")
    i.data.update(small)
    i.teacher.path = str(root / "teacher" / "export")
    i.student.update(student)
    i.optim.learning_rate = 3e-4
    i.train.update(num_steps=150, log_every=10, checkpoint_every=1000)
    inter = train.train_and_evaluate(i, str(root / "inter"))

    p = _cfg("task_distill.py", "sst2_pred")
    p.data.update(small)
    p.teacher.path = str(root / "teacher" / "export")
    p.student.path = str(root / "inter" / "export")
    p.optim.learning_rate = 3e-4
    p.train.update(num_steps=200, eval_every=100, log_every=10, checkpoint_every=1000)
    said = _Lines()
    log = logging.getLogger("jax_tinybert.teacher_cache")
    level = log.level
    log.addHandler(said)
    log.setLevel(logging.INFO)
    try:
        pred = train.train_and_evaluate(p, str(root / "pred"))
    finally:
        log.removeHandler(said)
        log.setLevel(level)
    pred["cache_log"] = said.lines
    return root, teacher, inter, pred


class _Lines(logging.Handler):
    """Keeps the messages logged (INFO and up) while it is attached."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_teacher_finetune_reaches_80_percent(sst2_runs):
    _, teacher, _, _ = sst2_runs
    print("teacher dev acc", teacher["best"])
    assert teacher["best"]["acc"] >= 0.80


def test_intermediate_stage_lowers_every_term(sst2_runs):
    root, _, inter, _ = sst2_runs
    recs = _records(root / "inter", "train")
    terms = [k for k in recs[0] if k.startswith("train/") and k.split("/", 1)[1] in
             ("embd", "attn", "hidn", "loss")]
    assert set(terms) == {"train/embd", "train/attn", "train/hidn", "train/loss"}
    for k in terms + [k for k in recs[0] if k.startswith(("train/attn/", "train/hidn/"))]:
        first = np.mean([r[k] for r in recs[:3]])
        last = np.mean([r[k] for r in recs[-3:]])
        print(f"{k}: {first:.4f} -> {last:.4f}")
        assert last < 0.9 * first, (k, first, last)


def test_pred_stage_beats_majority(sst2_runs, glue_dir):
    root, teacher, _, pred = sst2_runs
    recs = _records(root / "pred", "train")
    assert np.mean([r["train/pred"] for r in recs[-3:]]) < np.mean([r["train/pred"] for r in recs[:3]])
    # SST-2 dev: 444 positive of 872 -> the majority class scores 0.509.
    majority = 444 / 872
    print("student dev acc", pred["best"], "teacher", teacher["best"]["acc"])
    assert pred["best"]["acc"] >= majority + 0.10
    # The pred stage used the teacher cache, not the live teacher, and took the teacher's
    # outputs from the store the intermediate stage's cache build filled.
    assert os.path.isdir(root / "pred" / "cache" / "teacher")
    from_store = any("from the teacher store" in line for line in pred["cache_log"])
    # tests/conftest.py gives the session its own store, unless the caller set JTB_TEACHER_STORE
    # (off: every stage forwards its teacher itself).
    assert from_store != fs.env_off("JTB_TEACHER_STORE"), pred["cache_log"]
    assert os.path.exists(root / "pred" / "export" / "model.safetensors")
