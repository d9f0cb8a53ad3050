"""SQuAD v1.1 / v2.0 and CoNLL-2003 NER as a run's data: the tasks whose labels are positions.

    spec = position_tasks.get("squad20")          # None for a GLUE task
    split = position_tasks.load(spec, "train", tokenizer, data_dir=..., max_len=384, ...)
    split.encoded     # rows for the batcher: labels [n, 2] (span) or per token (token)
    split.examples    # the questions / sentences the dev metrics are computed on

Files: `data_dir` holds train.json + dev.json (SQuAD's official JSON) or train.txt + dev.txt
(CoNLL column files); `source="hf"` reads HF `datasets` (`squad`, `squad_v2`, `conll2003`,
online), `source="tfds"` TensorFlow Datasets (`squad/v1.1`, `squad/v2.0`, `conll2003`). A row of a span task is a window of a context (squad.encode_qa); dev rows carry no
labels: the metrics pair each row with its question through `example_id` (the row's index,
carried in the batch) and `features.example_id`.
"""
from __future__ import annotations

import dataclasses
import difflib
import logging
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from jax_tinybert.data import conll, squad
from jax_tinybert.data.tokenize import EncodedDataset, subset_indices
from jax_tinybert.errors import PathError, UserError

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PositionTask:
    """A task whose labels are positions: `head` "span" (start / end token of the answer) or
    "token" (a label per word, on its first piece)."""

    name: str
    head: str
    files: Dict[str, str]          # split -> file name in data_dir
    hf_name: str
    main_metric: str               # of the scorer's dict ("f1")
    version: Optional[str] = None  # SQuAD "1.1" / "2.0"
    max_len: int = 384             # the default row length (configs' task_lengths)

    @property
    def eval_splits(self) -> Tuple[str, ...]:
        return ("dev",)


TASKS: Dict[str, PositionTask] = {t.name: t for t in (
    PositionTask("squad11", "span", {"train": "train.json", "dev": "dev.json"}, "squad", "f1",
                 "1.1"),
    PositionTask("squad20", "span", {"train": "train.json", "dev": "dev.json"}, "squad_v2",
                 "best_f1", "2.0"),
    PositionTask("conll2003", "token", {"train": "train.txt", "dev": "dev.txt"}, "conll2003",
                 "f1", max_len=128),
)}
_ALIASES = {"squad": "squad11", "squad1": "squad11", "squad1.1": "squad11", "squadv1": "squad11",
            "squadv1.1": "squad11", "squad2": "squad20", "squad2.0": "squad20",
            "squadv2": "squad20", "squadv2.0": "squad20", "conll": "conll2003",
            "conll03": "conll2003", "conll-2003": "conll2003"}


def get(name: str) -> Optional[PositionTask]:
    """The position task named (case-insensitive, '_' / '-' ignored, aliases), else None."""
    key = str(name).strip().lower().replace("_", "").replace("-", "")
    key = _ALIASES.get(key, key)
    return TASKS.get(key)


def close_name(name: str) -> Optional[str]:
    """The position task a misspelt name is closest to, for an error message (or None)."""
    key = str(name).strip().lower().replace("_", "").replace("-", "")
    hit = difflib.get_close_matches(key, list(TASKS) + list(_ALIASES), n=1, cutoff=0.75)
    return _ALIASES.get(hit[0], hit[0]) if hit else None


@dataclasses.dataclass
class TokenLabelled(EncodedDataset):
    """An EncodedDataset whose labels are per token: `token_labels` int32 [total_tokens],
    ragged like input_ids; gather pads them with IGNORE into labels [b, T]."""

    token_labels: Optional[np.ndarray] = None

    def gather(self, indices: np.ndarray, seq_len: int) -> Dict[str, np.ndarray]:
        out = super().gather(indices, seq_len)
        lab = np.full((len(indices), seq_len), conll.IGNORE, np.int32)
        for r, i in enumerate(indices):
            s, e = int(self.offsets[i]), int(self.offsets[i + 1])
            lab[r, :e - s] = self.token_labels[s:e]
        out["labels"] = lab
        return out


@dataclasses.dataclass
class Split:
    """One split of a position task: `encoded` (rows for the batcher), `examples` (QAExample
    or NERSentence list), `features` (squad.QAFeatures / conll.NERFeatures), `labels` (NER's
    tag names in label order; None for span tasks)."""

    encoded: EncodedDataset
    examples: List[Any]
    features: Any
    labels: Optional[Tuple[str, ...]] = None


def file_path(spec: PositionTask, split: str, data_dir: str) -> str:
    """data_dir's file of the split, else a one-line error naming it and the fix."""
    if not data_dir:
        raise UserError(f"no data for {spec.name}: set --config.data.data_dir to a folder holding "
                        f"{' + '.join(spec.files.values())}, or use --config.data.source=hf "
                        "(online) or tfds")
    path = os.path.join(data_dir, spec.files[split])
    if not os.path.isfile(path):
        raise PathError(f"{path}: no such file; config.data.data_dir must hold "
                        f"{' + '.join(spec.files.values())} for {spec.name}")
    return path


def _train_file(train_file: str) -> str:
    if not os.path.isfile(train_file):
        raise PathError(f"config.data.train_file={train_file!r}: no such file (relative to "
                        f"{os.getcwd()}); pass a file written by jax_tinybert.data.augment")
    return train_file


def check_files(spec: PositionTask, data_dir: str, train_file: str = "") -> None:
    """The train and dev files a run reads exist, else a one-line PathError and the fix."""
    for split in spec.files:
        if split == "train" and train_file:
            _train_file(train_file)
        else:
            file_path(spec, split, data_dir)


def read(spec: PositionTask, split: str, *, data_dir: str = "", source: str = "tsv",
         ner_column: int = -1, train_file: str = "") -> List[Any]:
    """The split's examples from data_dir's file (source "tsv": files), HF `datasets` ("hf") or
    TFDS ("tfds": squad/v1.1, squad/v2.0, conll2003);
    train_file replaces the train split's file (e.g. data.augment's train_aug.json / .txt)."""
    if split == "train" and train_file:
        if spec.head == "span":
            return squad.read_squad_file(_train_file(train_file), version=spec.version)
        return conll.read_conll(_train_file(train_file), column=-1)
    if source == "hf":
        if spec.head == "span":
            return squad.read_hf_squad(spec.hf_name, split)
        return conll.read_hf_conll(split)
    if source == "tfds":
        if spec.head == "span":
            return squad.read_tfds_squad(spec.version, split)
        return conll.read_tfds_conll(split)
    if source != "tsv":
        raise UserError(f"config.data.source={source!r}: {spec.name} reads files (tsv), HF "
                        "datasets (hf) or TFDS (tfds)")
    path = file_path(spec, split, data_dir)
    if spec.head == "span":
        return squad.read_squad_file(path, version=spec.version)
    return conll.read_conll(path, column=ner_column)


def _ragged(features: conll.NERFeatures, pad_id: int) -> TokenLabelled:
    lens = features.attention_mask.sum(1).astype(np.int64)
    keep = np.arange(features.input_ids.shape[1])[None] < lens[:, None]
    offsets = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    return TokenLabelled(features.input_ids[keep].astype(np.int32),
                         np.zeros(int(offsets[-1]), np.int8), offsets, None, pad_id,
                         token_labels=features.labels[keep].astype(np.int32))


def load(spec: PositionTask, split: str, tokenizer, *, data_dir: str = "", source: str = "tsv",
         max_len: int = 384, doc_stride: int = 128, max_query_len: int = 64,
         ner_column: int = -1, labels: Optional[Sequence[str]] = None, subset: int = 0,
         subset_seed: int = 0, train_file: str = "") -> Split:
    """One split read and encoded with a fast HF `tokenizer`. subset > 0: that many examples
    (questions / sentences) drawn with a seeded shuffle before encoding. labels (token tasks):
    the label order (default: the train file's, `conll.label_order`); train rows carry labels,
    dev rows of span tasks do not (the scorer reads the examples)."""
    examples = read(spec, split, data_dir=data_dir, source=source, ner_column=ner_column,
                    train_file=train_file)
    idx = subset_indices(len(examples), subset, subset_seed)
    if idx is not None:
        examples = [examples[i] for i in idx]
    if not examples:
        raise UserError(f"{spec.name} {split}: no examples in {data_dir or spec.hf_name}")
    if spec.head == "span":
        feats = squad.encode_qa(tokenizer, examples, max_len=max_len, doc_stride=doc_stride,
                                max_query_len=max_query_len, train=split == "train")
        log.info("%s %s: %d questions in %d windows of <= %d tokens", spec.name, split,
                 len(examples), len(feats), max_len)
        return Split(feats.encoded, examples, feats)
    labels = tuple(labels or conll.label_order(examples))
    unknown = sorted({t for s in examples for t in s.tags} - set(labels))
    if unknown:
        raise UserError(f"{spec.name} {split}: tags {unknown} are not among the train set's "
                        f"labels {list(labels)}")
    feats = conll.encode_ner(tokenizer, examples, labels, max_len=max_len)
    cut = int(np.sum(feats.words_kept < np.array([len(s.words) for s in examples])))
    log.info("%s %s: %d sentences (%d cut to %d tokens)", spec.name, split, len(examples), cut,
             max_len)
    return Split(_ragged(feats, tokenizer.pad_token_id or 0), examples, feats, labels)
