"""SQuAD's official metrics, and answers from a span head's start/end logits over windows.

`exact` / `f1` are the official evaluate-v1.1 / v2.0 scripts' per-answer scores (answers
normalised: lower case, punctuation and the articles a/an/the removed, whitespace collapsed;
the best over the gold answers; an unanswerable question's gold is the empty answer).
`predict` picks each question's answer over ALL of its windows, which rows it owns being given
by `example_id` (never by row order), as HF run_qa's postprocessing: the n_best start and end
logits of each window, spans inside the context with end >= start and at most
max_answer_len tokens, text cut from the context by the tokens' char offsets; the null score
(v2.0) is the smallest start[0] + end[0] over the windows.
"""
from __future__ import annotations

import collections
import re
import string
from typing import Dict, Mapping, Sequence, Tuple

import numpy as np

from jax_tinybert.data.squad import QAExample, QAFeatures

_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """The official normalisation: lower, no punctuation, no articles, single spaces."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


def exact(pred: str, gold: str) -> float:
    return float(normalize_answer(pred) == normalize_answer(gold))


def f1(pred: str, gold: str) -> float:
    """Token-level F1 of the normalised answers (both empty: 1; one empty: 0)."""
    p, g = normalize_answer(pred).split(), normalize_answer(gold).split()
    if not p or not g:
        return float(p == g)
    common = sum((collections.Counter(p) & collections.Counter(g)).values())
    if common == 0:
        return 0.0
    prec, rec = common / len(p), common / len(g)
    return 2 * prec * rec / (prec + rec)


def _golds(e: QAExample) -> Sequence[str]:
    golds = [a for a in e.answers if normalize_answer(a)]
    return golds or [""]


def predict(start_logits: np.ndarray, end_logits: np.ndarray, features: QAFeatures,
            examples: Sequence[QAExample], n_best: int = 20, max_answer_len: int = 30
            ) -> Tuple[Dict[str, str], Dict[str, float]]:
    """start/end logits float [n_rows, T] (rows of `features`, padded past each row's length)
    -> ({question id: best non-null answer text}, {question id: null score - best span score}:
    > 0 means the null answer scores higher)."""
    best: Dict[int, Tuple[float, str]] = {}
    null: Dict[int, float] = {}
    for i in range(len(features)):
        ex = int(features.example_id[i])
        offs = features.row_offsets(i)
        n = len(offs)
        s, e = np.asarray(start_logits[i][:n], np.float64), np.asarray(end_logits[i][:n], np.float64)
        null[ex] = min(null.get(ex, np.inf), s[0] + e[0])
        ctx = offs[:, 0] >= 0
        for a in np.argsort(-s)[:n_best]:
            if not ctx[a]:
                continue
            for b in np.argsort(-e)[:n_best]:
                if not ctx[b] or b < a or b - a + 1 > max_answer_len:
                    continue
                score = s[a] + e[b]
                if ex not in best or score > best[ex][0]:
                    best[ex] = (score, examples[ex].context[offs[a, 0]:offs[b, 1]])
    texts, diffs = {}, {}
    for k, e in enumerate(examples):
        score, text = best.get(k, (-np.inf, ""))
        texts[e.id] = text
        diffs[e.id] = float(null.get(k, np.inf) - score)
    return texts, diffs


def squad_v1(predictions: Mapping[str, str], examples: Sequence[QAExample]) -> Dict[str, float]:
    """{"exact_match", "f1"} in percent, as evaluate-v1.1.py prints them."""
    # evaluate-v1.1.py takes every gold answer as written (v2.0 drops those normalising to "")
    em = [max(exact(predictions.get(e.id, ""), g) for g in e.answers) for e in examples]
    # ... and its F1 is 0 when either side normalises to no tokens (no common tokens)
    f = [max(f1(predictions.get(e.id, ""), g) if normalize_answer(predictions.get(e.id, ""))
             and normalize_answer(g) else 0.0 for g in e.answers) for e in examples]
    return {"exact_match": 100.0 * float(np.mean(em)), "f1": 100.0 * float(np.mean(f))}


def _best_threshold(scores: np.ndarray, null_diff: np.ndarray, has_ans: np.ndarray,
                    answered: np.ndarray) -> Tuple[float, float]:
    """evaluate-v2.0.py's find_best_thresh: questions sorted by null-score difference; answering
    those below a threshold. -> (best score in percent, threshold)."""
    cur = best = float(np.sum(~has_ans))     # predict null for all: every NoAns question right
    thresh = 0.0
    for i in np.argsort(null_diff, kind="stable"):
        cur += scores[i] if has_ans[i] else (-1.0 if answered[i] else 0.0)
        if cur > best:
            best, thresh = cur, float(null_diff[i])
    return 100.0 * best / len(scores), thresh


def squad_v2(predictions: Mapping[str, str], null_diffs: Mapping[str, float],
             examples: Sequence[QAExample], threshold: float = 0.0) -> Dict[str, float]:
    """The official v2.0 numbers in percent: exact / f1 answering where null_diff <= threshold
    (null otherwise), HasAns_* / NoAns_* of those, and best_exact / best_f1 with their
    thresholds chosen on these questions."""
    has = np.array([not e.is_impossible and bool(_golds(e)[0]) for e in examples])
    diff = np.array([null_diffs.get(e.id, np.inf) for e in examples], np.float64)
    answered = np.array([bool(predictions.get(e.id, "")) for e in examples])
    raw = {m: np.array([max(fn(predictions.get(e.id, ""), g) for g in _golds(e))
                        for e in examples]) for m, fn in (("exact", exact), ("f1", f1))}
    out: Dict[str, float] = {}
    for m, s in raw.items():
        final = np.where(diff > threshold, (~has).astype(np.float64), s)
        out[m] = 100.0 * float(np.mean(final))
        if has.any():
            out[f"HasAns_{m}"] = 100.0 * float(np.mean(final[has]))
        if (~has).any():
            out[f"NoAns_{m}"] = 100.0 * float(np.mean(final[~has]))
        out[f"best_{m}"], out[f"best_{m}_thresh"] = _best_threshold(s, diff, has, answered)
    return out
