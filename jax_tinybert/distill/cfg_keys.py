"""The keys an objective cfg (config.objective, less its name) may hold, and what each means.

Kept apart from objectives.py, which declares each objective's defaults for these keys.
"""
from __future__ import annotations

from jax_tinybert.distill import layer_maps as lm

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
