"""Fused attention (speed/attention.py, `train.attention`): the layers whose scores nothing reads
compute their context with jax.nn.dot_product_attention; the model's outputs, the asked-for
layers' logits and the gradients equal the model's own products' within 1e-5 in float32 (XLA's
implementation here; cuDNN's runs on a GPU: benchmarks/gpu_check.sh)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_tinybert.errors import UserError
from jax_tinybert.model.modeling import (PLAIN, BertConfig, BertForSequenceClassification,
                                         BertModel, random_params)
from jax_tinybert.speed import attention as fused, dots, dtypes as speed_dtypes

CFG = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                 intermediate_size=48, max_position_embeddings=32, num_labels=3)
XLA = fused.FusedAttention(PLAIN, "xla")


def _inputs(B=3, T=12, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, CFG.vocab_size, (B, T)).astype(np.int32)
    mask = np.ones((B, T), np.int32)
    mask[1, 7:] = 0     # right padding of different lengths
    mask[-1, 4:] = 0
    return ids, mask, np.zeros_like(ids)


def _out(model, params, *args, **kw):
    return model.apply({"params": params}, *args, **kw)


@pytest.mark.parametrize("layers", [(), (2,), (1, 3)])
def test_fused_layers_give_the_same_outputs_and_logits(layers):
    plain = BertModel(CFG)
    params = random_params(plain, 0)
    ids, mask, types = _inputs()
    a = _out(plain, params, ids, mask, types, attention_logits=layers)
    b = _out(plain.clone(products=XLA), params, ids, mask, types, attention_logits=layers)
    for x, y in zip(a.hidden_states, b.hidden_states):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(b.pooled), np.asarray(a.pooled), atol=1e-5)
    for i, (x, y) in enumerate(zip(a.attention_logits, b.attention_logits), 1):
        assert (x is None) == (y is None) == (i not in layers)
        if x is not None:
            np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-5)


def test_packed_rows_and_cls_only():
    """A [B, T, T] query x key mask (packed segments) and the last layer's [CLS] row only."""
    plain = BertForSequenceClassification(CFG)
    params = random_params(plain, 1)
    ids, _, types = _inputs(B=2, T=10, seed=1)
    seg = np.array([0] * 4 + [1] * 6)
    mask = np.broadcast_to((seg[:, None] == seg[None, :]).astype(np.int32), (2, 10, 10))
    pos = np.broadcast_to(np.concatenate([np.arange(4), np.arange(6)]), (2, 10))
    cls = np.array([[0, 4], [0, 4]], np.int32)
    kw = dict(position_ids=pos, cls_positions=cls, cls_only=True, attention_logits=False)
    a = _out(plain, params, ids, mask, types, **kw)
    b = _out(plain.clone(products=XLA), params, ids, mask, types, **kw)
    np.testing.assert_allclose(np.asarray(b.logits), np.asarray(a.logits), atol=1e-5)


@pytest.mark.parametrize("remat", [False, True])
def test_gradients_through_the_fused_layers(remat):
    plain = BertForSequenceClassification(CFG, remat=remat)
    params = jax.tree_util.tree_map(jnp.asarray, random_params(plain, 2))
    ids, mask, types = _inputs(seed=2)

    def loss(model):
        def f(p):
            out = _out(model, p, ids, mask, types, attention_logits=(2,))
            return jnp.sum(out.logits ** 2) + jnp.mean(out.attention_logits[1] ** 2)
        return jax.grad(f)(params)

    ga, gb = loss(plain), loss(plain.clone(products=XLA))
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(ga), jax.tree_util.tree_leaves(gb)):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-5, rtol=1e-4,
                                   err_msg=jax.tree_util.keystr(path))


def test_attention_dropout_keeps_the_models_products():
    """The fused op has no dropout: under attention dropout every layer computes as before, so
    the same dropout key gives the same outputs bit for bit."""
    plain = BertModel(CFG)
    params = random_params(plain, 3)
    ids, mask, types = _inputs(seed=3)
    key = {"dropout": jax.random.PRNGKey(7)}
    a = plain.apply({"params": params}, ids, mask, types, deterministic=False,
                    attention_logits=False, rngs=key)
    b = plain.clone(products=XLA).apply({"params": params}, ids, mask, types,
                                        deterministic=False, attention_logits=False, rngs=key)
    np.testing.assert_array_equal(np.asarray(b.last_hidden_state),
                                  np.asarray(a.last_hidden_state))


def test_what_auto_becomes_and_the_cudnn_shapes():
    assert fused.implementation("auto", "cpu", jnp.float32) is None
    assert fused.implementation("auto", "cpu", jnp.bfloat16) is None
    assert fused.implementation("auto", "gpu", jnp.bfloat16) == "cudnn"
    assert fused.implementation("auto", "gpu", jnp.float32) is None
    assert fused.implementation("auto", "tpu", jnp.bfloat16) is None
    assert fused.implementation("xla", "cpu", jnp.float32) == "xla"
    assert fused.implementation("off", "gpu", jnp.bfloat16) is None
    with pytest.raises(ValueError, match="train.attention='flash'"):
        fused.implementation("flash", "gpu", jnp.bfloat16)
    # cuDNN's kernel takes head sizes that are multiples of 8 (TinyBERT4's 26 is not) and even
    # lengths: other shapes keep the model's products (checked before any cuDNN call).
    cudnn = fused.FusedAttention(PLAIN, "cudnn")
    q = jnp.zeros((2, 12, 16, 26), jnp.bfloat16)
    assert cudnn.attention(q, q, q, jnp.zeros((2, 1, 1, 16)), jnp.bfloat16) is None
    q = jnp.zeros((2, 4, 15, 64), jnp.bfloat16)
    assert cudnn.attention(q, q, q, jnp.zeros((2, 1, 1, 15)), jnp.bfloat16) is None


def test_compute_dtypes_wrap_the_backends_products():
    half = speed_dtypes.compute_dtypes("bfloat16", "cpu")
    kw = fused.with_attention(half, "xla", "cpu", PLAIN)
    assert isinstance(kw["products"], fused.FusedAttention)
    assert isinstance(kw["products"].base, dots.HalfProducts)
    f32 = speed_dtypes.compute_dtypes("float32", "cpu")
    assert fused.with_attention(f32, "auto", "cpu", PLAIN) == {"dtype": jnp.float32}
    gpu = fused.with_attention(speed_dtypes.compute_dtypes("bfloat16", "gpu"), "auto", "gpu",
                               PLAIN)
    assert gpu["products"] == fused.FusedAttention(PLAIN, "cudnn")
    # 16-bit products with float32 activations, fused: within bfloat16's rounding of the plain
    plain = BertModel(CFG)
    params = random_params(plain, 4)
    ids, mask, types = _inputs(seed=4)
    a = _out(plain.clone(**half), params, ids, mask, types, attention_logits=False)
    b = _out(plain.clone(**kw), params, ids, mask, types, attention_logits=False)
    np.testing.assert_allclose(np.asarray(b.last_hidden_state), np.asarray(a.last_hidden_state),
                               atol=3e-2)


def test_cudnn_asked_for_where_it_cannot_run_is_one_line():
    from jax_tinybert.train import build

    with pytest.raises(UserError) as e:
        build.compute_dtypes("float32", "cudnn")
    msg = str(e.value)
    assert "config.train.attention='cudnn'" in msg and "--config.train.attention=auto" in msg
    assert "\n" not in msg


def test_the_config_reaches_both_models():
    from jax_tinybert.config import schema
    from jax_tinybert.train import build

    c = schema.base_config()
    c.train.attention = "xla"
    assert build.teacher_module(c, CFG, True).products == XLA
    assert build.student_module(c, CFG).products == XLA
    c.train.attention = "auto"     # on a CPU: the model's own products
    assert build.student_module(c, CFG).products is None
