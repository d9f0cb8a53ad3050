"""Fit a masked-LM head on top of a BERT encoder that has none (the packaged all-MiniLM-L6-v2, a
fine-tuned classifier export), on unlabelled text, and export an HF BertForMaskedLM folder that
data augmentation can use (`python -m jax_tinybert.data.augment --mlm <workdir>/export`).

    python -m jax_tinybert.main --config=configs/mlm_head.py --workdir=runs/mlm_head \
        --config.data.corpus=../shared/data/corpus
    # on a fine-tuned teacher instead of the packaged encoder:
    python -m jax_tinybert.main --config=configs/mlm_head.py --workdir=runs/sst2/mlm_head \
        --config.data.corpus=../shared/data/corpus --config.mlm.encoder=runs/sst2/teacher/export

The encoder is frozen by default (only the head trains: transform dense + gelu + LayerNorm and the
output bias; the decoder is tied to the encoder's word embeddings). --config.mlm.freeze_encoder=False
fine-tunes the encoder too. Masking: BERT's 15% (80% [MASK] / 10% random / 10% kept). The summary
reports the masked-token accuracy on held-out corpus sequences (never trained on).
"""
import ml_collections

from jax_tinybert.config.schema import base_config, parse_variant


def get_config(arg: str = ""):
    parse_variant(arg, "configs/mlm_head.py", default="", names=())  # the encoder: config.mlm
    c = base_config()
    c.stage = "mlm_head"
    c.mlm = ml_collections.ConfigDict(dict(
        encoder="packaged",      # HF BERT folder (a classifier export is fine) or "packaged"
        freeze_encoder=True,
        mask_rate=0.15,
        max_predictions=20,      # per sequence (BERT's 20 for length 128)
        eval_sequences=512,      # held-out corpus sequences for the masked-token accuracy
    ))
    c.data.kind = "corpus"
    c.data.corpus = ""
    c.data.seq_len = 128
    c.optim.learning_rate = 1e-3   # the head only; use ~5e-5 with freeze_encoder=False
    c.optim.schedule = "warmup_linear"
    c.optim.warmup_ratio = 0.05
    c.train.batch_size = 32
    c.train.num_steps = 2000
    c.train.eval_every = 500
    c.train.log_every = 50
    c.train.eval_batch_size = 64
    return c
