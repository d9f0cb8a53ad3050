"""Several short examples per row, for forwards that read one output per example.

A padded batch spends most of its work on padding when examples are short (SST-2's train
sentences average 13.3 tokens; even six length buckets pad them to 16.9). A packed row holds
several whole examples one after another, each a *segment*: its tokens attend to its own tokens
only, its position ids restart at 0, and its [CLS] row gives its output. The values are those of
the example forwarded alone (up to float rounding), at the cost of attention over the row's
length instead of the example's (a few % of a BERT layer's work at 64-128 tokens).

Layout of a packed batch (host side, `packed_batches`):

    input_ids, token_type_ids  int32 [R, P]   the segments' tokens, then padding
    attention_mask             int32 [R, P]   segment number 1..S per token, 0 = padding
    example_id                 int64 [R * S]  example of row r's segment s at r * S + s (-1: none)
    valid                      float32 [R * S]

`attention_mask` keeps the name and the meaning of an ordinary mask (0 = padding, > 0 = a real
token; a row with one segment is an ordinary row): `model_inputs` turns it into the [R, P, P]
mask, the position ids and the [CLS] positions inside the jitted program.
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Sequence

import jax.numpy as jnp
import numpy as np


def pack(lengths: np.ndarray, row_len: int, max_segments: int) -> List[np.ndarray]:
    """Rows of example indices: best-fit decreasing, each row's lengths summing to <= row_len
    and holding <= max_segments examples. lengths int [n] (each <= row_len). Deterministic: ties
    keep dataset order. -> list of int64 arrays (the examples of each row, in packing order)."""
    lengths = np.asarray(lengths, np.int64)
    row_len, max_segments = int(row_len), int(max_segments)
    if max_segments < 1:
        raise ValueError(f"pack: max_segments={max_segments} must be >= 1")
    if len(lengths) and (lengths.max() > row_len or lengths.min() < 1):
        bad = int(np.flatnonzero((lengths > row_len) | (lengths < 1))[0])
        raise ValueError(f"pack: example {bad} has {int(lengths[bad])} tokens; a packed row "
                         f"holds 1..{row_len}")
    # open[c]: rows (lists of examples) with exactly c tokens free and room for a segment.
    open_rows: List[List[list]] = [[] for _ in range(row_len + 1)]
    rows: List[list] = []
    for i in np.argsort(-lengths, kind="stable"):
        n = int(lengths[i])
        free = next((c for c in range(n, row_len + 1) if open_rows[c]), None)
        if free is None:
            row, free = [], row_len
            rows.append(row)
        else:
            row = open_rows[free].pop()
        row.append(int(i))
        if len(row) < max_segments and free - n > 0:
            open_rows[free - n].append(row)
    return [np.asarray(r, np.int64) for r in rows]


def packed_batches(ds, rows: Sequence[np.ndarray], row_len: int, max_segments: int,
                   batch_rows: int) -> Iterator[Dict[str, np.ndarray]]:
    """Batches of `batch_rows` packed rows (layout: module docstring) from `rows` of `pack`
    over `ds` (a `tokenize.EncodedDataset`); the last batch is filled with empty rows (one
    padding token, no segment). Example ids are ds's row indices."""
    S, P = int(max_segments), int(row_len)
    offs = ds.offsets
    R = int(batch_rows)
    for b0 in range(0, len(rows), R):
        chunk = rows[b0:b0 + R]
        ids = np.full((R, P), ds.pad_id, np.int32)
        tt = np.zeros((R, P), np.int32)
        seg = np.zeros((R, P), np.int32)
        ex = np.full((R * S,), -1, np.int64)
        for r, members in enumerate(chunk):
            if len(members) > S:
                raise ValueError(f"packed row of {len(members)} examples > max_segments {S}")
            t = 0
            for s, i in enumerate(members):
                a, e = int(offs[i]), int(offs[i + 1])
                ids[r, t:t + e - a] = ds.input_ids[a:e]
                tt[r, t:t + e - a] = ds.token_type_ids[a:e]
                seg[r, t:t + e - a] = s + 1
                ex[r * S + s] = i
                t += e - a
        yield {"input_ids": ids, "attention_mask": seg, "token_type_ids": tt,
               "example_id": ex, "valid": (ex >= 0).astype(np.float32)}


def model_inputs(segments, max_segments: int):
    """segments int [R, P] (1..S per token, 0 = padding; each segment contiguous, numbered in
    row order) -> (attention_mask int32 [R, P, P], position_ids int32 [R, P], cls_positions
    int32 [R, S]): a token attends to the tokens of its own segment; positions restart at each
    segment's first token, its [CLS]. A missing segment's [CLS] position is 0 (its output is
    discarded by `example_id` -1). Runs inside jit."""
    seg = jnp.asarray(segments, jnp.int32)
    R, P = seg.shape
    k = jnp.arange(1, int(max_segments) + 1, dtype=jnp.int32)
    cls = jnp.argmax(seg[:, None, :] == k[None, :, None], axis=-1).astype(jnp.int32)  # first
    start = jnp.take_along_axis(cls, jnp.maximum(seg - 1, 0), axis=1)
    pos = jnp.where(seg > 0, jnp.arange(P, dtype=jnp.int32)[None] - start, 0)
    mask = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] > 0)
    return mask.astype(jnp.int32), pos, cls

