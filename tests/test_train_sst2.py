"""A real short run on GLUE SST-2 with the packaged MiniLM teacher: fine-tune it, then task-distil
a small student (intermediate layers, then the prediction layer from the teacher cache).

Its own file: the suite's longest fixture, so that `--dist loadfile` can run it beside the rest of
tests/test_train.py (it is first in tests/conftest.py's LONGEST_FIRST).
"""
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from helpers import run_files, tiny_run
from jax_tinybert import fs

HELPER = pathlib.Path(__file__).resolve().parent / "helpers" / "sst2_run.py"
_records = run_files.records


# --------------------------------------------------------------------------- real SST-2 run

@pytest.fixture(scope="module")
def sst2_runs(tmp_path_factory, glue_dir):
    """Fine-tune the MiniLM teacher on an SST-2 subset, then task-distil a small random student
    (intermediate layers, then prediction layer from the cached teacher): helpers/sst2_run.py,
    in its own process with the caller's XLA_FLAGS (a user's compiled steps)."""
    root = tmp_path_factory.mktemp("sst2")
    p = subprocess.run([sys.executable, str(HELPER), str(root), str(glue_dir)],
                       env=tiny_run.user_env(), capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    runs = [json.loads((root / stage / "summary.json").read_text())
            for stage in ("teacher", "inter", "pred")]
    runs[2]["cache_log"] = json.loads((root / "pred_cache_log.json").read_text())
    return (root, *runs)


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
