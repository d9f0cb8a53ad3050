"""Reading a corpus folder written by `python -m jax_tinybert.data.prepare`.

A prepared folder holds `manifest.json` and ArrayRecord shards `rows-NNNNN.array_record`
(RECORD_OPTIONS): one record per packed sequence (`[CLS] ... [SEP]`, at most seq_len ids) as little-endian uint16 ids
(uint32 when the vocab exceeds 65,535 entries). Token types are all 0 and not stored. The
manifest names the tokenizer (fingerprint), the sources (content), the packing settings and
every shard's rows, bytes and sha256.

    python -m jax_tinybert.data.prepared DIR    # checks every shard, prints what DIR holds
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
from typing import Dict, Optional, Sequence

import numpy as np

from jax_tinybert import fs
from jax_tinybert.data.reader import PreparedRows
from jax_tinybert.data.tokenize import EncodedDataset, tokenizer_fingerprint
from jax_tinybert.errors import UserError, tool_exit
from jax_tinybert.progress import Progress

log = logging.getLogger(__name__)

FORMAT = "jax_tinybert.prepared/1"
MANIFEST = "manifest.json"
# 16 records per chunk: a reader keeps one index entry per chunk in memory (~10 bytes each: 0.75
# GB a process for 75M rows at group_size:1, 16x less here) and a random read fetches 16 x 256 B
# = one 4 KB page, the same I/O as one record (benchmarks/RESULTS.md#the-corpus-input-pipeline).
# Uncompressed: a chunk of token ids gains little from compression and random reads pay for it.
RECORD_OPTIONS = "group_size:16,uncompressed"


class PreparedError(UserError, ValueError):
    """A prepared corpus that cannot be used: damaged, missing shards, another tokenizer."""


def is_prepared(path: str) -> bool:
    """Whether `path` (a local folder or a bucket URL) holds a prepared corpus's manifest.json."""
    if fs.is_remote(path):
        return fs.isfile(f"{os.fspath(path).rstrip('/')}/{MANIFEST}")
    return os.path.isfile(os.path.join(os.path.expanduser(path), MANIFEST))


def read_manifest(path: str) -> Dict:
    """The manifest of prepared folder `path` (PreparedError when unreadable / another format)."""
    mpath = os.path.join(path, MANIFEST)
    try:
        with open(mpath, encoding="utf-8") as f:
            m = json.load(f)
    except (OSError, ValueError) as e:
        raise PreparedError(f"{mpath}: unreadable manifest ({e}); prepare the corpus again")
    if m.get("format") != FORMAT:
        raise PreparedError(f"{mpath}: format {m.get('format')!r}, this version reads {FORMAT!r}; "
                            "prepare the corpus again")
    return m


def shard_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def verify(path: str, manifest: Optional[Dict] = None, sha: bool = True) -> Dict:
    """Checks that every shard of the manifest exists with its size and (sha) its sha256;
    returns the manifest. Raises PreparedError naming the first missing or damaged shard."""
    m = manifest or read_manifest(path)
    for s in m["shards"]:
        p = os.path.join(path, s["file"])
        if not os.path.isfile(p):
            raise PreparedError(f"{path}: shard {s['file']} is missing; prepare the corpus again "
                                "(or restore the file)")
        size = os.path.getsize(p)
        if size != s["bytes"] or (sha and shard_sha256(p) != s["sha256"]):
            raise PreparedError(f"{path}: shard {s['file']} is damaged ({size} bytes, sha256 does "
                                f"not match the manifest's {s['sha256'][:12]}...); prepare the "
                                "corpus again (or restore the file)")
    return m


def read_rows(path: str, manifest: Optional[Dict] = None, check: bool = True) -> EncodedDataset:
    """All rows of prepared folder `path` in order -> EncodedDataset (input_ids int32 [tokens],
    token_type_ids int8 zeros [tokens], offsets int64 [rows + 1]), in memory; the same arrays
    `corpus.build_packed_corpus` gives for the same text."""
    from array_record.python.array_record_module import ArrayRecordReader

    m = verify(path, manifest) if check else (manifest or read_manifest(path))
    dtype = np.dtype(m["dtype"]).newbyteorder("<")
    ids = np.empty(int(m["tokens"]), np.int32)
    lengths = np.empty(int(m["rows"]), np.int64)
    t = r = 0
    for s in m["shards"]:
        p = os.path.join(path, s["file"])
        reader = ArrayRecordReader(p)
        try:
            if reader.num_records() != s["rows"]:
                raise PreparedError(f"{path}: shard {s['file']} holds {reader.num_records()} rows, "
                                    f"the manifest {s['rows']}; prepare the corpus again")
            recs = reader.read_all()
        finally:
            reader.close()
        flat = np.frombuffer(b"".join(recs), dtype)
        ids[t:t + len(flat)] = flat
        lengths[r:r + len(recs)] = [len(x) // dtype.itemsize for x in recs]
        t, r = t + len(flat), r + len(recs)
    if t != len(ids) or r != len(lengths):
        raise PreparedError(f"{path}: {t} tokens in {r} rows, the manifest says {len(ids)} in "
                            f"{len(lengths)}; prepare the corpus again")
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    pad = m["tokenizer"].get("pad_id")
    return EncodedDataset(ids, np.zeros(len(ids), np.int8), offsets, None, int(pad or 0))


def check_for_run(path: str, manifest: Dict, tokenizer, seq_len: Optional[int] = None,
                  mode: Optional[str] = None) -> None:
    """Refuses a manifest made with another tokenizer (naming both) or another seq_len; a
    `mode` other than the folder's is only logged (the rows were packed at prepare time)."""
    m = manifest
    want = tokenizer_fingerprint(tokenizer)
    got = m["tokenizer"]["fingerprint"]
    if got != want:
        mine = getattr(tokenizer, "name_or_path", "") or "the run's tokenizer"
        raise PreparedError(
            f"{path} was prepared with tokenizer {m['tokenizer'].get('name')!r} (fingerprint "
            f"{got[:12]}), the run uses {mine!r} (fingerprint {want[:12]}); prepare the corpus "
            "with this run's tokenizer (--tokenizer) or train with the one it was prepared with")
    have = int(m["settings"]["seq_len"])
    if seq_len is not None and int(seq_len) != have:
        raise PreparedError(f"{path} holds rows of seq_len={have}, the run has "
                            f"data.seq_len={seq_len}; set --config.data.seq_len={have} or prepare "
                            f"again with --seq_len {seq_len}")
    if mode and mode != m["settings"]["mode"]:
        log.warning("%s was packed in mode %r; data.corpus_mode=%r does not apply to it", path,
                    m["settings"]["mode"], mode)


def load_prepared(path: str, tokenizer, seq_len: Optional[int] = None,
                  mode: Optional[str] = None) -> EncodedDataset:
    """All rows of prepared folder `path` in memory, after `check_for_run` (shards checked
    against their sha256)."""
    path = os.path.expanduser(path)
    m = read_manifest(path)
    check_for_run(path, m, tokenizer, seq_len, mode)
    ds = read_rows(path, m)
    log.info("read %d prepared rows (%d tokens) from %s", len(ds), int(ds.offsets[-1]), path)
    return ds


def open_rows(path: str, tokenizer, seq_len: Optional[int] = None, mode: Optional[str] = None,
              memory_tokens: int = 0, local_dir: Optional[str] = None):
    """The rows of prepared folder `path` for a run: in memory (an EncodedDataset) when they
    hold at most `memory_tokens` tokens, else read in place (`reader.PreparedRows`). A folder in
    a bucket is first copied to local disk once (`local_copy` into `local_dir`). Shards are
    checked against the manifest's sha256 once per local copy (a stamp records their sizes
    and mtimes) and by size at every start."""
    if fs.is_remote(path):
        path = local_copy(path, local_dir or _local_root())
    path = os.path.expanduser(path)
    m = read_manifest(path)
    check_for_run(path, m, tokenizer, seq_len, mode)
    verify_once(path, m)
    if int(m["tokens"]) <= int(memory_tokens):
        ds = read_rows(path, m, check=False)
        log.info("read %d prepared rows (%d tokens) into memory from %s", len(ds),
                 int(ds.offsets[-1]), path)
        return ds
    log.info("reading %d prepared rows (%d tokens) in place from %s (%d shards)", m["rows"],
             m["tokens"], path, len(m["shards"]))
    return PreparedRows(path, m)


def _local_root() -> str:
    import tempfile

    return os.path.join(fs.cache_root() or tempfile.gettempdir(), "prepared")


def _stamp(path: str, m: Dict) -> str:
    st = [os.stat(os.path.join(path, s["file"])) for s in m["shards"]]
    blob = json.dumps([m["key"], os.path.realpath(path)] +
                      [[x.st_size, x.st_mtime_ns] for x in st])
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def verify_once(path: str, m: Dict) -> None:
    """`verify` (sha256 of every shard) unless this machine verified these very files before
    (same path, sizes, mtimes: a stamp under the local cache root); sizes always."""
    verify(path, m, sha=False)
    stamp = os.path.join(_local_root(), "verified", _stamp(path, m))
    if os.path.isfile(stamp):
        return
    verify(path, m)
    try:
        os.makedirs(os.path.dirname(stamp), exist_ok=True)
        fs.write_json_atomic(stamp, {"path": path, "key": m["key"]})
    except OSError:   # a read-only home: verified again next time
        pass


def local_copy(url: str, root: str) -> str:
    """A local copy of prepared folder `url` (a bucket) under `root`, named by the manifest's
    key: downloaded once (into a temporary folder, checked against the manifest, then renamed),
    reused by every later run on this machine."""
    with fs.open_file(f"{url.rstrip('/')}/{MANIFEST}", "rb") as fh:
        m = json.loads(fh.read())
    out = os.path.join(root, f"prepared-{m['key']}")
    if os.path.isfile(os.path.join(out, MANIFEST)):
        return out
    os.makedirs(root, exist_ok=True)
    tmp = fs.mkdtemp(out)
    try:
        total = sum(int(s["bytes"]) for s in m["shards"])
        done = 0
        with Progress(f"copy {url} to local disk", total=total, unit="B") as prog:
            for s in m["shards"]:
                with fs.open_file(f"{url.rstrip('/')}/{s['file']}", "rb") as src, \
                        open(os.path.join(tmp, s["file"]), "wb") as dst:
                    for chunk in iter(lambda: src.read(8 << 20), b""):
                        dst.write(chunk)
                        done += len(chunk)
                        prog.set(done)
        verify(tmp, m)
        with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(m, f)
        fs.swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("copied prepared corpus %s to %s", url, out)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m jax_tinybert.data.prepared DIR`: verify DIR's shards, print a summary line."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m jax_tinybert.data.prepared",
                                description="Check a prepared corpus folder against its manifest.")
    p.add_argument("dir")
    a = p.parse_args(argv)
    if not is_prepared(a.dir):
        raise PreparedError(f"{a.dir}: no {MANIFEST}; not a folder of python -m "
                            "jax_tinybert.data.prepare")
    m = verify(a.dir)
    c, t = m["counts"], m["tokenizer"]
    print(f"{a.dir}: ok, {m['rows']:,} rows of <= {m['settings']['seq_len']} tokens "
          f"({m['tokens']:,} tokens, {m['dtype']}) in {len(m['shards'])} shards; "
          f"{c['documents_kept']:,} documents ({c['duplicates_dropped']:,} duplicates dropped); "
          f"tokenizer {t['name']} ({t['fingerprint'][:12]}); key {m['key']}")
    return 0


if __name__ == "__main__":
    sys.exit(tool_exit(main))
