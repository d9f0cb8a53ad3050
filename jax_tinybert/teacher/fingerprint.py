"""Fingerprints: what a teacher cache (and a run's checkpoints) record of the teacher's weights
and of a dataset, so that other weights or other data are never read as the same."""
from __future__ import annotations

import hashlib
import json
import zlib
from typing import Any, Mapping

import jax
import numpy as np


def params_fingerprint(params) -> str:
    """sha256 over every leaf's path, dtype, shape and bytes (hex, 16 chars)."""
    h = hashlib.sha256()
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    for path, x in sorted(leaves, key=lambda kv: jax.tree_util.keystr(kv[0])):
        a = np.ascontiguousarray(np.asarray(jax.device_get(x)))
        h.update(f"{jax.tree_util.keystr(path)}|{a.dtype}|{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def arrays_fingerprint(*arrays) -> str:
    """sha256 of numpy arrays' dtype, shape and bytes (e.g. a dataset's ids and offsets)."""
    h = hashlib.sha256()
    for a in arrays:
        if a is None:
            h.update(b"None")
            continue
        a = np.asarray(a)
        h.update(f"{a.dtype}|{a.shape}".encode())
        flat = a.reshape(-1)
        step = 1 << 24
        for i in range(0, flat.size, step):  # chunks: memmapped corpora need not fit in memory
            h.update(np.ascontiguousarray(flat[i:i + step]).tobytes())
    return h.hexdigest()[:16]


def dataset_fingerprint(dataset) -> str:
    """Fingerprint of an `EncodedDataset`-like object (token ids, segments, offsets)."""
    if getattr(dataset, "fingerprint", None):   # rows read in place (data.reader)
        return dataset.fingerprint
    parts = [getattr(dataset, k, None) for k in ("input_ids", "token_type_ids", "offsets")]
    if all(p is None for p in parts):
        raise TypeError(f"dataset_fingerprint: {type(dataset).__name__} has no input_ids/"
                        "token_type_ids/offsets; pass your own data fingerprint")
    return arrays_fingerprint(*parts)


def _normalise(fp: Mapping[str, Any]) -> dict:
    """JSON round trip so tuples/lists and numpy scalars compare equal to what meta.json holds."""
    return json.loads(json.dumps(dict(fp), sort_keys=True, default=str))


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            crc = zlib.crc32(chunk, crc)
    return crc
