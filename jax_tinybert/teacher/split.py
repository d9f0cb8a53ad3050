"""One teacher pass for all the processes of a run, read by every process.

Each process forwards every P-th batch of the pass (its share) on all of its local devices
(`Spread`, where the speed profile says so), and writes it as a cache of its own rows in
`<cache>.parts-of-<P>/part-<p>`; process 0 then joins the parts into the one cache at `<cache>`
and every process opens that. The workdir must be one that every process sees (gs://, NFS):
`shared_workdir` probes it, and where it is not each process builds its own whole copy instead
(`teacher_training.build_for_training` chooses, and logs which and why).

    cache = build_shared(path, fingerprint, forward, params, batches, n, coord=coord)
"""
from __future__ import annotations

import itertools
import logging
import os
import shutil
import time
import uuid
import zlib
from typing import Any, Callable, Iterable, List, Mapping, Optional, Sequence, Tuple

import jax
import numpy as np

from jax_tinybert import fs, speed
from jax_tinybert.teacher import cache as teacher_cache
from jax_tinybert.teacher.cache import META, TeacherCache

log = logging.getLogger(__name__)

# The others wait for process 0's join of the parts: one read and one write of the whole cache.
JOIN_TIMEOUT_S = 6 * 3600
# Per-example rows copied per gather while joining (a [CLS] field is [N, K, 768] float32).
_JOIN_ROWS = 1 << 14


def shared_workdir(workdir: str, coord) -> Tuple[bool, str]:
    """(whether every process sees the same files at `workdir`, why): a bucket is shared; a local
    path is probed with a file process 0 writes there and every process looks for."""
    if jax.process_count() == 1:
        return True, "one process"
    if fs.is_remote(workdir):
        return True, "a gs:// workdir"
    token = coord.from_process_0(uuid.uuid4().hex, "probe_name")
    probe = os.path.join(workdir, "cache", f".shared-probe-{token}")
    if jax.process_index() == 0:
        os.makedirs(os.path.dirname(probe), exist_ok=True)
        with open(probe, "w") as fh:
            fh.write(token)
    coord.barrier("probe_written")
    unseen = coord.any_process(not os.path.exists(probe), "probe_seen")
    if jax.process_index() == 0:
        os.remove(probe)
    if unseen:
        return False, (f"the workdir {workdir} is not one folder for all processes (a file "
                       "process 0 wrote there is missing on another host)")
    return True, "every process sees the workdir"


class Spread:
    """`forward(params, ids, mask, types)` run data-parallel over `devices`: each batch's rows
    padded to a multiple of the device count and split over them, the params replicated once.
    Returns host arrays of the unpadded rows (the leading axis of every output is rows x S)."""

    def __init__(self, forward: Callable, devices: Sequence[Any]):
        mesh = jax.sharding.Mesh(np.asarray(devices), ("rows",))
        self._forward, self._k = forward, len(devices)
        self._rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("rows"))
        self._all = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        self._src = self._params = None

    def __call__(self, params, *args):
        if params is not self._src:   # build() passes the same params to every call
            self._params, self._src = jax.device_put(params, self._all), params
        R = args[0].shape[0]
        Rp = -(-R // self._k) * self._k
        if Rp != R:   # filler rows (mask 0) whose outputs are dropped below
            args = tuple(np.concatenate([a, np.zeros((Rp - R,) + a.shape[1:], a.dtype)])
                         for a in args)
        out = jax.device_get(self._forward(self._params,
                                           *(jax.device_put(a, self._rows) for a in args)))
        return out if Rp == R else jax.tree.map(lambda x: x[: x.shape[0] * R // Rp], out)


def pass_forward(forward: Callable) -> Callable:
    """The forward a process's share of the pass runs: over all its local devices where the speed
    profile says so (accelerators), else as it is."""
    devices = jax.local_devices()
    if len(devices) > 1 and speed.current().forward_all_devices:
        return Spread(forward, devices)
    return forward


def _share(batches: Iterable, p: int, P: int) -> Optional[Iterable]:
    """Every P-th batch from the p-th (the rows of one batch are forwarded together), or None
    when there is none."""
    mine = itertools.islice(iter(batches), p, None, P)
    first = next(mine, None)
    return None if first is None else itertools.chain([first], mine)


def mark_shared(cache: TeacherCache) -> TeacherCache:
    """Marks a cache that every process reads (process 0 alone deletes it: stream.py)."""
    cache.shared = True
    return cache


def _opened(path: str, fingerprint: Mapping[str, Any], coord) -> Optional[TeacherCache]:
    """The cache at `path` when it is current, as process 0 finds it (it alone re-reads the
    files' checksums) and tells the others; else None."""
    cache = None
    if jax.process_index() == 0 and (fs.exists(fs.join(path, META)) or fs.isdir(path)):
        try:
            cache = teacher_cache.open_cache(path, fingerprint, verify=True)
        except teacher_cache.CacheError as e:
            log.info("teacher cache %s: rebuilding (%s)", path, e)
    if coord.from_process_0("1" if cache else "0", "cache_current") == "0":
        return None
    return cache or TeacherCache(path, verify=False)


def build_shared(path: str, fingerprint: Mapping[str, Any], forward: Callable, params,
                 batches: Callable[[], Iterable], num_examples: int, coord,
                 num_rows: Optional[int] = None, token_fields: Sequence[str] = (),
                 token_dtype: str = "float32", work_total: Optional[float] = None
                 ) -> TeacherCache:
    """`teacher_cache.build_or_load` for every process of a run at once: the pass split over the
    processes (each its share on all its devices), joined by process 0 into one cache at `path`
    (in a workdir every process sees), opened by all. A part already built by an interrupted
    run with the same process count is reused. Arguments as `build_or_load`'s (batches: a
    callable returning the whole pass's batches, lazily; this process takes its share)."""
    fingerprint = dict(fingerprint, num_examples=int(num_examples))
    p, P = jax.process_index(), jax.process_count()
    cache = _opened(path, fingerprint, coord)
    if cache is not None:
        log.info("teacher cache %s: up to date (%d examples), read by all %d processes", path,
                 num_examples, P)
        return mark_shared(cache)
    t0 = time.perf_counter()
    parts_dir = f"{path.rstrip('/')}.parts-of-{P}"
    part = fs.join(parts_dir, f"part-{p}")
    mine = pass_forward(forward)
    log.info("teacher cache: the pass split over %d processes (each every %d-th batch, on %d "
             "local devices); process 0 joins the parts into %s", P, P,
             len(jax.local_devices()) if isinstance(mine, Spread) else 1, path)
    share = _share(batches(), p, P)
    if share is not None:
        teacher_cache.build_or_load(
            part, dict(fingerprint, part=[p, P]), mine, params, share,
            num_examples, num_rows=-(-(num_rows or num_examples) // P),
            token_fields=token_fields, token_dtype=token_dtype,
            work_total=None if work_total is None else work_total / P,
            warn_missing=False).close()
    forwarded_s = time.perf_counter() - t0
    coord.barrier("parts_built", timeout_s=JOIN_TIMEOUT_S)
    local = join(parts_dir, P, path, fingerprint, num_examples, num_rows) if p == 0 else None
    coord.barrier("parts_joined", timeout_s=JOIN_TIMEOUT_S)
    cache = mark_shared(TeacherCache(path, verify=False, local=local))
    seconds = time.perf_counter() - t0
    rows = int(np.asarray(cache.filled).sum())
    cache.build_stats = {"examples_per_s": rows / max(seconds, 1e-9), "seconds": seconds,
                         "forward_seconds": forwarded_s, "rows": rows,
                         "num_examples": int(num_examples), "processes": P,
                         "bytes": int(sum(i["bytes"] for i in list(cache.meta["fields"].values())
                                          + list(cache.meta.get("token_fields", {}).values())))}
    return cache


def join(parts_dir: str, P: int, path: str, fingerprint: Mapping[str, Any], num_examples: int,
         num_rows: Optional[int] = None) -> Optional[str]:
    """Writes the cache at `path` from the parts `parts_dir/part-<p>` (p < P; a process without
    a share has none) and removes them, with the parts of other process counts. -> the local
    copy of a cache published to a bucket (None: `path` is local)."""
    found = [fs.join(parts_dir, f"part-{i}") for i in range(P)]
    parts = [TeacherCache(d, verify=False) for d in found if fs.exists(fs.join(d, META))]
    if not parts:
        raise ValueError(f"teacher cache {path}: no process wrote a part under {parts_dir}")
    fs.clean_stale_temps(path)
    tmp = fs.staging_dir(path)
    try:
        files, filled = _join_fields(tmp, parts, num_examples)
        tokens = _JoinedTokens(tmp, parts, num_examples)
        expected = int(num_examples if num_rows is None else num_rows)
        if filled.sum() < expected:
            log.warning("teacher cache %s: %d of %d examples not covered by the batches; "
                        "looking them up will fail", path, expected - int(filled.sum()), expected)
        teacher_cache._publish(tmp, path, files, filled, tokens, fingerprint, num_examples)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        for c in parts:
            c.close()
    parent, stem = os.path.split(path.rstrip("/"))
    for name in fs.listdir(parent):
        if name.startswith(f"{stem}.parts-of-"):
            fs.rmtree(fs.join(parent, name))
    return tmp if fs.is_remote(path) else None


def _join_fields(tmp: str, parts: List[TeacherCache], num_examples: int):
    """The parts' per-example fields as float32 [num_examples, ...] maps in `tmp`, and the
    rows filled (bool [num_examples])."""
    filled = np.zeros((num_examples,), bool)
    files = {}
    for c in parts:
        ids = np.flatnonzero(np.asarray(c.filled))
        filled[ids] = True
        for k, v in c.fields.items():
            if k not in files:
                files[k] = np.lib.format.open_memmap(
                    os.path.join(tmp, k + ".npy"), mode="w+", dtype=np.float32,
                    shape=(num_examples,) + v.shape[1:])
            for s in range(0, len(ids), _JOIN_ROWS):
                files[k][ids[s:s + _JOIN_ROWS]] = v[ids[s:s + _JOIN_ROWS]]
    return files, filled


class _JoinedTokens:
    """The per-token fields of the parts, their .bin files concatenated and each part's row
    offsets moved by the elements before it; `close()` gives their meta entries as
    `teacher_cache._TokenWriter.close` does."""

    def __init__(self, folder: str, parts: List[TeacherCache], num_examples: int):
        self.folder, self.parts = folder, [c for c in parts if c.token_fields]
        self.names = tuple(sorted(self.parts[0].token_fields)) if self.parts else ()
        self.index = np.full((num_examples, 1 + len(self.names)), -1, np.int64)
        self.info = {k: self._concat(j, k) for j, k in enumerate(self.names)}

    def _concat(self, j: int, k: str) -> dict:
        first = self.parts[0].meta["token_fields"][k]
        itemsize, crc, elements, shapes = np.dtype(first["dtype"]).itemsize, 0, 0, {}
        out = os.path.join(self.folder, k + ".bin")
        with open(out, "wb") as dst:
            for c in self.parts:
                ti = np.asarray(c.token_index)
                rows = np.flatnonzero(ti[:, 0] >= 0)
                self.index[rows, 0] = ti[rows, 0]
                self.index[rows, 1 + j] = ti[rows, 1 + j] + elements
                with open(os.path.join(c.local_dir, k + ".bin"), "rb") as src:
                    while True:
                        b = src.read(64 << 20)
                        if not b:
                            break
                        crc = zlib.crc32(b, crc)
                        dst.write(b)
                elements += c.meta["token_fields"][k]["bytes"] // itemsize
                shapes.update(c.meta["token_fields"][k]["row_shapes"])
        return {"dtype": first["dtype"], "row_shapes": shapes, "bytes": os.path.getsize(out),
                "crc32": crc}

    @property
    def written(self) -> int:
        return int((self.index[:, 0] >= 0).sum())

    def close(self) -> dict:
        if not self.names:
            return {}
        p = os.path.join(self.folder, teacher_cache.TOKEN_INDEX)
        np.save(p, self.index)
        return {"token_fields": self.info, "token_index_file": teacher_cache._file_info(p)}
