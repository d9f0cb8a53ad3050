"""SHA-256 digests of the files of one checkpoint step, written at save, checked at restore.

orbax checksums nothing: bytes overwritten inside a compressed chunk can still decode, and the
restore then returns wrong values (NaN in an Adam moment, say) without an error. So once orbax
has written a step (before it renames the step's temporary folder into place) the digest of
every file goes to `<step>/digests.json`; a restore first re-hashes the files and compares.
A file changed, shortened, missing or unreadable makes the step corrupt.

    write(step_dir)                  # -> the digests dict, also written to step_dir/digests.json
    problem = verify(step_dir)       # None when intact, else a one-line description
"""
from __future__ import annotations

import collections
import concurrent.futures
import glob
import hashlib
import json
import logging
import os
from typing import Dict, Optional

from jax_tinybert import fs

log = logging.getLogger(__name__)

__all__ = ["DIGESTS", "Digester", "write", "verify", "compute"]

DIGESTS = "digests.json"
VERSION = 1
# Written or rewritten by orbax after the data, holding timestamps (and the best manager's
# metric), not array data: a damaged one fails orbax's own JSON parsing.
_SKIP = {DIGESTS, "commit_success.txt"}
_SKIP_TOP = {"_CHECKPOINT_METADATA"}
_CHUNK = 8 << 20


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with fs.open_file(path, "rb") as fh:
        while True:
            b = fh.read(_CHUNK)
            if not b:
                return h.hexdigest()
            h.update(b)  # releases the GIL: files hash in parallel threads


def _skipped(rel: str) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return name in _SKIP or ("/" not in rel and name in _SKIP_TOP)


def _remote_sizes(step_dir: str) -> Dict[str, int]:
    """{relative path: bytes} of every object under the URL `step_dir` (one listing)."""
    fsys, p = fs.url_fs(step_dir)
    p = p.rstrip("/")
    try:
        found = fsys.find(p, detail=True)
    except FileNotFoundError:
        return {}
    return {k[len(p) + 1:]: int(v.get("size") or 0) for k, v in found.items()
            if k.startswith(p + "/") and v.get("type") != "directory"}


def _files(step_dir: str):
    if fs.is_remote(step_dir):
        for rel in sorted(_remote_sizes(step_dir)):
            if not _skipped(rel):
                yield rel, fs.join(step_dir, *rel.split("/"))
        return
    for root, dirs, files in os.walk(step_dir):
        dirs.sort()
        for f in sorted(files):
            if f in _SKIP or (root == step_dir and f in _SKIP_TOP):
                continue
            full = os.path.join(root, f)
            yield os.path.relpath(full, step_dir).replace(os.sep, "/"), full


def compute(step_dir: str, rels=None) -> Dict[str, Dict]:
    """{relative path: {"bytes", "sha256"}} of the files under `step_dir` (or only `rels`)."""
    step_dir = os.fspath(step_dir)
    items = list(_files(step_dir)) if rels is None else [
        (r, os.path.join(step_dir, *r.split("/"))) for r in rels]
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as ex:
        digests = list(ex.map(lambda it: _sha256(it[1]), items))
    sizes = _remote_sizes(step_dir) if fs.is_remote(step_dir) else None
    return {rel: {"bytes": sizes[rel] if sizes is not None else os.path.getsize(full),
                  "sha256": d}
            for (rel, full), d in zip(items, digests)}


def write(step_dir: str) -> Dict[str, Dict]:
    """Hash every file of `step_dir` and write `step_dir/digests.json` (temp file + rename)."""
    step_dir = os.fspath(step_dir)
    files = compute(step_dir)
    path = fs.join(step_dir, DIGESTS)
    doc = {"version": VERSION, "algorithm": "sha256", "files": files}
    if fs.is_remote(path):   # one object upload: whole or absent
        fs.write_json_atomic(path, doc, indent=0, sort_keys=True)
        return files
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(doc, fh, indent=0, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return files


def verify(step_dir: str) -> Optional[str]:
    """None if every file listed in `step_dir/digests.json` is intact, else what is wrong.

    A step without digests.json (written by an older version) is reported as such; the caller
    decides whether to trust it.
    """
    step_dir = os.fspath(step_dir)
    path = fs.join(step_dir, DIGESTS)
    try:
        with fs.open_file(path) as fh:
            want = json.load(fh)["files"]
    except FileNotFoundError:
        return f"no {DIGESTS}"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{DIGESTS} unreadable ({type(e).__name__}: {e})"
    if fs.is_remote(step_dir):
        sizes = _remote_sizes(step_dir)
    else:
        sizes = {r: os.path.getsize(os.path.join(step_dir, *r.split("/"))) for r in want
                 if os.path.isfile(os.path.join(step_dir, *r.split("/")))}
    missing = [r for r in want if r not in sizes]
    if missing:
        return f"{len(missing)} file(s) missing, e.g. {missing[0]}"
    resized = [r for r, w in want.items() if sizes[r] != w["bytes"]]
    if resized:
        return f"{len(resized)} file(s) changed size, e.g. {resized[0]}"
    try:
        got = compute(step_dir, list(want))
    except OSError as e:
        return f"unreadable file ({e})"
    bad = [r for r in want if got[r]["sha256"] != want[r]["sha256"]]
    if bad:
        return f"{len(bad)} file(s) fail their sha256, e.g. {bad[0]}"
    return None


class Digester:
    """orbax post-finalization callback: hash the step just written into its digests.json.

    Runs on process 0 in orbax's background thread, after every process has written its
    shards and before the step's temporary folder is renamed into place, so a step that
    exists under its final name always has its digests. orbax keeps one save in flight per
    manager, so `pending` (steps in the order saves were started) names the step.
    """

    def __init__(self, directory: os.PathLike):
        self.directory = directory
        self.pending: collections.deque[int] = collections.deque()

    def discard(self, step: int) -> None:
        try:
            self.pending.remove(step)
        except ValueError:
            pass

    def __call__(self) -> None:
        if not self.pending:
            log.error("checkpoint digests: a save finished in %s but no step was pending",
                      self.directory)
            return
        step = self.pending.popleft()
        # On object stores orbax writes the step in place (no temporary folder, no rename).
        tmps = [] if fs.is_remote(self.directory) else sorted(glob.glob(os.path.join(os.fspath(self.directory),
                                             f"{step}.orbax-checkpoint-tmp*")),
                      key=os.path.getmtime)
        step_dir = tmps[-1] if tmps else os.path.join(os.fspath(self.directory), str(step))
        try:
            write(step_dir)
        except Exception:  # noqa: BLE001 - the save itself succeeded; its restore will refuse it
            log.exception("checkpoint digests: could not hash %s; this step will count as "
                          "damaged when restoring", step_dir)
