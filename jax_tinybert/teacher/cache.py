"""Teacher outputs computed once per dataset and read back per batch (host side).

Stages whose loss needs only the teacher's logits and [CLS] features (TinyBERT prediction, KD,
PKD) need no teacher forward in the training step: the features of every example are computed
once by a jitted forward, stored on disk, and added to each batch by `example_id`.

Layout of a cache folder::

    meta.json              version, fingerprint (what the cache was built from), num_examples,
                           per-field shape/dtype/crc32, filled (rows written)
    teacher_logits.npy     float32 [N, C]        (fields are whatever the forward returns)
    teacher_cls.npy        float32 [N, K, D_t]
    filled.npy             bool [N]              rows that some batch covered
    teacher_attn.bin       float16/32, ragged    per-token fields (intermediate stage): each
    teacher_hidden.bin                           row stored at its own bucket length T
    token_index.npy        int64 [N, 1 + F]      per row: T, then its element offset in each
                                                 of the F .bin files (-1: not cached)

Files are opened with `np.load(mmap_mode="r")`, so a cache larger than memory is fine. The
folder is written beside its final path and renamed into place when complete; a cache whose
fingerprint differs from the caller's, or that is truncated or corrupt, is rebuilt (the latter
with a warning).

    cache = teacher_cache.build_or_load(path, fingerprint, forward, params, batches, n)
    batch.update(cache.lookup(batch["example_id"]))
"""
from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import json
import logging
import os
import shutil
import zlib
from typing import (Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence,
                    Tuple, Union)

import jax
import jax.numpy as jnp
import numpy as np

from jax_tinybert import fs
from jax_tinybert.model import modeling
from jax_tinybert import flops as work_lib
from jax_tinybert.data import batching, packing, tokenize
from jax_tinybert.progress import Progress

log = logging.getLogger(__name__)

VERSION = 1
META = "meta.json"
FILLED = "filled.npy"
TOKEN_INDEX = "token_index.npy"
MODEL_KEYS = ("input_ids", "attention_mask", "token_type_ids")
# How many teacher forwards a cache build runs at once on CPU. XLA's CPU backend runs each
# attention product (a batched dot) on one core; a second forward in another thread fills the
# idle core (MiniLM-L6, batch 64, 2-core Xeon: 1.05-1.11x rows/s at T 16-128). Accelerators
# run the forwards in turn, as before.
FORWARDS_IN_FLIGHT = 2
# Tokens per teacher forward of a cache build on CPU (rows x length). At long lengths XLA's CPU
# forward runs more rows/s on fewer rows (MiniLM-L6, 2-core Xeon, two forwards in flight, rows/s
# at 8 / 16 / 64 rows: T 128 96 / 93 / 66, T 64 210 / 205 / 168; at T 16, 64 rows are best),
# so a build splits each batch into chunks of about this many tokens.
FORWARD_TOKENS = 1024
# Examples are packed several to a row (data/packing.py) for a forward that reads one output per
# example when that forwards at most this share of the bucketed pass's cost (`packing_plan`).
PACK_GAIN = 0.9
# A row of T tokens costs T + T^2 / PACK_ATTENTION_LEN (batching.bucket_cost: a token's
# attention over the row). Measured on the teacher's forward (MiniLM-L6, SST-2, 2-core Xeon): a token in
# a packed row of 64 cost 1.07x one of the bucketed pass (mean bucket ~17), i.e. ~600; the
# train step's backward and dropout weigh attention more (batching.bucket_cost: 256).
PACK_ATTENTION_LEN = 512


class CacheError(ValueError):
    """A cache folder that cannot be used (missing, truncated, corrupt, or built from other inputs)."""


# ----------------------------------------------------------------------------- fingerprints

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


# ----------------------------------------------------------------------------- reading

class TeacherCache:
    """An opened cache. `lookup(example_ids int64 [b])` -> {field: float32 [b, ...]}.

    Rows with example_id < 0 (filler rows of eval batches) come back as zeros.
    """

    def __init__(self, path: str, verify: bool = True, local: Optional[str] = None):
        # np.memmap needs local files: a cache in a bucket is read from a downloaded copy
        # (`local`: one the caller already has, e.g. the folder it was just built in).
        self.path, self.local_dir = path, local or fs.local_mirror(path)
        meta_path = fs.join(path, META)
        try:
            with open(os.path.join(self.local_dir, META)) as fh:
                meta = json.load(fh)
        except (OSError, json.JSONDecodeError) as e:
            raise CacheError(f"{meta_path}: unreadable ({type(e).__name__}: {e})") from e
        if meta.get("version") != VERSION:
            raise CacheError(f"{path}: cache format version {meta.get('version')} != {VERSION}")
        fields = {name: self._open(name + ".npy", info, verify)
                  for name, info in meta["fields"].items()}
        filled = self._open(FILLED, meta["filled_file"], verify)
        if int(filled.sum()) != int(meta["filled"]):
            raise CacheError(f"{path}: {FILLED} does not match meta.json")
        tok = meta.get("token_fields") or {}
        token_fields = {name: self._open_raw(name + ".bin", info, verify)
                        for name, info in tok.items()}
        token_index = self._open(TOKEN_INDEX, meta["token_index_file"], verify) if tok else None
        self._hold(path, self.local_dir, meta, int(meta["num_examples"]), fields, filled,
                   token_fields, token_index)

    def _hold(self, path: str, local_dir: str, meta: dict, num_examples: int,
              fields: Dict[str, Any], filled: np.ndarray, token_fields: Dict[str, Any],
              token_index: Optional[np.ndarray]) -> None:
        """The state a lookup reads, for an opened cache and for one being built alike."""
        self.path, self.local_dir, self.meta = path, local_dir, meta
        self.build_stats: Optional[Dict[str, float]] = None   # set by `build`: rate, seconds
        self.num_examples = num_examples
        self.fields, self.filled = fields, filled
        self.token_fields, self.token_index = token_fields, token_index

    def _open_raw(self, fname: str, info: dict, verify: bool) -> np.ndarray:
        p, shown = os.path.join(self.local_dir, fname), fs.join(self.path, fname)
        if not os.path.exists(p) or os.path.getsize(p) != info["bytes"]:
            size = os.path.getsize(p) if os.path.exists(p) else "no"
            raise CacheError(f"{shown}: {size} bytes, expected {info['bytes']}")
        if verify and _crc32(p) != info["crc32"]:
            raise CacheError(f"{shown}: checksum mismatch (corrupt file)")
        if not info["bytes"]:
            return np.zeros((0,), info["dtype"])
        return np.memmap(p, dtype=info["dtype"], mode="r")

    def _open(self, fname: str, info: dict, verify: bool) -> np.ndarray:
        p, shown = os.path.join(self.local_dir, fname), fs.join(self.path, fname)
        try:
            a = np.load(p, mmap_mode="r")
        except (OSError, ValueError) as e:  # missing, or shorter than its header says
            raise CacheError(f"{shown}: unreadable ({type(e).__name__}: {e})") from e
        if list(a.shape) != list(info["shape"]) or str(a.dtype) != info["dtype"]:
            raise CacheError(f"{shown}: shape {a.shape} {a.dtype}, meta.json says "
                             f"{info['shape']} {info['dtype']}")
        if os.path.getsize(p) != info["bytes"]:
            raise CacheError(f"{shown}: {os.path.getsize(p)} bytes, expected {info['bytes']}")
        if verify and _crc32(p) != info["crc32"]:
            raise CacheError(f"{shown}: checksum mismatch (corrupt file)")
        return a

    @classmethod
    def building(cls, folder: str, num_examples: int, fields: Dict[str, Any],
                 filled: np.ndarray, token_fields: Dict[str, Any],
                 token_index: Optional[np.ndarray],
                 row_shapes: Dict[str, Dict[str, list]]) -> "TeacherCache":
        """A cache still being written, as its build holds it (teacher_stream.py): `lookup`
        reads the rows written so far. fields: {name: array [N, ...]}; token_fields: {name:
        flat rows, sliceable like the memmap of a finished cache}; row_shapes: {name: {T: shape}}."""
        self = cls.__new__(cls)
        self._hold(folder, folder,
                   {"token_fields": {k: {"row_shapes": v} for k, v in row_shapes.items()}},
                   int(num_examples), fields, filled, token_fields, token_index)
        return self

    @property
    def fingerprint(self) -> dict:
        return self.meta["fingerprint"]

    def close(self) -> None:
        """Drops the memory maps of its files; a lookup afterwards raises CacheError. The pages
        of a deleted file are freed when its last map goes: by the thread that calls this
        (train.py deletes a finished run's GBs beside its export)."""
        self.fields, self.token_fields, self.token_index = {}, {}, None
        self.filled = None

    def lookup(self, example_ids, seq_len: Optional[int] = None) -> Dict[str, np.ndarray]:
        """{field: [b, ...]} for a batch's example ids: float32, per-token fields in the cache's
        dtype (float16 by default). Per-token fields need every real row cached at one length,
        `seq_len` (the batch's T) when given."""
        if self.filled is None:
            raise CacheError(f"teacher cache {self.path}: closed")
        ids = np.asarray(example_ids, np.int64).reshape(-1)
        real = ids >= 0
        if np.any(ids >= self.num_examples):
            raise IndexError(f"teacher cache {self.path}: example_id {int(ids.max())} >= "
                             f"{self.num_examples} cached examples (rebuild the cache for this "
                             "dataset)")
        safe = np.where(real, ids, 0)
        if not np.all(self.filled[safe[real]]):
            missing = sorted(set(ids[real][~self.filled[safe[real]]].tolist()))[:8]
            raise KeyError(f"teacher cache {self.path}: examples {missing} were not cached "
                           "(the batches used to build it did not cover the whole dataset)")
        out = {}
        for name, arr in self.fields.items():
            rows = np.asarray(arr[safe], np.float32)
            rows[~real] = 0.0
            out[name] = rows
        if self.token_fields:
            out.update(self._lookup_tokens(ids, real, seq_len))
        return out

    def _lookup_tokens(self, ids, real, seq_len: Optional[int]) -> Dict[str, np.ndarray]:
        index = np.asarray(self.token_index[np.where(real, ids, 0)])
        lens = set(index[real, 0].tolist())
        if seq_len is not None:
            lens.add(int(seq_len))
        if len(lens) != 1:
            raise CacheError(f"teacher cache {self.path}: a batch of rows cached at lengths "
                             f"{sorted(lens)}; the cache was built with other buckets (rebuild it: "
                             "delete the folder)")
        T = lens.pop()
        out = {}
        for j, (name, flat) in enumerate(self.token_fields.items()):
            shape = tuple(self.meta["token_fields"][name]["row_shapes"][str(T)])
            n = int(np.prod(shape))
            # In the stored dtype: the losses upcast to float32 inside the step (exactly), so the
            # host neither converts nor copies twice the bytes (~40 ms a step at T = 64).
            rows = np.zeros((len(ids),) + shape, flat.dtype)
            for b in np.flatnonzero(real):
                o = int(index[b, 1 + j])
                rows[b] = flat[o:o + n].reshape(shape)
            out[name] = rows
        return out


def open_cache(path: str, fingerprint: Optional[Mapping[str, Any]] = None,
               verify: bool = True) -> TeacherCache:
    """Open a cache; CacheError if it is unusable or (when given) its fingerprint differs."""
    if fs.is_remote(path) and fingerprint is not None:
        # Compare before downloading the whole cache.
        try:
            with fs.open_file(fs.join(path, META)) as fh:
                old = json.load(fh).get("fingerprint")
        except (OSError, ValueError, AttributeError) as e:
            raise CacheError(f"{fs.join(path, META)}: unreadable ({type(e).__name__}: {e})") from e
        if old != _normalise(fingerprint):
            raise CacheError(f"{path}: built from other inputs (fingerprint fields differ: "
                             f"{', '.join(_fingerprint_diff(old or {}, fingerprint))})")
    cache = TeacherCache(path, verify=verify)
    if fingerprint is not None and cache.fingerprint != _normalise(fingerprint):
        raise CacheError(f"{path}: built from other inputs (fingerprint fields differ: "
                         f"{', '.join(_fingerprint_diff(cache.fingerprint, fingerprint))})")
    return cache


def _fingerprint_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> list:
    new = _normalise(new)
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


# ----------------------------------------------------------------------------- building

def make_forward(model, feature_fn: Optional[Callable] = None, cls_layers: Sequence[int] = (),
                 attention_layers: Sequence[int] = (), token_fields: Sequence[str] = (),
                 token_dtype: str = "float32", cls_only: Optional[bool] = None,
                 packed_segments: Optional[int] = None):
    """Jitted (params, input_ids, attention_mask, token_type_ids) -> {field: [b, ...]}.

    feature_fn(BertOutput) -> dict, e.g. `objective.teacher_features`; default: `teacher_logits`
    [b, C] (when the model has a head) and `teacher_cls` [b, K, D] = the [CLS] vector of the
    1-based `cls_layers` (0 = embeddings). attention_layers: 1-based layers whose attention
    logits the model returns (for a feature_fn that reads them). Deterministic (no dropout).
    Fields are float32, those in `token_fields` `token_dtype`: cast inside the program, so
    a float16 per-token cache copies half the bytes to the host and converts nothing there.
    cls_only: the last layer computes its [CLS] row only (for a feature_fn that reads logits
    and [CLS] vectors, nothing per token); None: for the default feature_fn only.
    packed_segments: S for batches of packed rows (`packing.packed_batches`: attention_mask
    holds segment numbers): fields come per segment, [b * S, ...]; feature_fn sees each
    segment's [CLS] rows alone (`per_segment`), so it may read logits, pooled and
    hidden_states[l][:, 0], nothing per token.
    """
    if packed_segments and (attention_layers or token_fields):
        raise ValueError("make_forward: packed rows give one output per example; per-token "
                         "fields and attention logits need unpacked batches")
    attn = tuple(int(i) for i in attention_layers) or False
    layers = tuple(int(i) for i in cls_layers)
    dtypes = {k: jnp.dtype(token_dtype) for k in token_fields}

    def default(out):
        d = {}
        if out.logits is not None:
            d["teacher_logits"] = out.logits
        if layers:
            d["teacher_cls"] = jnp.stack([out.hidden_states[i][:, 0] for i in layers], axis=1)
        return d

    fn = feature_fn or default
    cls_only = feature_fn is None if cls_only is None else bool(cls_only)

    @jax.jit
    def forward(params, input_ids, attention_mask, token_type_ids):
        if packed_segments:
            mask, pos, cls = packing.model_inputs(attention_mask, packed_segments)
            out = per_segment(model.apply({"params": params}, input_ids, mask, token_type_ids,
                                          pos, deterministic=True, attention_logits=False,
                                          cls_only=cls_only, cls_positions=cls), cls, cls_only)
        else:
            out = model.apply({"params": params}, input_ids, attention_mask, token_type_ids,
                              deterministic=True, attention_logits=attn, cls_only=cls_only)
        return {k: v.astype(dtypes.get(k, jnp.float32)) for k, v in fn(out).items()
                if v is not None}

    return forward


def per_segment(out, cls_positions, cls_only: bool):
    """A packed forward's BertOutput as one example per segment: hidden_states[l] [R * S, 1, D]
    (each segment's [CLS] row), pooled [R * S, D], logits [R * S, C]; no attention logits.
    cls_positions int [R, S]; cls_only: the last layer computed those rows alone ([R, S, D])."""
    R, S = cls_positions.shape
    last = len(out.hidden_states) - 1

    def rows(i, h):
        h = h if cls_only and i == last else modeling.query_rows(h, cls_positions)
        return h.reshape(R * S, 1, h.shape[-1])

    flat = lambda x: None if x is None else x.reshape((R * S,) + x.shape[2:])
    return out.replace(hidden_states=tuple(rows(i, h) for i, h in enumerate(out.hidden_states)),
                       attention_logits=tuple(None for _ in out.attention_logits),
                       pooled=flat(out.pooled), logits=flat(out.logits))


def build(path: str, fingerprint: Mapping[str, Any], forward: Callable, params,
          batches: Iterable[Mapping[str, np.ndarray]], num_examples: int,
          num_rows: Optional[int] = None, token_fields: Sequence[str] = (),
          token_dtype: str = "float32", work_total: Optional[float] = None,
          live=None) -> TeacherCache:
    """Run `forward(params, ids, mask, types)` over `batches` and write the cache at `path`.

    batches: batch dicts (docs/design.md, "Batches") with `example_id` in [0, num_examples); rows with
    `valid == 0` (or example_id < 0) are skipped. num_rows: how many distinct rows the batches
    cover when that is deliberately fewer than num_examples (a run that reads part of its data);
    fewer than that is warned about. token_fields: fields of shape [b, ..., T, ...] (per-token
    outputs), stored ragged at each row's own length in `token_dtype`; the others are stored
    float32 [num_examples, ...]. Any existing folder at `path` is replaced only once the new one
    is complete. work_total: the batches' `forward_work` summed (`pass_work`), for a progress
    percentage and ETA that follow the work rather than the examples (None: the examples).
    live: a `teacher_stream.Live` that readers of the rows written so far wait on (the build then
    runs beside the training steps); its stop flag ends the build between batches.
    """
    expected = int(num_examples if num_rows is None else num_rows)
    path = fs.abspath(path)
    fs.makedirs(os.path.dirname(path))
    # Once, not per batch: host numpy params would be copied to the device at every call.
    params = jax.device_put(params)
    fs.clean_stale_temps(path)
    tmp = fs.staging_dir(path)   # local files (memmaps) either way; uploaded by publish_dir
    prog = Progress("teacher cache", total=expected, unit="ex", work_total=work_total)
    try:
        files: Dict[str, np.ndarray] = {}
        filled = np.zeros((num_examples,), bool)
        tokens = _TokenWriter(tmp, token_fields, token_dtype, num_examples,
                              flush=live is not None)
        if live is not None:
            live.attach(tmp, num_examples, files, filled, tokens)

        def write(feats, ids, keep, T, work):
            feats = tokens.write(feats, ids[keep], keep, T)
            for k, v in feats.items():
                v = np.asarray(v, np.float32)
                if k not in files:
                    files[k] = np.lib.format.open_memmap(
                        os.path.join(tmp, k + ".npy"), mode="w+", dtype=np.float32,
                        shape=(num_examples,) + v.shape[1:])
                files[k][ids[keep]] = v[keep]
            if live is not None:
                live.fill(filled, ids[keep])
            else:
                filled[ids[keep]] = True
            prog.update(int(keep.sum()), work=work)

        def rows():
            for batch in batches:
                ids = np.asarray(batch["example_id"], np.int64)
                keep = ids >= 0
                if "valid" in batch:
                    keep &= np.asarray(batch["valid"]) > 0
                if not keep.any():
                    continue
                if np.any(ids[keep] >= num_examples):
                    raise IndexError(f"teacher cache: example_id {int(ids[keep].max())} >= "
                                     f"num_examples {num_examples}")
                R, T = np.asarray(batch["input_ids"]).shape
                yield batch, (ids, keep, T, forward_work(keep, R, T))

        # The host copies out and writes one batch while the next forwards run (the copy-out
        # was 11 s of 46 s of an MRPC intermediate build).
        flops = work_lib.Work()
        for (ids, keep, T, work), feats in forwarded(forward, params, rows(), flops=flops):
            write(feats, ids, keep, T, work)
            if live is not None:
                live.check()
        prog.close(note=work_lib.fmt(flops.flops, prog.elapsed) if flops.known else "")
        if not files and not tokens.written:
            raise ValueError(f"teacher cache {path}: the batches held no valid rows")
        n_missing = int(expected - filled.sum())
        if n_missing > 0:
            log.warning("teacher cache %s: %d of %d examples not covered by the batches; "
                        "looking them up will fail", path, n_missing, expected)
        fields = {}
        # The maps stay open: the steps of a build beside them read them (Live.view) until the
        # finished cache replaces the build, and they stay valid through the folder's rename.
        for k, arr in files.items():
            arr.flush()
            fields[k] = _file_info(os.path.join(tmp, k + ".npy"))
        np.save(os.path.join(tmp, FILLED), filled)
        meta = {"version": VERSION,
                "fingerprint": _normalise(dict(fingerprint, num_examples=int(num_examples))),
                "num_examples": int(num_examples), "filled": int(filled.sum()),
                "fields": fields, "filled_file": _file_info(os.path.join(tmp, FILLED)),
                **tokens.close()}
        # meta.json last: a folder without it is never mistaken for a complete cache.
        with open(os.path.join(tmp, META), "w") as fh:
            json.dump(meta, fh, indent=1, sort_keys=True)
        # Remote: the staged folder stays as this process's local copy.
        fs.publish_dir(tmp, path, last=[META], keep_local=fs.is_remote(path))
    except BaseException:
        prog.close(stopped=True)
        tokens.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    cache = TeacherCache(path, verify=False, local=tmp if fs.is_remote(path) else None)
    stored = list(meta["fields"].values()) + list(meta.get("token_fields", {}).values())
    cache.build_stats = {"examples_per_s": prog.rate, "seconds": prog.elapsed,
                         "rows": int(filled.sum()), "num_examples": int(num_examples),
                         "bytes": int(sum(i["bytes"] for i in stored)),
                         **({"flops": flops.flops} if flops.known else {})}
    return cache


class _TokenWriter:
    """Appends per-token fields row by row to raw files, each row at its own length T."""

    def __init__(self, folder: str, names: Sequence[str], dtype: str, num_examples: int,
                 flush: bool = False):
        self.folder, self.names, self.dtype = folder, tuple(sorted(names)), np.dtype(dtype)
        # flush: each write reaches the file before it returns (rows read while the build runs).
        self.flush = flush
        self.index = np.full((num_examples, 1 + len(self.names)), -1, np.int64)
        self.handles = {k: open(os.path.join(folder, k + ".bin"), "wb") for k in self.names}
        self.offsets = {k: 0 for k in self.names}
        # Each file's CRC-32 as it is written, while its bytes are in cache: read back at close,
        # the 2.26 GB of an MRPC intermediate cache took ~0.9 s before the first step.
        self.crcs = {k: 0 for k in self.names}
        self.row_shapes: Dict[str, Dict[str, list]] = {k: {} for k in self.names}
        self.written = 0

    def write(self, feats: Dict[str, Any], ids: np.ndarray, keep: np.ndarray, T: int) -> dict:
        """Writes the token fields of the kept rows; returns the other fields."""
        if not self.names:
            return feats
        missing = [k for k in self.names if k not in feats]
        if missing:
            raise ValueError(f"teacher cache: the forward returned no {missing}")
        self.index[ids, 0] = T
        for j, k in enumerate(self.names):
            v = np.asarray(feats[k])
            # Copies only to drop rows or convert (a forward from make_forward(token_fields=...)
            # returns this dtype already).
            v = np.ascontiguousarray(v if keep.all() else v[keep], self.dtype)
            n = int(np.prod(v.shape[1:]))
            self.row_shapes[k].setdefault(str(T), list(v.shape[1:]))
            self.index[ids, 1 + j] = self.offsets[k] + n * np.arange(len(ids))
            data = memoryview(v).cast("B")
            self.crcs[k] = zlib.crc32(data, self.crcs[k])
            self.handles[k].write(data)
            if self.flush:
                self.handles[k].flush()
            self.offsets[k] += n * len(ids)
        self.written += len(ids)
        return {k: v for k, v in feats.items() if k not in self.names}

    def close(self) -> dict:
        """Meta entries for the token fields ({} without any)."""
        for fh in self.handles.values():
            fh.close()
        if not self.names:
            return {}
        p = os.path.join(self.folder, TOKEN_INDEX)
        np.save(p, self.index)
        info = {}
        for k in self.names:
            f = os.path.join(self.folder, k + ".bin")
            info[k] = {"dtype": self.dtype.name, "row_shapes": self.row_shapes[k],
                       "bytes": os.path.getsize(f), "crc32": self.crcs[k]}
        return {"token_fields": info, "token_index_file": _file_info(p)}

    def abort(self) -> None:
        for fh in self.handles.values():
            fh.close()


def _file_info(p: str) -> dict:
    a = np.load(p, mmap_mode="r")
    return {"shape": list(a.shape), "dtype": str(a.dtype), "bytes": os.path.getsize(p),
            "crc32": _crc32(p)}


def forward_work(keep: np.ndarray, num_rows: int, row_len: int) -> float:
    """The work of forwarding a batch of `num_rows` rows of `row_len` tokens, counting the rows
    that hold a kept example (keep: bool [num_rows * S], S examples a row; 1 unpacked):
    rows x (T + T^2 / PACK_ATTENTION_LEN), the cost `packing_plan` weighs."""
    rows = np.asarray(keep).reshape(num_rows, -1).any(axis=1).sum()
    return float(rows * batching.row_cost(row_len, PACK_ATTENTION_LEN))


def pass_work(lengths: np.ndarray, buckets: Sequence[int], plan=None) -> float:
    """The `forward_work` of a whole pass over examples of `lengths`: in their buckets, or in
    the packed rows of `plan` (`packing_plan`'s (row_len, S, rows))."""
    if plan is None:
        return batching.bucket_cost(lengths, buckets, PACK_ATTENTION_LEN)
    return float(len(plan[2]) * batching.row_cost(plan[0], PACK_ATTENTION_LEN))


def build_or_load(path: str, fingerprint: Mapping[str, Any], forward: Callable, params,
                  batches: Union[Iterable, Callable[[], Iterable]], num_examples: int,
                  verify: bool = True, num_rows: Optional[int] = None,
                  token_fields: Sequence[str] = (), token_dtype: str = "float32",
                  work_total: Optional[float] = None, live=None) -> TeacherCache:
    """The cache at `path` if it was built from the same `fingerprint`, else (re)build it.

    fingerprint: what the outputs depend on, e.g. {"teacher": params_fingerprint(p),
    "data": dataset_fingerprint(ds), "tokenizer": ..., "layers": [...]}; compared with the
    one in meta.json. batches: an iterable, or a callable returning one (called only when a
    build is needed). A truncated or corrupt cache is rebuilt with a warning. num_rows, live: see
    `build` (put what selects the rows into the fingerprint).
    """
    fingerprint = dict(fingerprint, num_examples=int(num_examples))
    # A build killed earlier (kill -9, preemption) left its hidden temporary folder behind.
    for t in fs.clean_stale_temps(path):
        log.warning("teacher cache: removed %s, left by an interrupted build", t)
    if fs.exists(fs.join(path, META)) or fs.isdir(path):
        try:
            cache = open_cache(path, fingerprint, verify=verify)
            log.info("teacher cache %s: up to date (%d examples)", path, cache.num_examples)
            return cache
        except CacheError as e:
            if "built from other inputs" in str(e):
                log.info("teacher cache %s: rebuilding (%s)", path, e)
            else:
                log.warning("teacher cache %s is unusable, rebuilding it: %s", path, e)
    it = batches() if callable(batches) else batches
    return build(path, fingerprint, forward, params, it, num_examples, num_rows=num_rows,
                 token_fields=token_fields, token_dtype=token_dtype, work_total=work_total,
                 live=live)


# ----------------------------------------------------------------------------- trainer glue

def token_cache_bytes(obj, seq_lens: np.ndarray, dtype: str = "float16") -> int:
    """Disk bytes of the per-token teacher cache of an intermediate objective for rows padded
    to `seq_lens` (int [R], each row's bucket length): attention logits [K_a, H, T, T] plus
    hidden states [K_h, T, D] per row."""
    tc = obj.teacher_config
    T = np.asarray(seq_lens, np.int64)
    ka = len(obj.teacher_attention_layers) * tc.num_attention_heads
    kh = len(obj.teacher_hidden_layers) * tc.hidden_size
    return int(np.dtype(dtype).itemsize * np.sum(ka * T * T + kh * T))


def teacher_model_id(teacher) -> str:
    """The teacher module's part of a cache fingerprint: its class and compute dtypes."""
    out = f"{type(teacher).__name__}:{getattr(teacher, 'dtype', None)}"
    # Products in another dtype than the activations give other outputs. Named only then, so
    # that the fingerprints of caches built before dot_dtype existed still match.
    if getattr(teacher, "dot_dtype", None) is not None:
        out += f":dots={teacher.dot_dtype}"
    return out


def build_for_training(models, obj, data, workdir: str, mesh=None, batch_size: int = 64,
                       num_steps: Optional[int] = None,
                       token_dtype: Optional[str] = None, store=None, live=None,
                       order: Optional[Iterable[Tuple[int, np.ndarray]]] = None) -> TeacherCache:
    """The cache for a training run (called by `train.train_and_evaluate`).

    Covers the examples of `data.train_dataset` that the run's `num_steps` training steps read
    (`rows_to_cache`: all of them once num_steps is an epoch or more, or None): a run of fewer
    steps than an epoch of a large (e.g. augmented) train set forwards only the rows it will use. One
    pass in dataset order, no dropped remainder. Each process builds its own copy (under
    `cache/teacher_p<i>` when there are several): no collective is involved, and the workdir
    need not be shared. token_dtype (float16 | float32): cache the
    objective's per-token features (intermediate stage: attention logits, hidden states), each
    row at its bucket length, in that dtype. store: a `teacher_store.Store` (or None): an
    entry there that covers the rows is copied in instead of running the teacher, and what
    this build computes per example (logits, [CLS] vectors; not the per-token fields) is
    published to it for later runs. live, order: a build beside the steps (teacher_stream.py):
    the `Live` that readers wait on, and (T, example rows [b]) of the steps left, in the order
    they run (`teacher_stream.steps_order`), which an unpacked pass follows before the rows no
    step reads.
    """
    ds = data.train_dataset
    n = len(ds)
    tok = tokenize.load_data_tokenizer(models.tokenizer_dir)
    fingerprint = {
        # build.Models hashes its teacher once a run; other `models` (tests) are hashed here.
        "teacher": (getattr(models, "teacher_fingerprint", None)
                    or params_fingerprint(models.teacher_params)),
        "teacher_model": teacher_model_id(models.teacher),
        "teacher_config": models.teacher_config.to_dict(),
        "data": dataset_fingerprint(ds),
        "tokenizer": tokenize.tokenizer_fingerprint(tok),
        "layers": list(getattr(obj, "teacher_cls_layers", ()) or ()),
        "objective": getattr(obj, "name", None),
    }
    buckets = _train_buckets(data)
    token_fields: Tuple[str, ...] = ()
    attn_layers: Tuple[int, ...] = ()
    if token_dtype:
        token_fields = obj.token_cache_fields
        attn_layers = tuple(obj.teacher_attention_layers)
        # A row's length is its bucket's: other buckets need another cache.
        fingerprint.update(buckets=list(buckets), token_dtype=str(token_dtype),
                           hidden_layers=list(obj.teacher_hidden_layers),
                           attention_layers=list(attn_layers))
    rows, lengths, plan = _pass_plan(obj, data, token_dtype, num_steps)
    if rows is not None:
        # Which rows is part of what the cache holds: another step count or seed rebuilds it.
        fingerprint["rows"] = arrays_fingerprint(rows)
        log.info("teacher cache: %d steps read %d of %d train examples; caching those",
                 num_steps, len(rows), n)
    name = "teacher" if jax.process_count() == 1 else f"teacher_p{jax.process_index()}"
    path = fs.join(workdir, "cache", name)

    def batches():   # asked for only when the cache is built here
        if plan is None and order is not None:
            return _ordered_row_batches(ds, order, rows, buckets, batch_size)
        if plan is None:
            return _row_batches(ds, rows, buckets, batch_size)
        log.info("teacher cache: %d examples packed into %d rows of %d tokens (up to %d per "
                 "row): %.0f%% of the tokens of padding each to its bucket", len(lengths),
                 len(plan[2]), plan[0], plan[1],
                 100.0 * len(plan[2]) * plan[0] / max(1, batching.padded_tokens(lengths, buckets)))
        return _packed_row_batches(ds, rows, plan, batch_size)

    forward = _training_forward(models, obj, token_dtype,
                                packed_segments=None if plan is None else plan[1])
    # What the per-example outputs depend on, whichever objective asks: the logits-only entry of
    # an intermediate build is the one a prediction or KD run looks for.
    share_fp = dict(fingerprint, layers=[] if token_fields else fingerprint["layers"],
                    num_examples=n)
    if store is not None and not token_fields and not _is_current(path, fingerprint, n):
        need = np.arange(n) if rows is None else rows
        # An entry of a run with other buckets lacks a few rows (each bucket drops its own
        # incomplete batch): those are forwarded here, up to a quarter of what the run reads.
        entry = store.find(share_fp, rows, max_missing=len(need) // 4)
        if entry is not None:
            missing = need[~np.asarray(entry.filled)[need]]
            log.info("teacher cache: teacher outputs of %d examples from the teacher store %s "
                     "(computed by an earlier run with the same teacher and data; "
                     "JTB_TEACHER_STORE=off to recompute)%s", len(need) - len(missing),
                     entry.path, f"; forwarding the {len(missing)} it lacks" if len(missing)
                     else "")
            def fill(ids):   # a few rows: in buckets, with the forward of unpacked rows
                return _forward_rows(_training_forward(models, obj, token_dtype),
                                     models.teacher_params,
                                     _row_batches(ds, ids, buckets, batch_size), ids)

            cache = store.adopt(entry, path, fingerprint, missing=missing, fill=fill)
            if len(missing):
                store.publish(cache, share_fp)   # the entry grows to the rows of both runs
            return cache
    cache = build_or_load(path, fingerprint, forward, models.teacher_params, batches, n,
                          num_rows=None if rows is None else len(rows),
                          token_fields=token_fields, token_dtype=token_dtype or "float32",
                          work_total=pass_work(lengths, buckets, plan), live=live)
    if store is not None and cache.build_stats is not None:
        store.publish(cache, share_fp, fields=["teacher_logits"] if token_fields else None)
    cache.fields = _step_fields(cache.fields, token_dtype)
    return cache


def _pass_plan(obj, data, token_dtype: Optional[str], num_steps: Optional[int]):
    """(rows, lengths, plan) of `build_for_training`'s pass: the rows it caches
    (`rows_to_cache`; None = all), their lengths int [R], and the `packing_plan` of a forward
    that reads one output per example (None: unpacked, each row at its bucket's length)."""
    ds = data.train_dataset
    rows = rows_to_cache(data.train_batches, ds, num_steps)
    lengths = np.asarray(ds.lengths)[slice(None) if rows is None else rows]
    plan = (packing_plan(lengths, _train_buckets(data)) if _reads_cls_only(obj, token_dtype)
            else None)
    return rows, lengths, plan


def _train_buckets(data) -> Tuple[int, ...]:
    """The length buckets of `data`'s train batches (batching.DEFAULT_BUCKETS without any)."""
    return getattr(data.train_batches, "buckets", None) or batching.DEFAULT_BUCKETS


def follows_steps(obj, data, token_dtype: Optional[str], num_steps: Optional[int]) -> bool:
    """Whether `build_for_training(..., order=)` forwards the rows in the order of the steps
    that read them, as a build beside the steps (teacher_stream.py) needs so that a step finds
    its rows written: a per-token cache always; a cache of logits / [CLS] rows when its
    examples are not packed (`packing_plan`: MRPC's pairs are not; SST-2's short sentences are,
    several to a row in no step's order, and would all be waited for by the first step)."""
    return _pass_plan(obj, data, token_dtype, num_steps)[2] is None


def _step_fields(fields: Dict[str, Any], token_dtype: Optional[str]) -> Dict[str, Any]:
    """Of a training cache's fields, those its batches get: a per-token (intermediate) cache
    keeps its logits for the store only, since the intermediate loss reads the per-token fields."""
    return {k: v for k, v in fields.items() if not (token_dtype and k == "teacher_logits")}


def _reads_cls_only(obj, token_dtype: Optional[str]) -> bool:
    """Whether a training cache's forward reads logits and [CLS] rows alone."""
    return not token_dtype and not obj.reads_tokens


def _training_forward(models, obj, token_dtype: Optional[str],
                      packed_segments: Optional[int] = None) -> Callable:
    """The forward a training run's cache is built with (see `build_for_training`);
    packed_segments: for the batches of `_packed_row_batches` (see `make_forward`)."""
    token_fields = tuple(obj.token_cache_fields) if token_dtype else ()

    def with_logits(out):
        # The logits cost one pooler + classifier on the forward that runs anyway: stored so the
        # prediction stage after this one (same teacher, same data) reads them from the store.
        return dict(obj.teacher_features(out), teacher_logits=out.logits)

    return make_forward(models.teacher, with_logits if token_fields else obj.teacher_features,
                        attention_layers=obj.teacher_attention_layers if token_fields else (),
                        token_fields=token_fields, token_dtype=token_dtype or "float32",
                        cls_only=_reads_cls_only(obj, token_dtype),
                        packed_segments=packed_segments)


def lookup_spec(models, obj, batch: Mapping[str, Any],
                token_dtype: Optional[str] = None) -> Dict[str, jax.ShapeDtypeStruct]:
    """What `lookup` adds to `batch` (int [b, T] model inputs) from the cache that
    `build_for_training(models, obj, ..., token_dtype=token_dtype)` builds, as shapes and dtypes,
    without running the teacher: the train step can be compiled for those batches while the cache
    is being built. {field: ShapeDtypeStruct [b, ...]}."""
    forward = _training_forward(models, obj, token_dtype)
    out = jax.eval_shape(forward, models.teacher_params,
                         *(jax.ShapeDtypeStruct(np.shape(batch[k]), np.asarray(batch[k]).dtype)
                           for k in MODEL_KEYS))
    return _step_fields(out, token_dtype)


def rows_per_forward(seq_len: int, batch_size: int) -> int:
    """Rows of a [batch_size, seq_len] batch that one cache-build forward takes: on CPU
    `batching.chunk_rows` of FORWARD_TOKENS tokens, the whole batch on accelerators."""
    if jax.default_backend() != "cpu":
        return int(batch_size)
    return batching.chunk_rows(batch_size, seq_len, FORWARD_TOKENS)


def packing_plan(lengths: np.ndarray, buckets: Sequence[int]
                 ) -> Optional[Tuple[int, int, List[np.ndarray]]]:
    """(row_len, max_segments, rows of `packing.pack`) for a teacher pass over examples of
    `lengths` (int [n]) that reads one output per example, or None when packing them would not
    cost at most PACK_GAIN of padding each to its bucket of `buckets` (cost of a token in a
    row of T: 1 + T / PACK_ATTENTION_LEN). row_len: of the buckets that hold the longest
    example, the cheapest. SST-2 train (mean 13.3 tokens, buckets up to 64): rows of 64, 16 segments, 79% of
    the bucketed tokens; MRPC pairs (mean 53) at 128: 94%, not packed."""
    lengths = np.asarray(lengths, np.int64)
    b = np.asarray(sorted(int(x) for x in buckets), np.int64)
    if not len(lengths) or lengths.max() > b[-1]:
        return None
    best, cost = None, PACK_GAIN * pass_work(lengths, b)
    for P in b[b >= lengths.max()].tolist():   # each bucket long enough for every example
        rows = packing.pack(lengths, P, max(1, P // 4))
        S = max(len(r) for r in rows)
        packed = pass_work(lengths, b, (P, S, rows))
        if S > 1 and packed <= cost:
            best, cost = (P, S, rows), packed
    return best


def _packed_row_batches(ds, rows: Optional[np.ndarray], plan, batch_size: int):
    """`_row_batches` for a `packing_plan` over dataset rows `rows` (None: all of ds): packed
    batches (data/packing.py) of FORWARD_TOKENS tokens on CPU (`rows_per_forward`), of
    batch_size rows elsewhere; example_id = the row's index in ds."""
    P, S, packed = plan
    src = ds if rows is None else tokenize.take(ds, rows)
    for batch in packing.packed_batches(src, packed, P, S, rows_per_forward(P, batch_size)):
        if rows is not None:
            ids = batch["example_id"]
            batch["example_id"] = np.where(ids >= 0, rows[np.maximum(ids, 0)], -1)
        yield batch


def _row_batches(ds, rows: Optional[np.ndarray], buckets, batch_size: int):
    """Eval-mode bucketed batches over dataset rows `rows` (int [R]; None: all of `ds`), no
    row dropped, each split into chunks of `rows_per_forward` rows; example_id = the row's
    index in `ds` (-1 for filler rows)."""
    src = ds if rows is None else tokenize.take(ds, rows)
    it = batching.BucketedBatcher(src, min(batch_size, max(1, len(src))), buckets,
                                  train=False, process_index=0, process_count=1)
    for batch in it:
        if rows is not None:  # subset positions -> the train set's example ids
            ids = batch["example_id"]
            batch["example_id"] = np.where(ids >= 0, rows[np.maximum(ids, 0)], -1)
        n, T = np.shape(batch["input_ids"])
        step = rows_per_forward(T, n)
        for s in range(0, n, step):
            chunk = {k: v[s:s + step] for k, v in batch.items()}
            if np.any(chunk["example_id"] >= 0):   # not filler rows only
                yield chunk


def _ordered_row_batches(ds, order: Iterable[Tuple[int, np.ndarray]], rows: Optional[np.ndarray],
                         buckets, batch_size: int):
    """Batches for a cache build over the rows of `order` ((T, example rows int [g], -1 =
    filler) per step, e.g. `teacher_stream.steps_order`) first, each at its step's T, in that
    order, then over the rows of `rows` (None: all of ds) that no step of it reads, bucket by
    bucket. Chunks of `rows_per_forward(T, g)` rows (g: the steps' batch; `batch_size` without
    steps), the shapes of a build before the steps of batch g; a step's (or a bucket's) last
    chunk is completed with filler rows (example_id -1, valid 0)."""
    done = np.zeros((len(ds),), bool)
    wanted = np.zeros((len(ds),), bool)
    wanted[slice(None) if rows is None else rows] = True
    left, g = int(wanted.sum()), None
    for T, ids in order:
        if left <= 0:
            break
        ids = np.asarray(ids, np.int64)
        g = g or len(ids)
        ids = ids[ids >= 0]   # a step's rows are distinct (a slice of the epoch's permutation)
        ids = ids[wanted[ids] & ~done[ids]]
        done[ids] = True
        left -= len(ids)
        yield from _chunks(ds, ids, int(T), rows_per_forward(int(T), g))
    rest = np.flatnonzero(wanted & ~done)
    if len(rest):
        g = g or int(batch_size)
        b = np.asarray(sorted(buckets), np.int64)
        T_rest = b[batching.assign_buckets(np.asarray(ds.lengths)[rest], b)]
        for T in np.unique(T_rest).tolist():
            yield from _chunks(ds, rest[T_rest == T], int(T), rows_per_forward(int(T), g))


def _chunks(ds, ids: np.ndarray, T: int, step: int):
    """Rows `ids` of ds at length T in chunks of `step` rows, the last completed with filler
    rows (a copy of a real row, example_id -1, valid 0)."""
    for s in range(0, len(ids), step):
        part = ids[s:s + step]
        real = np.arange(step) < len(part)
        fill = np.where(real, np.resize(part, step), part[0])
        chunk = {k: v for k, v in ds.gather(fill, T).items() if k != "labels"}
        chunk["example_id"] = np.where(real, fill, -1)
        chunk["valid"] = real.astype(np.float32)
        yield chunk


def forwarded(forward: Callable, params, items: Iterable[Tuple[Mapping[str, Any], Any]],
              in_flight: Optional[int] = None, flops: Optional[work_lib.Work] = None
              ) -> Iterator[Tuple[Any, Dict[str, np.ndarray]]]:
    """(tag, host outputs of `forward(params, *batch[MODEL_KEYS])`) for each (batch, tag) of
    `items`, in their order. On CPU up to `in_flight` (default FORWARDS_IN_FLIGHT) forwards run
    at once, each in its own thread, and one more is queued; elsewhere one at a time, the next
    dispatched while the caller handles the last. Leaving the loop early cancels the queued ones
    and waits for those running. flops: counts each forward's FLOPs (`forward` jitted)."""
    if in_flight is None:
        in_flight = FORWARDS_IN_FLIGHT if jax.default_backend() == "cpu" else 1

    def run(batch):
        args = tuple(np.asarray(batch[k]) for k in MODEL_KEYS)
        out = jax.device_get(forward(params, *args))
        if flops is not None:
            lower = getattr(forward, "lower", None)   # None: not jitted, no count
            flops.add(tuple((a.shape, a.dtype.str) for a in args),
                      (lambda: lower(params, *args)) if lower else None)
        return out

    pending: collections.deque = collections.deque()
    pool = concurrent.futures.ThreadPoolExecutor(in_flight, thread_name_prefix="teacher")
    try:
        for batch, tag in items:
            pending.append((tag, pool.submit(run, batch)))
            if len(pending) > in_flight:
                tag, fut = pending.popleft()
                yield tag, fut.result()
        while pending:
            tag, fut = pending.popleft()
            yield tag, fut.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _forward_rows(forward: Callable, params, batches, rows: np.ndarray) -> Dict[str, np.ndarray]:
    """forward's outputs over `batches` (from `_row_batches(ds, rows, ...)`, rows sorted int
    [M]) -> {field: float32 [M, ...]} in the order of `rows`."""
    params = jax.device_put(params)
    out: Dict[str, np.ndarray] = {}

    def positions():
        for batch in batches:
            ids = np.asarray(batch["example_id"])
            keep = (ids >= 0) & (np.asarray(batch["valid"]) > 0)
            yield batch, (keep, np.searchsorted(rows, ids[keep]))

    for (keep, pos), feats in forwarded(forward, params, positions()):
        for k, v in feats.items():
            if k not in out:
                out[k] = np.zeros((len(rows),) + v.shape[1:], np.float32)
            out[k][pos] = np.asarray(v, np.float32)[keep]
    return out


def _is_current(path: str, fingerprint: Mapping[str, Any], num_examples: int) -> bool:
    """Whether the workdir cache at `path` is already the one for `fingerprint` (meta only)."""
    try:
        with fs.open_file(fs.join(path, META)) as fh:
            old = json.load(fh).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return False
    return old == _normalise(dict(fingerprint, num_examples=int(num_examples)))


def rows_to_cache(batcher, ds, num_steps: Optional[int]) -> Optional[np.ndarray]:
    """The rows of `ds` a training run's teacher cache holds: int64 [R] sorted, the rows that
    `num_steps` steps of `batcher` read, or None for all of them.

    All of them from an epoch on: an epoch leaves only each bucket's incomplete batch unread (at
    most buckets x batch rows), and forwarding those too makes the entry published to the
    teacher store serve a later stage whose buckets or seed leave other rows, which would
    otherwise compile teacher forward programs for a handful of rows (~7 s of an MRPC
    prediction epoch)."""
    if (num_steps is None or not hasattr(batcher, "rows_read")
            or not isinstance(ds, tokenize.EncodedDataset)
            or num_steps >= batcher.steps_per_epoch):
        return None
    rows = batcher.rows_read(num_steps)
    return None if len(rows) == len(ds) else rows
