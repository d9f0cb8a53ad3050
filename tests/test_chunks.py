"""The train step's forwards in row chunks (step.num_chunks, train.chunk_tokens)."""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_tinybert import build, config_base
from jax_tinybert import objectives as O
from jax_tinybert import step as step_lib
from jax_tinybert.modeling import BertConfig, BertForSequenceClassification

B, T = 8, 16


@pytest.mark.parametrize("batch,seq,tokens,expect", [
    (32, 128, 1024, 4),    # 8 rows of 128 = 1,024 tokens
    (32, 64, 1024, 2),
    (32, 80, 1024, 4),     # 12 rows fit, 8 is the largest divisor of 32 that does
    (32, 16, 1024, 1),     # the whole batch is 512 tokens
    (30, 128, 1024, 5),    # 6 rows of 30
    (7, 128, 1024, 1),
    (7, 512, 1024, 7),     # 2 rows fit; 7 is prime
    (3, 5000, 1024, 3),    # one row even when it holds more
    (32, 128, 0, 1),       # 0: whole
])
def test_num_chunks(batch, seq, tokens, expect):
    assert step_lib.num_chunks(batch, seq, tokens) == expect


def _cfg(layers, hidden):
    return BertConfig(vocab_size=40, hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=2, intermediate_size=2 * hidden,
                      max_position_embeddings=T, num_labels=2)


def _batch(seed=0):
    r = np.random.default_rng(seed)
    lengths = np.array([16, 3, 9, 16, 5, 12, 7, 14])
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.int32)
    return {"input_ids": jnp.asarray(r.integers(1, 40, (B, T)) * mask, jnp.int32),
            "attention_mask": jnp.asarray(mask),
            "token_type_ids": jnp.zeros((B, T), jnp.int32),
            "labels": jnp.asarray(r.integers(0, 2, B), jnp.int32),
            "valid": jnp.ones(B, jnp.float32)}


@pytest.mark.parametrize("name", ["tinybert_intermediate", "tinybert_pred"])
def test_chunked_forwards_give_the_same_loss_and_gradients(name):
    s_cfg, t_cfg = _cfg(2, 8), _cfg(4, 12)
    student, teacher = BertForSequenceClassification(s_cfg), BertForSequenceClassification(t_cfg)
    obj = O.make_objective(name, {"mode": "tinybert"}, s_cfg, t_cfg)
    batch = _batch()
    init = lambda m, seed: m.init(jax.random.PRNGKey(seed), batch["input_ids"],
                                  attention_logits=False)["params"]
    params = {"student": init(student, 0), "proj": obj.init_projection(jax.random.PRNGKey(2))}
    teacher_params = init(teacher, 1)

    def loss_and_grads(tokens):
        loss_fn = step_lib.make_loss_fn(student, teacher, obj, student_dropout=False,
                                        chunk_tokens=tokens)
        (loss, terms), g = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(
            params, teacher_params, batch, jax.random.PRNGKey(3))
        return float(loss), g

    ref, g_ref = loss_and_grads(0)
    # 32 tokens: 2 rows a chunk, 4 chunks; 48: 3 rows fit, so 2 chunks of 4.
    for tokens in (32, 48):
        loss, g = loss_and_grads(tokens)
        assert loss == pytest.approx(ref, rel=1e-5), tokens
        for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(g_ref)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_chunks_with_dropout_draw_masks_of_their_own():
    # Four equal rows, one a chunk: with the whole batch's key reused in every chunk, all four
    # would come out equal.
    cfg = _cfg(2, 8).replace(hidden_dropout_prob=0.5, attention_probs_dropout_prob=0.5)
    model = BertForSequenceClassification(cfg)
    row = _batch()
    batch = {k: jnp.repeat(row[k][:1], 4, axis=0) for k in step_lib.MODEL_KEYS}
    params = model.init(jax.random.PRNGKey(0), batch["input_ids"],
                        attention_logits=False)["params"]
    out = step_lib._apply_chunked(model, params, batch, T, deterministic=False,
                                  rng=jax.random.PRNGKey(5), attention_logits=False)
    h = np.asarray(out.hidden_states[-1])
    assert h.shape == (4, T, 8)
    assert all(not np.allclose(h[i], h[j]) for i in range(4) for j in range(i + 1, 4))
    # Without dropout, the rows are equal, and equal to the whole batch's forward.
    det = step_lib._apply_chunked(model, params, batch, T, deterministic=True, rng=None,
                                  attention_logits=False)
    whole = step_lib._apply(model, params, batch, deterministic=True, rng=None,
                            attention_logits=False)
    np.testing.assert_allclose(np.asarray(det.logits), np.asarray(whole.logits), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(np.asarray(det.logits)[1:], np.asarray(det.logits)[:1].repeat(3, 0),
                               rtol=1e-5, atol=1e-6)


def _mesh(n):
    return types.SimpleNamespace(devices=np.zeros(n))


@pytest.mark.parametrize("value,devices,backend,steps,buckets,expect", [
    (-1, 1, "cpu", 500, 5, 1024),       # 100 steps a bucket
    (-1, 1, "cpu", 224, 5, 0),          # MRPC's 2-epoch intermediate stage: 45 a bucket
    (-1, 1, "cpu", 100, 1, 1024),
    (-1, 8, "cpu", 5000, 1, 0),         # simulated devices: no chunks
    (-1, 1, "gpu", 5000, 1, 0),
    (-1, 1, "tpu", 5000, 1, 0),
    (0, 1, "cpu", 5000, 1, 0),
    (512, 1, "cpu", 10, 5, 512),
    (2048, 1, "gpu", 10, 5, 2048),
])
def test_chunk_tokens_auto(monkeypatch, value, devices, backend, steps, buckets, expect):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    config = config_base.base_config()
    config.train.chunk_tokens = value
    assert build.chunk_tokens(config, _mesh(devices), steps, buckets) == expect


def test_the_log_line_says_what_is_chunked(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    config = config_base.base_config()
    note = lambda steps, teacher: build._chunks_note(config, _mesh(1), steps, 2, teacher)
    assert note(1000, object()) == ("; the teacher's and the student's forwards in row chunks of "
                                    "<= 1024 tokens (train.chunk_tokens)")
    assert note(1000, None) == "; the student's forward in row chunks of <= 1024 tokens " \
                               "(train.chunk_tokens)"
    assert note(199, object()) == ""   # 99 steps a bucket
