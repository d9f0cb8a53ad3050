"""Distillation loss terms: pure, jit-friendly functions of arrays (docs/losses.md).

Every term takes `mode`:

- ``"masked"`` (default): padding never counts. Means are taken over real tokens (attention:
  over (query, key) pairs where both are real) pooled over the batch, so the value does not
  depend on how much padding a batch carries.
- ``"tinybert"``: the official PyTorch reductions, for reproducing published numbers
  (additive -10000 mask and ``<= -100 -> 0`` on attention scores, plain means with padding
  included, prediction loss averaged over classes too, PKD's float16 patience rounding).

Every term also takes ``valid`` [B] (optional): per-example weights, 0 for filler rows that only
exist to keep shapes static. With ``valid=None`` all rows count with weight 1. In tinybert mode
a weighted per-example mean is used, which equals the official plain mean when all weights are 1.

Shapes: B batch, T padded length, H heads, D hidden width, C classes, K patience layers.
Results are float32 scalars (float64 when inputs are float64, e.g. under ``jax.enable_x64``).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jax_tinybert.model.modeling import matmul_rows

Array = jax.Array

MODES = ("masked", "tinybert")

# Official TinyBERT constants: the additive attention mask and the threshold below which
# masked scores are zeroed before the MSE (TinyBERT/task_distill.py, general_distill.py).
TINYBERT_MASK_VALUE = -10000.0
TINYBERT_ZERO_BELOW = -100.0
# torch.nn.functional.normalize's default eps, used by PKD's patience loss.
_NORMALIZE_EPS = 1e-12
# Masked keys for attention distributions: finite so that log-softmax differences stay finite.
_KEY_MASK_VALUE = -1e9


def check_mode(mode: str) -> str:
    """Returns `mode` or raises ValueError listing the valid modes."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not a loss mode; expected one of {MODES} "
                         "('masked' ignores padding, 'tinybert' reproduces the official code)")
    return mode


def _f(x: Array) -> Array:
    """Upcasts bf16/f16 activations so reductions run in at least float32."""
    x = jnp.asarray(x)
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _weights(valid: Optional[Array], batch: int, dtype) -> Array:
    if valid is None:
        return jnp.ones((batch,), dtype)
    valid = jnp.asarray(valid)
    if valid.shape != (batch,):
        raise ValueError(f"valid must have shape [B]=({batch},), got {valid.shape}")
    return valid.astype(dtype)


def _safe_div(num: Array, den: Array) -> Array:
    # An all-filler batch has num = den = 0: report 0 instead of NaN (and keep gradients finite).
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)


def _example_mean(per_example: Array, valid: Optional[Array]) -> Array:
    """Mean over examples of a [B] vector, weighted by `valid` when given."""
    if valid is None:
        return jnp.mean(per_example)
    w = _weights(valid, per_example.shape[0], per_example.dtype)
    return _safe_div(jnp.sum(w * per_example), jnp.sum(w))


def _check_same_shape(name: str, s: Array, t: Array, hint: str = "") -> None:
    if s.shape != t.shape:
        raise ValueError(f"{name}: student shape {s.shape} != teacher shape {t.shape}{hint}")


# ----------------------------------------------------------------------------- projections

def init_dense(rng: Array, d_in: int, d_out: int, stddev: float = 0.02, dtype=jnp.float32) -> dict:
    """Dense params {"kernel": [d_in, d_out] ~ N(0, stddev^2), "bias": [d_out] zeros}."""
    return {"kernel": stddev * jax.random.normal(rng, (d_in, d_out), dtype),
            "bias": jnp.zeros((d_out,), dtype)}


def project(params: Optional[dict], x: Array) -> Array:
    """x [..., d_in] -> x @ kernel + bias [..., d_out]; identity when params is None or {}."""
    if not params:
        return x
    return matmul_rows(x, params["kernel"].astype(x.dtype)) + params["bias"].astype(x.dtype)


# ----------------------------------------------------------------------------- attention

def attention_mse(s_logits: Array, t_logits: Array, attention_mask: Array, mode: str = "masked",
                  valid: Optional[Array] = None) -> Array:
    """MSE between raw attention scores of one student and one teacher layer.

    s_logits, t_logits: [B, H, T, T] raw Q K^T / sqrt(d_head) before mask and softmax.
    attention_mask: [B, T] (1 real token, 0 padding). valid: [B] example weights or None.
    masked: mean over heads and over (query, key) pairs where both tokens are real.
    tinybert: both get the additive (1 - mask) * -10000 on keys, entries <= -100 become 0,
    then a plain mean over B * H * T * T (padded query rows count).
    Returns a scalar.
    """
    check_mode(mode)
    s, t = _f(s_logits), _f(t_logits)
    _check_same_shape("attention_mse", s, t,
                      " (attention losses need equal head counts and sequence lengths)")
    B, H, T, _ = s.shape
    m = jnp.asarray(attention_mask).astype(s.dtype)
    if mode == "tinybert":
        bias = ((1.0 - m) * TINYBERT_MASK_VALUE)[:, None, None, :]
        s, t = s + bias, t + bias
        s = jnp.where(s <= TINYBERT_ZERO_BELOW, 0.0, s)
        t = jnp.where(t <= TINYBERT_ZERO_BELOW, 0.0, t)
        if valid is None:
            return jnp.mean(jnp.square(s - t))
        return _example_mean(jnp.mean(jnp.square(s - t), axis=(1, 2, 3)), valid)
    w = _weights(valid, B, s.dtype)
    pair = (w[:, None, None] * m[:, :, None] * m[:, None, :])[:, None]  # [B, 1, T, T]
    return _safe_div(jnp.sum(pair * jnp.square(s - t)), H * jnp.sum(pair))


def _masked_log_softmax(logits: Array, attention_mask: Array) -> Array:
    keys = jnp.asarray(attention_mask)[:, None, None, :] > 0
    return jax.nn.log_softmax(jnp.where(keys, logits, _KEY_MASK_VALUE), axis=-1)


def attention_kl(s_logits: Array, t_logits: Array, attention_mask: Array, mode: str = "masked",
                 valid: Optional[Array] = None) -> Array:
    """KL(teacher || student) between attention distributions (softmax over real keys).

    s_logits, t_logits: [B, H, T, T] raw scores; attention_mask [B, T]; valid [B] or None.
    Mean over heads and real query rows. The official TinyBERT code has no such term, so only
    mode="masked" exists. Returns a scalar.
    """
    check_mode(mode)
    if mode != "masked":
        raise ValueError("attention_kl has no official TinyBERT counterpart; use mode='masked'")
    s, t = _f(s_logits), _f(t_logits)
    _check_same_shape("attention_kl", s, t, " (attention losses need equal head counts)")
    B, H = s.shape[:2]
    m = jnp.asarray(attention_mask).astype(s.dtype)
    log_q, log_p = _masked_log_softmax(s, attention_mask), _masked_log_softmax(t, attention_mask)
    keys = m[:, None, None, :] > 0
    kl_rows = jnp.sum(jnp.where(keys, jnp.exp(log_p) * (log_p - log_q), 0.0), axis=-1)  # [B,H,T]
    rows = (_weights(valid, B, s.dtype)[:, None] * m)[:, None, :]  # [B, 1, T]
    return _safe_div(jnp.sum(rows * kl_rows), H * jnp.sum(rows))


# ----------------------------------------------------------------------------- hidden states

def _token_weights(attention_mask, valid, B, dtype):
    return _weights(valid, B, dtype)[:, None] * jnp.asarray(attention_mask).astype(dtype)


def hidden_mse(s_hidden: Array, t_hidden: Array, attention_mask: Array, mode: str = "masked",
               valid: Optional[Array] = None) -> Array:
    """MSE between (already projected) student and teacher hidden states of one layer pair.

    s_hidden, t_hidden: [B, T, D] (project the student first with `project` when widths differ).
    attention_mask [B, T]; valid [B] or None.
    masked: mean over real tokens and the D units. tinybert: plain mean over B * T * D.
    Returns a scalar.
    """
    check_mode(mode)
    s, t = _f(s_hidden), _f(t_hidden)
    if s.shape[-1] != t.shape[-1]:
        raise ValueError(
            f"hidden_mse: student width {s.shape[-1]} != teacher width {t.shape[-1]}; project the "
            "student states first (losses.project, or objective cfg projection='shared' or "
            "'per_layer' instead of 'none')")
    _check_same_shape("hidden_mse", s, t)
    B, T, D = s.shape
    if mode == "tinybert":
        if valid is None:
            return jnp.mean(jnp.square(s - t))
        return _example_mean(jnp.mean(jnp.square(s - t), axis=(1, 2)), valid)
    w = _token_weights(attention_mask, valid, B, s.dtype)
    return _safe_div(jnp.sum(w[:, :, None] * jnp.square(s - t)), D * jnp.sum(w))


def embedding_mse(s_emb: Array, t_emb: Array, attention_mask: Array, mode: str = "masked",
                  valid: Optional[Array] = None) -> Array:
    """L_embd: `hidden_mse` on the embedding outputs (hidden state 0), [B, T, D] each."""
    return hidden_mse(s_emb, t_emb, attention_mask, mode=mode, valid=valid)


def cosine_hidden_loss(s_hidden: Array, t_hidden: Array, attention_mask: Array,
                       mode: str = "masked", valid: Optional[Array] = None,
                       eps: float = 1e-8) -> Array:
    """Mean over tokens of 1 - cos(s, t); s_hidden, t_hidden [B, T, D] of equal width.

    masked: real tokens only; tinybert: every position (no official counterpart, same reduction
    as the official hidden MSE). Returns a scalar.
    """
    check_mode(mode)
    s, t = _f(s_hidden), _f(t_hidden)
    if s.shape[-1] != t.shape[-1]:
        raise ValueError(f"cosine_hidden_loss: student width {s.shape[-1]} != teacher width "
                         f"{t.shape[-1]}; project the student states first (losses.project)")
    _check_same_shape("cosine_hidden_loss", s, t)
    B = s.shape[0]
    cos = jnp.sum(s * t, -1) / jnp.maximum(
        jnp.linalg.norm(s, axis=-1) * jnp.linalg.norm(t, axis=-1), eps)
    d = 1.0 - cos  # [B, T]
    if mode == "tinybert":
        return _example_mean(jnp.mean(d, axis=1), valid)
    w = _token_weights(attention_mask, valid, B, s.dtype)
    return _safe_div(jnp.sum(w * d), jnp.sum(w))


# ----------------------------------------------------------------------------- predictions

def _check_logits(name, s, t):
    if s.ndim != 2:
        raise ValueError(f"{name}: logits must be [B, C], got shape {s.shape}")
    _check_same_shape(name, s, t, " (student and teacher need the same number of labels)")


def soft_cross_entropy(s_logits: Array, t_logits: Array, temperature: float = 1.0,
                       mode: str = "masked", t2: bool = False,
                       valid: Optional[Array] = None) -> Array:
    """Soft cross-entropy -sum_c softmax(t/T)_c log_softmax(s/T)_c.

    s_logits, t_logits: [B, C]; valid [B] or None. masked: sum over classes, mean over examples.
    tinybert: mean over examples AND classes (the official code; = masked / C).
    t2: multiply by T^2 (Hinton), off in the official TinyBERT. Returns a scalar.
    """
    check_mode(mode)
    s, t = _f(s_logits), _f(t_logits)
    _check_logits("soft_cross_entropy", s, t)
    p = jax.nn.softmax(t / temperature, axis=-1)
    ce = -p * jax.nn.log_softmax(s / temperature, axis=-1)  # [B, C]
    per_ex = jnp.mean(ce, -1) if mode == "tinybert" else jnp.sum(ce, -1)
    loss = jnp.mean(per_ex) if valid is None else _example_mean(per_ex, valid)
    return loss * temperature ** 2 if t2 else loss


def kl_divergence(s_logits: Array, t_logits: Array, temperature: float = 1.0,
                  mode: str = "masked", t2: bool = True,
                  valid: Optional[Array] = None) -> Array:
    """KL(softmax(t/T) || softmax(s/T)), the KD term of PKD; equals soft CE minus teacher entropy.

    s_logits, t_logits: [B, C]; valid [B] or None. masked: sum over classes, mean over examples.
    tinybert: PyTorch KLDivLoss(reduction='mean'), i.e. mean over B * C (as the official PKD).
    t2: multiply by T^2 (on in PKD). Returns a scalar.
    """
    check_mode(mode)
    s, t = _f(s_logits), _f(t_logits)
    _check_logits("kl_divergence", s, t)
    log_q = jax.nn.log_softmax(s / temperature, axis=-1)
    if mode == "tinybert":
        # As torch: the target is the softmax output and its log is taken afterwards (xlogy).
        p = jax.nn.softmax(t / temperature, axis=-1)
        kl = jnp.where(p > 0, p * (jnp.log(jnp.where(p > 0, p, 1.0)) - log_q), 0.0)
        per_ex = jnp.mean(kl, -1)
    else:
        log_p = jax.nn.log_softmax(t / temperature, axis=-1)
        per_ex = jnp.sum(jnp.exp(log_p) * (log_p - log_q), -1)
    loss = jnp.mean(per_ex) if valid is None else _example_mean(per_ex, valid)
    return loss * temperature ** 2 if t2 else loss


def logits_mse(s_logits: Array, t_logits: Array, temperature: float = 1.0, t2: bool = False,
               valid: Optional[Array] = None) -> Array:
    """MSE of the logits divided by T: mean over classes, then over examples (TextBrewer's
    kd_mse_loss; Ba & Caruana's logit regression). One reduction in both modes (no official
    TinyBERT or PKD counterpart). s_logits, t_logits: [B, C]; valid [B] or None.
    t2: multiply by T^2, which makes the value that of the raw logits. Returns a scalar.
    """
    s, t = _f(s_logits), _f(t_logits)
    _check_logits("logits_mse", s, t)
    per_ex = jnp.mean(jnp.square((s - t) / temperature), -1)
    loss = jnp.mean(per_ex) if valid is None else _example_mean(per_ex, valid)
    return loss * temperature ** 2 if t2 else loss


def probability_shift(t_logits: Array, labels: Array) -> Array:
    """The teacher's logits [B, C] with, in each row where its largest logit is not the gold
    label's (int labels [B]), those two values swapped, so its soft targets peak at the gold
    label (TextBrewer's probability_shift); rows it gets right are unchanged. Returns [B, C].
    """
    t = _f(t_logits)
    if t.ndim != 2:
        raise ValueError(f"probability_shift: logits must be [B, C], got shape {t.shape}")
    labels = jnp.asarray(labels).astype(jnp.int32)
    top = jnp.argmax(t, axis=-1)
    t_top = jnp.take_along_axis(t, top[:, None], axis=-1)
    t_gold = jnp.take_along_axis(t, labels[:, None], axis=-1)
    classes = jnp.arange(t.shape[-1])[None, :]
    # Where top == gold both masks pick one column and the two values are equal: no change.
    return jnp.where(classes == top[:, None], t_gold,
                     jnp.where(classes == labels[:, None], t_top, t))


def cross_entropy(logits: Array, labels: Array, valid: Optional[Array] = None) -> Array:
    """Hard-label cross-entropy: logits [B, C], labels int [B]; mean over examples (both modes).
    Rows labelled < 0 (IGNORE, -100: PyTorch's ignore_index) weigh 0."""
    lg = _f(logits)
    if lg.ndim != 2:
        raise ValueError(f"cross_entropy: logits must be [B, C], got shape {lg.shape}")
    labels = jnp.asarray(labels).astype(jnp.int32)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(lg, -1), jnp.maximum(labels, 0)[:, None],
                               axis=-1)[:, 0]
    labelled = (labels >= 0).astype(nll.dtype)
    w = labelled if valid is None else labelled * _weights(valid, nll.shape[0], nll.dtype)
    return _example_mean(nll, w)


IGNORE = -100   # a position without a label (pieces after a word's first, special tokens)


def position_rows(logits: Array, head: str) -> Array:
    """Per-position logits as rows of classification logits, so that every classification loss
    reads them unchanged: span [B, 2, T] (start and end logits; a softmax over positions) ->
    [2B, T]; token [B, T, C] -> [B T, C]."""
    lg = jnp.asarray(logits)
    if lg.ndim != 3:
        raise ValueError(f"position_rows: {head} logits must be 3-D, got shape {lg.shape}")
    return lg.reshape(-1, lg.shape[-1])


def position_weights(head: str, attention_mask: Array, valid: Optional[Array]) -> Array:
    """The rows' weights of `position_rows`: span, each example's two rows its weight (positions
    past its length are masked inside the logits); token, its real tokens (attention_mask).
    valid: [B] example weights or None. -> float32 [R]."""
    m = jnp.asarray(attention_mask)
    w = jnp.ones((m.shape[0],), jnp.float32) if valid is None else jnp.asarray(valid, jnp.float32)
    if head == "span":
        return jnp.repeat(w, 2)
    return (m.astype(jnp.float32) * w[:, None]).reshape(-1)


def regression_mse(pred: Array, target: Array, valid: Optional[Array] = None) -> Array:
    """MSE for regression (num_labels = 1): pred [B] or [B, 1] vs target [B] or [B, 1].

    The target is the gold score (fine-tuning) or the teacher's prediction (distillation).
    Mean over examples (both modes; the official code's MSELoss on view(-1)).
    """
    p, y = _f(pred).reshape(-1), _f(target).reshape(-1)
    if p.shape != y.shape:
        raise ValueError(f"regression_mse: {p.shape[0]} predictions vs {y.shape[0]} targets "
                         "(regression models must have num_labels = 1)")
    return _example_mean(jnp.square(p - y), valid)


# ----------------------------------------------------------------------------- PKD patience

def _l2_normalize(x: Array) -> Array:
    # torch F.normalize: x / max(||x||, eps).
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), _NORMALIZE_EPS)


def round_f16(x: Array) -> Array:
    """Rounds to float16 and back (the official PKD casts the patience loss with .half())."""
    return x.astype(jnp.float16).astype(x.dtype)


def patience_loss(s_cls: Array, t_cls: Array, normalize: bool = True, mode: str = "masked",
                  valid: Optional[Array] = None) -> Array:
    """PKD patience loss on [CLS] vectors (Sun et al. 2019, eq. 4).

    s_cls, t_cls: [B, K, D] (K mapped layers; project the student first if widths differ).
    normalize: L2-normalise each [CLS] vector first (PKD default). valid [B] or None.
    masked: the paper's formula, sum over the K layers and D units of (s - t)^2, mean over
    examples. tinybert: the official code's mean over B * K * D (= masked / (K * D)), rounded
    to float16 as its `.half()`; the objective rounds beta * that again. A beta tuned for one
    mode carries to the other as beta_masked = beta_tinybert / (K * D). Returns a scalar.
    """
    check_mode(mode)
    s, t = _f(s_cls), _f(t_cls)
    if s.shape[-1] != t.shape[-1]:
        raise ValueError(f"patience_loss: student width {s.shape[-1]} != teacher width "
                         f"{t.shape[-1]}; project the student [CLS] vectors first")
    _check_same_shape("patience_loss", s, t, " (one teacher layer per student layer)")
    if s.ndim != 3:
        raise ValueError(f"patience_loss: expected [B, K, D] [CLS] vectors, got {s.shape}")
    if normalize:
        s, t = _l2_normalize(s), _l2_normalize(t)
    sq = jnp.square(s - t)
    if mode == "masked":
        return _example_mean(jnp.sum(sq, axis=(1, 2)), valid)
    # One flat mean as the official code takes it (the float16 rounding below is exact-sensitive).
    loss = jnp.mean(sq) if valid is None else _example_mean(jnp.mean(sq, axis=(1, 2)), valid)
    return round_f16(loss)


# ----------------------------------------------------------------------------- MiniLM

def _relation_log_softmax(a: Array, b: Array, attention_mask: Array) -> Array:
    """log softmax_keys(a b^T / sqrt(d)) over real keys: a, b [B, H, T, d] -> [B, H, T, T]."""
    scores = jnp.einsum("bhqd,bhkd->bhqk", a, b) / jnp.sqrt(jnp.asarray(a.shape[-1], a.dtype))
    return _masked_log_softmax(scores, attention_mask)


def _relation_kl(s_log: Array, t_log: Array, attention_mask: Array,
                 valid: Optional[Array]) -> Array:
    """KL(teacher || student) per real query row, [B, H, T, T] log-distributions over real keys;
    mean over relation heads and real query rows (rows weighted by `valid`). A scalar."""
    B, H = s_log.shape[:2]
    m = jnp.asarray(attention_mask).astype(s_log.dtype)
    keys = m[:, None, None, :] > 0
    kl_rows = jnp.sum(jnp.where(keys, jnp.exp(t_log) * (t_log - s_log), 0.0), axis=-1)
    rows = (_weights(valid, B, s_log.dtype)[:, None] * m)[:, None, :]  # [B, 1, T]
    return _safe_div(jnp.sum(rows * kl_rows), H * jnp.sum(rows))


def _check_relation_inputs(name: str, attention_mask, *xs) -> None:
    if jnp.ndim(attention_mask) != 2:
        raise ValueError(f"{name}: attention_mask must be [B, T] (packed rows' [B, T, T] masks "
                         f"are not supported), got shape {jnp.shape(attention_mask)}")
    for x in xs:
        if x.ndim != 4:
            raise ValueError(f"{name}: q, k, v must be [B, H, T, d_head], got shape {x.shape}")


def minilm_loss(s_qkv, t_qkv, attention_mask: Array, valid: Optional[Array] = None):
    """MiniLM (Wang et al. 2020, eqs. 5-7): L_AT + L_VR of one student and one teacher layer.

    s_qkv, t_qkv: (q, k, v), each [B, H, T, d_head] (q unscaled); d_head may differ between
    the two, H may not (the relations are compared per head). attention_mask [B, T]; valid [B]
    or None. L_AT = KL(teacher || student) of softmax(q k^T / sqrt(d_head)), L_VR the same of
    softmax(v v^T / sqrt(d_head)); each a mean over heads and real query rows, keys over real
    tokens only. Returns (L_AT + L_VR, {"at": L_AT, "vr": L_VR}), scalars.
    """
    (sq, sk, sv), (tq, tk, tv) = [tuple(_f(x) for x in qkv) for qkv in (s_qkv, t_qkv)]
    _check_relation_inputs("minilm_loss", attention_mask, sq, sk, sv, tq, tk, tv)
    if sq.shape[1] != tq.shape[1]:
        raise ValueError(f"minilm_loss: student has {sq.shape[1]} attention heads, teacher "
                         f"{tq.shape[1]}; MiniLM v1 compares per head: give the student "
                         "the teacher's head count or use objective minilmv2")
    at = _relation_kl(_relation_log_softmax(sq, sk, attention_mask),
                      _relation_log_softmax(tq, tk, attention_mask), attention_mask, valid)
    vr = _relation_kl(_relation_log_softmax(sv, sv, attention_mask),
                      _relation_log_softmax(tv, tv, attention_mask), attention_mask, valid)
    return at + vr, {"at": at, "vr": vr}


def split_relation_heads(x: Array, relation_heads: int) -> Array:
    """[B, H, T, d_head] -> concatenated heads [B, T, H * d_head] -> [B, A_r, T, H * d_head / A_r]
    (MiniLMv2's relation heads). The width must divide by relation_heads."""
    B, H, T, d = x.shape
    if (H * d) % relation_heads:
        raise ValueError(f"split_relation_heads: width {H * d} does not divide into "
                         f"{relation_heads} relation heads")
    flat = x.transpose(0, 2, 1, 3).reshape(B, T, H * d)
    return flat.reshape(B, T, relation_heads, H * d // relation_heads).transpose(0, 2, 1, 3)


def minilmv2_loss(s_qkv, t_qkv, attention_mask: Array, relation_heads: int,
                  valid: Optional[Array] = None):
    """MiniLMv2 (Wang et al. 2021, eqs. 1-4): self-attention relation distillation.

    s_qkv, t_qkv: (q, k, v), each [B, H, T, d_head] (q unscaled); student and teacher may
    differ in H and d_head, each width H * d_head must divide by `relation_heads` (A_r).
    For X in {Q, K, V}: the heads concatenated and re-split into A_r heads of width d_r, the
    relation R = softmax(X X^T / sqrt(d_r)) over real keys; the loss is the sum over QQ, KK, VV
    of KL(R_teacher || R_student), each a mean over the A_r heads and real query rows.
    attention_mask [B, T]; valid [B] or None.
    Returns (L_QQ + L_KK + L_VV, {"qq": L_QQ, "kk": L_KK, "vv": L_VV}), scalars.
    """
    s_qkv, t_qkv = [tuple(_f(x) for x in qkv) for qkv in (s_qkv, t_qkv)]
    _check_relation_inputs("minilmv2_loss", attention_mask, *s_qkv, *t_qkv)
    terms = {}
    for name, s, t in zip(("qq", "kk", "vv"), s_qkv, t_qkv):
        s, t = split_relation_heads(s, relation_heads), split_relation_heads(t, relation_heads)
        terms[name] = _relation_kl(_relation_log_softmax(s, s, attention_mask),
                                   _relation_log_softmax(t, t, attention_mask),
                                   attention_mask, valid)
    return terms["qq"] + terms["kk"] + terms["vv"], terms


__all__ = [
    "MODES", "check_mode", "init_dense", "project", "attention_mse", "attention_kl",
    "hidden_mse", "embedding_mse", "cosine_hidden_loss", "soft_cross_entropy", "kl_divergence",
    "cross_entropy", "regression_mse", "round_f16", "patience_loss", "minilm_loss",
    "minilmv2_loss", "split_relation_heads",
]
