"""CoNLL-2003 NER: column files and HF `datasets`' `conll2003`, tags in IOB2, label order by name,
and first-piece labels for a token-classification head.

Column files: one token per line (`word POS chunk NER`; the NER column chosen by position,
default the last), blank lines between sentences, `-DOCSTART-` lines between documents. IOB1
files (an `I-` tag may open a chunk, `B-` only between two adjacent chunks of one type) are
detected and converted to IOB2; `scheme="iob2"` refuses them instead. Bad lines stop with one
`glue.DataError` naming file:line.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from jax_tinybert import fs
from jax_tinybert.data.glue import DataError, tfds_split, record_text

# HF `conll2003`'s ClassLabel order of ner_tags.
HF_LABELS = ("O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC")
IGNORE = -100   # label of the pieces after a word's first and of special tokens


@dataclasses.dataclass(frozen=True)
class NERSentence:
    """One sentence: its words, their IOB2 tags, and the file line it starts at (0: not a file)."""

    words: Tuple[str, ...]
    tags: Tuple[str, ...]
    line: int = 0


def _check_tag(tag: str, where: str) -> None:
    if tag != "O" and not (tag[:2] in ("B-", "I-") and len(tag) > 2):
        raise DataError(f"{where}: tag {tag!r} is not IOB (O, B-TYPE or I-TYPE); pick the NER "
                        "column with column=")


def _opens_with_i(tags: Sequence[str]) -> int:
    """Index of the first I- tag that opens a chunk (IOB1 style), or -1."""
    prev = "O"
    for i, t in enumerate(tags):
        if t.startswith("I-") and (prev == "O" or prev[2:] != t[2:]):
            return i
        prev = t
    return -1


def to_iob2(tags: Sequence[str]) -> Tuple[str, ...]:
    """IOB1 -> IOB2: an I- tag that opens a chunk becomes B-."""
    out, prev = [], "O"
    for t in tags:
        if t.startswith("I-") and (prev == "O" or prev[2:] != t[2:]):
            t = "B-" + t[2:]
        out.append(t)
        prev = t
    return tuple(out)


def _sentences(path: str, column: int):
    """-> [(first line, words, tags)] of a column file, tags as written."""
    out, words, tags, first = [], [], [], 0
    with fs.open_file(path, "rb") as fh:
        for n, raw in enumerate(fh.read().decode("utf-8").splitlines(), 1):
            cols = raw.split()
            if not cols or cols[0] == "-DOCSTART-":
                if words:
                    out.append((first, words, tags))
                words, tags = [], []
                continue
            if len(cols) < 2 or not -len(cols) <= column < len(cols) or column in (0, -len(cols)):
                raise DataError(f"{path}:{n}: {len(cols)} column(s); expected a word and its NER "
                                f"tag in column {column} (e.g. 'EU NNP B-NP B-ORG')")
            _check_tag(cols[column], f"{path}:{n}")
            first = first if words else n
            words.append(cols[0])
            tags.append(cols[column])
    if words:
        out.append((first, words, tags))
    return out


def read_conll(path: str, column: int = -1, scheme: str = "auto") -> List[NERSentence]:
    """The sentences of a CoNLL column file, tags in IOB2. scheme: auto (IOB1 detected and
    converted) | iob1 | iob2 (an I- tag opening a chunk is an error naming its line)."""
    if scheme not in ("auto", "iob1", "iob2"):
        raise ValueError(f"scheme={scheme!r}: expected auto, iob1 or iob2")
    if not fs.isfile(path):
        raise DataError(f"{path}: file not found (expected a CoNLL column file, e.g. train.txt)")
    raw = _sentences(path, column)
    if not raw:
        raise DataError(f"{path}: no sentences read")
    iob1 = scheme == "iob1"
    for first, _, tags in raw:
        i = _opens_with_i(tags)
        if i >= 0 and scheme == "iob2":
            raise DataError(f"{path}:{first + i}: {tags[i]} opens a chunk, which IOB2 does not "
                            "allow (IOB1 file? pass scheme='iob1' or 'auto')")
        iob1 = iob1 or (i >= 0 and scheme == "auto")
    return [NERSentence(tuple(w), to_iob2(t) if iob1 else tuple(t), first)
            for first, w, t in raw]


def read_hf_conll(split: str, **load_kwargs) -> List[NERSentence]:
    """`datasets.load_dataset("conll2003", split=...)` (online or its cache): tokens and
    ner_tags in HF's ClassLabel order (HF_LABELS); split train | dev | validation | test."""
    try:
        import datasets  # noqa: F401  (optional dependency)
    except ImportError as e:
        raise ImportError("source='hf' needs the `datasets` package: pip install datasets") from e
    hf_split = {"dev": "validation"}.get(split, split)
    try:
        ds = datasets.load_dataset("conll2003", split=hf_split, **load_kwargs)
    except Exception as e:  # offline, no cache, ...
        raise DataError(f"could not load HF dataset conll2003 split {hf_split}: {e} (offline? "
                        "read the column files with read_conll)") from e
    return [NERSentence(tuple(r["tokens"]), tuple(HF_LABELS[t] for t in r["ner_tags"]))
            for r in ds]


def read_tfds_conll(split: str, **load_kwargs) -> List[NERSentence]:
    """TFDS `conll2003` (its local data_dir, or downloaded): tokens and ner tags by the names of
    its ClassLabel (info.features), in IOB2 (an IOB1 chunk opening converted); split train |
    dev | validation | test."""
    tf_split = {"validation": "dev"}.get(split, split)
    where = f"tfds conll2003:{tf_split}"
    records, info = tfds_split("conll2003", tf_split, **load_kwargs)
    names = list(info.features["ner"].feature.names)
    for name in names:
        _check_tag(name, where)
    out = [NERSentence(tuple(record_text(w) for w in r["tokens"]),
                       to_iob2([names[int(t)] for t in r["ner"]])) for r in records]
    if not out:
        raise DataError(f"{where}: no sentences")
    return out


def label_order(sentences: Sequence[NERSentence]) -> Tuple[str, ...]:
    """The labels, fixed by name: HF_LABELS where the data's tags are among them (so a model
    trained on HF's conll2003 keeps its ids), else "O" then the others sorted by type, B- first."""
    seen = {t for s in sentences for t in s.tags}
    if seen <= set(HF_LABELS):
        return HF_LABELS
    rest = sorted(seen - {"O"}, key=lambda t: (t[2:], t[:2]))
    return ("O",) + tuple(rest)


def remap(id2label: Mapping[int, str], labels: Sequence[str], who: str = "teacher") -> np.ndarray:
    """int [C]: for a model's output index i (its id2label), our label index, by name."""
    index = {name: i for i, name in enumerate(labels)}
    missing = sorted(set(labels) - set(id2label.values()))
    extra = sorted(set(id2label.values()) - set(labels))
    if missing or extra:
        raise DataError(f"the {who}'s id2label does not name the data's labels: missing "
                        f"{missing}, unknown {extra}")
    return np.asarray([index[id2label[i]] for i in range(len(id2label))], np.int32)


@dataclasses.dataclass
class NERFeatures:
    """Rows of token ids with per-token labels: `input_ids`, `labels` int32 [n, T] (IGNORE on
    pieces after a word's first and on special and pad tokens), `attention_mask`; `words_kept`
    int [n], the words of each sentence inside max_len (the others count as predicted O)."""

    input_ids: np.ndarray
    attention_mask: np.ndarray
    labels: np.ndarray
    first_piece: np.ndarray      # int32 [n, T]: word index at a word's first piece, else -1
    words_kept: np.ndarray


def encode_ner(tokenizer, sentences: Sequence[NERSentence], labels: Sequence[str],
               max_len: int = 128) -> NERFeatures:
    """Sentences -> padded rows through the fast tokenizer's word_ids (words given as split:
    a byte-level BPE tokenizer needs add_prefix_space=True, as HF's own NER examples load it)."""
    index = {t: i for i, t in enumerate(labels)}
    n = len(sentences)
    ids = np.full((n, max_len), tokenizer.pad_token_id or 0, np.int32)
    mask = np.zeros((n, max_len), np.int32)
    lab = np.full((n, max_len), IGNORE, np.int32)
    first = np.full((n, max_len), -1, np.int32)
    kept = np.zeros(n, np.int64)
    for k, s in enumerate(sentences):
        enc = tokenizer(list(s.words), is_split_into_words=True, truncation=True,
                        max_length=max_len)
        row = enc["input_ids"]
        ids[k, :len(row)], mask[k, :len(row)] = row, 1
        prev = None
        for t, w in enumerate(enc.word_ids()):
            if w is not None and w != prev:
                lab[k, t], first[k, t] = index[s.tags[w]], w
                kept[k] = w + 1
            prev = w
    return NERFeatures(ids, mask, lab, first, kept)


def word_tags(logits: np.ndarray, features: NERFeatures, sentences: Sequence[NERSentence],
              labels: Sequence[str]) -> List[List[str]]:
    """Per-word predicted tags from per-token logits [n, T, C] at each word's first piece;
    words cut off by max_len are predicted O."""
    best = np.asarray(logits).argmax(-1)
    out = []
    for k, s in enumerate(sentences):
        tags = ["O"] * len(s.words)
        for t in np.nonzero(features.first_piece[k] >= 0)[0]:
            tags[int(features.first_piece[k, t])] = labels[int(best[k, t])]
        out.append(tags)
    return out


def entity_counts(sentences: Sequence[NERSentence]) -> Dict[str, int]:
    """Chunks per type (IOB2 tags: one per B- tag)."""
    counts: Dict[str, int] = {}
    for s in sentences:
        for t in s.tags:
            if t.startswith("B-"):
                counts[t[2:]] = counts.get(t[2:], 0) + 1
    return counts
