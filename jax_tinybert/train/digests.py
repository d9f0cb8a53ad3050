"""Digests of the files of one checkpoint step, written at save, checked at restore.

orbax checksums nothing: bytes overwritten inside a compressed chunk can still decode, and the
restore then returns wrong values (NaN in an Adam moment, say) without an error. So once orbax
has written a step (before it renames the step's temporary folder into place) the digest of
every file goes to `<step>/digests.json`; a restore first compares the files with them.
A file changed, shortened, missing or unreadable makes the step corrupt.

Which digest: on a local disk, the SHA-256 of each file. On an object store that keeps a
checksum of every object (GCS: the CRC32C it computes at upload, in every listing), the
store's own: one listing at save records them and one listing at restore compares, so no byte
of the step is downloaded (an overwritten object has a new CRC32C). An object whose listing
gives no checksum (another store) is downloaded and SHA-256 hashed instead.

digests.json, version 2 (version 1, SHA-256 for every file, is still read)::

    {"version": 2, "files": {"state/d/0a1b...": {"bytes": 40960, "crc32c": "ROPt5Q=="},
                             "meta/metadata": {"bytes": 57, "sha256": "9f86d0..."}}}

`crc32c` as GCS gives it: base64 of the 4 big-endian bytes of the CRC32C (Castagnoli).

    write(step_dir)                  # -> the digests dict, also written to step_dir/digests.json
    problem = verify(step_dir)       # None when intact, else a one-line description
"""
from __future__ import annotations

import base64
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

__all__ = ["DIGESTS", "VERSION", "Digester", "write", "verify", "compute"]

DIGESTS = "digests.json"
VERSION = 2
_ALGORITHMS = ("crc32c", "sha256")
# Written or rewritten by orbax after the data, holding timestamps (and the best manager's
# metric), not array data: a damaged one fails orbax's own JSON parsing.
_SKIP = {DIGESTS, "commit_success.txt"}
_SKIP_TOP = {"_CHECKPOINT_METADATA"}
_CHUNK = 8 << 20


def _read_chunks(path: str):
    with fs.open_file(path, "rb") as fh:
        while True:
            b = fh.read(_CHUNK)
            if not b:
                return
            yield b


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    for b in _read_chunks(path):
        h.update(b)  # releases the GIL: files hash in parallel threads
    return h.hexdigest()


def _crc32c(path: str) -> str:
    """A file's CRC32C as GCS writes it: a step written to a bucket, then copied to a disk."""
    try:
        import google_crc32c  # noqa: PLC0415 - comes with gcsfs; only such copies need it
    except ImportError as e:
        raise OSError(f"google-crc32c is needed to check {path} (pip install google-crc32c)") \
            from e
    h = google_crc32c.Checksum()
    for b in _read_chunks(path):
        h.update(b)
    return base64.b64encode(h.digest()).decode()


_HASH = {"sha256": _sha256, "crc32c": _crc32c}


def _skipped(rel: str) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return name in _SKIP or ("/" not in rel and name in _SKIP_TOP)


def _listing(step_dir: str) -> Dict[str, Dict]:
    """{relative path: {"bytes", "crc32c" (None when the store gives none)}} of every object
    under the URL `step_dir`, from one listing (no object is read)."""
    fsys, p = fs.url_fs(step_dir)
    p = p.rstrip("/")
    try:
        found = fsys.find(p, detail=True)
    except FileNotFoundError:
        return {}
    return {k[len(p) + 1:]: {"bytes": int(v.get("size") or 0), "crc32c": v.get("crc32c")}
            for k, v in found.items()
            if k.startswith(p + "/") and v.get("type") != "directory"}


def _local_files(step_dir: str):
    for root, dirs, files in os.walk(step_dir):
        dirs.sort()
        for f in sorted(files):
            if f in _SKIP or (root == step_dir and f in _SKIP_TOP):
                continue
            full = os.path.join(root, f)
            yield os.path.relpath(full, step_dir).replace(os.sep, "/"), full


def _hash_all(step_dir: str, todo: Dict[str, str]) -> Dict[str, str]:
    """{rel: digest} of the files `todo` ({rel: algorithm}), in parallel threads."""
    items = sorted(todo.items())
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as ex:
        got = list(ex.map(lambda it: _HASH[it[1]](fs.join(step_dir, *it[0].split("/"))),
                          items))
    return {rel: d for (rel, _), d in zip(items, got)}


def compute(step_dir: str, algorithm: Optional[str] = None) -> Dict[str, Dict]:
    """{relative path: {"bytes", "crc32c" | "sha256"}} of the files under `step_dir`.

    `algorithm` None: the store's CRC32C of each object of a bucket (from one listing, nothing
    downloaded) where the store gives one, else SHA-256 (read in full). "sha256": SHA-256 of
    every file (on a bucket every object is downloaded).
    """
    step_dir = os.fspath(step_dir)
    if algorithm not in (None, "sha256"):
        raise ValueError(f"algorithm must be None or 'sha256', got {algorithm!r}")
    if fs.is_remote(step_dir):
        listed = {r: v for r, v in _listing(step_dir).items() if not _skipped(r)}
    else:
        listed = {r: {"bytes": os.path.getsize(full), "crc32c": None}
                  for r, full in _local_files(step_dir)}
    out, todo = {}, {}
    for rel, v in listed.items():
        out[rel] = {"bytes": v["bytes"]}
        if algorithm is None and v["crc32c"]:
            out[rel]["crc32c"] = v["crc32c"]
        else:
            todo[rel] = "sha256"
    for rel, d in _hash_all(step_dir, todo).items():
        out[rel]["sha256"] = d
    return dict(sorted(out.items()))


def write(step_dir: str, algorithm: Optional[str] = None) -> Dict[str, Dict]:
    """Digest every file of `step_dir` (see `compute`) into `step_dir/digests.json` (atomic)."""
    step_dir = os.fspath(step_dir)
    files = compute(step_dir, algorithm)
    path = fs.join(step_dir, DIGESTS)
    doc = {"version": VERSION, "files": files}
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


def _read(step_dir: str):
    """(files dict, None) of `step_dir/digests.json`, or (None, the problem)."""
    try:
        with fs.open_file(fs.join(step_dir, DIGESTS)) as fh:
            doc = json.load(fh)
        version, want = int(doc.get("version", 1)), doc["files"]
        if not all(isinstance(w, dict) and isinstance(w.get("bytes"), int)
                   for w in want.values()):
            raise ValueError("an entry without its size in bytes")
    except FileNotFoundError:
        return None, f"no {DIGESTS}"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return None, f"{DIGESTS} unreadable ({type(e).__name__}: {e})"
    # A newer writer may use a digest this version cannot check: not damage, so say so.
    if version > VERSION or not all(any(a in w for a in _ALGORITHMS) for w in want.values()):
        return None, (f"{DIGESTS} is version {version}, written by a newer jax-tinybert (this "
                      f"one reads versions <= {VERSION}): restore with that version")
    return want, None


def verify(step_dir: str, *, content: bool = True) -> Optional[str]:
    """None if every file listed in `step_dir/digests.json` is intact, else what is wrong.

    `content=False` checks only that each file is there with its size (no data read): for the
    processes of a job beside the one that checks the contents. A step without digests.json
    (written by an older version) is reported as such; the caller decides whether to trust it.
    """
    step_dir = os.fspath(step_dir)
    want, problem = _read(step_dir)
    if problem:
        return problem
    if fs.is_remote(step_dir):
        have = _listing(step_dir)
    else:
        have = {r: {"bytes": os.path.getsize(os.path.join(step_dir, *r.split("/"))),
                    "crc32c": None} for r in want
                if os.path.isfile(os.path.join(step_dir, *r.split("/")))}
    missing = [r for r in want if r not in have]
    if missing:
        return f"{len(missing)} file(s) missing, e.g. {missing[0]}"
    resized = [r for r, w in want.items() if have[r]["bytes"] != w["bytes"]]
    if resized:
        return f"{len(resized)} file(s) changed size, e.g. {resized[0]}"
    if not content:
        return None
    got, todo = {}, {}
    for rel, w in want.items():
        alg = "crc32c" if "crc32c" in w else "sha256"
        if alg == "crc32c" and have[rel]["crc32c"]:
            got[rel] = have[rel]["crc32c"]     # the store's checksum: nothing downloaded
        else:
            todo[rel] = alg
    try:
        got.update(_hash_all(step_dir, todo))
    except OSError as e:
        return f"unreadable file ({e})"
    for alg in _ALGORITHMS:
        bad = [r for r, w in want.items() if alg in w and got[r] != w[alg]]
        if bad:
            return f"{len(bad)} file(s) fail their {alg}, e.g. {bad[0]}"
    return None


class Digester:
    """orbax post-finalization callback: digest the step just written into its digests.json.

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
        tmps = [] if fs.is_remote(self.directory) else sorted(
            glob.glob(os.path.join(os.fspath(self.directory), f"{step}.orbax-checkpoint-tmp*")),
            key=os.path.getmtime)
        step_dir = tmps[-1] if tmps else os.path.join(os.fspath(self.directory), str(step))
        try:
            write(step_dir)
        except Exception:  # noqa: BLE001 - the save itself succeeded; its restore will refuse it
            log.exception("checkpoint digests: could not digest %s; this step will count as "
                          "damaged when restoring", step_dir)
