"""Where a stage picks up: its newest readable checkpoint, checked against the teacher and the
train set it was trained from (a digest of each, recorded in every checkpoint)."""
from __future__ import annotations

import os
from typing import Dict

import jax
import numpy as np

from jax_tinybert.errors import UserError
from jax_tinybert.teacher import fingerprint as teacher_fingerprint
from jax_tinybert.train.checkpoints import Checkpointer


# A train set of more tokens than this (a corpus on disk) is fingerprinted by its offsets, labels
# and 256 evenly spaced runs of its tokens adding up to this many, so that a start does not read
# all of it (~1 s per 100 M tokens; runs, not a stride, as a stride touches every page).
FULL_FINGERPRINT_TOKENS = 1 << 24


def _token_sample(a):
    """`a` itself, or FULL_FINGERPRINT_TOKENS of it in 256 evenly spaced runs (a memmap reads
    only those pages)."""
    if a is None or len(a) <= FULL_FINGERPRINT_TOKENS:
        return a
    n = FULL_FINGERPRINT_TOKENS // 256
    starts = np.linspace(0, len(a) - n, 256).astype(np.int64)
    return np.concatenate([np.asarray(a[s:s + n]) for s in starts])


def input_fingerprints(run) -> Dict[str, str]:
    """What a run's steps are trained from besides its config, recorded in every checkpoint:
    "teacher" (a digest of the teacher's weights, for the stages that read them) and
    "train_data" (of the train set's token ids, segments, offsets and labels)."""
    out = {}
    if run.models.teacher_fingerprint is not None:
        out["teacher"] = run.models.teacher_fingerprint
    ds = run.data.train_dataset
    ids, offsets = getattr(ds, "input_ids", None), getattr(ds, "offsets", None)
    if getattr(ds, "fingerprint", None):   # rows read in place: the prepared content's key
        out["train_data"] = ds.fingerprint
    elif ids is not None and offsets is not None:
        out["train_data"] = teacher_fingerprint.arrays_fingerprint(
            _token_sample(ids), _token_sample(getattr(ds, "token_type_ids", None)), offsets,
            getattr(ds, "labels", None))
    return out


def _check_inputs(run, workdir: str, step: int, saved: Dict[str, str],
                  now: Dict[str, str]) -> None:
    """Refuses to go on training from checkpoint `step` with another teacher or train set than
    the one it was trained with (same config: the paths name the same files, whose content
    changed)."""
    c = run.config
    changed = {k for k in saved.keys() & now.keys() if saved[k] != now[k]}
    if "teacher" in changed:
        raise UserError(
            f"workdir {workdir} holds a run distilled from other teacher weights: the weights at "
            f"config.teacher.path={c.teacher.path} changed after step {step} was saved "
            f"(fingerprint {saved['teacher']} -> {now['teacher']}); going on would mix two "
            f"teachers. Put the old weights back, use a new --workdir, or delete {workdir} to "
            "start over")
    if "train_data" in changed:
        src = {"glue": f"{c.data.task} in {c.data.glue_dir or os.environ.get('GLUE_DIR', '')}",
               "corpus": f"corpus {c.data.corpus}"}.get(c.data.kind, f"data.kind={c.data.kind}")
        raise UserError(
            f"workdir {workdir} holds a run trained on other data: the train set ({src}) changed "
            f"after step {step} was saved: the same number of examples, other tokens or labels "
            f"(fingerprint {saved['train_data']} -> {now['train_data']}); going on would follow "
            f"the saved data order over other examples. Put the old data back, use a new "
            f"--workdir, or delete {workdir} to start over")


def restore(ckpt: Checkpointer, run, state, workdir: str,
             inputs: Dict[str, str]):
    """-> (start step, state, best eval, the run's history so far) from the newest readable
    checkpoint (the data position restored too), or the fresh state at step 0. inputs: this
    run's `input_fingerprints`, checked against the checkpoint's while steps are left."""
    restored = ckpt.restore_latest(run.step.abstract_state)
    if restored is None:
        return 0, state, None, {}
    start_step, state, meta = restored
    if start_step < run.total_steps:
        _check_inputs(run, workdir, start_step, meta.get("inputs") or {}, inputs)
    try:
        run.data.train_batches.load_state_dict(meta["data"])
    except ValueError as e:   # the data of this run is not the saved run's: the user's to fix
        raise UserError(f"--workdir={workdir}: {e}") from e
    if jax.process_index() == 0:
        print(f"resumed from step {start_step} in {workdir}", flush=True)
    return start_step, state, meta.get("best"), meta.get("history") or {}
