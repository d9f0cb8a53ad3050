"""The span (SQuAD) and token (NER) losses of every classification objective: finetune, KD, PKD's
KD part and TinyBERT's prediction layer on per-position logits, against PyTorch's cross-entropy
(ignore_index) and NumPy written from the formulas (softmax over a row's real positions or over
a token's labels)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from jax_tinybert.distill import losses as L
from jax_tinybert.distill.objectives import make_objective
from jax_tinybert.model import heads
from jax_tinybert.model.modeling import BertConfig, BertOutput

B, T, C = 3, 7, 5
LENS = np.array([7, 5, 3])
MASK = (np.arange(T)[None] < LENS[:, None]).astype(np.int32)


def _out(logits):
    return BertOutput(hidden_states=(), attention_logits=(), logits=logits)


def _span_logits(rng):
    x = rng.normal(size=(B, 2, T)).astype(np.float32)
    return np.where(MASK[:, None, :] > 0, x, heads.MASKED_LOGIT).astype(np.float32)


def _np_soft_ce(s, t, temp, axis_mask):
    """-sum p_t log q_s over the real entries of the last axis (the rest excluded)."""
    def log_softmax(x):
        x = np.where(axis_mask, x / temp, -np.inf)
        m = x.max(-1, keepdims=True)
        return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))
    p = np.exp(log_softmax(t))
    return -(p * np.where(axis_mask, log_softmax(s), 0.0)).sum(-1)


def _cfg(n):
    return BertConfig(vocab_size=10, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=16, num_labels=n)


def test_span_finetune_is_run_qa_loss():
    """(start CE + end CE) / 2, mean over examples, as HF's *ForQuestionAnswering."""
    rng = np.random.default_rng(0)
    s = _span_logits(rng)
    labels = np.array([[2, 4], [0, 0], [1, 2]], np.int32)
    obj = make_objective("finetune", {}, _cfg(2), head="span")
    loss, _ = obj({}, _out(s), None, {"labels": labels, "attention_mask": MASK})
    st, en = torch.from_numpy(s[:, 0]), torch.from_numpy(s[:, 1])
    lab = torch.from_numpy(labels).long()
    ref = (F.cross_entropy(st, lab[:, 0]) + F.cross_entropy(en, lab[:, 1])) / 2
    np.testing.assert_allclose(float(loss), float(ref), rtol=1e-5)


@pytest.mark.parametrize("temp", [1.0, 2.0])
def test_span_prediction_layer_soft_ce_over_real_positions(temp):
    """TinyBERT's soft CE per start / end distribution over the row's real positions, mean of
    the 2B distributions; a filler row (valid 0) does not count."""
    rng = np.random.default_rng(1)
    s, t = _span_logits(rng), _span_logits(rng)
    valid = np.array([1.0, 1.0, 0.0], np.float32)
    obj = make_objective("tinybert_pred", {"temperature": temp}, _cfg(2), _cfg(2), head="span")
    loss, terms = obj({}, _out(s), _out(t), {"attention_mask": MASK, "valid": valid})
    ce = _np_soft_ce(s, t, temp, (MASK > 0)[:, None, :])      # [B, 2]
    np.testing.assert_allclose(float(loss), ce[:2].mean(), rtol=1e-5)


def test_token_finetune_ignores_unlabelled_pieces():
    """PyTorch's cross_entropy(ignore_index=-100): the mean over labelled tokens only."""
    rng = np.random.default_rng(2)
    s = rng.normal(size=(B, T, C)).astype(np.float32)
    labels = rng.integers(0, C, size=(B, T)).astype(np.int32)
    labels[:, 0] = L.IGNORE
    labels[MASK == 0] = L.IGNORE
    labels[0, 3] = L.IGNORE
    obj = make_objective("finetune", {}, _cfg(C), head="token")
    loss, _ = obj({}, _out(s), None, {"labels": labels, "attention_mask": MASK})
    ref = F.cross_entropy(torch.from_numpy(s).reshape(-1, C),
                          torch.from_numpy(labels).long().reshape(-1), ignore_index=-100)
    np.testing.assert_allclose(float(loss), float(ref), rtol=1e-5)


def test_token_kd_soft_term_over_real_tokens():
    """KD: alpha * T^2 KL over the real tokens (attention mask) + (1 - alpha) CE over the labelled."""
    rng = np.random.default_rng(3)
    s, t = (rng.normal(size=(B, T, C)).astype(np.float32) for _ in range(2))
    labels = np.where(MASK > 0, rng.integers(0, C, size=(B, T)), L.IGNORE).astype(np.int32)
    obj = make_objective("kd", {"temperature": 2.0, "alpha": 0.3}, _cfg(C), _cfg(C),
                         head="token")
    loss, terms = obj({}, _out(s), _out(t), {"labels": labels, "attention_mask": MASK})
    real = MASK > 0
    full = np.ones((B, T, C), bool)
    kl = _np_soft_ce(s, t, 2.0, full) - _np_soft_ce(t, t, 2.0, full)        # [B, T]
    kd = 4.0 * kl[real].mean()
    ce = F.cross_entropy(torch.from_numpy(s).reshape(-1, C),
                         torch.from_numpy(labels).long().reshape(-1), ignore_index=-100)
    np.testing.assert_allclose(float(terms["kd"]), kd, rtol=1e-5)
    np.testing.assert_allclose(float(loss), 0.3 * kd + 0.7 * float(ce), rtol=1e-5)


def test_position_objectives_read_every_token_and_take_cached_logits():
    """A span prediction stage computes the last layer's every row (no cls_only), and reads the
    teacher's [B, 2, T] logits from the batch (teacher/positions.py) as it reads them from t_out."""
    seq = make_objective("tinybert_pred", {}, _cfg(2), _cfg(2))
    span = make_objective("tinybert_pred", {}, _cfg(2), _cfg(2), head="span")
    assert not seq.reads_tokens and span.reads_tokens and span.teacher_cacheable
    rng = np.random.default_rng(4)
    s, t = _span_logits(rng), _span_logits(rng)
    live, _ = span({}, _out(s), _out(t), {"attention_mask": MASK})
    cached, _ = span({}, _out(s), None, {"attention_mask": MASK, "teacher_logits": t})
    assert float(live) == pytest.approx(float(cached), rel=1e-7)
