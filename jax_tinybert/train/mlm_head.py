"""Fit a masked-LM head on top of any BERT encoder, so that encoders without one (sentence-
transformers such as the packaged all-MiniLM-L6-v2, fine-tuned classifiers) can drive TinyBERT
data augmentation (jax_tinybert/data/augment.py, mode "mlm").

The head is BERT's: transform (dense D -> D, gelu, LayerNorm) then a decoder tied to the encoder's
word embeddings plus a per-token bias, with HF `BertForMaskedLM` names (`cls.predictions.*`), so
the exported folder loads in `hf.load_pretrained(..., mlm_head=True)` and in transformers.

Loss (the BERT masking of Devlin et al. 2019): per sequence, `rate` of the real non-special tokens
(at least 1, at most `max_predictions`) are chosen; 80% of them become [MASK], 10% a random token,
10% stay; the loss is the mean cross-entropy of the original token at the chosen positions:

    L = -1/|M| sum_{(b, m) in M} log softmax(E · LN(gelu(W h_{b, pos_bm} + c)) + bias)[label_bm]

With the encoder frozen (default) only W, c, the LayerNorm and the bias train; the tied E stays the
encoder's. The bias starts at the log unigram frequency of the training tokens, so step 0 already
predicts the frequency prior.
"""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Dict, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_tinybert.train import build, workdir_lock
from jax_tinybert import fs
from jax_tinybert.config.check import ConfigValueError
from jax_tinybert.data import corpus as corpus_lib
from jax_tinybert.data import tokenize
from jax_tinybert.model.export import export_hf
from jax_tinybert.model.hf import bert_params, load_pretrained
from jax_tinybert.model.modeling import BertConfig, BertModel, _MLMHead

log = logging.getLogger(__name__)

Array = jax.Array


# ----------------------------------------------------------------------------- masking

def mask_batch(input_ids: np.ndarray, attention_mask: np.ndarray, rng: np.random.Generator, *,
               mask_id: int, vocab_size: int, special_ids: Sequence[int],
               max_predictions: int = 20, rate: float = 0.15
               ) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """BERT masking of a batch (host side, numpy).

    input_ids, attention_mask: int [B, T]. Returns (inputs int32 [B, T], positions int32 [B, M],
    labels int32 [B, M], weights float32 [B, M]) with M = max_predictions; unused prediction
    slots have weight 0 (position 0, label 0).
    """
    ids = np.asarray(input_ids)
    B, T = ids.shape
    M = int(max_predictions)
    inputs = ids.astype(np.int32).copy()
    positions = np.zeros((B, M), np.int32)
    labels = np.zeros((B, M), np.int32)
    weights = np.zeros((B, M), np.float32)
    eligible = (np.asarray(attention_mask) > 0) & ~np.isin(ids, np.asarray(list(special_ids)))
    for b in range(B):
        cand = np.flatnonzero(eligible[b])
        if len(cand) == 0:
            continue
        k = int(min(M, max(1, round(rate * len(cand)))))
        pos = np.sort(rng.choice(cand, size=k, replace=False))
        positions[b, :k], labels[b, :k], weights[b, :k] = pos, ids[b, pos], 1.0
        u = rng.random(k)
        inputs[b, pos[u < 0.8]] = mask_id
        rnd = pos[(u >= 0.8) & (u < 0.9)]
        inputs[b, rnd] = rng.integers(0, vocab_size, size=len(rnd))
    return inputs, positions, labels, weights


# ----------------------------------------------------------------------------- the head

def init_head(config: BertConfig, rng: Array, log_prior: Optional[np.ndarray] = None) -> dict:
    """Head params {"predictions": {"transform": {"dense", "LayerNorm"}, "bias" [V]}} (HF names);
    `log_prior` [V] (log unigram frequencies) initialises the bias."""
    D, V = config.hidden_size, config.vocab_size
    params = _MLMHead(config).init(rng, jnp.zeros((1, D)), jnp.zeros((V, D)))["params"]
    params = jax.tree_util.tree_map(np.asarray, params)
    if log_prior is not None:
        params["predictions"]["bias"] = np.asarray(log_prior, np.float32).reshape(V)
    return params


def log_unigram_prior(token_ids: np.ndarray, vocab_size: int, smoothing: float = 1.0
                      ) -> np.ndarray:
    """log((count + smoothing) / sum) over the vocabulary, float32 [V]."""
    counts = np.bincount(np.asarray(token_ids).ravel(), minlength=vocab_size)[:vocab_size]
    p = (counts + smoothing) / (counts.sum() + smoothing * vocab_size)
    return np.log(p).astype(np.float32)


def masked_lm_loss(head_params: dict, hidden: Array, embedding: Array, positions: Array,
                   labels: Array, weights: Array, config: BertConfig
                   ) -> Tuple[Array, Dict[str, Array]]:
    """Mean cross-entropy at the masked positions (the formula in the module docstring).

    hidden [B, T, D] (encoder output), embedding [V, D] (tied decoder), positions/labels
    int [B, M], weights [B, M] (0 = unused slot). Returns (loss, {"correct", "count"}), the
    last two sums for the masked-token accuracy.
    """
    h = jnp.take_along_axis(hidden, positions[..., None], axis=1)          # [B, M, D]
    logits = _MLMHead(config).apply({"params": head_params}, h, embedding)  # [B, M, V]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    w = weights.astype(jnp.float32)
    count = jnp.sum(w)
    loss = jnp.sum(w * nll) / jnp.maximum(count, 1.0)
    correct = jnp.sum(w * (jnp.argmax(logits, -1) == labels))
    return loss, {"correct": correct, "count": count}


def make_steps(config: BertConfig, tx: optax.GradientTransformation, freeze_encoder: bool = True):
    """(train_step, eval_step), both jitted.

    train_step(params, opt_state, inputs, mask, positions, labels, weights) ->
    (params, opt_state, loss, stats); params = {"bert": ..., "cls": ...}. With freeze_encoder only
    params["cls"] changes (the encoder's forward is outside the gradient).
    eval_step(params, inputs, mask, positions, labels, weights) -> (loss, stats).
    """
    bert = BertModel(config, add_pooling_layer=False)

    def encode(bert_params, inputs, mask):
        out = bert.apply({"params": bert_params}, inputs, mask, None, deterministic=True,
                         attention_logits=False)
        return out.hidden_states[-1]

    def emb(bert_params):
        return bert_params["embeddings"]["word_embeddings"]["embedding"]

    def loss_fn(trainable, frozen, inputs, mask, positions, labels, weights):
        p = {**frozen, **trainable}
        hidden = encode(p["bert"], inputs, mask)
        return masked_lm_loss(p["cls"], hidden, emb(p["bert"]), positions, labels, weights, config)

    def train_step(params, opt_state, inputs, mask, positions, labels, weights):
        keys = ("cls",) if freeze_encoder else ("bert", "cls")
        trainable = {k: params[k] for k in keys}
        frozen = {k: v for k, v in params.items() if k not in keys}
        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            trainable, frozen, inputs, mask, positions, labels, weights)
        updates, opt_state = tx.update(grads, opt_state, trainable)
        trainable = optax.apply_updates(trainable, updates)
        return {**params, **trainable}, opt_state, loss, stats

    def eval_step(params, inputs, mask, positions, labels, weights):
        return loss_fn({}, params, inputs, mask, positions, labels, weights)

    return jax.jit(train_step), jax.jit(eval_step)


# ----------------------------------------------------------------------------- the stage

def _split(n: int, eval_sequences: int) -> Tuple[np.ndarray, np.ndarray]:
    """(train, eval) sequence indices: every k-th sequence is held out, spread over the corpus."""
    if n < 2:
        raise ConfigValueError(f"mlm_head: the corpus packs into {n} sequence(s); need at least 2 "
                         "(one to train on, one held out)")
    n_eval = int(min(max(1, eval_sequences), n // 2))
    ev = np.unique(np.linspace(0, n - 1, n_eval).round().astype(np.int64))
    return np.setdiff1d(np.arange(n), ev), ev


def evaluate(eval_step, params, ds, indices, seq_len, batch_size, mask_kw, seed=1234) -> dict:
    """Masked-token accuracy and loss over `indices` with a fixed masking (same every call)."""
    rng = np.random.default_rng(seed)
    correct = count = loss_sum = 0.0
    for s in range(0, len(indices), batch_size):
        b = ds.gather(indices[s:s + batch_size], seq_len)
        inputs, pos, lab, w = mask_batch(b["input_ids"], b["attention_mask"], rng, **mask_kw)
        loss, st = eval_step(params, inputs, b["attention_mask"], pos, lab, w)
        correct += float(st["correct"])
        count += float(st["count"])
        loss_sum += float(loss) * float(st["count"])
    return {"masked_token_acc": correct / max(count, 1.0), "loss": loss_sum / max(count, 1.0),
            "masked_tokens": int(count)}


def fit(config, workdir: str) -> dict:
    """The mlm_head stage (configs/mlm_head.py): fit, evaluate on held-out text, export.

    Writes <workdir>/export (HF BertForMaskedLM folder), <workdir>/summary.json (masked-token
    accuracy before/after, steps, wall time) and returns the summary. A finished workdir (its
    summary.json exists) is not refitted.
    """
    workdir = fs.abspath(workdir)
    done = fs.join(workdir, "summary.json")
    if fs.exists(done):
        with fs.open_file(done) as fh:
            return json.load(fh)
    m, tc = config.mlm, config.train
    if not config.data.corpus:
        raise ConfigValueError("config.data.corpus is empty: pass --config.data.corpus=FILE_OR_FOLDER "
                         "(plain text, e.g. ../shared/data/corpus)")
    if not 0.0 < float(m.mask_rate) < 1.0 or int(m.max_predictions) < 1:
        raise ConfigValueError(f"config.mlm.mask_rate={m.mask_rate} must be in (0, 1) and "
                         f"config.mlm.max_predictions={m.max_predictions} >= 1")
    if int(tc.num_steps) < 1:
        raise ConfigValueError("config.train.num_steps must be >= 1 for the mlm_head stage")
    with workdir_lock.hold(workdir):
        return _fit(config, workdir, done)


def _fit(config, workdir: str, done: str) -> dict:
    m, tc = config.mlm, config.train
    t0 = time.time()
    enc_path = str(build.resolve_model_path(m.encoder))
    tok = tokenize.load_tokenizer(enc_path)
    bcfg, params = load_pretrained(enc_path, for_classification=False)
    bert = jax.tree_util.tree_map(np.asarray, bert_params(params))
    seq_len = int(config.data.seq_len)
    files = [f.strip() for f in str(config.data.corpus).split(",") if f.strip()]
    ds = corpus_lib.packed_corpus(files if len(files) > 1 else files[0], tok, seq_len,
                                  cache_dir=config.data.cache_dir
                                  or os.path.join(workdir, "cache"))
    train_idx, eval_idx = _split(len(ds), int(m.eval_sequences))
    is_train = np.zeros(len(ds), bool)
    is_train[train_idx] = True
    prior = log_unigram_prior(np.asarray(ds.input_ids)[np.repeat(is_train, ds.lengths)],
                              bcfg.vocab_size)
    head = init_head(bcfg, jax.random.PRNGKey(int(tc.seed)), prior)
    state = {"bert": bert, "cls": head}
    steps = int(tc.num_steps)
    tx, schedule = build.build_optimizer(config, steps)
    freeze = bool(m.freeze_encoder)
    opt_state = tx.init({"cls": head} if freeze else state)
    train_step, eval_step = make_steps(bcfg, tx, freeze_encoder=freeze)
    mask_kw = dict(mask_id=tok.mask_token_id, vocab_size=bcfg.vocab_size,
                   special_ids=tok.all_special_ids, max_predictions=int(m.max_predictions),
                   rate=float(m.mask_rate))
    ev_bs = int(tc.eval_batch_size)
    print(f"[mlm_head] encoder {enc_path} ({'frozen' if freeze else 'trained'}), corpus "
          f"{len(ds)} sequences of <= {seq_len} tokens: {len(train_idx)} train, {len(eval_idx)} "
          f"held out; {steps} steps of {tc.batch_size}", flush=True)
    before = evaluate(eval_step, state, ds, eval_idx, seq_len, ev_bs, mask_kw)
    print(f"eval step 0 (unigram prior only): masked_token_acc="
          f"{before['masked_token_acc']:.4f} loss={before['loss']:.3f}", flush=True)
    history = [{"step": 0, **before}]
    rng = np.random.default_rng(int(tc.seed))
    order, cursor = rng.permutation(train_idx), 0
    t_last, acc_c, acc_n = time.time(), 0.0, 0.0
    for step in range(1, steps + 1):
        if cursor + tc.batch_size > len(order):
            order, cursor = rng.permutation(train_idx), 0
        idx = order[cursor:cursor + tc.batch_size]
        cursor += tc.batch_size
        b = ds.gather(np.sort(idx), seq_len)
        inputs, pos, lab, w = mask_batch(b["input_ids"], b["attention_mask"], rng, **mask_kw)
        state, opt_state, loss, st = train_step(state, opt_state, inputs, b["attention_mask"],
                                                pos, lab, w)
        # Summed on the device: a float() here would wait for every step (no async dispatch).
        acc_c = acc_c + st["correct"]
        acc_n = acc_n + st["count"]
        if step % tc.log_every == 0 or step == steps:
            if not np.isfinite(float(loss)):
                raise FloatingPointError(f"mlm_head: non-finite loss at step {step}; lower "
                                         "config.optim.learning_rate")
            dt = time.time() - t_last
            print(f"step {step:>6}/{steps} loss={float(loss):.3f} train_acc="
                  f"{float(acc_c) / max(float(acc_n), 1.0):.4f} lr={float(schedule(step)):.2e} "
                  f"{tc.log_every * tc.batch_size / dt:.1f} seq/s", flush=True)
            t_last, acc_c, acc_n = time.time(), 0.0, 0.0
        if (tc.eval_every and step % tc.eval_every == 0) or step == steps:
            ev = evaluate(eval_step, state, ds, eval_idx, seq_len, ev_bs, mask_kw)
            history.append({"step": step, **ev})
            print(f"eval step {step}: masked_token_acc={ev['masked_token_acc']:.4f} "
                  f"loss={ev['loss']:.3f}", flush=True)
    host = jax.tree_util.tree_map(np.asarray, jax.device_get(state))
    export_dir = export_hf(bcfg, host, fs.join(workdir, "export"), tokenizer_dir=enc_path)
    summary = {"stage": "mlm_head", "encoder": enc_path, "freeze_encoder": freeze,
               "steps": steps, "batch_size": int(tc.batch_size), "seq_len": seq_len,
               "train_sequences": int(len(train_idx)), "eval_sequences": int(len(eval_idx)),
               "before": before, "after": history[-1], "eval_history": history,
               "wall_s": time.time() - t0, "export": export_dir}
    fs.makedirs(workdir)
    fs.write_json_atomic(done, summary, indent=1, default=float)
    print(f"[mlm_head] done in {summary['wall_s']:.0f}s; held-out masked-token accuracy "
          f"{before['masked_token_acc']:.4f} -> {history[-1]['masked_token_acc']:.4f}; "
          f"exported to {export_dir}", flush=True)
    return summary


__all__ = ["mask_batch", "init_head", "log_unigram_prior", "masked_lm_loss", "make_steps",
           "evaluate", "fit"]
