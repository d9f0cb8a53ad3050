"""SQuAD v1.1 / v2.0: readers (official JSON files, HF `datasets`) and the windowing of contexts
into model rows, as HF's run_qa does it.

Every reader returns the same `QAExample` list: id, title, context, question, every gold answer
(texts and char starts; dev files keep every annotator's answer) and `is_impossible` (v2.0).
Bad records raise a one-line `glue.DataError` naming the file and the question id.

`encode_qa` turns examples into windows (rows): the question cut to `max_query_len` tokens, the
context cut into windows of at most `max_len` tokens in all, consecutive windows overlapping by
`doc_stride` tokens (the HF tokenizers' `stride`, which run_qa's `--doc_stride` sets), laid out
with the tokenizer's own special tokens (`[CLS] q [SEP] c [SEP]`; RoBERTa `<s> q </s></s> c </s>`).
A row keeps the char offsets of its context tokens, so a span of tokens maps back to the text.
"""
from __future__ import annotations

import dataclasses
import io
import json
import logging
from typing import List, Optional, Sequence, Tuple

import numpy as np

from jax_tinybert import fs
from jax_tinybert.data.glue import DataError, tfds_split, record_text
from jax_tinybert.data.tokenize import EncodedDataset
from jax_tinybert.progress import Progress

log = logging.getLogger(__name__)

# HF `datasets` names -> SQuAD version.
HF_NAMES = {"squad": "1.1", "squad_v2": "2.0"}
HF_SPLITS = {"train": "train", "dev": "validation", "validation": "validation"}


@dataclasses.dataclass(frozen=True)
class QAExample:
    """One question. `answers[i]` starts at char `answer_starts[i]` of `context`; v2.0 impossible
    questions have no answers."""

    id: str
    title: str
    context: str
    question: str
    answers: Tuple[str, ...]
    answer_starts: Tuple[int, ...]
    is_impossible: bool = False


def _checked(qid: str, title: str, context: str, question, answers, starts, impossible: bool,
             v2: bool, where: str) -> QAExample:
    """A QAExample, or DataError naming `where` and the question id."""
    at = f"{where}: question {qid!r}"
    if not isinstance(question, str) or not question.strip():
        raise DataError(f"{at}: empty or missing 'question'")
    if len(answers) != len(starts):
        raise DataError(f"{at}: {len(answers)} answer texts but {len(starts)} answer_start values")
    if impossible and not v2:
        raise DataError(f"{at}: is_impossible=true in a SQuAD v1.1 file; read it as v2.0")
    if impossible and answers:
        raise DataError(f"{at}: is_impossible=true but {len(answers)} answers; an unanswerable "
                        "question has an empty 'answers' list")
    if not impossible and not answers:
        raise DataError(f"{at}: no answers" + (" and is_impossible is false" if v2 else
                                               " (a SQuAD v1.1 question needs one)"))
    for text, start in zip(answers, starts):
        if not isinstance(text, str) or not text or not isinstance(start, int) or start < 0:
            raise DataError(f"{at}: bad answer {{'text': {text!r}, 'answer_start': {start!r}}}")
        if context[start:start + len(text)] != text:
            raise DataError(f"{at}: answer {text!r} is not at answer_start={start} of its context "
                            f"(found {context[start:start + len(text)]!r}); fix answer_start")
    return QAExample(str(qid), title, context, question, tuple(answers), tuple(starts),
                     bool(impossible))


def _field(d, key: str, where: str):
    if not isinstance(d, dict) or key not in d:
        raise DataError(f"{where}: missing field {key!r} (official SQuAD JSON: data[].paragraphs[]"
                        ".{context, qas[].{id, question, answers[].{text, answer_start}}})")
    return d[key]


def _file_version(doc, path: str, version: Optional[str]) -> bool:
    """True for v2.0 (from `version`, else the file's "version" field, else is_impossible keys)."""
    v = version or str(doc.get("version", "")) if isinstance(doc, dict) else version
    v = str(v or "").lstrip("v")
    if v.startswith("2"):
        return True
    if v.startswith("1"):
        return False
    text = json.dumps(doc.get("data", [])[:3]) if isinstance(doc, dict) else ""
    return '"is_impossible"' in text


def read_squad_file(path: str, *, version: Optional[str] = None) -> List[QAExample]:
    """The questions of an official SQuAD JSON file (v1.1 or v2.0: `version` "1.1"/"2.0", default
    the file's own "version" field). Raises DataError naming the file and the question id."""
    if not fs.isfile(path):
        raise DataError(f"{path}: file not found (expected an official SQuAD JSON file, e.g. "
                        "dev-v1.1.json)")
    with fs.open_file(path, "rb") as f:
        try:
            doc = json.loads(f.read().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataError(f"{path}: not a UTF-8 JSON document ({e})") from None
    v2 = _file_version(doc, path, version)
    out, seen = [], set()
    for ai, article in enumerate(_field(doc, "data", path)):
        title = str(article.get("title", "")) if isinstance(article, dict) else ""
        for pi, para in enumerate(_field(article, "paragraphs", f"{path}: data[{ai}]")):
            where = f"{path}: data[{ai}].paragraphs[{pi}]"
            context = _field(para, "context", where)
            if not isinstance(context, str) or not context:
                raise DataError(f"{where}: empty or missing 'context'")
            for qi, qa in enumerate(_field(para, "qas", where)):
                qid = _field(qa, "id", f"{where}.qas[{qi}]")
                if qid in seen:
                    raise DataError(f"{path}: question {qid!r}: duplicate id")
                seen.add(qid)
                answers = _field(qa, "answers", f"{path}: question {qid!r}")
                texts = [_field(a, "text", f"{path}: question {qid!r}") for a in answers]
                starts = [_field(a, "answer_start", f"{path}: question {qid!r}") for a in answers]
                imp = qa.get("is_impossible", False)
                out.append(_checked(qid, title, context, _field(qa, "question", f"{path}: "
                                    f"question {qid!r}"), texts, starts, bool(imp), v2, path))
    if not out:
        raise DataError(f"{path}: no questions read")
    return out


def read_hf_squad(name: str, split: str, **load_kwargs) -> List[QAExample]:
    """`datasets.load_dataset(name, split=...)` for name in {"squad", "squad_v2"} (online or a
    local HF cache); split "train" or "dev"/"validation". Same checks as read_squad_file."""
    if name not in HF_NAMES:
        raise ValueError(f"unknown HF SQuAD dataset {name!r}; expected one of {sorted(HF_NAMES)}")
    try:
        import datasets  # noqa: F401  (optional dependency)
    except ImportError as e:
        raise ImportError("source='hf' needs the `datasets` package: pip install datasets (or read "
                          "the official JSON files with read_squad_file)") from e
    hf_split = HF_SPLITS.get(split, split)
    try:
        ds = datasets.load_dataset(name, split=hf_split, **load_kwargs)
    except Exception as e:  # offline, no cache, ...
        raise DataError(f"could not load HF dataset {name} split {hf_split}: {e} (offline? read "
                        "the official JSON files with read_squad_file)") from e
    return _from_records(ds, f"hf {name}:{hf_split}", HF_NAMES[name] == "2.0")


def _from_records(records, where: str, v2: bool) -> List[QAExample]:
    """HF / TFDS SQuAD records (str or bytes fields) -> checked QAExamples; an unanswerable
    v2.0 question has no answers."""
    out = []
    for r in records:
        texts = [record_text(t) for t in r["answers"]["text"]]
        starts = [int(x) for x in r["answers"]["answer_start"]]
        qid, title, context, question = (record_text(r.get(k, "")) for k in
                                         ("id", "title", "context", "question"))
        out.append(_checked(qid, title, context, question, texts, starts, v2 and not texts, v2,
                            where))
    if not out:
        raise DataError(f"{where}: no examples")
    return out


TFDS_NAMES = {"1.1": "squad/v1.1", "2.0": "squad/v2.0"}


def read_tfds_squad(version: str, split: str, **load_kwargs) -> List[QAExample]:
    """TFDS `squad/v1.1` or `squad/v2.0` (its local data_dir, or downloaded); split "train" or
    "dev"/"validation". Same checks as read_squad_file (an unanswerable v2.0 question: no
    answers)."""
    name, tf_split = TFDS_NAMES[version], HF_SPLITS.get(split, split)
    records, _ = tfds_split(name, tf_split, **load_kwargs)
    return _from_records(records, f"tfds {name}:{tf_split}", version == "2.0")


@dataclasses.dataclass
class QAFeatures:
    """Windows of SQuAD examples, ragged like tokenize.EncodedDataset (which holds the ids).

    `encoded.labels`: int32 [n, 2] (start, end token positions in the row; (0, 0) = [CLS] when
    the window does not hold the whole first answer or the question has none) or None (eval).
    `char_offsets`: int32 [total_tokens, 2], the [start, end) chars of each context token in its
    example's context, (-1, -1) on question and special tokens. `example_id`: int64 [n], the
    index of each row's example in the list given to encode_qa.
    """

    encoded: EncodedDataset
    char_offsets: np.ndarray
    example_id: np.ndarray
    num_truncated_questions: int = 0

    def __len__(self) -> int:
        return len(self.encoded)

    def row_offsets(self, i: int) -> np.ndarray:
        """int32 [len_i, 2] char offsets of row i's tokens ((-1, -1) outside the context)."""
        o = self.encoded.offsets
        return self.char_offsets[o[i]:o[i + 1]]

    def save_npz(self, path: str) -> None:
        """Atomic write of all arrays (temp file, then rename)."""
        e = self.encoded
        arrays = dict(input_ids=e.input_ids, token_type_ids=e.token_type_ids, offsets=e.offsets,
                      pad_id=np.int64(e.pad_id), char_offsets=self.char_offsets,
                      example_id=self.example_id,
                      num_truncated_questions=np.int64(self.num_truncated_questions))
        if e.labels is not None:
            arrays["labels"] = e.labels
        with fs.atomic_open(path, "wb") as f:
            np.savez(f, **arrays)

    @classmethod
    def load_npz(cls, path: str) -> "QAFeatures":
        with fs.open_file(path, "rb") as fh, np.load(io.BytesIO(fh.read())) as z:
            enc = EncodedDataset(z["input_ids"], z["token_type_ids"], z["offsets"],
                                 z["labels"] if "labels" in z.files else None, int(z["pad_id"]))
            return cls(enc, z["char_offsets"], z["example_id"], int(z["num_truncated_questions"]))


def pair_template(tokenizer) -> List[Tuple[str, int, int]]:
    """The tokenizer's layout of a pair: a list of ("special", token_id, type_id) and ("seq",
    0 | 1, type_id), e.g. BERT [special 101 0, seq 0 0, special 102 0, seq 1 1, special 102 1].
    From `build_inputs_with_special_tokens` on sentinel ids (RoBERTa `<s> q </s></s> c </s>`);
    token types from the tokenizer where it has them, else 0."""
    q, c = -1, -2   # sentinels: no vocabulary holds negative ids
    ids = list(tokenizer.build_inputs_with_special_tokens([q], [c]))
    if len(ids) - 2 != tokenizer.num_special_tokens_to_add(pair=True) or ids.count(q) != 1 \
            or ids.count(c) != 1 or ids.index(q) > ids.index(c):
        raise ValueError(f"{type(tokenizer).__name__}: pair layout {ids} does not put the "
                         "question once before the context; question-first tokenizers only")
    types = [0] * len(ids)
    if "token_type_ids" in tokenizer.model_input_names:
        types = list(tokenizer.create_token_type_ids_from_sequences([q], [c]))
    return [("seq", 0 if t == q else 1, int(tt)) if t in (q, c) else ("special", int(t), int(tt))
            for t, tt in zip(ids, types)]


def window_starts(n_tokens: int, budget: int, doc_stride: int) -> List[int]:
    """First context token of each window: windows of `budget` tokens, overlapping by
    `doc_stride`, the last one reaching the end (HF tokenizers' overflow with `stride`)."""
    if budget <= doc_stride:
        raise DataError(f"a window has room for {budget} context tokens, not more than "
                        f"config.data.doc_stride={doc_stride}; raise config.data.max_len or lower "
                        "config.data.doc_stride / max_query_len")
    starts, s = [0], 0
    while s + budget < n_tokens:
        s += budget - doc_stride
        starts.append(s)
    return starts


def answer_positions(offsets: np.ndarray, start_char: int, end_char: int) -> Optional[Tuple[int, int]]:
    """(first, last) index into `offsets` (int [k, 2] char spans of a window's context tokens)
    of the tokens covering chars [start_char, end_char), or None when the window does not hold
    them all (run_qa's rule: the last token starting at or before start_char, the first token
    ending at or after end_char)."""
    if len(offsets) == 0 or offsets[0, 0] > start_char or offsets[-1, 1] < end_char:
        return None
    s = int(np.searchsorted(offsets[:, 0], start_char, side="right")) - 1
    e = int(np.searchsorted(offsets[:, 1], end_char, side="left"))
    return s, e


def _tokenize(tokenizer, texts: Sequence[str], offsets: bool, batch_size: int):
    ids, offs = [], []
    for s in range(0, len(texts), batch_size):
        enc = tokenizer(list(texts[s:s + batch_size]), add_special_tokens=False,
                        return_attention_mask=False, return_token_type_ids=False,
                        return_offsets_mapping=offsets, verbose=False)
        ids += enc["input_ids"]
        if offsets:
            offs += [np.asarray(o, np.int32).reshape(-1, 2) for o in enc["offset_mapping"]]
    return ids, offs


class _Rows:
    """Accumulates windows; `add` lays one out by the template."""

    def __init__(self, template):
        self.template = template
        self.ids, self.types, self.offs, self.lens = [], [], [], []
        self.example_id, self.labels = [], []

    def add(self, q: List[int], c: List[int], c_offs: np.ndarray, ex: int, label) -> int:
        """Appends one row; returns the row position of its first context token."""
        ids, types, offs, ctx_pos = [], [], [], 0
        for kind, v, tt in self.template:
            if kind == "special":
                ids.append(v)
                types.append(tt)
                offs.append(np.full((1, 2), -1, np.int32))
                continue
            seq = q if v == 0 else c
            if v == 1:
                ctx_pos = len(ids)
            ids += seq
            types += [tt] * len(seq)
            offs.append(c_offs if v == 1 else np.full((len(seq), 2), -1, np.int32))
        self.ids.append(np.asarray(ids, np.int32))
        self.types.append(np.asarray(types, np.int8))
        self.offs.append(np.concatenate(offs))
        self.lens.append(len(ids))
        self.example_id.append(ex)
        self.labels.append(label)
        return ctx_pos


def encode_qa(tokenizer, examples: Sequence[QAExample], *, max_len: int = 384,
              doc_stride: int = 128, max_query_len: int = 64, train: bool = True,
              batch_size: int = 1024) -> QAFeatures:
    """Windows of `examples` (see the module docstring) with a fast HF tokenizer. `train`: label
    each window with the token span of the first gold answer ((0, 0) when the window does not
    hold all of it, or the question is unanswerable), as run_qa's prepare_train_features."""
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("encode_qa needs a fast (Rust) tokenizer for char offsets")
    template = pair_template(tokenizer)
    n_special = sum(1 for t in template if t[0] == "special")
    # run_qa strips questions' leading whitespace (some SQuAD questions have it; RoBERTa's
    # byte-level BPE would keep it as a token).
    q_ids, _ = _tokenize(tokenizer, [e.question.lstrip() for e in examples], False, batch_size)
    contexts = list(dict.fromkeys(e.context for e in examples))  # many questions per context
    c_index = {c: i for i, c in enumerate(contexts)}
    c_ids, c_offs = _tokenize(tokenizer, contexts, True, batch_size)
    rows, cut = _Rows(template), 0
    prog = Progress("window SQuAD", total=len(examples), unit="ex")
    for ei, ex in enumerate(examples):
        q = q_ids[ei][:max_query_len]
        cut += len(q_ids[ei]) > max_query_len
        ci = c_index[ex.context]
        ids, offs = c_ids[ci], c_offs[ci]
        budget = max_len - len(q) - n_special
        span = None
        if train and ex.answers:
            span = (ex.answer_starts[0], ex.answer_starts[0] + len(ex.answers[0]))
        for s in window_starts(len(ids), budget, doc_stride):
            w_offs = offs[s:s + budget]
            pos = answer_positions(w_offs, *span) if span else None
            ctx_pos = rows.add(q, ids[s:s + budget], w_offs, ei, pos)
            if pos is not None:
                rows.labels[-1] = (pos[0] + ctx_pos, pos[1] + ctx_pos)
        prog.update(1)
    prog.close()
    if cut:
        log.info("cut %d of %d questions to max_query_len=%d tokens", cut, len(examples),
                 max_query_len)
    offsets = np.zeros(len(rows.lens) + 1, np.int64)
    np.cumsum(rows.lens, out=offsets[1:])
    labels = None
    if train:
        labels = np.asarray([lab if lab is not None else (0, 0) for lab in rows.labels],
                            np.int32).reshape(-1, 2)
    enc = EncodedDataset(np.concatenate(rows.ids) if rows.ids else np.zeros(0, np.int32),
                         np.concatenate(rows.types) if rows.types else np.zeros(0, np.int8),
                         offsets, labels, tokenizer.pad_token_id or 0)
    char_offsets = np.concatenate(rows.offs) if rows.offs else np.zeros((0, 2), np.int32)
    return QAFeatures(enc, char_offsets.astype(np.int32), np.asarray(rows.example_id, np.int64),
                      cut)
