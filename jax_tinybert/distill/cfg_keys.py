"""The keys an objective cfg (config.objective, less its name) may hold, what each means, and
`resolve_cfg`: a cfg with an objective's defaults filled in, its values checked.

Kept apart from objectives.py, which declares each objective's defaults for these keys.
"""
from __future__ import annotations

from typing import Any

from jax_tinybert.distill import layer_maps as lm
from jax_tinybert.distill import losses
from jax_tinybert.errors import UserError

PROJECTIONS = ("shared", "per_layer", "none")
ATTN_LOSS_NAMES = ("mse", "kl")
HIDN_LOSS_NAMES = ("mse", "cosine")
KD_LOSSES = ("ce", "mse")


class ObjectiveConfigError(UserError, ValueError):
    """An objective cfg value that this objective or these models cannot run with."""

# Every key a stage's objective cfg may hold. A key an objective does not use is ignored, so a
# config can share one block across stages; a misspelt key is an error.
CFG_KEYS = {
    "mode": "'masked' (padding never counts) or 'tinybert' (official reductions)",
    "temperature": "softmax temperature of the soft-label terms",
    "alpha": "pkd/kd: weight of the KD term; the hard-label term gets 1 - alpha",
    "beta": "pkd: weight of the patience term (masked mode sums over K layers x D units, "
            "tinybert mode averages: beta_masked = beta_tinybert / (K * D))",
    "t2": "multiply soft-label terms by temperature^2",
    "layer_map": f"one of {lm.NAMES} or explicit (student, teacher) pairs",
    "projection": "'shared' (one fit_dense, as official), 'per_layer' or 'none'",
    "w_embd": "tinybert_intermediate: weight of the embedding term",
    "w_attn": "tinybert_intermediate: weight of the attention terms",
    "w_hidn": "tinybert_intermediate: weight of the hidden-state terms",
    "attn_loss": "tinybert_intermediate: the attention terms' loss, 'mse' (TinyBERT: MSE of the "
                 "raw scores) or 'kl' (KL(teacher || student) of the attention distributions "
                 "over real keys, TextBrewer's attention_ce / MiniLM's; masked mode only)",
    "hidn_loss": "tinybert_intermediate: the embedding and hidden-state terms' loss, 'mse' "
                 "(TinyBERT) or 'cosine' (1 - cos per token, DistilBERT's / TextBrewer's cos)",
    "kd_loss": "tinybert_pred, kd, pkd on classification: the soft-label term, 'ce' (the "
               "prediction stage's soft CE, KD's and PKD's KL) or 'mse' (MSE of the logits / T, "
               "x T^2 with t2: TextBrewer's kd_mse, Ba & Caruana's logit regression)",
    "probability_shift": "tinybert_pred, kd, pkd on classification: swap the teacher's largest "
                         "logit with the gold label's where they differ, so the soft targets "
                         "peak at the gold label (TextBrewer's probability_shift)",
    "w_pred": "tinybert_pred: weight of the prediction term",
    "normalize_patience": "pkd: L2-normalise [CLS] vectors before the patience MSE",
    "layer_weights": "tinybert_intermediate: lambda_m per student layer 0..M (default all 1)",
    "regression_target": "tinybert_pred on regression: 'teacher' (clean) or 'gold' (official "
                         "STS-B bug, tinybert mode only)",
    "teacher_layer": "minilm, minilmv2: the 1-based teacher layer distilled into the student's "
                     "last (default the teacher's last)",
    "relation_heads": "minilmv2: relation heads A_r (both widths must divide by it; default "
                      "the teacher's head count, 64 for a teacher of width >= 1024)",
}


def _as_dict(cfg: Any) -> dict:
    if cfg is None:
        return {}
    if hasattr(cfg, "to_dict"):  # ml_collections.ConfigDict / FrozenConfigDict
        return dict(cfg.to_dict())
    return dict(cfg)


def resolve_cfg(name: str, defaults: dict, cfg: Any) -> dict:
    """defaults, overridden by the keys of cfg that are not None; checked."""
    cfg = _as_dict(cfg)
    unknown = sorted(set(cfg) - set(CFG_KEYS))
    if unknown:
        valid = "\n".join(f"  {k}: {v}" for k, v in CFG_KEYS.items())
        raise ObjectiveConfigError(f"objective '{name}': unknown cfg key(s) {unknown}; valid keys:\n{valid}")
    out = dict(defaults)
    out.update({k: v for k, v in cfg.items() if v is not None or k == "layer_weights"})
    if out["layer_weights"] is not None and len(out["layer_weights"]) == 0:
        out["layer_weights"] = None   # the config's () = every layer weighted 1
    losses.check_mode(out["mode"])
    if out["projection"] not in PROJECTIONS:
        raise ObjectiveConfigError(f"objective '{name}': cfg projection={out['projection']!r}; expected "
                         f"one of {PROJECTIONS}")
    if not float(out["temperature"]) > 0:
        raise ObjectiveConfigError(f"objective '{name}': cfg temperature must be > 0, "
                         f"got {out['temperature']!r}")
    if not 0.0 <= float(out["alpha"]) <= 1.0:
        raise ObjectiveConfigError(f"objective '{name}': cfg alpha must be in [0, 1], got {out['alpha']!r}")
    for key, kinds in (("attn_loss", ATTN_LOSS_NAMES), ("hidn_loss", HIDN_LOSS_NAMES),
                       ("kd_loss", KD_LOSSES)):
        if out[key] not in kinds:
            raise ObjectiveConfigError(f"objective '{name}': cfg {key}={out[key]!r}; expected one "
                                       f"of {tuple(kinds)}")
    if out["regression_target"] not in ("teacher", "gold"):
        raise ObjectiveConfigError(f"objective '{name}': cfg regression_target must be 'teacher' or 'gold', "
                         f"got {out['regression_target']!r}")
    for k in ("temperature", "alpha", "beta", "w_embd", "w_attn", "w_hidn", "w_pred"):
        if out[k] is not None:  # only pkd's beta defaults to None (resolved per mode and shape)
            out[k] = float(out[k])
    out["t2"] = bool(out["t2"])
    out["normalize_patience"] = bool(out["normalize_patience"])
    out["probability_shift"] = bool(out["probability_shift"])
    return out
