"""Dev metrics of the span and token tasks from the student's per-row logits: SQuAD's official
EM / F1 (v1.1; v2.0 with the best threshold and HasAns / NoAns) and CoNLL's entity-level
precision / recall / F1. Rows are paired with their questions and sentences by `example_id`
(the row's index in the dev split), never by the order the batches came in."""
from __future__ import annotations

from typing import Dict

import numpy as np

from jax_tinybert.data import conll
from jax_tinybert.data.position_tasks import Split
from jax_tinybert.model.heads import MASKED_LOGIT
from jax_tinybert.train import ner_metrics, qa_metrics


def place_rows(logits_list, ids_list, n_rows: int, max_len: int, head: str) -> np.ndarray:
    """Eval batches' logits ([B, 2, T_b] span, [B, T_b, C] token; filler rows have id -1) ->
    one array by row id: [n_rows, 2, max_len] / [n_rows, max_len, C], padded past each bucket."""
    first = np.asarray(logits_list[0])
    shape = ((n_rows, 2, max_len) if head == "span" else (n_rows, max_len, first.shape[-1]))
    out = np.full(shape, MASKED_LOGIT if head == "span" else 0.0, np.float32)
    seen = np.zeros(n_rows, bool)
    for lg, ids in zip(logits_list, ids_list):
        lg, ids = np.asarray(lg), np.asarray(ids).reshape(-1)
        keep = ids >= 0
        t = lg.shape[2] if head == "span" else lg.shape[1]
        if head == "span":
            out[ids[keep], :, :t] = lg[keep]
        else:
            out[ids[keep], :t] = lg[keep]
        seen[ids[keep]] = True
    if not seen.all():
        raise RuntimeError(f"eval: {int((~seen).sum())} of {n_rows} dev rows got no logits")
    return out


def score(split: Split, head: str, version: str, logits: np.ndarray) -> Dict[str, float]:
    """The task's metrics from `place_rows`' logits; "main" the one checkpoints are chosen by
    (SQuAD v1.1 f1, v2.0 best_f1, both in percent as the official scripts print them; CoNLL
    f1 in [0, 1])."""
    if head == "span":
        texts, diffs = qa_metrics.predict(logits[:, 0], logits[:, 1], split.features,
                                          split.examples)
        if version == "1.1":
            out = qa_metrics.squad_v1(texts, split.examples)
            return dict(out, main=out["f1"])
        out = qa_metrics.squad_v2(texts, diffs, split.examples)
        return dict(out, main=out["best_f1"])
    tags = conll.word_tags(logits, split.features, split.examples, split.labels)
    out = ner_metrics.entity_scores([s.tags for s in split.examples], tags)
    return dict(out, main=out["f1"])
