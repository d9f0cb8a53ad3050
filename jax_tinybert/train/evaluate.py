"""The dev set's metrics, and the student written out as a Hugging Face folder."""
from __future__ import annotations

import os
from typing import Dict, Optional

import jax
import numpy as np
from jax.experimental import multihost_utils

from jax_tinybert.data import position_tasks
from jax_tinybert.model.export import export_hf
from jax_tinybert.parallel import sharding as shd
from jax_tinybert.progress import Progress
from jax_tinybert.train import metrics as M, position_scores
from jax_tinybert.train import step as step_lib
from jax_tinybert.train.checkpoints import Checkpointer


def exports_best(best: Optional[dict], step: int) -> bool:
    """Whether the export is the best checkpoint's, read back from disk: the best eval was not
    at the last step `step`."""
    return best is not None and best["step"] != step


def best_params(ckpt: Checkpointer, run, state, best: Optional[dict], step: int):
    """(student params to export, their step): the best checkpoint's when `_exports_best`
    (the final state's if that checkpoint is damaged or missing)."""
    if exports_best(best, step):
        got = ckpt.restore_best(run.step.abstract_state)
        if got is not None:
            if jax.process_index() == 0:
                print(f"exporting the best checkpoint (step {got[0]})", flush=True)
            return got[1].params["student"], got[0]
        if jax.process_index() == 0:
            print(f"the best checkpoint (step {best['step']}) is damaged or missing: "
                  f"exporting the final state (step {step}) instead", flush=True)
    return state.params["student"], step


def evaluate(eval_fn, params, data, mesh) -> Dict[str, float]:
    """Runs the student over the dev set; the task's metrics on the host ("main" = the task's
    headline score)."""
    data.eval_batches.reset()
    preds, ids = [], []
    unit = "ex" if data.head == "sequence" else "rows"
    with Progress("eval", total=len(data.eval_labels), unit=unit) as prog:
        for batch in data.eval_batches:
            keep = {k: batch[k] for k in step_lib.EVAL_KEYS}
            # Every process gets the global logits and, row for row, their examples' ids.
            logits, example_id = jax.device_get(eval_fn(params, shd.shard_batch(keep, mesh)))
            ids.append(np.asarray(example_id).reshape(-1))
            preds.append(np.asarray(logits))
            prog.update(int((ids[-1] >= 0).sum()))
    if data.head != "sequence":   # SQuAD windows / CoNLL sentences: rows placed by id
        spec = position_tasks.get(data.task)
        logits = position_scores.place_rows(preds, ids, len(data.eval_labels), data.max_len,
                                            data.head)
        return position_scores.score(data.eval_split, data.head, spec.version, logits)
    preds = np.concatenate(preds)
    ids = np.concatenate(ids)
    keep = ids >= 0
    preds, ids = preds[keep], ids[keep]
    labels = data.eval_labels[ids]
    p = preds[:, 0] if preds.shape[1] == 1 else preds.argmax(-1)
    out = M.compute(data.task, p, labels)
    out["main"] = M.score(data.task, p, labels)
    if preds.shape[1] > 1 and len(p) > 1 and np.all(p == p[0]) and jax.process_index() == 0:
        print(one_class_warning(int(p[0]), len(p), data.id2label,
                                float(np.mean(labels == p[0]))), flush=True)
    return out


def one_class_warning(cls: int, n: int, id2label: Optional[Dict[int, str]],
                      share: float) -> str:
    """The line printed when a classifier gives every dev example the same class: its scores
    are then the majority-class baseline's (or below), whatever they look like."""
    label = str(id2label.get(cls, cls)) if id2label else str(cls)
    name = f"class {cls}" + (f" ({label})" if label != str(cls) else "")
    return (f"[eval] warning: all {n:,} dev examples were predicted as {name}, which is "
            f"{share:.2%} of the dev labels: the model has not learned to tell the classes "
            "apart yet (train longer, or raise optim.learning_rate)")


def export(run, params, workdir: str) -> str:
    """workdir/export: the student as an HF folder (a bare encoder after general distillation,
    whose head was never trained). Written by process 0; every process gathers the params."""
    export_dir = os.path.join(workdir, "export")
    host = jax.tree_util.tree_map(np.asarray, _to_host(params))
    if jax.process_index() == 0:
        as_base = run.data.task is None
        export_hf(run.models.student_config, host["bert"] if as_base else host, export_dir,
                  tokenizer_dir=run.models.tokenizer_dir, id2label=run.data.id2label)
    return export_dir


def _to_host(tree):
    """Fully-replicated host copy of a (possibly sharded, multi-process) pytree."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    return multihost_utils.process_allgather(tree, tiled=True)
