"""GLUE metrics on the host (numpy), matching scikit-learn / SciPy.

Model selection uses one number per task (`main_metric`):
CoLA mcc; SST-2/MNLI/QNLI/RTE/WNLI acc; MRPC/QQP `acc_and_f1` = (acc + F1) / 2 (as HF run_glue
reports; the official TinyBERT script selects MRPC on acc alone); STS-B `corr` =
(Pearson + Spearman) / 2. MNLI's score is the matched dev accuracy; mismatched is reported aside.
"""
from __future__ import annotations

from typing import Dict, Iterable, Sequence, Union

import numpy as np

from jax_tinybert.data.glue import get_task


def _as_class(preds: np.ndarray) -> np.ndarray:
    """Logits [n, C] -> argmax ids [n]; ids [n] pass through."""
    preds = np.asarray(preds)
    return preds.argmax(-1) if preds.ndim == 2 else preds


def accuracy(preds, labels) -> float:
    """preds: ids [n] or logits [n, C]; labels: ids [n]."""
    p, y = _as_class(preds), np.asarray(labels)
    return float(np.mean(p == y)) if len(y) else 0.0


def f1(preds, labels, positive: int = 1) -> float:
    """Binary F1 of class `positive` (0 when there is no true or predicted positive)."""
    p, y = _as_class(preds), np.asarray(labels)
    tp = float(np.sum((p == positive) & (y == positive)))
    fp = float(np.sum((p == positive) & (y != positive)))
    fn = float(np.sum((p != positive) & (y == positive)))
    return 0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn)


def matthews_corrcoef(preds, labels) -> float:
    """Multiclass Matthews correlation (Gorodkin's R_K, as sklearn); 0 when undefined."""
    p, y = _as_class(preds), np.asarray(labels)
    classes, inv = np.unique(np.concatenate([y, p]), return_inverse=True)
    k = len(classes)
    yi, pi = inv[:len(y)], inv[len(y):]
    cm = np.zeros((k, k), np.float64)
    np.add.at(cm, (yi, pi), 1)
    t, pk = cm.sum(1), cm.sum(0)
    c, s = np.trace(cm), cm.sum()
    cov_ytyp = c * s - t @ pk
    cov_ypyp = s * s - pk @ pk
    cov_ytyt = s * s - t @ t
    if cov_ypyp * cov_ytyt == 0:
        return 0.0
    return float(cov_ytyp / np.sqrt(cov_ytyt * cov_ypyp))


def pearson(preds, labels) -> float:
    """Pearson r; preds [n] or [n, 1]."""
    x = np.asarray(preds, np.float64).reshape(-1)
    y = np.asarray(labels, np.float64).reshape(-1)
    xm, ym = x - x.mean(), y - y.mean()
    den = np.sqrt((xm @ xm) * (ym @ ym))
    return float(xm @ ym / den) if den > 0 else 0.0


def _rank(a: np.ndarray) -> np.ndarray:
    """Average ranks (ties share the mean rank), 1-based, like scipy.stats.rankdata."""
    order = np.argsort(a, kind="mergesort")
    sa = a[order]
    new = np.concatenate([[True], sa[1:] != sa[:-1]])
    group = np.cumsum(new) - 1
    starts = np.flatnonzero(new)
    ends = np.concatenate([starts[1:], [len(a)]])
    avg = (starts + ends - 1) / 2.0 + 1.0
    ranks = np.empty(len(a), np.float64)
    ranks[order] = avg[group]
    return ranks


def spearman(preds, labels) -> float:
    """Spearman rho = Pearson of average ranks."""
    x = np.asarray(preds, np.float64).reshape(-1)
    y = np.asarray(labels, np.float64).reshape(-1)
    return pearson(_rank(x), _rank(y))


def _acc_and_f1(p, y):
    return (accuracy(p, y) + f1(p, y)) / 2


def _corr(p, y):
    return (pearson(p, y) + spearman(p, y)) / 2


METRICS = {
    "acc": accuracy, "accuracy": accuracy, "f1": f1, "mcc": matthews_corrcoef,
    "matthews_corrcoef": matthews_corrcoef, "pearson": pearson, "spearman": spearman,
    "acc_and_f1": _acc_and_f1, "corr": _corr,
}


def _names(task_or_metric_names) -> Sequence[str]:
    if isinstance(task_or_metric_names, str):
        if task_or_metric_names.lower() in METRICS:
            return [task_or_metric_names.lower()]
        return list(get_task(task_or_metric_names).metrics)
    return [n.lower() for n in task_or_metric_names]


def compute(task_or_metric_names: Union[str, Iterable[str]], preds, labels,
            valid=None) -> Dict[str, float]:
    """Metrics by task name ("sst-2", "STS-B", ...) or metric names -> {name: value}.

    preds: class ids [n], logits [n, C], or regression scores [n] / [n, 1]; labels [n].
    valid: optional [n] weights (filler rows of eval batches have 0) selecting rows to score.
    """
    preds, labels = np.asarray(preds), np.asarray(labels)
    if valid is not None:
        keep = np.asarray(valid) > 0
        preds, labels = preds[keep], labels[keep]
    out = {}
    for n in _names(task_or_metric_names):
        if n not in METRICS:
            raise KeyError(f"unknown metric {n!r}; valid: {sorted(METRICS)}")
        p = preds.reshape(-1) if n in ("pearson", "spearman", "corr") else preds
        out[n] = METRICS[n](p, labels)
    return out


def main_metric(task) -> str:
    """The metric name used to select checkpoints for `task` (see module docstring)."""
    return get_task(task).main_metric


def score(task, preds, labels, valid=None) -> float:
    """The task's main metric value (higher is better)."""
    name = main_metric(task)
    return compute([name], preds, labels, valid)[name]
