"""The nine GLUE tasks: specs, and readers for GLUE TSV folders, HF `datasets` and TFDS.

Every reader returns the same `Example` list for the same task and split: text fields are
strings, `label` is an int index into `TaskSpec.labels` (classification) or a float
(regression, STS-B). Label ids follow the order of the labels as written in GLUE's own files
(MNLI: contradiction, entailment, neutral), which is also what the official BERT/TinyBERT
processors use, so a teacher fine-tuned with the official code keeps its label order.
"""
from __future__ import annotations

import csv
import dataclasses
import difflib
import logging
import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple, Union

from jax_tinybert import fs
from jax_tinybert.errors import PathError, UserError

log = logging.getLogger(__name__)

# GLUE's MNLI/QQP rows can exceed csv's default 128 KiB field limit.
csv.field_size_limit(min(sys.maxsize, 2**31 - 1))


class DataError(UserError, ValueError):
    """Bad input data: the message names the file, the line and what was expected."""


class UnknownTaskError(UserError, KeyError):
    """A task name that is not one of the nine GLUE tasks (or their aliases)."""

    def __str__(self):  # KeyError's str() would quote the message
        return str(self.args[0])


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """Static description of a GLUE task.

    `text_a_col` / `text_b_col` / `label_col`: column indices in GLUE's TSV rows (negative =
    from the end, as GLUE's MNLI/QNLI/RTE rows put the gold label last). `num_columns`: columns a
    row must have per split ("*" = any split not listed); None = as many as the header.
    `splits`: split name -> TSV file stem. `hf_fields`: (text_a, text_b) field names in HF/TFDS.
    `hf_labels`: HF/TFDS ClassLabel names in their index order (None when ids already match ours).
    `metrics`: metric names for `jax_tinybert.train.metrics.compute`; `main_metric`: the one used for
    model selection.
    """

    name: str
    dir_name: str
    text_a_col: int
    text_b_col: Optional[int]
    label_col: int
    labels: Optional[Tuple[str, ...]]  # None = regression
    has_header: bool
    splits: Dict[str, str]
    hf_name: str
    hf_fields: Tuple[str, Optional[str]]
    hf_splits: Dict[str, str]
    metrics: Tuple[str, ...]
    main_metric: str
    hf_labels: Optional[Tuple[str, ...]] = None
    num_columns: Optional[Dict[str, int]] = None

    @property
    def num_labels(self) -> int:
        return 1 if self.labels is None else len(self.labels)

    @property
    def is_regression(self) -> bool:
        return self.labels is None

    @property
    def is_pair(self) -> bool:
        return self.text_b_col is not None

    @property
    def eval_splits(self) -> Tuple[str, ...]:
        return tuple(s for s in self.splits if s.startswith("dev"))


_DEV = {"train": "train", "dev": "dev"}
_HF_DEV = {"train": "train", "dev": "validation", "test": "test"}

TASKS: Dict[str, TaskSpec] = {
    "cola": TaskSpec("cola", "CoLA", 3, None, 1, ("0", "1"), False, _DEV, "cola",
                     ("sentence", None), _HF_DEV, ("mcc", "acc"), "mcc",
                     num_columns={"*": 4}),
    "sst-2": TaskSpec("sst-2", "SST-2", 0, None, 1, ("0", "1"), True, _DEV, "sst2",
                      ("sentence", None), _HF_DEV, ("acc",), "acc"),
    "mrpc": TaskSpec("mrpc", "MRPC", 3, 4, 0, ("0", "1"), True, _DEV, "mrpc",
                     ("sentence1", "sentence2"), _HF_DEV, ("acc", "f1", "acc_and_f1"),
                     "acc_and_f1"),
    "sts-b": TaskSpec("sts-b", "STS-B", 7, 8, -1, None, True, _DEV, "stsb",
                      ("sentence1", "sentence2"), _HF_DEV, ("pearson", "spearman", "corr"),
                      "corr"),
    "qqp": TaskSpec("qqp", "QQP", 3, 4, 5, ("0", "1"), True, _DEV, "qqp",
                    ("question1", "question2"), _HF_DEV, ("acc", "f1", "acc_and_f1"),
                    "acc_and_f1"),
    # MNLI: matched and mismatched dev sets are distinct splits. (The official TinyBERT
    # script evaluates both into one variable and the second overwrites the first.)
    "mnli": TaskSpec("mnli", "MNLI", 8, 9, -1, ("contradiction", "entailment", "neutral"), True,
                     {"train": "train", "dev_matched": "dev_matched",
                      "dev_mismatched": "dev_mismatched"}, "mnli",
                     ("premise", "hypothesis"),
                     {"train": "train", "dev_matched": "validation_matched",
                      "dev_mismatched": "validation_mismatched"}, ("acc",), "acc",
                     hf_labels=("entailment", "neutral", "contradiction")),
    "qnli": TaskSpec("qnli", "QNLI", 1, 2, -1, ("entailment", "not_entailment"), True, _DEV,
                     "qnli", ("question", "sentence"), _HF_DEV, ("acc",), "acc",
                     hf_labels=("entailment", "not_entailment")),
    "rte": TaskSpec("rte", "RTE", 1, 2, -1, ("entailment", "not_entailment"), True, _DEV, "rte",
                    ("sentence1", "sentence2"), _HF_DEV, ("acc",), "acc",
                    hf_labels=("entailment", "not_entailment")),
    "wnli": TaskSpec("wnli", "WNLI", 1, 2, -1, ("0", "1"), True, _DEV, "wnli",
                     ("sentence1", "sentence2"), _HF_DEV, ("acc",), "acc"),
}

_ALIASES = {
    "sst2": "sst-2", "sst": "sst-2", "stsb": "sts-b", "sts": "sts-b",
    "mnli-m": "mnli", "mnli_m": "mnli", "mnli-mm": "mnli", "mnli_mm": "mnli",
}


def get_task(name: Union[str, TaskSpec]) -> TaskSpec:
    """Task lookup, case-insensitive, with aliases (sst2, SST-2, stsb, sts_b, ...)."""
    if isinstance(name, TaskSpec):
        return name
    key = str(name).strip().lower().replace("_", "-")
    key = _ALIASES.get(key, _ALIASES.get(key.replace("-", ""), key))
    if key not in TASKS:
        close = difflib.get_close_matches(key, list(TASKS) + list(_ALIASES), n=1, cutoff=0.6)
        raise UnknownTaskError(
            f"unknown GLUE task {name!r}"
            + (f" (did you mean {TASKS[_ALIASES.get(close[0], close[0])].dir_name}?)" if close else "")
            + f"; valid: {', '.join(d.dir_name for d in TASKS.values())}"
            f" (case-insensitive; aliases: {', '.join(sorted(_ALIASES))})")
    return TASKS[key]


def _split_name(spec: TaskSpec, split: str) -> str:
    s = split.strip().lower().replace("-", "_")
    if s in ("validation", "eval", "val"):
        s = "dev"
    if s in ("validation_matched",):
        s = "dev_matched"
    if s in ("validation_mismatched",):
        s = "dev_mismatched"
    if s == "dev" and "dev" not in spec.splits:  # MNLI: "dev" means matched
        s = "dev_matched"
    if s not in spec.splits and s != "test":
        raise KeyError(f"task {spec.dir_name} has no split {split!r}; valid: {sorted(spec.splits)}")
    return s


@dataclasses.dataclass(frozen=True)
class Example:
    """One GLUE row. `label`: class index into TaskSpec.labels, float (STS-B), or None (test)."""

    guid: str
    text_a: str
    text_b: Optional[str]
    label: Union[int, float, None]


def _parse_label(spec: TaskSpec, raw: str, where: str):
    if spec.is_regression:
        try:
            v = float(raw)
        except ValueError:
            raise DataError(f"{where}: label {raw!r} is not a number (STS-B scores are floats "
                            f"in [0, 5])") from None
        if v != v:  # NaN
            raise DataError(f"{where}: label is NaN")
        return v
    try:
        return spec.labels.index(raw.strip())
    except ValueError:
        raise DataError(f"{where}: unknown label {raw!r}; expected one of {list(spec.labels)}"
                        ) from None


def _tsv_rows(path: str):
    """(1-based line number, row) per line of a GLUE TSV; row is a list of fields, or a
    DataError for a line that is not UTF-8 (so `skip_bad_rows` can skip it)."""
    with fs.open_file(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):  # GLUE's MRPC files have a BOM
                raw = raw[3:]
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield lineno, DataError(
                    f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column "
                    f"{e.start + 1}); re-save the file as UTF-8, or set "
                    "--config.data.skip_bad_rows=True to skip such rows")
                continue
            # QUOTE_NONE, as the official processors: a line is one row.
            try:
                yield lineno, next(csv.reader([text], delimiter="\t", quoting=csv.QUOTE_NONE), [])
            except csv.Error as e:
                yield lineno, DataError(f"{path}:{lineno}: {e}; fix the line, or set "
                                        "--config.data.skip_bad_rows=True to skip such rows")


def read_tsv_split(task, split: str, path: str, *, skip_bad_rows: bool = False,
                   with_labels: Optional[bool] = None) -> List[Example]:
    """Reads one GLUE TSV file. Rows are tab-separated with no quoting (csv.QUOTE_NONE, like the
    official processors: MRPC/STS-B sentences contain unbalanced double quotes).

    Raises DataError naming the file and 1-based line for: wrong column count, unknown or
    unparsable label, empty sentence. With `skip_bad_rows=True` those rows are skipped, counted
    and logged instead.
    """
    spec = get_task(task)
    if with_labels is None:
        with_labels = split != "test"
    if not fs.isfile(path):
        raise DataError(f"{spec.dir_name} {split}: file not found: {path} (expected the GLUE "
                        f"folder layout <glue_dir>/{spec.dir_name}/<split>.tsv)")
    examples: List[Example] = []
    bad: List[str] = []
    ncols = None
    if spec.num_columns:
        ncols = spec.num_columns.get(split, spec.num_columns.get("*"))
    for lineno, row in _tsv_rows(path):
        if lineno == 1 and spec.has_header:
            if ncols is None and not isinstance(row, DataError):
                ncols = len(row)
            continue
        where = f"{path}:{lineno}"
        try:
            if isinstance(row, DataError):
                raise row
            if ncols is not None and len(row) != ncols:
                raise DataError(f"{where}: expected {ncols} tab-separated columns for "
                                f"{spec.dir_name} {split}, got {len(row)}")
            a = row[spec.text_a_col]
            b = row[spec.text_b_col] if spec.is_pair else None
            if not a.strip() or (b is not None and not b.strip()):
                raise DataError(f"{where}: empty sentence (column "
                                f"{spec.text_a_col if not a.strip() else spec.text_b_col})")
            label = _parse_label(spec, row[spec.label_col], where) if with_labels else None
        except DataError as e:
            if not skip_bad_rows:
                raise
            bad.append(str(e))
            continue
        examples.append(Example(f"{split}-{lineno}", a, b, label))
    if bad:
        log.warning("%s: skipped %d bad rows (first: %s)", path, len(bad), bad[0])
    if not examples:
        raise DataError(f"{path}: no examples read")
    return examples


def tsv_path(glue_dir: str, task, split: str) -> str:
    """<glue_dir>/<TaskDir>/<split>.tsv (MNLI dev splits: dev_matched.tsv / dev_mismatched.tsv)."""
    spec = get_task(task)
    s = _split_name(spec, split)
    return fs.join(glue_dir, spec.dir_name, spec.splits.get(s, s) + ".tsv")


def _from_records(spec: TaskSpec, split: str, records, source: str) -> List[Example]:
    fa, fb = spec.hf_fields
    out = []
    for i, r in enumerate(records):
        a = record_text(r[fa])
        b = record_text(r[fb]) if fb else None
        lab = r.get("label", -1)
        lab = lab.item() if hasattr(lab, "item") else lab
        if split == "test" or lab == -1:
            label = None
        elif spec.is_regression:
            label = float(lab)
        elif spec.hf_labels is not None:
            label = spec.labels.index(spec.hf_labels[int(lab)])
        else:
            label = int(lab)
        out.append(Example(f"{split}-{i}", a, b, label))
    if not out:
        raise DataError(f"{source}: no examples")
    return out


def read_hf_split(task, split: str, **load_kwargs) -> List[Example]:
    """Reads `glue/<task>` through Hugging Face `datasets` (needs the package and the hub or a
    local HF cache). Label ids are mapped to this module's order."""
    spec = get_task(task)
    s = _split_name(spec, split)
    try:
        import datasets  # noqa: F401  (optional dependency)
    except ImportError as e:
        raise ImportError("source='hf' needs the `datasets` package: pip install datasets "
                          "(or use source='tsv' with a GLUE folder)") from e
    hf_split = spec.hf_splits.get(s, s)
    try:
        ds = datasets.load_dataset("glue", spec.hf_name, split=hf_split, **load_kwargs)
    except Exception as e:  # offline, no cache, ...
        raise DataError(f"could not load HF dataset glue/{spec.hf_name} split {hf_split}: {e} "
                        f"(offline? use source='tsv' with a GLUE folder)") from e
    return _from_records(spec, s, ds, f"hf glue/{spec.hf_name}:{hf_split}")


def tfds_split(name: str, split: str, **load_kwargs):
    """(records as NumPy dicts, the dataset's tfds info) of TFDS `name`'s `split` (its local
    data_dir, or downloaded); a missing package or dataset is one line naming it."""
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise ImportError("source='tfds' needs tensorflow-datasets (and tensorflow): "
                          "pip install tensorflow-datasets") from e
    try:
        ds, info = tfds.load(name, split=split, with_info=True, **load_kwargs)
        return tfds.as_numpy(ds), info
    except Exception as e:
        raise DataError(f"could not load TFDS {name} split {split}: {e}") from e


def record_text(x) -> str:
    """A text field of an HF or TFDS record as str (TFDS gives bytes under as_numpy)."""
    return x.decode("utf-8") if isinstance(x, bytes) else str(x)


def read_tfds_split(task, split: str, **load_kwargs) -> List[Example]:
    """Reads `glue/<task>` through TensorFlow Datasets. Label ids mapped to this module's order."""
    spec = get_task(task)
    s = _split_name(spec, split)
    tf_split = spec.hf_splits.get(s, s)
    records, _ = tfds_split(f"glue/{spec.hf_name}", tf_split, **load_kwargs)
    return _from_records(spec, s, records, f"tfds glue/{spec.hf_name}:{tf_split}")


def load_examples(task, split: str, *, source: str = "tsv", glue_dir: Optional[str] = None,
                  path: Optional[str] = None, skip_bad_rows: bool = False) -> List[Example]:
    """Examples of one task split from `source` in {"tsv", "hf", "tfds"}.

    For "tsv", give `glue_dir` (GLUE layout) or an explicit `path` (e.g. an augmented
    `train_aug.tsv`).
    """
    spec = get_task(task)
    if source == "tsv":
        if path is None and _split_name(spec, split) == "test":
            raise ValueError("GLUE test TSVs have no labels and other columns; only train/dev "
                             "splits (or an explicit path in the train layout) are read")
        if path is None:
            if glue_dir is None:
                raise ValueError("source='tsv' needs glue_dir or path")
            path = tsv_path(glue_dir, spec, split)
        return read_tsv_split(spec, _split_name(spec, split), path, skip_bad_rows=skip_bad_rows)
    if source == "hf":
        return read_hf_split(spec, split)
    if source == "tfds":
        return read_tfds_split(spec, split)
    raise ValueError(f"unknown source {source!r}; expected 'tsv', 'hf' or 'tfds'")


def label_counts(spec: TaskSpec, examples: Sequence[Example]) -> Dict[str, int]:
    """Label name -> count (classification tasks)."""
    counts = {l: 0 for l in spec.labels}
    for e in examples:
        counts[spec.labels[e.label]] += 1
    return counts


def check_files(spec: TaskSpec, glue_dir: str, train_file: str = "") -> None:
    """The task's train and dev TSVs exist under glue_dir (default $GLUE_DIR), else a one-line
    PathError naming the file or folder and the fix; train_file replaces train.tsv."""
    field = "--config.data.glue_dir" if glue_dir else "$GLUE_DIR"
    glue_dir = glue_dir or os.environ.get("GLUE_DIR", "")
    if not glue_dir:
        raise PathError(
            f"no GLUE data for {spec.dir_name}: set GLUE_DIR or --config.data.glue_dir to a "
            f"folder holding {spec.dir_name}/train.tsv and {spec.dir_name}/dev.tsv (e.g. "
            "--config.data.glue_dir=../shared/data/glue), or use --config.data.source=hf "
            "(online)")
    if not os.path.isdir(glue_dir):
        raise PathError(f"{field}={glue_dir}: no such folder (relative to {os.getcwd()}); "
                        f"pass the folder holding {spec.dir_name}/train.tsv")
    for split in ("train", spec.eval_splits[0]):
        f = train_file if split == "train" and train_file else tsv_path(glue_dir, spec, split)
        if not os.path.isfile(f):
            raise PathError(f"{f}: no such file; {field}={glue_dir} must hold the GLUE "
                            f"layout <glue_dir>/{spec.dir_name}/<split>.tsv"
                            if f != train_file else
                            f"config.data.train_file={f!r}: no such file (relative to "
                            f"{os.getcwd()}); pass a TSV in the task's train.tsv format")
