"""Loss terms against NumPy re-statements of the formulas (docs/losses.md), both modes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_tinybert.distill import losses as L

B, H, T, D, C = 3, 2, 6, 5, 4
LENGTHS = (6, 4, 2)
VALID = np.array([1.0, 0.0, 1.0], np.float32)


def _mask(lengths=LENGTHS, t=T):
    return (np.arange(t)[None, :] < np.array(lengths)[:, None]).astype(np.int32)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


# --------------------------------------------------------------------------- numpy references

def np_attention_mse(s, t, mask, mode, valid=None):
    s, t = s.astype(np.float64), t.astype(np.float64)
    b_, h_, t_, _ = s.shape
    w = np.ones(b_) if valid is None else valid.astype(np.float64)
    if mode == "tinybert":
        per_ex = np.zeros(b_)
        for b in range(b_):
            add = (1.0 - mask[b]) * -10000.0  # added along the key axis
            ss, tt = s[b] + add, t[b] + add
            ss[ss <= -100] = 0.0
            tt[tt <= -100] = 0.0
            per_ex[b] = ((ss - tt) ** 2).sum() / (h_ * t_ * t_)
        return (w * per_ex).sum() / w.sum()
    num = den = 0.0
    for b in range(b_):
        for q in range(t_):
            for k in range(t_):
                if mask[b, q] and mask[b, k]:
                    num += w[b] * ((s[b, :, q, k] - t[b, :, q, k]) ** 2).sum()
                    den += w[b] * h_
    return num / den


def np_hidden_mse(s, t, mask, mode, valid=None):
    s, t = s.astype(np.float64), t.astype(np.float64)
    w = np.ones(s.shape[0]) if valid is None else valid.astype(np.float64)
    if mode == "tinybert":
        per_ex = ((s - t) ** 2).mean(axis=(1, 2))
        return (w * per_ex).sum() / w.sum()
    tok = w[:, None] * mask
    return (tok[:, :, None] * (s - t) ** 2).sum() / (tok.sum() * s.shape[-1])


def np_log_softmax(x):
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def np_soft_ce(s, t, temp, mode, t2=False, valid=None):
    p = np.exp(np_log_softmax(t / temp))
    ce = -p * np_log_softmax(s / temp)
    per_ex = ce.mean(-1) if mode == "tinybert" else ce.sum(-1)
    w = np.ones(len(per_ex)) if valid is None else valid.astype(np.float64)
    out = (w * per_ex).sum() / w.sum()
    return out * temp ** 2 if t2 else out


def np_kl(s, t, temp, mode, t2=True, valid=None):
    lp, lq = np_log_softmax(t / temp), np_log_softmax(s / temp)
    kl = np.exp(lp) * (lp - lq)
    per_ex = kl.mean(-1) if mode == "tinybert" else kl.sum(-1)
    w = np.ones(len(per_ex)) if valid is None else valid.astype(np.float64)
    out = (w * per_ex).sum() / w.sum()
    return out * temp ** 2 if t2 else out


def np_patience(s, t, normalize, valid=None, official_mean=False):
    """PKD eq. 4: sum over layers k and units d of (s/|s| - t/|t|)^2, mean over examples; the
    official code averages over k and d instead (official_mean)."""
    s, t = s.astype(np.float64), t.astype(np.float64)
    if normalize:
        s = s / np.maximum(np.linalg.norm(s, axis=-1, keepdims=True), 1e-12)
        t = t / np.maximum(np.linalg.norm(t, axis=-1, keepdims=True), 1e-12)
    per_ex = np.zeros(s.shape[0])
    for b in range(s.shape[0]):
        for k in range(s.shape[1]):
            per_ex[b] += sum((s[b, k, d] - t[b, k, d]) ** 2 for d in range(s.shape[2]))
    if official_mean:
        per_ex /= s.shape[1] * s.shape[2]
    w = np.ones(len(per_ex)) if valid is None else valid.astype(np.float64)
    return (w * per_ex).sum() / w.sum()


def close(a, b, rtol=2e-6, atol=1e-7):
    np.testing.assert_allclose(float(a), float(b), rtol=rtol, atol=atol)


# --------------------------------------------------------------------------- attention

@pytest.mark.parametrize("mode", ["masked", "tinybert"])
@pytest.mark.parametrize("use_valid", [False, True])
def test_attention_mse_matches_numpy(rng, mode, use_valid):
    s = rng.normal(0, 3, (B, H, T, T)).astype(np.float32)
    t = rng.normal(0, 3, (B, H, T, T)).astype(np.float32)
    s[0, 0, 1, 2] = -150.0  # a real score below -100: zeroed in tinybert mode only
    mask, valid = _mask(), (VALID if use_valid else None)
    got = L.attention_mse(s, t, mask, mode=mode, valid=valid)
    close(got, np_attention_mse(s, t, mask, mode, valid))


def test_attention_modes_differ_by_the_padding_share(rng):
    # Student == teacher on padded query rows, random elsewhere: tinybert mode zeroes padded
    # keys (the -10000 mask) and averages over all B*H*T*T entries, so it equals the masked
    # value times (#real (q, k) pairs) / (B*T*T) = 56 / 108.
    s = rng.normal(0, 2, (B, H, T, T)).astype(np.float32)
    t = rng.normal(0, 2, (B, H, T, T)).astype(np.float32)
    mask = _mask()
    pad_q = mask[:, None, :, None] == 0
    t = np.where(pad_q, s, t)
    masked = float(L.attention_mse(s, t, mask, mode="masked"))
    tiny = float(L.attention_mse(s, t, mask, mode="tinybert"))
    pairs = sum(n * n for n in LENGTHS)
    assert pairs == 56
    close(tiny, masked * pairs / (B * T * T), rtol=1e-5)
    assert tiny < 0.6 * masked


def test_masked_attention_ignores_padding_amount(rng):
    s = rng.normal(size=(B, H, T, T)).astype(np.float32)
    t = rng.normal(size=(B, H, T, T)).astype(np.float32)
    mask = _mask()
    base = L.attention_mse(s, t, mask)
    # Three more padded positions holding junk: the masked value must not move.
    T2 = T + 3
    s2 = rng.normal(0, 50, (B, H, T2, T2)).astype(np.float32)
    t2 = rng.normal(0, 50, (B, H, T2, T2)).astype(np.float32)
    s2[:, :, :T, :T], t2[:, :, :T, :T] = s, t
    close(L.attention_mse(s2, t2, _mask(t=T2)), base, rtol=1e-5)
    assert abs(float(L.attention_mse(s2, t2, _mask(t=T2), mode="tinybert"))
               - float(L.attention_mse(s, t, mask, mode="tinybert"))) > 1e-3


def test_filler_rows_do_not_count(rng):
    s = rng.normal(size=(B, H, T, T)).astype(np.float32)
    t = rng.normal(size=(B, H, T, T)).astype(np.float32)
    mask = _mask()
    for mode in ("masked", "tinybert"):
        a = L.attention_mse(s, t, mask, mode=mode, valid=VALID)
        s2 = s.copy()
        s2[1] += 100.0  # row 1 is filler
        close(L.attention_mse(s2, t, mask, mode=mode, valid=VALID), a)
        close(a, L.attention_mse(s[[0, 2]], t[[0, 2]], mask[[0, 2]], mode=mode))
    # An all-filler batch gives 0, not NaN.
    assert float(L.attention_mse(s, t, mask, valid=np.zeros(B, np.float32))) == 0.0


def test_attention_shape_mismatch_is_clear(rng):
    s = rng.normal(size=(B, 2, T, T))
    t = rng.normal(size=(B, 3, T, T))
    with pytest.raises(ValueError, match="head counts"):
        L.attention_mse(s, t, _mask())
    with pytest.raises(ValueError, match="mode"):
        L.attention_mse(s, s, _mask(), mode="official")


def test_attention_kl_matches_numpy(rng):
    s = rng.normal(size=(B, H, T, T)).astype(np.float32)
    t = rng.normal(size=(B, H, T, T)).astype(np.float32)
    mask = _mask()
    num = den = 0.0
    for b in range(B):
        n = LENGTHS[b]
        lp, lq = np_log_softmax(t[b, :, :n, :n]), np_log_softmax(s[b, :, :n, :n])
        num += VALID[b] * (np.exp(lp) * (lp - lq)).sum()
        den += VALID[b] * H * n
    close(L.attention_kl(s, t, mask, valid=VALID), num / den, rtol=1e-5)
    assert float(L.attention_kl(s, s, mask)) == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="masked"):
        L.attention_kl(s, t, mask, mode="tinybert")


# --------------------------------------------------------------------------- hidden

@pytest.mark.parametrize("mode", ["masked", "tinybert"])
@pytest.mark.parametrize("use_valid", [False, True])
def test_hidden_mse_matches_numpy(rng, mode, use_valid):
    s = rng.normal(size=(B, T, D)).astype(np.float32)
    t = rng.normal(size=(B, T, D)).astype(np.float32)
    mask, valid = _mask(), (VALID if use_valid else None)
    close(L.hidden_mse(s, t, mask, mode=mode, valid=valid), np_hidden_mse(s, t, mask, mode, valid))
    close(L.embedding_mse(s, t, mask, mode=mode, valid=valid),
          np_hidden_mse(s, t, mask, mode, valid))


def test_hidden_modes_differ_by_the_padding_share(rng):
    s = rng.normal(size=(B, T, D)).astype(np.float32)
    t = np.where(_mask()[:, :, None] > 0, rng.normal(size=(B, T, D)), s).astype(np.float32)
    masked = float(L.hidden_mse(s, t, _mask()))
    tiny = float(L.hidden_mse(s, t, _mask(), mode="tinybert"))
    close(tiny, masked * sum(LENGTHS) / (B * T), rtol=1e-5)  # 12 / 18 of the masked value


def test_hidden_projection_and_width_error(rng):
    s = rng.normal(size=(B, T, 3)).astype(np.float32)
    t = rng.normal(size=(B, T, D)).astype(np.float32)
    with pytest.raises(ValueError, match="project"):
        L.hidden_mse(s, t, _mask())
    p = L.init_dense(jax.random.PRNGKey(0), 3, D)
    assert p["kernel"].shape == (3, D) and p["bias"].shape == (D,)
    assert float(jnp.abs(p["bias"]).sum()) == 0.0
    assert 0.005 < float(jnp.std(p["kernel"])) < 0.05
    k, b = np.asarray(p["kernel"]), np.asarray(p["bias"]) + 0.3
    proj = {"kernel": k, "bias": b}
    close(L.hidden_mse(L.project(proj, s), t, _mask()), np_hidden_mse(s @ k + b, t, _mask(),
                                                                      "masked"))


@pytest.mark.parametrize("mode", ["masked", "tinybert"])
def test_cosine_hidden_loss(rng, mode):
    s = rng.normal(size=(B, T, D)).astype(np.float32)
    t = rng.normal(size=(B, T, D)).astype(np.float32)
    cos = (s * t).sum(-1) / (np.linalg.norm(s, axis=-1) * np.linalg.norm(t, axis=-1))
    w = VALID[:, None] * (_mask() if mode == "masked" else np.ones((B, T)))
    close(L.cosine_hidden_loss(s, t, _mask(), mode=mode, valid=VALID),
          (w * (1 - cos)).sum() / w.sum(), rtol=1e-5)
    assert float(L.cosine_hidden_loss(s, 2 * s, _mask())) == pytest.approx(0.0, abs=1e-6)


# --------------------------------------------------------------------------- predictions

@pytest.mark.parametrize("mode", ["masked", "tinybert"])
@pytest.mark.parametrize("temp,t2", [(1.0, False), (2.0, False), (3.0, True)])
def test_soft_cross_entropy(rng, mode, temp, t2):
    s = rng.normal(0, 2, (B, C)).astype(np.float32)
    t = rng.normal(0, 2, (B, C)).astype(np.float32)
    close(L.soft_cross_entropy(s, t, temp, mode=mode, t2=t2), np_soft_ce(s, t, temp, mode, t2),
          rtol=1e-5)
    close(L.soft_cross_entropy(s, t, temp, mode=mode, t2=t2, valid=VALID),
          np_soft_ce(s, t, temp, mode, t2, VALID), rtol=1e-5)


def test_soft_ce_modes_differ_by_num_classes(rng):
    s, t = rng.normal(size=(B, C)), rng.normal(size=(B, C))
    close(L.soft_cross_entropy(s, t, 2.0, mode="tinybert") * C,
          L.soft_cross_entropy(s, t, 2.0, mode="masked"), rtol=1e-5)


@pytest.mark.parametrize("mode", ["masked", "tinybert"])
def test_kl_divergence(rng, mode):
    s = rng.normal(0, 2, (B, C)).astype(np.float32)
    t = rng.normal(0, 2, (B, C)).astype(np.float32)
    close(L.kl_divergence(s, t, 4.0, mode=mode, valid=VALID), np_kl(s, t, 4.0, mode, True, VALID),
          rtol=1e-5)
    close(L.kl_divergence(s, t, 1.0, mode=mode, t2=False), np_kl(s, t, 1.0, mode, False),
          rtol=1e-5)
    # KL = soft CE - teacher entropy.
    p = np.exp(np_log_softmax(t.astype(np.float64)))
    ent = -(p * np.log(p)).sum(-1).mean()
    close(L.kl_divergence(s, t, 1.0, t2=False),
          float(L.soft_cross_entropy(s, t, 1.0)) - ent, rtol=1e-5)


@pytest.mark.parametrize("temp,t2", [(1.0, False), (2.0, False), (2.0, True)])
def test_logits_mse(rng, temp, t2):
    s = rng.normal(0, 2, (B, C)).astype(np.float32)
    t = rng.normal(0, 2, (B, C)).astype(np.float32)
    d = (s.astype(np.float64) - t) / temp
    per_ex = (d ** 2).sum(-1) / C                      # mean over the classes
    scale = temp ** 2 if t2 else 1.0
    close(L.logits_mse(s, t, temp, t2=t2), scale * per_ex.mean(), rtol=1e-5)
    close(L.logits_mse(s, t, temp, t2=t2, valid=VALID),
          scale * (VALID * per_ex).sum() / VALID.sum(), rtol=1e-5)
    if t2:   # T^2 undoes the division: the raw logits' MSE
        close(L.logits_mse(s, t, temp, t2=True), ((s.astype(np.float64) - t) ** 2).mean(),
              rtol=1e-5)
    assert float(L.logits_mse(s, s, temp)) == 0.0
    with pytest.raises(ValueError, match="same number of labels"):
        L.logits_mse(s, t[:, :2])


def test_probability_shift(rng):
    t = rng.normal(0, 2, (8, C)).astype(np.float32)
    labels = rng.integers(0, C, 8)
    labels[:2] = t[:2].argmax(-1)                     # two rows the teacher gets right
    want = t.copy()
    for b in range(8):                                # swap the top value and the gold one
        top = t[b].argmax()
        want[b, top], want[b, labels[b]] = t[b, labels[b]], t[b, top]
    got = np.asarray(L.probability_shift(t, labels))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got[:2], t[:2])     # right rows unchanged
    assert (got.argmax(-1) == labels).all()
    assert (t.argmax(-1) != labels).sum() >= 3        # the case is exercised
    np.testing.assert_array_equal(np.sort(got, -1), np.sort(t, -1))   # a permutation per row


def test_hard_labels(rng):
    s = rng.normal(size=(B, C)).astype(np.float32)
    y = np.array([0, 3, 1])
    nll = -np_log_softmax(s)[np.arange(B), y]
    close(L.cross_entropy(s, y), nll.mean())
    close(L.cross_entropy(s, y, valid=VALID), (VALID * nll).sum() / VALID.sum())
    pred = rng.normal(size=(B, 1)).astype(np.float32)
    gold = rng.normal(size=(B,)).astype(np.float32)
    close(L.regression_mse(pred, gold), ((pred[:, 0] - gold) ** 2).mean())
    close(L.regression_mse(pred, gold, valid=VALID),
          (VALID * (pred[:, 0] - gold) ** 2).sum() / VALID.sum())
    with pytest.raises(ValueError, match="num_labels = 1"):
        L.regression_mse(s, gold)


# --------------------------------------------------------------------------- patience

@pytest.mark.parametrize("normalize", [True, False])
def test_patience_loss(rng, normalize):
    s = rng.normal(size=(B, 2, D)).astype(np.float32)
    t = rng.normal(size=(B, 2, D)).astype(np.float32)
    ref = np_patience(s, t, normalize)
    close(L.patience_loss(s, t, normalize=normalize), ref, rtol=1e-5)
    close(L.patience_loss(s, t, normalize=normalize, valid=VALID),
          np_patience(s, t, normalize, VALID), rtol=1e-5)
    official = np_patience(s, t, normalize, official_mean=True)
    np.testing.assert_allclose(ref / official, 2 * D)  # masked = official mean x K*D
    tiny = float(L.patience_loss(s, t, normalize=normalize, mode="tinybert"))
    assert tiny == float(np.float16(np.float32(official)))  # the official .half()
    if normalize:  # unit vectors: each layer's squared distance is in [0, 4]
        per_ex = np.asarray([np_patience(s[i:i + 1], t[i:i + 1], True) for i in range(B)])
        assert ((per_ex >= 0) & (per_ex <= 4 * 2)).all()
    with pytest.raises(ValueError, match="project"):
        L.patience_loss(s, t[..., :3])


# --------------------------------------------------------------------------- gradients, float64

def _numeric_grad(f, x, eps=1e-6):
    g = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        xp, xm = x.copy(), x.copy()
        xp[i] += eps
        xm[i] -= eps
        g[i] = (float(f(xp)) - float(f(xm))) / (2 * eps)
    return g


@pytest.mark.parametrize("mode", ["masked", "tinybert"])
def test_gradients_float64(mode):
    r = np.random.default_rng(1)
    mask = _mask((4, 3), 4)
    valid = np.array([1.0, 0.5])
    with jax.enable_x64(True):
        s = r.normal(size=(2, 2, 4, 4))
        t = r.normal(size=(2, 2, 4, 4))
        f = jax.jit(lambda x: L.attention_mse(x, jnp.asarray(t), mask, mode=mode, valid=valid))
        assert f(s).dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(jax.grad(f)(s)), _numeric_grad(f, s),
                                   rtol=1e-6, atol=1e-9)
        # Hidden term through a projection: d/d(kernel) and d/d(student states).
        hs, ht = r.normal(size=(2, 4, 3)), r.normal(size=(2, 4, 5))
        k0, b0 = r.normal(size=(3, 5)), r.normal(size=(5,))
        fk = jax.jit(lambda k: L.hidden_mse(L.project({"kernel": k, "bias": b0}, hs), ht, mask,
                                            mode=mode, valid=valid))
        np.testing.assert_allclose(np.asarray(jax.grad(fk)(k0)), _numeric_grad(fk, k0),
                                   rtol=1e-6, atol=1e-9)
        fh = jax.jit(lambda h: L.hidden_mse(L.project({"kernel": k0, "bias": b0}, h), ht, mask,
                                            mode=mode))
        np.testing.assert_allclose(np.asarray(jax.grad(fh)(hs)), _numeric_grad(fh, hs),
                                   rtol=1e-6, atol=1e-9)
        z, zt = r.normal(size=(2, 3)), r.normal(size=(2, 3))
        fz = jax.jit(lambda x: L.soft_cross_entropy(x, zt, 2.0, mode=mode, t2=True))
        np.testing.assert_allclose(np.asarray(jax.grad(fz)(z)), _numeric_grad(fz, z),
                                   rtol=1e-6, atol=1e-9)
        pc, pt = r.normal(size=(2, 2, 3)), r.normal(size=(2, 2, 3))
        fp = jax.jit(lambda x: L.patience_loss(x, pt, normalize=True))
        np.testing.assert_allclose(np.asarray(jax.grad(fp)(pc)), _numeric_grad(fp, pc),
                                   rtol=1e-6, atol=1e-9)


def test_grads_finite_for_all_filler_batch():
    s = jnp.ones((2, 2, 4, 4))
    g = jax.grad(lambda x: L.attention_mse(x, 0 * x, _mask((4, 3), 4), valid=jnp.zeros(2)))(s)
    assert bool(jnp.all(jnp.isfinite(g))) and float(jnp.abs(g).sum()) == 0.0
    g = jax.grad(lambda x: L.attention_kl(x, 0 * x, jnp.zeros((2, 4), jnp.int32)))(s)
    assert bool(jnp.all(jnp.isfinite(g)))


def test_bf16_inputs_reduce_in_float32(rng):
    s = jnp.asarray(rng.normal(size=(B, T, D)), jnp.bfloat16)
    out = L.hidden_mse(s, s + 1, _mask())
    assert out.dtype == jnp.float32
    close(out, 1.0, rtol=1e-2)
