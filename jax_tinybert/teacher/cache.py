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
import json
import logging
import os
import shutil
import zlib
from typing import (Any, Callable, Dict, Iterable, Iterator, Mapping, Optional, Sequence, Tuple,
                    Union)

import jax
import jax.numpy as jnp
import numpy as np

from jax_tinybert import fs, speed
from jax_tinybert.model import modeling
from jax_tinybert import flops as work_lib
from jax_tinybert.data import batching, packing
from jax_tinybert.progress import Progress
from jax_tinybert.teacher.fingerprint import _crc32, _normalise

log = logging.getLogger(__name__)

VERSION = 1
META = "meta.json"
FILLED = "filled.npy"
TOKEN_INDEX = "token_index.npy"
MODEL_KEYS = ("input_ids", "attention_mask", "token_type_ids")
# How many forwards a cache build runs at once, and their size in tokens: speed.profile's
# forwards_in_flight and forward_tokens (two of ~1,024 tokens on a CPU, one whole batch elsewhere).
# A row of T tokens costs T + T^2 / PACK_ATTENTION_LEN (batching.bucket_cost: a token's
# attention over the row). Measured on the teacher's forward (MiniLM-L6, SST-2, 2-core Xeon): a token in
# a packed row of 64 cost 1.07x one of the bucketed pass (mean bucket ~17), i.e. ~600; the
# train step's backward and dropout weigh attention more (batching.bucket_cost: 256).
PACK_ATTENTION_LEN = 512


class CacheError(ValueError):
    """A cache folder that cannot be used (missing, truncated, corrupt, or built from other inputs)."""


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
        self.shared = False   # read by every process of a run (teacher/split.py)
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
          live=None, warn_missing: bool = True) -> TeacherCache:
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
    warn_missing=False: a part of a pass split over processes (teacher/split.py checks the whole).
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

        # The host copies out and writes one batch while the next forwards run (the copy-out
        # was 11 s of 46 s of an MRPC intermediate build).
        flops = work_lib.Work()
        rows = _valid_rows(batches, num_examples)
        for (ids, keep, T, work), feats in forwarded(forward, params, rows, flops=flops):
            write(feats, ids, keep, T, work)
            if live is not None:
                live.check()
        prog.close(note=work_lib.fmt(flops.flops, prog.elapsed) if flops.known else "")
        if not files and not tokens.written:
            raise ValueError(f"teacher cache {path}: the batches held no valid rows")
        n_missing = int(expected - filled.sum())
        if n_missing > 0 and warn_missing:
            log.warning("teacher cache %s: %d of %d examples not covered by the batches; "
                        "looking them up will fail", path, n_missing, expected)
        meta = _publish(tmp, path, files, filled, tokens, fingerprint, num_examples)
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


def _valid_rows(batches: Iterable[Mapping[str, np.ndarray]], num_examples: int):
    """(batch, (example ids, kept rows, T, forward work)) for each batch with a row to cache."""
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


def _publish(tmp: str, path: str, files: Dict[str, np.ndarray], filled: np.ndarray, tokens,
             fingerprint: Mapping[str, Any], num_examples: int) -> dict:
    """Writes a built cache's meta.json in its staging folder `tmp` and moves the folder to
    `path`; -> the meta."""
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
    return meta


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
                  work_total: Optional[float] = None, live=None,
                  warn_missing: bool = True) -> TeacherCache:
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
                 live=live, warn_missing=warn_missing)


def forwarded(forward: Callable, params, items: Iterable[Tuple[Mapping[str, Any], Any]],
              in_flight: Optional[int] = None, flops: Optional[work_lib.Work] = None
              ) -> Iterator[Tuple[Any, Dict[str, np.ndarray]]]:
    """(tag, host outputs of `forward(params, *batch[MODEL_KEYS])`) for each (batch, tag) of
    `items`, in their order. On CPU up to `in_flight` (default: the profile's forwards_in_flight) forwards run
    at once, each in its own thread, and one more is queued; elsewhere one at a time, the next
    dispatched while the caller handles the last. Leaving the loop early cancels the queued ones
    and waits for those running. flops: counts each forward's FLOPs (`forward` jitted)."""
    if in_flight is None:
        in_flight = speed.current().forwards_in_flight

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
