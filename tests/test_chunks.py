"""The train step's forwards in row chunks (step.num_chunks, train.chunk_tokens)."""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_tinybert.train import build
from jax_tinybert.config import schema as config_base
from jax_tinybert.distill import objectives as O
from jax_tinybert.train import step as step_lib
from jax_tinybert.model.modeling import BertConfig, BertForSequenceClassification, random_params

B, T = 32, 16


@pytest.mark.parametrize("batch,seq,tokens,expect", [
    (32, 128, 1024, 4),    # 32 -> 16 -> 8 rows of 128 = 1,024 tokens
    (32, 64, 1024, 2),
    (32, 80, 1024, 4),     # 16 rows are 1,280 tokens: 8
    (32, 48, 1024, 2),     # 16 rows are 768 tokens
    (32, 16, 1024, 1),     # the whole batch is 512 tokens
    (30, 128, 1024, 2),    # 15 rows: an odd count is not halved
    (64, 512, 1024, 8),    # 8 rows at least, though they hold 4,096 tokens
    (16, 512, 1024, 2),
    (7, 128, 1024, 1),
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
    lengths = np.tile([16, 3, 9, 16, 5, 12, 7, 14], B // 8)
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
    # NumPy draws: `init_params` would run both models op by op (~15 s of one-op compilations).
    params = {"student": random_params(student, 0),
              "proj": obj.init_projection(jax.random.PRNGKey(2))}
    teacher_params = random_params(teacher, 1)

    def loss_and_grads(tokens):
        loss_fn = step_lib.make_loss_fn(student, teacher, obj, student_dropout=False,
                                        chunk_tokens=tokens)
        (loss, terms), g = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(
            params, teacher_params, batch, jax.random.PRNGKey(3))
        return float(loss), g

    ref, g_ref = loss_and_grads(0)
    # 128 tokens: 8 rows a chunk, 4 chunks (how many a token budget gives: test_num_chunks;
    # 2 chunks, the same code, compiled another ~9 s here for no other path).
    loss, g = loss_and_grads(128)
    assert loss == pytest.approx(ref, rel=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(g_ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_chunked_forward_gives_each_row_its_own_outputs():
    # The losses are means over the batch, blind to an order the two models share: compare rows.
    model = BertForSequenceClassification(_cfg(2, 8))
    batch = _batch(1)
    params = random_params(model, 0)
    kw = dict(deterministic=True, rng=None, attention_logits=(1, 2))
    whole = step_lib._apply(model, params, batch, **kw)
    for tokens in (128, 256):   # 4 and 2 chunks
        out = step_lib._apply_chunked(model, params, batch, tokens, **kw)
        for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(whole)):
            assert a.shape == b.shape
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_chunks_with_dropout_draw_masks_of_their_own():
    # 32 equal rows in 4 chunks of 8: with the whole batch's key reused in every chunk, row i
    # would come out as rows i + 8, i + 16 and i + 24 do.
    cfg = _cfg(2, 8).replace(hidden_dropout_prob=0.5, attention_probs_dropout_prob=0.5)
    model = BertForSequenceClassification(cfg)
    row = _batch()
    batch = {k: jnp.repeat(row[k][:1], B, axis=0) for k in step_lib.MODEL_KEYS}
    params = random_params(model, 0)
    assert step_lib.num_chunks(B, T, 8 * T) == 4
    out = step_lib._apply_chunked(model, params, batch, 8 * T, deterministic=False,
                                  rng=jax.random.PRNGKey(5), attention_logits=False)
    h = np.asarray(out.hidden_states[-1]).reshape(4, 8, T, 8)
    assert all(not np.allclose(h[i], h[j]) for i in range(4) for j in range(i + 1, 4))
    # Without dropout, the rows are equal, and equal to the whole batch's forward.
    det = step_lib._apply_chunked(model, params, batch, 8 * T, deterministic=True, rng=None,
                                  attention_logits=False)
    whole = step_lib._apply(model, params, batch, deterministic=True, rng=None,
                            attention_logits=False)
    np.testing.assert_allclose(np.asarray(det.logits), np.asarray(whole.logits), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(np.asarray(det.logits)[1:],
                               np.asarray(det.logits)[:1].repeat(B - 1, 0), rtol=1e-5, atol=1e-6)


def _mesh(n):
    return types.SimpleNamespace(devices=np.zeros(n))


@pytest.mark.parametrize("value,devices,backend,steps,buckets,expect", [
    (-1, 1, "cpu", 500, 5, 1024),       # 100 steps a bucket
    (-1, 1, "cpu", 224, 5, 0),          # MRPC's 2-epoch intermediate stage: 45 a bucket
    (-1, 1, "cpu", 100, 1, 1024),
    (-1, 1, "cpu", 199, 2, 0),             # 99 steps a bucket
    (-1, 8, "cpu", 5000, 1, 0),         # simulated devices: no chunks
    (-1, 1, "gpu", 5000, 1, 0),
    (-1, 1, "tpu", 5000, 1, 0),
    (0, 1, "cpu", 5000, 1, 0),
    (512, 1, "cpu", 10, 5, 512),
    (2048, 1, "gpu", 10, 5, 2048),
])
def test_chunk_tokens_auto(monkeypatch, value, devices, backend, steps, buckets, expect):
    from jax_tinybert import speed

    config = config_base.base_config()
    config.train.chunk_tokens = value
    resolved, _ = speed.resolve(config, backend, speed.RunFacts(steps, steps, buckets, devices))
    assert resolved.train.chunk_tokens == expect


def test_the_log_line_says_what_is_chunked():
    assert build._chunks_note(1024, object()) == (
        "; the teacher's and the student's forwards in row chunks of <= 1024 tokens "
        "(train.chunk_tokens)")
    assert build._chunks_note(512, None) == "; the student's forward in row chunks of <= 512 " \
                                            "tokens (train.chunk_tokens)"
    assert build._chunks_note(0, object()) == ""


@pytest.mark.parametrize("steps,expect", [(1000, 1024), (20, 0)])
def test_build_step_reports_the_chunks_its_loss_runs(steps, expect):
    from jax_tinybert.cli import plan
    from jax_tinybert.model.modeling import init_params

    if jax.default_backend() != "cpu" or jax.device_count() != 1:
        pytest.skip("the auto rule chunks on one CPU device only")
    tcfg, scfg = _cfg(4, 12), _cfg(2, 8)
    config = plan.plan_config(objective="tinybert_intermediate")
    obj = build.build_objective(config, scfg, tcfg)
    teacher = build.teacher_module(config, tcfg, classifier=True)
    built = build.build_step(config, student=build.student_module(config, scfg),
                             teacher=teacher, objective=obj,
                             student_params=init_params(BertForSequenceClassification(scfg),
                                                        jax.random.PRNGKey(1)),
                             teacher_params=init_params(teacher, jax.random.PRNGKey(0)),
                             mesh=build.make_mesh(config), total_steps=steps)
    assert built.chunk_tokens == expect
