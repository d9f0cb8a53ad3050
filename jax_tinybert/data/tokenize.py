"""Tokenization of GLUE examples into a compact ragged dataset, with an on-disk npz cache.

Pieces are produced by an HF fast tokenizer in batches (Rust, multi-threaded); special-token
assembly (the tokenizer's own layout: BERT's `[CLS] a [SEP] b [SEP]`, RoBERTa's
`<s> a </s></s> b </s>`) and longest-first truncation happen here, so the number of truncated
sequences is known exactly. Truncation follows the official BERT/TinyBERT `_truncate_seq_pair`
(pop from the longer side, from b on ties) within max_len less the layout's special tokens (3
for a BERT pair, 4 for RoBERTa's); HF's Rust "longest_first" differs only on an odd budget
split between two long sides, where it gives the extra token to b instead of a.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import logging
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from jax_tinybert import fs
from jax_tinybert.data import glue, wordpiece
from jax_tinybert.progress import Progress

log = logging.getLogger(__name__)

# 2: the tokenizer's own special-token layout (a RoBERTa pair cached by 1 had BERT's).
CACHE_VERSION = 2


def load_tokenizer(path_or_name: str):
    """`transformers.AutoTokenizer.from_pretrained(path_or_name)`, requiring a fast tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path_or_name, use_fast=True)
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"{path_or_name}: need a fast (Rust) tokenizer; got {type(tok).__name__}")
    return tok


def load_data_tokenizer(path_or_name: str):
    """The tokenizer for batches of ids: `wordpiece.load` (no transformers import, ~4 s less
    per run) where it reproduces `load_tokenizer(path_or_name)` exactly, else that."""
    return wordpiece.load(path_or_name) or load_tokenizer(path_or_name)


@dataclasses.dataclass
class EncodedDataset:
    """Ragged token ids. Example i is `input_ids[offsets[i]:offsets[i+1]]` (with its specials).

    `labels`: int32 [n] / float32 [n] / None. Arrays may be numpy memmaps (corpus on disk).
    """

    input_ids: np.ndarray        # int32 [total_tokens]
    token_type_ids: np.ndarray   # int8 [total_tokens]
    offsets: np.ndarray          # int64 [n + 1]
    labels: Optional[np.ndarray] = None
    pad_id: int = 0
    num_truncated: int = 0

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        """int64 [n] token counts."""
        return np.diff(self.offsets)

    def gather(self, indices: np.ndarray, seq_len: int) -> Dict[str, np.ndarray]:
        """Rows `indices` padded to seq_len -> input_ids/attention_mask/token_type_ids [b, T]
        int32 and `labels` [b] when present."""
        b = len(indices)
        ids = np.full((b, seq_len), self.pad_id, np.int32)
        tt = np.zeros((b, seq_len), np.int32)
        mask = np.zeros((b, seq_len), np.int32)
        for r, i in enumerate(indices):
            s, e = int(self.offsets[i]), int(self.offsets[i + 1])
            n = e - s
            if n > seq_len:
                raise ValueError(f"example {i} has {n} tokens > bucket length {seq_len}")
            ids[r, :n] = self.input_ids[s:e]
            tt[r, :n] = self.token_type_ids[s:e]
            mask[r, :n] = 1
        out = {"input_ids": ids, "attention_mask": mask, "token_type_ids": tt}
        if self.labels is not None:
            out["labels"] = self.labels[np.asarray(indices)]
        return out

    def save_npz(self, path: str) -> None:
        """Atomic write (temp file in the same folder, then os.replace)."""
        fs.clean_stale_temps(path)
        arrays = dict(input_ids=self.input_ids, token_type_ids=self.token_type_ids,
                      offsets=self.offsets, pad_id=np.int64(self.pad_id),
                      num_truncated=np.int64(self.num_truncated))
        if self.labels is not None:
            arrays["labels"] = self.labels
        with fs.atomic_open(path, "wb") as f:
            np.savez(f, **arrays)

    @classmethod
    def load_npz(cls, path: str) -> "EncodedDataset":
        with fs.open_file(path, "rb") as fh, np.load(io.BytesIO(fh.read())) as z:
            return cls(z["input_ids"], z["token_type_ids"], z["offsets"],
                       z["labels"] if "labels" in z.files else None, int(z["pad_id"]),
                       int(z["num_truncated"]))


def truncate_pair(a: List[int], b: Optional[List[int]], max_tokens: int):
    """Longest-first truncation to a total of max_tokens pieces. Returns (a, b, truncated)."""
    la, lb = len(a), (len(b) if b is not None else 0)
    if la + lb <= max_tokens:
        return a, b, False
    if b is None:
        return a[:max_tokens], None, True
    # Closed form of "pop from the longer (b on ties) until it fits".
    while la + lb > max_tokens:
        if la > lb:
            la -= 1
        else:
            lb -= 1
    return a[:la], b[:lb], True


@dataclasses.dataclass(frozen=True)
class Template:
    """The special tokens a tokenizer's post-processor puts around one or two segments:
    `ids[0] a ids[1]` (single) or `ids[0] a ids[1] b ids[2]` (pair), `types` likewise, and
    `seg_types` the token type of a (and b). BERT: `[CLS] a [SEP] b [SEP]`, types 0/1;
    RoBERTa / XLM-R: `<s> a </s></s> b </s>`, types all 0."""

    ids: Tuple[Tuple[int, ...], ...]
    types: Tuple[Tuple[int, ...], ...]
    seg_types: Tuple[int, ...]

    @property
    def num_special(self) -> int:
        return sum(len(p) for p in self.ids)

    def build(self, a: List[int], b: Optional[List[int]] = None):
        """-> (ids, token types) of the segment(s) with their special tokens."""
        segs = [a] if b is None else [a, b]
        ids, tt = list(self.ids[0]), list(self.types[0])
        for k, seg in enumerate(segs):
            ids += seg + list(self.ids[k + 1])
            tt += [self.seg_types[k]] * len(seg) + list(self.types[k + 1])
        return ids, tt


def _sentinels(backend):
    """Encodings of two short texts without special tokens, the backend's fixed padding /
    truncation (a saved tokenizer.json may carry them) off for the call and restored after."""
    pad, trunc = backend.padding, backend.truncation
    backend.no_padding()
    backend.no_truncation()
    try:
        return [backend.encode(t, add_special_tokens=False) for t in ("a", "b")]
    finally:
        if pad:
            backend.enable_padding(**{k: v for k, v in pad.items()})
        if trunc:
            backend.enable_truncation(**trunc)


def special_template(tokenizer, pair: bool) -> Template:
    """The tokenizer's own special-token layout, read off its Rust post-processor applied to
    two sentinel segments (what `tokenizer(a, b)` itself does; `special_tokens_mask` tells
    the added tokens). ValueError when it adds no special tokens (no [CLS]-like first token)."""
    backend = tokenizer.backend_tokenizer
    segs = _sentinels(backend)[:2 if pair else 1]
    proc = backend.post_processor
    if proc is None:
        raise ValueError(f"{getattr(tokenizer, 'name_or_path', tokenizer)}: the tokenizer adds no "
                         "special tokens (no post-processor); need a BERT/RoBERTa-style one")
    enc = proc.process(segs[0], segs[1] if pair else None, add_special_tokens=True)
    ids, tts, special = enc.ids, enc.type_ids, enc.special_tokens_mask
    parts, types, seg_types, i = [], [], [], 0
    for k in range(len(segs) + 1):
        j = i
        while j < len(ids) and special[j]:
            j += 1
        parts.append(tuple(ids[i:j]))
        types.append(tuple(tts[i:j]))
        if k < len(segs):
            n = len(segs[k].ids)
            if ids[j:j + n] != segs[k].ids:
                raise ValueError(f"{getattr(tokenizer, 'name_or_path', tokenizer)}: cannot read "
                                 "the special-token layout off its post-processor")
            seg_types.append(tts[j] if n else 0)
            j += n
        i = j
    if i != len(ids) or not parts[0]:
        raise ValueError(f"{getattr(tokenizer, 'name_or_path', tokenizer)}: the post-processor "
                         "adds no first special token; need a BERT/RoBERTa-style tokenizer")
    return Template(tuple(parts), tuple(types), tuple(seg_types))


def encode_texts(tokenizer, texts_a: Sequence[str], texts_b: Optional[Sequence[Optional[str]]],
                 max_len: int, labels=None, batch_size: int = 4096,
                 desc: str = "tokenize") -> EncodedDataset:
    """Tokenizes (pairs of) texts in batches with the tokenizer's own special-token layout
    (`special_template`: `[CLS] a [SEP] (b [SEP])` for BERT, `<s> a </s>(</s> b </s>)` for
    RoBERTa / XLM-R), truncated to max_len tokens longest-first. Logs how many were truncated;
    progress under `desc`."""
    pad_id = tokenizer.pad_token_id or 0
    n = len(texts_a)
    pair = texts_b is not None and any(t is not None for t in texts_b)
    templates = {False: special_template(tokenizer, False)}
    if pair:
        templates[True] = special_template(tokenizer, True)
    ids_parts, tt_parts, lens = [], [], np.zeros(n, np.int64)
    truncated = 0
    prog = Progress(desc, total=n, unit="ex")
    for s in range(0, n, batch_size):
        ea = tokenizer(list(texts_a[s:s + batch_size]), add_special_tokens=False,
                       return_attention_mask=False, return_token_type_ids=False, verbose=False)["input_ids"]
        eb = (tokenizer(list(texts_b[s:s + batch_size]), add_special_tokens=False,
                        return_attention_mask=False, return_token_type_ids=False, verbose=False)["input_ids"]
              if pair else [None] * len(ea))
        for j, (a, b) in enumerate(zip(ea, eb)):
            t = templates[b is not None]
            a, b, cut = truncate_pair(a, b, max_len - t.num_special)
            truncated += cut
            seq, tt = t.build(a, b)
            ids_parts.append(np.asarray(seq, np.int32))
            tt_parts.append(np.asarray(tt, np.int8))
            lens[s + j] = len(seq)
        prog.update(len(ea))
    prog.close()
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    if truncated:
        log.info("truncated %d of %d sequences to max_len=%d", truncated, n, max_len)
    lab = None
    if labels is not None:
        lab = np.asarray(labels)
    return EncodedDataset(
        np.concatenate(ids_parts) if ids_parts else np.zeros(0, np.int32),
        np.concatenate(tt_parts) if tt_parts else np.zeros(0, np.int8),
        offsets, lab, pad_id, truncated)


def encode_examples(tokenizer, spec, examples: Sequence[glue.Example], max_len: int
                    ) -> EncodedDataset:
    """GLUE examples -> EncodedDataset; labels int32 (classification) or float32 (regression)."""
    spec = glue.get_task(spec)
    labels = None
    if examples and examples[0].label is not None:
        labels = np.asarray([e.label for e in examples],
                            np.float32 if spec.is_regression else np.int32)
    return encode_texts(tokenizer, [e.text_a for e in examples],
                        [e.text_b for e in examples] if spec.is_pair else None, max_len, labels,
                        desc=f"tokenize {spec.dir_name}")


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of the tokenizer's full definition (vocab, normalizer, special tokens)."""
    import json

    # The backend JSON also records the last call's truncation/padding settings: not part of
    # the tokenizer's identity, and they change with use.
    d = json.loads(tokenizer.backend_tokenizer.to_str())
    d.pop("truncation", None)
    d.pop("padding", None)
    h = hashlib.sha256()
    h.update(json.dumps(d, sort_keys=True).encode("utf-8"))
    h.update(repr(sorted((k, str(v)) for k, v in tokenizer.special_tokens_map.items())).encode())
    return h.hexdigest()


def file_fingerprint(path: str) -> str:
    """sha256 of the file bytes (GLUE files are small; content is safer than mtime)."""
    h = hashlib.sha256()
    with fs.open_file(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cache_key(tokenizer, data_path: str, max_len: int, task: str, extra: str = "") -> str:
    h = hashlib.sha256()
    for part in (f"v{CACHE_VERSION}", tokenizer_fingerprint(tokenizer), file_fingerprint(data_path),
                 str(max_len), task, extra):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def subset_indices(total: int, n: int, seed: int) -> Optional[np.ndarray]:
    """The n of `total` examples a run with `data.*_subset=n` uses: a seeded shuffle's first n,
    in dataset order (int64 [n]); None when n is 0 or >= total (all examples)."""
    if not n or n >= total:
        return None
    return np.sort(np.random.default_rng(seed).permutation(total)[:n])


def take(ds: EncodedDataset, idx: Optional[np.ndarray]) -> EncodedDataset:
    """Examples `idx` of ds, in that order (None: ds itself). num_truncated stays ds's."""
    if idx is None:
        return ds
    offs = ds.offsets
    ids = np.concatenate([ds.input_ids[offs[i]:offs[i + 1]] for i in idx])
    tts = np.concatenate([ds.token_type_ids[offs[i]:offs[i + 1]] for i in idx])
    lens = np.diff(offs)[idx]
    return EncodedDataset(
        ids, tts, np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
        None if ds.labels is None else ds.labels[idx], ds.pad_id, ds.num_truncated)


TOKEN_STORE_ENV = "JTB_TOKEN_STORE"


def token_store() -> Optional[str]:
    """The tokenised splits shared by the runs on this machine: $JTB_TOKEN_STORE, default
    ~/.cache/jax_tinybert/tokens; None when JTB_TOKEN_STORE=off."""
    return fs.shared_store(TOKEN_STORE_ENV, "tokens")


def load_glue_encoded(task, split: str, tokenizer, max_len: int, *, glue_dir: Optional[str] = None,
                      path: Optional[str] = None, cache_dir: Optional[str] = None,
                      skip_bad_rows: bool = False, source: str = "tsv", subset: int = 0,
                      subset_seed: int = 0, store_dir: Optional[str] = None) -> EncodedDataset:
    """Reads + tokenizes a GLUE TSV split, through an npz cache in `cache_dir` when given.

    The cache file name is a hash of the tokenizer definition, the data file bytes, max_len and
    the task, so any change re-tokenizes. Non-TSV sources are not cached. `store_dir` (with
    cache_dir; e.g. `token_store()`): a folder of such files shared between runs, read when
    cache_dir has none (and copied there, so the workdir stays self-contained) and given a copy
    of what this call tokenizes: the stages of a recipe tokenize the train set once (~4 s for
    SST-2).
    `subset=n` (> 0): only the examples `subset_indices(len(split), n, subset_seed)`. Without a
    cache of the whole split only those n are tokenized (and nothing is cached): a 1,000-example
    run on SST-2 does not tokenize its 67,349 rows. Either way the examples are the same.
    """
    spec = glue.get_task(task)
    if source != "tsv":
        ex = glue.load_examples(spec, split, source=source)
        idx = subset_indices(len(ex), subset, subset_seed)
        return encode_examples(tokenizer, spec, ex if idx is None else [ex[i] for i in idx],
                               max_len)
    if path is None:
        if glue_dir is None:
            raise ValueError("need glue_dir or path")
        path = glue.tsv_path(glue_dir, spec, split)
    if not fs.isfile(path):
        raise glue.DataError(f"{spec.dir_name} {split}: file not found: {path}")
    cache_path = store_path = None
    if cache_dir:
        key = cache_key(tokenizer, path, max_len, spec.name, f"skip={skip_bad_rows}")
        name = f"{spec.name}-{split}-{max_len}-{key}.npz"
        cache_path = fs.join(cache_dir, name)
        store_path = fs.join(store_dir, name) if store_dir else None
        for src in (cache_path, store_path):
            if src is None or not fs.exists(src):
                continue
            try:
                ds = EncodedDataset.load_npz(src)
            except Exception as e:  # a torn/corrupt file: rebuild it
                log.warning("ignoring unreadable cache %s: %s", src, e)
                continue
            if src == store_path:
                ds.save_npz(cache_path)
            log.info("loaded tokenized %s %s from %s", spec.dir_name, split, src)
            return take(ds, subset_indices(len(ds), subset, subset_seed))
    ex = glue.load_examples(spec, split, path=path, skip_bad_rows=skip_bad_rows)
    idx = subset_indices(len(ex), subset, subset_seed)
    if idx is not None:
        ds = encode_examples(tokenizer, spec, [ex[i] for i in idx], max_len)
        log.info("%s %s: %d of %d examples (subset), %d truncated to %d tokens", spec.dir_name,
                 split, len(ds), len(ex), ds.num_truncated, max_len)
        return ds
    ds = encode_examples(tokenizer, spec, ex, max_len)
    log.info("%s %s: %d examples, %d truncated to %d tokens", spec.dir_name, split, len(ds),
             ds.num_truncated, max_len)
    if cache_path:
        ds.save_npz(cache_path)
    if store_path:
        try:
            fs.makedirs(store_dir)
            ds.save_npz(store_path)
        except OSError as e:   # a read-only or full store: this run is not affected
            log.warning("could not add %s to the token store: %s", name, e)
    return ds
