"""The teacher's per-position logits of a span or token task's train rows, computed once.

The prediction, KD and PKD stages of SQuAD and CoNLL read only the teacher's logits, [2, T]
(start / end) or [T, C] per row: computed here in one pass over the train rows before the
steps, held in memory (ragged, each row at its own length: SQuAD's 88k official windows are
~0.3 GB in float32) and added to each batch by `example_id`, so the steps run no teacher
forward. Each process computes every row (a step may read any of them); nothing is written to
disk, so a resumed run computes them again (a forward of the train set, ~1/3 of an epoch).

    cache = positions.build(teacher, teacher_params, dataset, buckets, head)
    batch.update(cache.lookup(batch["example_id"], seq_len=T))
"""
from __future__ import annotations

import logging
import time
from typing import Dict, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_tinybert.data import batching
from jax_tinybert.model.heads import MASKED_LOGIT
from jax_tinybert.progress import Progress

log = logging.getLogger(__name__)
MODEL_KEYS = ("input_ids", "attention_mask", "token_type_ids")


class PositionLogitsCache:
    """Per-row teacher logits, ragged: `values` float32 [total_tokens, C'] (span: C' = 2, the
    start and end logit of each token), row i at `offsets[i]:offsets[i + 1]`."""

    token_fields: tuple = ()   # nothing for teacher_stream.TokenCacheDrop to delete

    def __init__(self, values: np.ndarray, offsets: np.ndarray, head: str,
                 build_stats: Optional[dict] = None, cls: Optional[np.ndarray] = None):
        self.values, self.offsets, self.head = values, offsets, head
        self.build_stats = build_stats
        self.cls = cls   # float32 [n, K, D_t]: PKD's [CLS] vectors of its teacher layers, or None

    def lookup(self, example_ids, seq_len: Optional[int] = None) -> Dict[str, np.ndarray]:
        """{"teacher_logits": [b, 2, T] (span; positions past a row's end at MASKED_LOGIT) or
        [b, T, C] (token)} for a batch's ids (filler rows, id -1: zeros / masked)."""
        ids = np.asarray(example_ids, np.int64).reshape(-1)
        lens = self.offsets[np.maximum(ids, 0) + 1] - self.offsets[np.maximum(ids, 0)]
        T = int(seq_len if seq_len is not None else lens.max(initial=1))
        fill = MASKED_LOGIT if self.head == "span" else 0.0
        out = np.full((len(ids), T, self.values.shape[1]), fill, np.float32)
        for r, i in enumerate(ids):
            if i >= 0:
                s, e = int(self.offsets[i]), int(self.offsets[i + 1])
                out[r, :e - s] = self.values[s:e]
        got = {"teacher_logits": out.transpose(0, 2, 1) if self.head == "span" else out}
        if self.cls is not None:
            got["teacher_cls"] = np.where((ids >= 0)[:, None, None],
                                          self.cls[np.maximum(ids, 0)], 0.0).astype(np.float32)
        return got

    def close(self) -> None:
        self.values = self.values[:0]


def with_cls_layers(cache: PositionLogitsCache, have: Sequence[int],
                    want: Sequence[int]) -> PositionLogitsCache:
    """`cache` (holding the [CLS] vectors of the layers `have`) with those of `want` only
    (none when `want` is empty); a ValueError when one of `want` is not in `have`."""
    missing = [t for t in want if t not in have]
    if missing:
        raise ValueError(f"teacher logits: no [CLS] vectors of layers {missing} (have {have})")
    cls = cache.cls[:, [list(have).index(t) for t in want]] if want else None
    return PositionLogitsCache(cache.values, cache.offsets, cache.head, cache.build_stats, cls)


def lookup_spec(head: str, num_labels: int, batch, cls_layers: Sequence[int] = (),
                width: int = 0) -> Dict[str, jax.ShapeDtypeStruct]:
    """What `lookup` adds to `batch`, as shapes (for compiling the step ahead); cls_layers and
    width (the teacher's hidden size): PKD's [CLS] vectors."""
    b, T = np.shape(batch["input_ids"])
    shape = (b, 2, T) if head == "span" else (b, T, num_labels)
    out = {"teacher_logits": jax.ShapeDtypeStruct(shape, jnp.float32)}
    if cls_layers:
        out["teacher_cls"] = jax.ShapeDtypeStruct((b, len(cls_layers), width), jnp.float32)
    return out


def build(teacher, teacher_params, dataset, buckets: Sequence[int], head: str,
          batch_size: int = 64, cls_layers: Sequence[int] = ()) -> PositionLogitsCache:
    """One forward of `teacher` over every row of `dataset` (an EncodedDataset), rows grouped
    by their bucket of `buckets` (one program per bucket), `batch_size` rows a forward;
    cls_layers: the teacher layers (hidden-state indices) whose [CLS] vectors PKD reads."""
    t0 = time.time()
    params = jax.device_put(teacher_params)
    layers = tuple(cls_layers)

    def run(p, ids, mask, tt):
        out = teacher.apply({"params": p}, ids, mask, tt, deterministic=True,
                            attention_logits=False)
        cls = jnp.stack([out.hidden_states[t][:, 0] for t in layers], 1) if layers else None
        return out.logits, cls

    forward = jax.jit(run)
    cls_rows = None
    lengths = np.asarray(dataset.lengths)
    per_bucket = np.asarray(sorted(buckets))[batching.assign_buckets(lengths, buckets)]
    width = 2 if head == "span" else None
    values: Optional[np.ndarray] = None
    with Progress("teacher logits", total=len(lengths), unit="rows") as prog:
        for T in sorted(set(per_bucket.tolist())):
            rows = np.flatnonzero(per_bucket == T)
            for s in range(0, len(rows), batch_size):
                idx = rows[s:s + batch_size]
                pad = np.concatenate([idx, np.full(batch_size - len(idx), idx[0])])
                b = dataset.gather(pad, int(T))
                lg, cls = forward(params, *(b[k] for k in MODEL_KEYS))
                lg = np.asarray(lg, np.float32)
                lg = lg.transpose(0, 2, 1) if head == "span" else lg     # [b, T, C']
                if layers:
                    cls = np.asarray(cls, np.float32)
                    if cls_rows is None:
                        cls_rows = np.zeros((len(lengths),) + cls.shape[1:], np.float32)
                    cls_rows[idx] = cls[:len(idx)]
                if values is None:
                    width = lg.shape[-1]
                    values = np.zeros((int(dataset.offsets[-1]), width), np.float32)
                for r, i in enumerate(idx):
                    o = int(dataset.offsets[i])
                    values[o:o + lengths[i]] = lg[r, :lengths[i]]
                prog.update(len(idx))
    stats = {"rows": int(len(lengths)), "wall_s": round(time.time() - t0, 2)}
    log.info("teacher logits of %d train rows in %.1f s (%d programs): the steps run no "
             "teacher", len(lengths), stats["wall_s"], len(set(per_bucket.tolist())))
    return PositionLogitsCache(values if values is not None else np.zeros((0, width or 1)),
                               np.asarray(dataset.offsets, np.int64), head, stats, cls_rows)
