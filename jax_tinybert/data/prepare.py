"""Prepare a general-distillation corpus once: tokenize, pack, write sharded ArrayRecord rows.

    python -m jax_tinybert.data.prepare --source DIR_OR_FILE [--source hf:NAME?...] --out OUT \\
        --tokenizer DIR_OR_NAME [--seq_len 128] [--mode sentences|documents] \\
        [--shard i --num_shards N] [--finalize]

Packing is `corpus.PackedTextStream`'s (the official TinyBERT formats): each document's lines
are tokenized without special tokens, documents are concatenated with a [SEP] after each, and
the stream is cut into `[CLS] chunk [SEP]` rows (RoBERTa: `<s> chunk </s>`) of seq_len tokens.
Exact duplicate documents are dropped (the first one stays; --keep_duplicates keeps them).

Workers: document i (global reading order) belongs to worker (i // BLOCK) % N. Each worker
reads all the text but tokenizes only its documents, into a part `OUT.parts/KEY/part-k-of-N`
(the token stream of its documents, their indices, hashes and lengths). The last worker to
finish (or `--finalize`) assembles OUT: documents in global order, duplicates across parts
dropped, packed into rows: the same rows as one worker. All is written under a temp name, then
renamed (OUT absent or complete); a rerun reuses finished parts and an OUT of the same key.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import errno
import hashlib
import itertools
import json
import logging
import os
import shutil
import socket
import sys
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from jax_tinybert import fs
from jax_tinybert.data import sources as src
from jax_tinybert.data.prepared import (FORMAT, MANIFEST, RECORD_OPTIONS, PreparedError,
                                        read_manifest, shard_sha256)
from jax_tinybert.data.tokenize import load_data_tokenizer, tokenizer_fingerprint
from jax_tinybert.errors import UserError, is_disk_full, tool_exit
from jax_tinybert.progress import Progress

log = logging.getLogger(__name__)

BLOCK = 1024              # documents per block of the worker split
BATCH_CHARS = 1 << 20     # text per encode_batch call: ~15k lines, every core busy
READ_TOKENS = 1 << 23     # tokens per read of a part's stream while packing
DOC_DTYPE = np.dtype([("index", "<i8"), ("length", "<i8"), ("hash", "V16")])


@dataclasses.dataclass(frozen=True)
class Settings:
    """What decides the rows besides the tokenizer and the text."""
    seq_len: int = 128
    mode: str = "sentences"
    text_field: str = "text"
    dedup: bool = True
    rows_per_shard: int = 1 << 20


def ids_dtype(tokenizer) -> np.dtype:
    """uint16 when every id fits (a vocab of <= 65,535 entries), else uint32 (little-endian)."""
    return np.dtype("<u2") if len(tokenizer.get_vocab()) <= 65535 else np.dtype("<u4")


def prepare_key(tok_fp: str, ident: Sequence[Dict], s: Settings) -> str:
    """sha256 (24 hex) of the format, tokenizer fingerprint, source identity and settings."""
    blob = json.dumps({"format": FORMAT, "tokenizer": tok_fp, "sources": list(ident),
                       "seq_len": s.seq_len, "mode": s.mode, "text_field": s.text_field,
                       "dedup": s.dedup, "rows_per_shard": s.rows_per_shard}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _host_pid() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def _disk_full(e: BaseException) -> bool:
    return is_disk_full(e) or getattr(e, "errno", None) in (errno.EDQUOT, errno.EFBIG)


# How ArrayRecord's C++ writer reports a failed write (a RuntimeError with the OS message).
_NO_SPACE = ("No space left on device", "File too large", "Disk quota exceeded")


def _ar_call(fn, *args):
    """fn(*args) with ArrayRecord's out-of-space RuntimeError raised as OSError(ENOSPC)."""
    try:
        return fn(*args)
    except RuntimeError as e:
        if any(m in str(e) for m in _NO_SPACE):
            raise OSError(errno.ENOSPC, str(e)) from e
        raise


# ----------------------------------------------------------------------------- tokenizing

def tokenize_documents(backend, docs: Sequence[List[str]], dtype, sep_id: int):
    """Documents (lists of lines) -> (stream [tokens] of `dtype`: each document's pieces and a
    [SEP], documents without pieces left out; lengths int64 [docs], 0 for those). One
    encode_batch call over all the lines."""
    lines = [line for d in docs for line in d]
    # encode_batch_fast (tokenizers >= 0.20): encode_batch without the character offsets,
    # which packing does not read; the ids are the same.
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    ids = [e.ids for e in encode(lines, add_special_tokens=False)]
    line_len = np.fromiter(map(len, ids), np.int64, count=len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype, count=int(line_len.sum()))
    per_doc = np.fromiter(map(len, docs), np.int64, count=len(docs))
    doc_tok = np.bincount(np.repeat(np.arange(len(docs)), per_doc), weights=line_len,
                          minlength=len(docs)).astype(np.int64)
    has = doc_tok > 0
    stream = np.insert(flat, np.cumsum(doc_tok)[has], dtype.type(sep_id))
    return stream, doc_tok + has


def doc_hash(lines: List[str]) -> bytes:
    return hashlib.blake2b("\n".join(lines).encode("utf-8", "surrogatepass"),
                           digest_size=16).digest()


class _Part:
    """A worker's part being written: tokens.bin (the stream) and docs.npy (DOC_DTYPE)."""

    def __init__(self, tmp: str):
        self.tmp = tmp
        os.makedirs(tmp)
        self.f = open(os.path.join(tmp, "tokens.bin"), "wb")
        self.sha = hashlib.sha256()
        self.docs: List[np.ndarray] = []
        self.tokens = 0

    def add(self, stream: np.ndarray, index, length, hashes) -> None:
        b = stream.tobytes()
        self.f.write(b)
        self.sha.update(b)
        self.tokens += len(stream)
        rec = np.zeros(len(index), DOC_DTYPE)
        rec["index"], rec["length"] = index, length
        rec["hash"] = np.frombuffer(b"".join(hashes), "V16") if hashes else rec["hash"]
        self.docs.append(rec)

    def finish(self, final: str, info: Dict) -> Dict:
        self.f.close()
        docs = np.concatenate(self.docs) if self.docs else np.zeros(0, DOC_DTYPE)
        np.save(os.path.join(self.tmp, "docs.npy"), docs)
        info = dict(info, tokens=self.tokens, tokens_sha256=self.sha.hexdigest(),
                    docs_sha256=shard_sha256(os.path.join(self.tmp, "docs.npy")))
        with open(os.path.join(self.tmp, "part.json"), "w") as f:
            json.dump(info, f)
        os.replace(self.tmp, final)
        return info


def _tokenize_batch(backend, batch, dtype, sep_id: int):
    docs = [d for _, _, d in batch if d is not None]
    stream, lengths = tokenize_documents(backend, docs, dtype, sep_id)
    full = np.zeros(len(batch), np.int64)     # duplicates (d is None) keep length 0
    full[[j for j, (_, _, d) in enumerate(batch) if d is not None]] = lengths
    return stream, [i for i, _, _ in batch], full, [h for _, h, _ in batch]


class _Pipeline:
    """Tokenizes batch k on a thread while the caller reads batch k + 1 (encode_batch releases
    the GIL): reading and hashing overlap the tokenizer instead of adding to it."""

    def __init__(self, part: _Part, backend, dtype, sep_id: int):
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(1)
        self.part, self.args, self.pending = part, (backend, dtype, sep_id), None

    def submit(self, batch) -> None:
        self.wait()
        self.pending = self.pool.submit(_tokenize_batch, self.args[0], batch, *self.args[1:])

    def wait(self) -> None:
        if self.pending is not None:
            self.part.add(*self.pending.result())
            self.pending = None

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)


def run_worker(sources, tokenizer, s: Settings, final: str, shard: int, num_shards: int,
               total_bytes: int) -> Dict:
    """Tokenizes worker `shard`'s documents into part folder `final` (via a temp folder);
    returns its part.json. A local duplicate is recorded with length 0 (global ones are dropped
    at assembly)."""
    tmp = f"{final}.tmp-{_host_pid()}"
    part = _Part(tmp)
    pipe = _Pipeline(part, tokenizer.backend_tokenizer, ids_dtype(tokenizer),
                     tokenizer.sep_token_id)
    counter = src._Counter()
    seen = set()
    batch, chars, n_docs, n_mine = [], 0, 0, 0
    unit = "B" if total_bytes else "doc"
    # Every worker reports (workers are not JAX processes: JTB_PROCESS_ID does not apply).
    with Progress(f"prepare {shard + 1}/{num_shards}", total=total_bytes or None, unit=unit,
                  enabled=os.environ.get("JTB_PROGRESS", "1") != "0") as prog:
        try:
            for i, lines in enumerate(src.documents(sources, s.mode, s.text_field, counter)):
                n_docs = i + 1
                if (i // BLOCK) % num_shards != shard:
                    continue
                n_mine += 1
                h = doc_hash(lines)
                dup = s.dedup and h in seen
                seen.add(h)
                batch.append((i, h, None if dup else lines))
                chars += 0 if dup else sum(map(len, lines))
                if chars >= BATCH_CHARS:
                    pipe.submit(batch)
                    batch, chars = [], 0
                    prog.set(counter.position if unit == "B" else n_docs)
            if batch:
                pipe.submit(batch)
        finally:
            pipe.close()
        prog.set(total_bytes or n_docs)
    info = {"shard": shard, "num_shards": num_shards, "documents_read": n_docs,
            "documents": n_mine, "dtype": ids_dtype(tokenizer).name,
            "seconds": round(prog.elapsed, 2)}
    return part.finish(final, info)


# ----------------------------------------------------------------------------- assembling

class RowWriter:
    """Packs a token stream into `[CLS] chunk [SEP]` rows and writes them to ArrayRecord shards
    of rows_per_shard rows in folder `tmp`."""

    def __init__(self, tmp: str, seq_len: int, cls_id: int, sep_id: int, dtype,
                 rows_per_shard: int):
        self.tmp, self.n = tmp, seq_len - 2
        self.cls, self.sep, self.dtype = cls_id, sep_id, np.dtype(dtype)
        self.rows_per_shard = rows_per_shard
        self.carry = np.zeros(0, self.dtype)
        self.shards: List[Dict] = []
        self.w = None
        self.rows = self.tokens = 0

    def _write(self, row: np.ndarray) -> None:
        from array_record.python.array_record_module import ArrayRecordWriter

        if self.w is None:
            name = f"rows-{len(self.shards):05d}.array_record"
            self.w = ArrayRecordWriter(os.path.join(self.tmp, name), RECORD_OPTIONS)
            self.shards.append({"file": name, "rows": 0, "tokens": 0})
        _ar_call(self.w.write, row.tobytes())
        sh = self.shards[-1]
        sh["rows"] += 1
        sh["tokens"] += len(row)
        self.rows, self.tokens = self.rows + 1, self.tokens + len(row)
        if sh["rows"] == self.rows_per_shard:
            self._close_shard()

    def _close_shard(self) -> None:
        w, self.w = self.w, None
        _ar_call(w.close)
        sh = self.shards[-1]
        p = os.path.join(self.tmp, sh["file"])
        sh["bytes"], sh["sha256"] = os.path.getsize(p), shard_sha256(p)

    def add(self, chunk: np.ndarray) -> None:
        data = np.concatenate([self.carry, np.asarray(chunk, self.dtype)])
        m = len(data) // self.n
        rows = np.empty((m, self.n + 2), self.dtype)
        rows[:, 0], rows[:, -1] = self.cls, self.sep
        rows[:, 1:-1] = data[:m * self.n].reshape(m, self.n)
        for r in rows:
            self._write(r)
        self.carry = data[m * self.n:]

    def close(self) -> List[Dict]:
        if len(self.carry):
            self._write(np.concatenate([[self.cls], self.carry, [self.sep]]).astype(self.dtype))
            self.carry = self.carry[:0]
        if self.w is not None:
            self._close_shard()
        return self.shards


def _load_part(parts_dir: str, k: int, n: int):
    d = os.path.join(parts_dir, f"part-{k:05d}-of-{n:05d}")
    try:
        with open(os.path.join(d, "part.json")) as f:
            info = json.load(f)
    except (OSError, ValueError):
        raise PreparedError(f"part {k} of {n} ({d}) is missing or unfinished; run worker "
                            f"--shard {k} --num_shards {n} again") from None
    for name in ("tokens.bin", "docs.npy"):
        p = os.path.join(d, name)
        if not os.path.isfile(p) or shard_sha256(p) != info[name.split(".")[0] + "_sha256"]:
            raise PreparedError(f"part {k} of {n}: {p} is missing or damaged (sha256); delete "
                                f"{d} and run worker --shard {k} --num_shards {n} again")
    docs = np.load(os.path.join(d, "docs.npy"))
    tokens = np.memmap(os.path.join(d, "tokens.bin"), np.dtype(info["dtype"]).newbyteorder("<"),
                       "r") if info["tokens"] else np.zeros(0, info["dtype"])
    return info, docs, tokens


def _check_parts(parts_dir: str, loaded) -> None:
    """The parts cover every document once (their workers read the same text, split alike)."""
    read = {i["documents_read"] for i, _, _ in loaded}
    idx = np.sort(np.concatenate([d["index"] for _, d, _ in loaded]))
    if len(read) != 1 or not np.array_equal(idx, np.arange(read.pop())):
        raise PreparedError(f"the parts in {parts_dir} do not add up to one corpus (their "
                            "workers read different text or split it differently); delete "
                            "that folder and prepare again")


def merge_plan(docs_per_part: Sequence[np.ndarray], dedup: bool):
    """Parts' DOC_DTYPE arrays -> (runs: int64 [r, 3] of (part, start, length) slices of the
    parts' streams in global order, counts). Duplicates keep their first document."""
    allp = np.concatenate(docs_per_part) if docs_per_part else np.zeros(0, DOC_DTYPE)
    part = np.repeat(np.arange(len(docs_per_part)), [len(d) for d in docs_per_part])
    start = np.concatenate([np.cumsum(d["length"]) - d["length"] for d in docs_per_part]
                           ) if docs_per_part else np.zeros(0, np.int64)
    order = np.argsort(allp["index"], kind="stable")
    allp, part, start = allp[order], part[order], start[order]
    first = np.ones(len(allp), bool)
    if dedup and len(allp):
        first[:] = False
        first[np.unique(allp["hash"], return_index=True)[1]] = True
    keep = first & (allp["length"] > 0)
    p, s, ln = part[keep], start[keep], allp["length"][keep]
    new = np.ones(len(p), bool)
    new[1:] = (p[1:] != p[:-1]) | (s[1:] != s[:-1] + ln[:-1])
    idx = np.flatnonzero(new)
    runs = np.stack([p[idx], s[idx], np.add.reduceat(ln, idx) if len(idx) else idx], 1)
    counts = {"documents": int(len(allp)), "duplicates_dropped": int((~first).sum()),
              "documents_without_tokens": int((first & (allp["length"] == 0)).sum()),
              "documents_kept": int(keep.sum()),
              "content_sha256": hashlib.sha256(allp["hash"].tobytes()).hexdigest()}
    return runs.astype(np.int64), counts


def assemble(out: str, parts_dir: str, num_shards: int, tokenizer, s: Settings,
             meta: Dict) -> Dict:
    """Packs the N parts into OUT's shards (temp folder, renamed into place); returns the
    manifest. `meta`: the key, sources and the rest the manifest records."""
    t0 = time.perf_counter()
    loaded = [_load_part(parts_dir, k, num_shards) for k in range(num_shards)]
    _check_parts(parts_dir, loaded)
    runs, counts = merge_plan([d for _, d, _ in loaded], s.dedup)
    tmp = f"{out}.tmp-{_host_pid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    dtype = np.dtype(loaded[0][0]["dtype"]).newbyteorder("<")
    w = RowWriter(tmp, s.seq_len, tokenizer.cls_token_id, tokenizer.sep_token_id, dtype,
                  s.rows_per_shard)
    total = int(runs[:, 2].sum()) if len(runs) else 0
    with Progress("pack rows", total=total, unit="tok") as prog:
        for p, start, length in runs:
            for a in range(start, start + length, READ_TOKENS):
                chunk = loaded[p][2][a:min(a + READ_TOKENS, start + length)]
                w.add(chunk)
                prog.update(len(chunk))
        shards = w.close()
    if not w.rows:
        shutil.rmtree(tmp, ignore_errors=True)
        raise src.SourceError(f"no text in {', '.join(meta['sources'])}: "
                              f"{counts['documents']} documents, none with tokens; check the "
                              "paths, --mode and --text_field")
    m = dict(meta, format=FORMAT, dtype=dtype.name, rows=w.rows, tokens=w.tokens,
             record_options=RECORD_OPTIONS, workers=num_shards, shards=shards,
             counts={k: v for k, v in counts.items() if k != "content_sha256"},
             content_sha256=counts["content_sha256"],
             seconds={"parts": [i.get("seconds") for i, _, _ in loaded],
                      "assemble": round(time.perf_counter() - t0, 2)},
             created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump(m, f, indent=1)
    try:
        os.replace(tmp, out)
    except OSError:
        # Another worker published first: its folder holds the same rows.
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isfile(os.path.join(out, MANIFEST)):
            raise
        return read_manifest(out)
    shutil.rmtree(parts_dir, ignore_errors=True)
    try:
        os.rmdir(os.path.dirname(parts_dir))
    except OSError:
        pass
    return m


def _take_lock(parts_dir: str, force: bool) -> bool:
    """The right to assemble (a folder created atomically, naming its host and pid). A lock
    left by a dead process on this host, or `force`, is taken over."""
    lock = os.path.join(parts_dir, "assembling")
    try:
        os.mkdir(lock)
    except FileExistsError:
        try:
            with open(os.path.join(lock, "owner")) as f:
                host, pid = f.read().rsplit("-", 1)
            dead = host == socket.gethostname() and not _alive(int(pid))
        except (OSError, ValueError):
            dead = False
        if not (force or dead):
            return False
    with open(os.path.join(lock, "owner"), "w") as f:
        f.write(_host_pid())
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _clean_stale(prefix: str) -> None:
    """Removes temp folders `prefix.tmp-*` left by an interrupted run."""
    d, base = os.path.split(prefix)
    for name in os.listdir(d or "."):
        if name.startswith(os.path.basename(base) + ".tmp-"):
            host_pid = name.split(".tmp-", 1)[1]
            host, _, pid = host_pid.rpartition("-")
            if host == socket.gethostname() and pid.isdigit() and _alive(int(pid)):
                continue
            shutil.rmtree(os.path.join(d, name), ignore_errors=True)


def _existing(out: str, key: str, meta: Dict) -> Optional[Dict]:
    """A finished OUT with this key (reused), None when OUT is absent or empty; refuses an OUT
    holding anything else, naming what differs."""
    if os.path.isfile(os.path.join(out, MANIFEST)):
        m = read_manifest(out)
        if m["key"] == key:
            return m
        differ = [k for k, a, b in (
            ("tokenizer", m["tokenizer"]["fingerprint"], meta["tokenizer"]["fingerprint"]),
            ("source content", m["source_identity"], meta["source_identity"]),
            ("settings", m["settings"], meta["settings"])) if a != b]
        raise UserError(f"--out {out} holds a corpus prepared from other inputs (its "
                        f"{', '.join(differ) or 'format'} differ; key {m['key']}, this one {key}); "
                        f"choose another --out or delete {out}")
    if os.path.isdir(out) and os.listdir(out):
        raise UserError(f"--out {out} is a folder with files and no {MANIFEST}; choose an empty "
                        "or new folder")
    return None


def plan(source_specs: Sequence[str], tokenizer, settings: Settings = Settings(),
         hints: Optional[Dict] = None, tokenizer_name: str = "") -> Dict:
    """What a prepare of `source_specs` would produce: the manifest's `meta` (its content key
    under "key") and the resolved sources (under "_sources", not written)."""
    sources = src.resolve(source_specs)
    ident = src.identity(sources, hints or {})
    tok_fp = tokenizer_fingerprint(tokenizer)
    key = prepare_key(tok_fp, ident, settings)
    return {"key": key, "sources": list(source_specs), "source_identity": ident,
            "stat_hints": src.stat_hints(sources, ident), "settings": dataclasses.asdict(settings),
            "tokenizer": {"fingerprint": tok_fp, "name": str(tokenizer_name or getattr(
                tokenizer, "name_or_path", "")), "vocab_size": len(tokenizer.get_vocab()),
                "cls_id": tokenizer.cls_token_id, "sep_id": tokenizer.sep_token_id,
                "pad_id": tokenizer.pad_token_id}, "_sources": sources}


def prepare(source_specs: Sequence[str], out: str, tokenizer, settings: Settings = Settings(),
            shard: int = 0, num_shards: int = 1, finalize: bool = False,
            tokenizer_name: str = "", planned: Optional[Dict] = None) -> Optional[Dict]:
    """Prepares the corpus of `source_specs` into folder `out` (module docstring): this
    worker's part, then the assembly when every part is done. Returns the manifest, or None
    when parts of other workers are still missing. planned: `plan(...)` of these arguments
    (its files are then not hashed again)."""
    if not 0 <= shard < num_shards:
        raise UserError(f"--shard {shard} --num_shards {num_shards}: need 0 <= shard < num_shards")
    if fs.is_remote(out):
        raise UserError(f"--out {out}: a prepared folder is written to a file system the "
                        "workers share (local, NFS, a mounted bucket), not to a bucket URL")
    out = os.path.abspath(os.path.expanduser(out)).rstrip("/")
    if planned is None:
        hints = {}
        if os.path.isfile(os.path.join(out, MANIFEST)):
            hints = read_manifest(out).get("stat_hints", {})
        planned = plan(source_specs, tokenizer, settings, hints, tokenizer_name)
    meta = {k: v for k, v in planned.items() if k != "_sources"}
    sources, key = planned["_sources"], meta["key"]
    done = _existing(out, key, meta)
    if done is not None:
        print(f"{out}: already prepared (key {key}), reused", file=sys.stderr)
        return done
    os.makedirs(os.path.dirname(out), exist_ok=True)
    parts_dir = os.path.join(f"{out}.parts", key)
    try:
        return _prepare_parts(sources, out, parts_dir, tokenizer, settings, shard, num_shards,
                              finalize, meta)
    except OSError as e:
        if not _disk_full(e):
            raise
        raise UserError(f"disk full while preparing {out} ({e.strerror or e}): nothing was "
                        f"published; free space (about 2.5 GB per 1B tokens at seq_len 128) "
                        "and run again: finished parts are reused") from None


def _prepare_parts(sources, out, parts_dir, tokenizer, s, shard, num_shards, finalize, meta):
    name = f"part-{shard:05d}-of-{num_shards:05d}"
    final = os.path.join(parts_dir, name)
    t0 = time.perf_counter()
    if not finalize and not os.path.isfile(os.path.join(final, "part.json")):
        os.makedirs(parts_dir, exist_ok=True)
        _clean_stale(final)
        total = sum(x.total_bytes for x in sources)
        try:
            info = run_worker(sources, tokenizer, s, final, shard, num_shards, total)
        except BaseException:
            shutil.rmtree(f"{final}.tmp-{_host_pid()}", ignore_errors=True)
            raise
        dt = time.perf_counter() - t0
        print(f"part {shard + 1}/{num_shards}: {info['documents']:,} of "
              f"{info['documents_read']:,} documents, {info['tokens']:,} tokens in {dt:.1f}s "
              f"({info['tokens'] / max(dt, 1e-9):,.0f} tokens/s)", file=sys.stderr)
    names = [f"part-{k:05d}-of-{num_shards:05d}" for k in range(num_shards)]
    missing = [k for k, n in enumerate(names)
               if not os.path.isfile(os.path.join(parts_dir, n, "part.json"))]
    if missing:
        if finalize:
            raise PreparedError(f"cannot assemble {out}: parts {missing} of {num_shards} are "
                                "not done; run those workers (--shard K) first")
        print(f"part {shard + 1}/{num_shards} done; waiting for parts {missing}: the last worker "
              f"to finish assembles {out} (or run --finalize)", file=sys.stderr)
        return None
    if not _take_lock(parts_dir, force=finalize):
        print(f"another worker is assembling {out}; if none is, run --finalize", file=sys.stderr)
        return None
    _clean_stale(out)
    try:
        m = assemble(out, parts_dir, num_shards, tokenizer, s, meta)
    except BaseException:
        # A failure or Ctrl-C (a kill leaves both, found stale by the next run).
        shutil.rmtree(os.path.join(parts_dir, "assembling"), ignore_errors=True)
        shutil.rmtree(f"{out}.tmp-{_host_pid()}", ignore_errors=True)
        raise
    c = m["counts"]
    print(f"{out}: {m['rows']:,} rows of <= {s.seq_len} tokens ({m['tokens']:,} tokens) in "
          f"{len(m['shards'])} shards from {c['documents_kept']:,} documents "
          f"({c['duplicates_dropped']:,} duplicates dropped, {c['documents_without_tokens']:,} "
          f"without tokens)", file=sys.stderr)
    return m


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line (module docstring); errors as one line `error: ...`, exit status 2."""
    p = argparse.ArgumentParser(prog="python -m jax_tinybert.data.prepare",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--source", action="append", required=True,
                   help="a file, a folder (read recursively), gs://prefix or glob, "
                        "hf:NAME_OR_PATH?options or tfds:NAME?options; repeat")
    p.add_argument("--out", required=True, help="the prepared folder (data.corpus of a run)")
    p.add_argument("--tokenizer", required=True, help="tokenizer folder or name")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--mode", choices=("sentences", "documents"), default="sentences")
    p.add_argument("--text_field", default="text", help=".jsonl / dataset field with the text")
    p.add_argument("--keep_duplicates", action="store_true",
                   help="keep exact duplicate documents (default: drop all but the first)")
    p.add_argument("--rows_per_shard", type=int, default=1 << 20)
    p.add_argument("--shard", type=int, default=0)
    p.add_argument("--num_shards", type=int, default=1)
    p.add_argument("--finalize", action="store_true",
                   help="only assemble OUT from the finished parts (e.g. the last worker died)")
    a = p.parse_args(argv)
    if a.seq_len < 3:
        raise UserError(f"--seq_len {a.seq_len}: need >= 3 ([CLS], a token, [SEP])")
    logging.basicConfig(level=logging.WARNING)
    tok = _load_tokenizer(a.tokenizer)
    s = Settings(a.seq_len, a.mode, a.text_field, not a.keep_duplicates, a.rows_per_shard)
    prepare(a.source, a.out, tok, s, a.shard, a.num_shards, a.finalize, a.tokenizer)
    return 0


def _load_tokenizer(name: str):
    try:
        tok = load_data_tokenizer(name)
    except (OSError, ValueError) as e:
        raise UserError(f"--tokenizer {name}: cannot load it ({type(e).__name__}: {e}); pass a "
                        "folder with tokenizer.json or a model name") from None
    if tok.cls_token_id is None or tok.sep_token_id is None:
        raise UserError(f"--tokenizer {name}: has no [CLS]/[SEP] (<s>/</s>); BERT/RoBERTa-style only")
    return tok


if __name__ == "__main__":
    sys.exit(tool_exit(main))
