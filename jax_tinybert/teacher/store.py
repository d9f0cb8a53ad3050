"""Teacher outputs shared between runs on one machine, keyed by what they depend on.

Runs with the same teacher (its parameter bytes), tokenizer and train data need the same
per-example teacher logits and [CLS] vectors: the prediction stage after the intermediate stage
of the same recipe, the KD and PKD baselines beside it, a sweep over the student's learning rate
or temperature. The first run to compute them publishes a copy here; a later run copies the
entry into its own workdir (`<workdir>/cache/teacher`, so the workdir stays self-contained)
instead of running the teacher over the data again. The intermediate stage's per-token cache
build computes the teacher's logits too (one more head on the forward it runs anyway) and
publishes them, so the prediction stage after it starts training at once.

Where: `$JTB_TEACHER_STORE`, default `~/.cache/jax_tinybert/teacher`; `JTB_TEACHER_STORE=off`
neither reads nor writes. Layout: `<root>/<key>/`, a teacher-cache folder (teacher_cache.py)
without per-token fields, key = sha256 of the share fingerprint. Entries larger than
MAX_ENTRY_BYTES are not stored (the per-token caches never are). Delete the folder to reclaim
the space; a damaged entry is ignored with a warning and replaced by the next build.

The share fingerprint is the run's cache fingerprint without what only selects rows or names
the objective (`rows`, `objective`): an entry is used when it covers every row the run reads.
The padded length a row was computed at (the run's buckets) is not part of it: it changes the
outputs only by float rounding (masked positions get zero attention weight).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from jax_tinybert import fs
from jax_tinybert.teacher import cache as tc, positions

log = logging.getLogger(__name__)

ENV = "JTB_TEACHER_STORE"
MAX_ENTRY_BYTES = 2 * 10**9
# Fingerprint fields that select rows or name the objective: not what an output depends on.
NOT_SHARED = ("rows", "objective", "buckets", "token_dtype", "hidden_layers", "attention_layers")


def root_from_env() -> Optional[str]:
    """The store folder ($JTB_TEACHER_STORE or the default), or None when sharing is off."""
    return fs.shared_store(ENV, "teacher")


def share_fingerprint(fingerprint: Mapping[str, Any]) -> dict:
    """What the outputs depend on: the run's cache fingerprint less NOT_SHARED."""
    return {k: v for k, v in tc._normalise(fingerprint).items() if k not in NOT_SHARED}


def key(share_fp: Mapping[str, Any]) -> str:
    """Entry name: sha256 of the canonical JSON of the share fingerprint (24 hex)."""
    blob = json.dumps(tc._normalise(share_fp), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


class Store:
    """One store folder. `find` an entry covering some rows, `adopt` it into a workdir cache,
    `publish` a workdir cache's per-example fields."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)

    def __repr__(self) -> str:
        return f"Store({self.root!r})"

    def entry_path(self, fingerprint: Mapping[str, Any]) -> str:
        """The entry folder of a cache fingerprint (NOT_SHARED fields ignored)."""
        return os.path.join(self.root, key(share_fingerprint(fingerprint)))

    def find(self, fingerprint: Mapping[str, Any], rows: Optional[np.ndarray],
             max_missing: int = 0) -> Optional[tc.TeacherCache]:
        """The entry for `fingerprint` (NOT_SHARED fields ignored) if it is intact and lacks at
        most `max_missing` rows of `rows` (int [R]; None: all of its examples); else None (a
        damaged entry is logged and removed)."""
        share_fp = share_fingerprint(fingerprint)
        path = self.entry_path(share_fp)
        if not os.path.isfile(os.path.join(path, tc.META)):
            return None
        try:
            entry = tc.open_cache(path, share_fp, verify=True)
        except tc.CacheError as e:
            if "built from other inputs" in str(e):
                return None
            log.warning("teacher store: ignoring and removing the damaged entry %s: %s", path, e)
            shutil.rmtree(path, ignore_errors=True)
            return None
        filled = np.asarray(entry.filled)
        missing = int((~filled).sum() if rows is None else (~filled[np.asarray(rows)]).sum())
        return entry if missing <= max_missing else None

    def adopt(self, entry: tc.TeacherCache, path: str, fingerprint: Mapping[str, Any],
              missing: Optional[np.ndarray] = None,
              fill: Optional[Callable[[np.ndarray], Mapping[str, np.ndarray]]] = None
              ) -> tc.TeacherCache:
        """Copy `entry` to the workdir cache folder `path` under the run's own `fingerprint`
        (what `teacher_cache.build_or_load` compares on the next start). missing: rows (int
        [M]) the entry lacks and the run reads, computed by `fill(rows) -> {field: [M, ...]}`
        (a teacher forward) into the copy."""
        path = fs.abspath(path)
        fs.makedirs(os.path.dirname(path))
        fs.clean_stale_temps(path)
        tmp = fs.staging_dir(path)
        try:
            for name in list(entry.fields) + [os.path.splitext(tc.FILLED)[0]]:
                shutil.copyfile(os.path.join(entry.local_dir, name + ".npy"),
                                os.path.join(tmp, name + ".npy"))
            meta = dict(entry.meta, fingerprint=tc._normalise(
                dict(fingerprint, num_examples=entry.num_examples)))
            if missing is not None and len(missing):
                meta = _fill_rows(tmp, meta, np.asarray(missing, np.int64), fill(missing))
            with open(os.path.join(tmp, tc.META), "w") as fh:
                json.dump(meta, fh, indent=1, sort_keys=True)
            fs.publish_dir(tmp, path, last=[tc.META], keep_local=fs.is_remote(path))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return tc.TeacherCache(path, verify=False, local=tmp if fs.is_remote(path) else None)

    def publish(self, cache: tc.TeacherCache, fingerprint: Mapping[str, Any],
                fields: Optional[list] = None) -> Optional[str]:
        """Copy the per-example `fields` (default: all) of `cache` into the store as the entry of
        `fingerprint` (NOT_SHARED fields ignored), unless one is there already or it is over MAX_ENTRY_BYTES. Best effort: a
        full disk or a read-only home only logs a warning. Returns the entry path or None."""
        fields = [f for f in (cache.fields if fields is None else fields) if f in cache.fields]
        if not fields:
            return None
        size = sum(cache.meta["fields"][f]["bytes"] for f in fields)
        if size > MAX_ENTRY_BYTES:
            log.info("teacher store: not storing %.2f GB of teacher outputs (over %.1f GB)",
                     size / 1e9, MAX_ENTRY_BYTES / 1e9)
            return None
        share_fp = share_fingerprint(fingerprint)
        path = self.entry_path(share_fp)
        if self.find(share_fp, np.flatnonzero(np.asarray(cache.filled))) is not None:
            return path   # an intact entry already has every row this one has
        tmp = None
        try:
            os.makedirs(self.root, exist_ok=True)
            fs.clean_stale_temps(path)
            tmp = fs.mkdtemp(path)
            for name in fields + [os.path.splitext(tc.FILLED)[0]]:
                shutil.copyfile(os.path.join(cache.local_dir, name + ".npy"),
                                os.path.join(tmp, name + ".npy"))
            meta = {k: v for k, v in cache.meta.items()
                    if k not in ("token_fields", "token_index_file")}
            meta["fields"] = {f: cache.meta["fields"][f] for f in fields}
            meta["fingerprint"] = tc._normalise(share_fp)
            with open(os.path.join(tmp, tc.META), "w") as fh:
                json.dump(meta, fh, indent=1, sort_keys=True)
            # An entry with fewer rows (a shorter run's) is replaced; a reader of the old one
            # has its files open already.
            fs.swap_into_place(tmp, path)
            return path
        except OSError as e:
            log.warning("teacher store %s: could not store the teacher outputs (%s); the run "
                        "goes on without sharing them", self.root, e)
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            return None

    # Span and token tasks: the teacher's per-position logits (teacher/positions.py), one
    # file per entry, `<root>/positions/<key>.npz`, so that the KD and PKD baselines and a
    # prediction stage after them read the pass the first of them ran.
    def positions_path(self, fingerprint: Mapping[str, Any]) -> str:
        """The entry file of a fingerprint (NOT_SHARED fields ignored, as for entry_path)."""
        return os.path.join(self.root, "positions", key(share_fingerprint(fingerprint)) + ".npz")

    def find_positions(self, fingerprint: Mapping[str, Any], num_rows: int,
                       cls_layers: Sequence[int] = ()
                       ) -> Optional["positions.PositionLogitsCache"]:
        """The stored logits of `fingerprint` (a dict of what they depend on) for a dataset of
        `num_rows` rows, with the [CLS] vectors of the teacher layers `cls_layers` (hidden-state
        indices; PKD's); None when absent or without those layers (a damaged file is logged and
        removed)."""
        path = self.positions_path(fingerprint)
        if not os.path.isfile(path):
            return None
        try:
            with np.load(path) as z:
                values, offsets, head = z["values"], z["offsets"], str(z["head"])
                have = [int(t) for t in z["cls_layers"]]
                cls = z["cls"] if have else None
            if len(offsets) != num_rows + 1 or int(offsets[-1]) != len(values):
                raise ValueError(f"{len(offsets) - 1} rows, {len(values)} positions")
        except (OSError, ValueError, KeyError) as e:
            log.warning("teacher store: ignoring and removing the damaged entry %s: %s", path, e)
            with contextlib.suppress(OSError):
                os.unlink(path)
            return None
        if not set(cls_layers) <= set(have):
            return None
        log.info("teacher logits of %d train rows from the teacher store %s", num_rows, path)
        got = positions.PositionLogitsCache(values, offsets, head, None, cls)
        return positions.with_cls_layers(got, have, cls_layers)

    def publish_positions(self, cache: "positions.PositionLogitsCache",
                          fingerprint: Mapping[str, Any], cls_layers: Sequence[int] = ()
                          ) -> Optional[str]:
        """Write `cache` (with the [CLS] vectors of `cls_layers`) as the entry of `fingerprint`,
        atomically; best effort, as publish."""
        path = self.positions_path(fingerprint)
        arrays = dict(values=cache.values, offsets=cache.offsets, head=np.asarray(cache.head),
                      cls_layers=np.asarray(list(cls_layers), np.int64))
        if cache.cls is not None:
            arrays["cls"] = cache.cls
        if sum(a.nbytes for a in arrays.values()) > MAX_ENTRY_BYTES:
            return None
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with fs.atomic_open(path, "wb") as fh:
                np.savez(fh, **arrays)
            return path
        except OSError as e:
            log.warning("teacher store %s: could not store the teacher logits (%s); the run "
                        "goes on without sharing them", self.root, e)
            return None


def _fill_rows(folder: str, meta: dict, rows: np.ndarray, values: Mapping[str, np.ndarray]
               ) -> dict:
    """Writes `values` ({field: [M, ...]}) at `rows` of the cache files in `folder` and marks
    them filled; -> meta with the new file sizes and checksums."""
    if not set(meta["fields"]) <= set(values):
        raise ValueError(f"teacher store: the forward gave {sorted(values)}, the entry holds "
                         f"{sorted(meta['fields'])}")
    meta = dict(meta, fields=dict(meta["fields"]))
    for name in meta["fields"]:
        p = os.path.join(folder, name + ".npy")
        arr = np.load(p, mmap_mode="r+")
        arr[rows] = np.asarray(values[name], arr.dtype)
        arr.flush()
        del arr
        meta["fields"][name] = tc._file_info(p)
    p = os.path.join(folder, tc.FILLED)
    filled = np.load(p)
    filled[rows] = True
    np.save(p, filled)
    meta.update(filled=int(filled.sum()), filled_file=tc._file_info(p))
    return meta


def from_env() -> Optional[Store]:
    """The store configured by $JTB_TEACHER_STORE (None when off)."""
    root = root_from_env()
    return Store(root) if root else None
