"""General-distillation data: plain text packed into fixed-length sequences, and the official
TinyBERT pregenerated `epoch_N.json` files.

Packing: documents are tokenized (no special tokens) and concatenated into one token stream with
a [SEP] after each document; the stream is cut into chunks of seq_len - 2 pieces and each chunk
becomes `[CLS] chunk [SEP]` (RoBERTa / XLM-R: `<s> chunk </s>`; token_type 0). Concatenating the
chunk interiors gives the stream back exactly: no token is lost or duplicated. Only the very last
sequence may be shorter.

Large corpora: files are read line by line and packed sequences are appended to flat binary
files on disk, opened later as numpy memmaps, so neither the text nor the packed ids need to fit
in RAM. A run reads its corpus through `corpus_rows` and `reader.CorpusBatcher` (Grain): text is
prepared (`data.prepare`) into the run's cache first; `build_packed_corpus` is the sequence-by-
sequence packer kept as the reference the prepared rows are checked against.
"""
from __future__ import annotations

import errno
import glob
import hashlib
import json
import logging
import os
import shutil
import socket
import time
from typing import Dict, Iterator, List, Optional, Sequence, Union

import numpy as np

from jax_tinybert import fs
from jax_tinybert.data import prepare, prepared
from jax_tinybert.data.tokenize import EncodedDataset, tokenizer_fingerprint
from jax_tinybert.progress import Progress

log = logging.getLogger(__name__)

PathOrPaths = Union[str, Sequence[str]]


def list_text_files(paths: PathOrPaths) -> List[str]:
    """A file, a folder (its *.txt, sorted), or a list of them -> sorted list of files."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: List[str] = []
    for p in paths:
        p = os.fspath(p)
        if os.path.isdir(p):
            out.extend(sorted(glob.glob(os.path.join(p, "*.txt"))))
        elif os.path.isfile(p):
            out.append(p)
        else:
            raise FileNotFoundError(f"corpus path not found: {p}")
    if not out:
        raise FileNotFoundError(f"no .txt files in {list(paths)}")
    return out


class PackedTextStream:
    """Iterator of packed sequences (int32 [<= seq_len] arrays: [CLS] ... [SEP]) from text files.

    mode="sentences": one sentence per line, blank lines separate documents (BERT's corpus
    format); mode="documents": one document per line. A file end always ends a document.
    `state_dict()` / `load_state_dict()` resume exactly at the next sequence; the state holds
    the file index, a byte offset and the (short) buffer of tokenized-but-unemitted pieces.
    """

    def __init__(self, files: PathOrPaths, tokenizer, seq_len: int = 128, mode: str = "sentences",
                 lines_per_batch: int = 256):
        if mode not in ("sentences", "documents"):
            raise ValueError(f"mode must be 'sentences' or 'documents', got {mode!r}")
        if seq_len < 3:
            raise ValueError("seq_len must be >= 3")
        self.files = list_text_files(files)
        self.tokenizer = tokenizer
        self.seq_len = int(seq_len)
        self.mode = mode
        self.lines_per_batch = int(lines_per_batch)
        self.cls_id, self.sep_id = tokenizer.cls_token_id, tokenizer.sep_token_id
        self._file_idx = 0
        self._offset = 0
        self._doc_open = False   # current document has tokens (needs a [SEP] when it ends)
        self._buf: List[int] = []
        self._pos = 0
        self._emitted = 0
        self._fh = None

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> Dict:
        """Exact position: the next sequence is the one after the `num_emitted` already given."""
        return {"file_index": self._file_idx, "byte_offset": self._offset,
                "doc_open": self._doc_open, "buffer": list(self._buf[self._pos:]),
                "num_emitted": self._emitted, "seq_len": self.seq_len, "mode": self.mode,
                "files": [os.path.basename(f) for f in self.files]}

    def load_state_dict(self, state: Dict) -> None:
        if state["seq_len"] != self.seq_len or state["mode"] != self.mode:
            raise ValueError("cannot resume: seq_len/mode differ from the saved stream")
        if state["files"] != [os.path.basename(f) for f in self.files]:
            raise ValueError("cannot resume: corpus file list differs from the saved stream")
        self._close()
        self._file_idx, self._offset = int(state["file_index"]), int(state["byte_offset"])
        self._doc_open = bool(state["doc_open"])
        self._buf, self._pos = list(state["buffer"]), 0
        self._emitted = int(state["num_emitted"])

    @property
    def position(self):
        """(file index, byte offset in that file) of the next line to be read."""
        return self._file_idx, self._offset

    # -- reading ----------------------------------------------------------------------------
    def _close(self):
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def _read_lines(self):
        """Up to lines_per_batch (text, ends_doc_after) items; None at the end of the corpus.
        Advances (file_idx, offset) past what it returns."""
        items = []
        while len(items) < self.lines_per_batch:
            if self._file_idx >= len(self.files):
                break
            if self._fh is None:
                self._fh = open(self.files[self._file_idx], "rb")
                self._fh.seek(self._offset)
            raw = self._fh.readline()
            if not raw:  # end of file = end of document
                items.append(("", True))
                self._close()
                self._file_idx += 1
                self._offset = 0
                continue
            start = self._offset
            self._offset += len(raw)
            text = raw.decode("utf-8", errors="replace")
            if start == 0 and text.startswith("\ufeff"):
                text = text[1:]
            text = text.strip()
            if self.mode == "sentences":
                items.append((text, not text))
            elif text:
                items.append((text, True))
        return items or None

    def _fill(self) -> bool:
        """Tokenizes the next batch of lines into the buffer. False at the end of the corpus."""
        items = self._read_lines()
        if items is None:
            return False
        texts = [t for t, _ in items if t]
        enc = iter(self.tokenizer(texts, add_special_tokens=False, return_attention_mask=False,
                                  return_token_type_ids=False, verbose=False)["input_ids"] if texts else [])
        if self._pos:
            self._buf, self._pos = self._buf[self._pos:], 0
        for text, ends in items:
            if text:
                ids = next(enc)
                if ids:
                    self._buf.extend(ids)
                    self._doc_open = True
            if ends and self._doc_open:
                self._buf.append(self.sep_id)
                self._doc_open = False
        return True

    def __iter__(self) -> Iterator[np.ndarray]:
        return self

    def __next__(self) -> np.ndarray:
        n = self.seq_len - 2
        while len(self._buf) - self._pos < n:
            if not self._fill():
                break
        avail = len(self._buf) - self._pos
        if avail == 0:
            self._close()
            raise StopIteration
        take = min(n, avail)
        chunk = self._buf[self._pos:self._pos + take]
        self._pos += take
        self._emitted += 1
        return np.asarray([self.cls_id] + chunk + [self.sep_id], np.int32)

    def token_stream(self) -> Iterator[int]:
        """The unpacked stream (document pieces + [SEP] per document), for tests/inspection."""
        other = PackedTextStream(self.files, self.tokenizer, self.seq_len, self.mode,
                                 self.lines_per_batch)
        while other._fill():
            yield from other._buf[other._pos:]
            other._pos = len(other._buf)


class _RaggedWriter:
    """Appends variable-length sequences to flat binary files in a temp folder; `finish()` moves
    the folder into place atomically and returns a memmapped EncodedDataset."""

    def __init__(self, out_dir: str, pad_id: int):
        self.out_dir = out_dir
        if fs.is_remote(out_dir):   # a bucket: written locally, uploaded by finish()
            self.tmp = fs.staging_dir(out_dir)
        else:
            self.tmp = f"{out_dir}.tmp-{socket.gethostname()}-{os.getpid()}"
            shutil.rmtree(self.tmp, ignore_errors=True)
            os.makedirs(self.tmp)
        self.f_ids = open(os.path.join(self.tmp, "input_ids.bin"), "wb")
        self.f_tt = open(os.path.join(self.tmp, "token_type_ids.bin"), "wb")
        self.f_off = open(os.path.join(self.tmp, "offsets.bin"), "wb")
        self.f_off.write(np.zeros(1, np.int64).tobytes())
        self.total, self.n, self.pad_id = 0, 0, pad_id

    def append(self, ids: np.ndarray, tt: Optional[np.ndarray] = None):
        ids = np.asarray(ids, np.int32)
        tt = np.zeros(len(ids), np.int8) if tt is None else np.asarray(tt, np.int8)
        self.f_ids.write(ids.tobytes())
        self.f_tt.write(tt.tobytes())
        self.total += len(ids)
        self.n += 1
        self.f_off.write(np.int64(self.total).tobytes())

    def finish(self, meta: Dict) -> EncodedDataset:
        for f in (self.f_ids, self.f_tt, self.f_off):
            f.close()
        meta = dict(meta, num_sequences=self.n, num_tokens=self.total, pad_id=self.pad_id)
        with open(os.path.join(self.tmp, "meta.json"), "w") as f:
            json.dump(meta, f)
        if fs.is_remote(self.out_dir):
            # meta.json last: a folder without it is not a cache. The staged files stay as
            # this process's local copy (memmapped).
            fs.publish_dir(self.tmp, self.out_dir, last=["meta.json"], keep_local=True)
            return open_ragged(self.tmp)
        try:
            os.replace(self.tmp, self.out_dir)
        except OSError:
            # Another process (same shared cache) finished first: its copy is identical.
            if not os.path.exists(os.path.join(self.out_dir, "meta.json")):
                raise
            shutil.rmtree(self.tmp, ignore_errors=True)
        return open_ragged(self.out_dir)


def open_ragged(path: str) -> EncodedDataset:
    """Memmaps a folder written by `build_packed_corpus` / `read_pregenerated` (a folder in
    a bucket is downloaded first: np.memmap needs local files)."""
    path = fs.local_mirror(path)
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)

    def mm(name, dtype, n):
        if n == 0:
            return np.zeros(0, dtype)
        return np.memmap(os.path.join(path, name), dtype=dtype, mode="r", shape=(n,))

    return EncodedDataset(mm("input_ids.bin", np.int32, meta["num_tokens"]),
                          mm("token_type_ids.bin", np.int8, meta["num_tokens"]),
                          mm("offsets.bin", np.int64, meta["num_sequences"] + 1),
                          None, int(meta["pad_id"]))


def _files_key(files: Sequence[str]) -> str:
    h = hashlib.sha256()
    for f in files:
        st = os.stat(f)
        h.update(f"{os.path.abspath(f)}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()


def build_packed_corpus(files: PathOrPaths, tokenizer, seq_len: int = 128, *,
                        cache_dir: str, mode: str = "sentences") -> EncodedDataset:
    """Packs text files into `[CLS] ... [SEP]` sequences of <= seq_len tokens, stored on disk in
    `cache_dir` (keyed by tokenizer, file paths/sizes/mtimes, seq_len, mode) and memmapped."""
    files = list_text_files(files)
    h = hashlib.sha256("\0".join([tokenizer_fingerprint(tokenizer), _files_key(files),
                                  str(seq_len), mode]).encode()).hexdigest()[:24]
    out = fs.join(cache_dir, f"packed-{seq_len}-{h}")
    if fs.exists(fs.join(out, "meta.json")):
        return open_ragged(out)
    fs.makedirs(cache_dir)
    w = _RaggedWriter(out, tokenizer.pad_token_id or 0)
    stream = PackedTextStream(files, tokenizer, seq_len, mode)
    sizes = np.cumsum([0] + [os.path.getsize(f) for f in files])
    with Progress(f"pack corpus ({len(files)} files)", total=int(sizes[-1]), unit="B") as prog:
        for seq in stream:
            w.append(seq)
            if w.n % 256 == 0:
                f_idx, offset = stream.position
                prog.set(int(sizes[min(f_idx, len(files))]) + offset)
        prog.set(int(sizes[-1]))
    ds = w.finish({"kind": "packed", "seq_len": seq_len, "mode": mode, "files": files})
    log.info("packed %d files into %d sequences of <= %d tokens (%d tokens)", len(files), len(ds),
             seq_len, int(ds.offsets[-1]))
    return ds


def packed_corpus(paths: PathOrPaths, tokenizer, seq_len: int = 128, *, cache_dir: str,
                  mode: str = "sentences") -> EncodedDataset:
    """The packed rows of a corpus in memory: a folder written by `python -m
    jax_tinybert.data.prepare` (it holds manifest.json) read as prepared
    (`prepared.load_prepared`: its tokenizer and seq_len checked), else `build_packed_corpus`
    of the text files and folders."""
    listed = _listed(paths)
    if any(prepared.is_prepared(p) for p in listed):
        _only_one(listed)
        return prepared.load_prepared(os.fspath(listed[0]), tokenizer, seq_len, mode=mode)
    return build_packed_corpus(paths, tokenizer, seq_len, cache_dir=cache_dir, mode=mode)


def _listed(paths: PathOrPaths) -> List[str]:
    return [os.fspath(paths)] if isinstance(paths, (str, os.PathLike)) else [
        os.fspath(p) for p in paths]


def _only_one(listed: Sequence[str]) -> None:
    if len(listed) > 1:
        raise prepared.PreparedError(f"corpus {list(listed)}: a prepared folder (with "
                                     "manifest.json) must be the only path")


# A prepared cache of raw text another process is assembling: how long to wait for it.
PREPARE_WAIT_S = 3600.0


def corpus_rows(paths: PathOrPaths, tokenizer, seq_len: int = 128, *, cache_dir: str,
                mode: str = "sentences", memory_tokens: int = 0):
    """The rows a general-distillation run reads (`reader.CorpusBatcher`'s source): a prepared
    folder (local or in a bucket) opened by `prepared.open_rows`; text files and folders
    (local or gs://, read as `python -m jax_tinybert.data.prepare` reads them) are prepared
    first into `cache_dir/prepared-<content key>` (a bucket cache_dir: the local cache root),
    reused by every later run on the same text. Corpora of at most `memory_tokens` tokens are
    held in memory, larger ones read in place."""
    listed = _listed(paths)
    if any(prepared.is_prepared(p) for p in listed):
        _only_one(listed)
        return prepared.open_rows(listed[0], tokenizer, seq_len, mode, memory_tokens)
    settings = prepare.Settings(seq_len=int(seq_len), mode=mode)
    root = os.path.abspath(os.path.expanduser(
        prepared._local_root() if fs.is_remote(cache_dir) else cache_dir))
    planned = prepare.plan(listed, tokenizer, settings, _stat_hints(root))
    out = os.path.join(root, f"prepared-{planned['key']}")
    if not prepared.is_prepared(out):
        _prepare_or_wait(listed, out, tokenizer, settings, planned)
    return prepared.open_rows(out, tokenizer, seq_len, mode, memory_tokens)


def _stat_hints(root: str) -> Dict:
    """The files' (size, mtime, sha256) that earlier prepares in `root` recorded: a rerun on
    unchanged text does not hash it again."""
    hints: Dict = {}
    for m in sorted(glob.glob(os.path.join(root, "prepared-*", prepared.MANIFEST))):
        try:
            with open(m, encoding="utf-8") as f:
                hints.update(json.load(f).get("stat_hints", {}))
        except (OSError, ValueError):
            continue
    return hints


def _prepare_or_wait(listed, out, tokenizer, settings, planned) -> None:
    """Prepares `out`, or waits for the process of this run that is preparing it (a cache
    folder the processes share)."""
    try:
        if prepare.prepare(listed, out, tokenizer, settings, planned=planned) is not None:
            return
    except OSError as e:   # another process published the same part first: it assembles
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) and not prepared.is_prepared(out):
            raise
    log.info("another process is preparing %s; waiting for it", out)
    t0 = time.monotonic()
    while not prepared.is_prepared(out):
        if time.monotonic() - t0 > PREPARE_WAIT_S:
            raise prepared.PreparedError(
                f"{out}: another process has been preparing this corpus for "
                f"{PREPARE_WAIT_S:.0f} s without finishing; if it died, delete {out}.parts and "
                "run again")
        time.sleep(2.0)


def pregenerated_files(path: str, epoch: int) -> str:
    """The `epoch_{N}.json` to use for training epoch `epoch` (cycling over the available data
    epochs, as the official general_distill.py does)."""
    if os.path.isfile(path):
        return path
    n = 0
    while os.path.isfile(os.path.join(path, f"epoch_{n}.json")):
        n += 1
    if n == 0:
        raise FileNotFoundError(f"no epoch_0.json in {path} (official TinyBERT pregenerated data)")
    return os.path.join(path, f"epoch_{epoch % n}.json")


def read_pregenerated(path: str, tokenizer, *, epoch: int = 0, max_seq_len: Optional[int] = None,
                      cache_dir: Optional[str] = None) -> EncodedDataset:
    """Reads an official TinyBERT `epoch_N.json` (one JSON per line with `tokens`, `segment_ids`,
    `is_random_next`, `masked_lm_positions`, `masked_lm_labels`).

    `tokens` already hold [CLS]/[SEP]/[MASK]; they are mapped to ids with the tokenizer's vocab.
    The MLM/NSP fields are not used by distillation. Sequences longer than max_seq_len
    (default: `max_seq_len` of `epoch_N_metrics.json`, else unlimited) are truncated like the
    official reader. With cache_dir, ids go to disk and are memmapped (large files).
    """
    fpath = pregenerated_files(path, epoch)
    metrics_path = fpath[:-len(".json")] + "_metrics.json"
    if max_seq_len is None and os.path.isfile(metrics_path):
        with open(metrics_path) as f:
            max_seq_len = json.load(f).get("max_seq_len")
    vocab = tokenizer.get_vocab()
    unk = tokenizer.unk_token_id
    pad = tokenizer.pad_token_id or 0
    if cache_dir:
        st = os.stat(fpath)
        h = hashlib.sha256(f"{tokenizer_fingerprint(tokenizer)}\0{os.path.abspath(fpath)}\0"
                           f"{st.st_size}\0{st.st_mtime_ns}\0{max_seq_len}".encode()).hexdigest()[:24]
        out = fs.join(cache_dir, f"pregen-{h}")
        if fs.exists(fs.join(out, "meta.json")):
            return open_ragged(out)
        fs.makedirs(cache_dir)
        w = _RaggedWriter(out, pad)
    ids_l, tt_l = [], []
    n_unk = 0
    with open(fpath, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ex = json.loads(line)
                tokens, seg = ex["tokens"], ex["segment_ids"]
            except (ValueError, KeyError) as e:
                raise ValueError(f"{fpath}:{lineno}: expected a JSON object with 'tokens' and "
                                 f"'segment_ids' ({e})") from None
            if max_seq_len and len(tokens) > max_seq_len:
                tokens = tokens[:max_seq_len]
            if len(seg) != len(tokens):  # as the official reader: fall back to segment 0
                seg = [0] * len(tokens)
            ids = [vocab.get(t, unk) for t in tokens]
            n_unk += sum(1 for t in tokens if t not in vocab)
            if cache_dir:
                w.append(np.asarray(ids, np.int32), np.asarray(seg, np.int8))
            else:
                ids_l.append(np.asarray(ids, np.int32))
                tt_l.append(np.asarray(seg, np.int8))
    if n_unk:
        log.warning("%s: %d tokens not in the tokenizer vocab (mapped to [UNK]); was it generated "
                    "with a different vocab?", fpath, n_unk)
    if cache_dir:
        return w.finish({"kind": "pregenerated", "file": fpath})
    lens = np.array([len(x) for x in ids_l], np.int64)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    cat = (lambda xs, dt: np.concatenate(xs) if xs else np.zeros(0, dt))
    return EncodedDataset(cat(ids_l, np.int32), cat(tt_l, np.int8), offsets, None, pad)
