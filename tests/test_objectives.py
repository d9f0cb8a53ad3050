"""Named objectives on random model outputs: composition, options, errors, jit and caching.

Real models run in test_oracle.py; here random BertOutputs keep the file fast."""
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from jax_tinybert.distill import objectives as O
from jax_tinybert.model.modeling import BertConfig, BertOutput

B, T = 3, 7
LENGTHS = (7, 5, 2)


def cfg(layers, hidden, heads=2, labels=2):
    return BertConfig(vocab_size=40, hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, intermediate_size=2 * hidden,
                      max_position_embeddings=16, num_labels=labels)


S_CFG, T_CFG = cfg(2, 8), cfg(4, 12)


def fake(config, seed, attention=True):
    """A BertOutput of random arrays: objectives only read its fields, so no model is needed."""
    r = np.random.default_rng(seed)
    n, d, h = config.num_hidden_layers, config.hidden_size, config.num_attention_heads
    a = lambda *shape: jnp.asarray(r.normal(size=shape), jnp.float32)
    out = BertOutput(hidden_states=tuple(a(B, T, d) for _ in range(n + 1)),
                     attention_logits=tuple(a(B, h, T, T) if attention else None
                                            for _ in range(n)),
                     pooled=a(B, d), logits=2 * a(B, config.num_labels))
    # Drawn after the rest, which keep their values: q, k, v [B, H, T, d_head] per layer.
    return out.replace(qkv=tuple(tuple(a(B, h, T, d // h) for _ in range(3)) for _ in range(n)))


def make_batch(seed=0, labels=2):
    r = np.random.default_rng(seed)
    mask = (np.arange(T)[None] < np.array(LENGTHS)[:, None]).astype(np.int32)
    b = {"input_ids": (r.integers(1, 40, (B, T)) * mask).astype(np.int32),
         "attention_mask": mask, "token_type_ids": np.zeros((B, T), np.int32),
         "valid": np.ones(B, np.float32)}
    b["labels"] = (r.normal(size=B).astype(np.float32) if labels == 1
                   else r.integers(0, labels, B).astype(np.int32))
    return b


@pytest.fixture(scope="module")
def outs():
    batch = make_batch()
    return batch, fake(S_CFG, 1), fake(T_CFG, 2)


# --------------------------------------------------------------------------- numpy references

def np_att(s, t, mask):
    s, t = np.asarray(s, np.float64), np.asarray(t, np.float64)
    pair = mask[:, None, :, None] * mask[:, None, None, :] * np.ones_like(s)
    return (pair * (s - t) ** 2).sum() / pair.sum()


def np_hid(s, t, mask):
    s, t = np.asarray(s, np.float64), np.asarray(t, np.float64)
    w = mask[:, :, None] * np.ones_like(s)
    return (w * (s - t) ** 2).sum() / w.sum()


def np_att_kl(s, t, mask):
    """KL(teacher || student) of the softmax over real keys, mean over heads and real query rows."""
    s, t = np.asarray(s, np.float64), np.asarray(t, np.float64)
    total, rows = 0.0, 0
    for b in range(s.shape[0]):
        keys = mask[b] > 0
        for i in np.flatnonzero(keys):
            rows += 1
            for h in range(s.shape[1]):
                p = np.exp(t[b, h, i, keys] - t[b, h, i, keys].max())
                q = np.exp(s[b, h, i, keys] - s[b, h, i, keys].max())
                p, q = p / p.sum(), q / q.sum()
                total += (p * np.log(p / q)).sum()
    return total / (rows * s.shape[1])


def np_cos(s, t, mask):
    """1 - cos(s, t) per real token, averaged."""
    s, t = np.asarray(s, np.float64), np.asarray(t, np.float64)
    cos = (s * t).sum(-1) / (np.linalg.norm(s, axis=-1) * np.linalg.norm(t, axis=-1))
    return ((1 - cos) * mask).sum() / mask.sum()


def np_lsm(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


# --------------------------------------------------------------------------- errors

def test_unknown_name_and_keys():
    with pytest.raises(ValueError, match="tinybert_intermediate.*finetune"):
        O.make_objective("tinybert", {}, S_CFG, T_CFG)
    with pytest.raises(ValueError, match=r"(?s)unknown cfg key\(s\) \['temp'\].*temperature"):
        O.make_objective("kd", {"temp": 2.0}, S_CFG, T_CFG)
    with pytest.raises(ValueError, match="projection"):
        O.make_objective("tinybert_intermediate", {"projection": "linear"}, S_CFG, T_CFG)
    with pytest.raises(ValueError, match="mode"):
        O.make_objective("kd", {"mode": "official"}, S_CFG, T_CFG)
    with pytest.raises(ValueError, match="teacher_config"):
        O.make_objective("kd", {}, S_CFG, None)
    with pytest.raises(ValueError, match="num_labels"):
        O.make_objective("kd", {}, S_CFG, cfg(4, 12, labels=3))


def test_width_head_and_layer_errors():
    with pytest.raises(ValueError, match="hidden_size=8 != teacher hidden_size=12.*'shared'"):
        O.make_objective("tinybert_intermediate", {"projection": "none"}, S_CFG, T_CFG)
    with pytest.raises(ValueError, match="num_attention_heads"):
        O.make_objective("tinybert_intermediate", {}, S_CFG, cfg(4, 12, heads=3))
    # Without the attention term the head counts may differ.
    obj = O.make_objective("tinybert_intermediate", {"w_attn": 0}, S_CFG, cfg(4, 12, heads=3))
    assert obj.student_attention_layers == () == obj.teacher_attention_layers
    # Parity mode refuses what the official code asserts; masked mode rounds g(m) = m N / M.
    with pytest.raises(ValueError, match="multiple of student layers"):
        O.make_objective("tinybert_intermediate", {"mode": "tinybert"}, cfg(3, 8), T_CFG)
    obj = O.make_objective("tinybert_intermediate", {}, cfg(3, 8), T_CFG)
    assert obj.layer_map.teacher_hidden_layers == tuple(
        round(m * T_CFG.num_hidden_layers / 3 + 1e-9) for m in range(4))
    with pytest.raises(ValueError, match="layer_weights"):
        O.make_objective("tinybert_intermediate", {"layer_weights": [1, 1]}, S_CFG, T_CFG)
    with pytest.raises(ValueError, match="hidden_size=8 != teacher hidden_size=12"):
        O.make_objective("pkd", {}, S_CFG, T_CFG)  # PKD has no projection by default


def test_flags_and_layers():
    i = O.make_objective("tinybert_intermediate", None, S_CFG, T_CFG)
    assert (i.student_attention_layers, i.teacher_attention_layers) == ((1, 2), (2, 4))
    assert i.needs_teacher and not i.teacher_cacheable
    p = O.make_objective("tinybert_pred", {}, S_CFG, T_CFG)
    assert p.needs_teacher and p.teacher_cacheable and p.student_attention_layers == ()
    assert p.init_projection(jax.random.PRNGKey(0)) == {}
    f = O.make_objective("finetune", {}, S_CFG)
    assert not f.needs_teacher and not f.teacher_cacheable
    k = O.make_objective("pkd", {"projection": "shared"}, cfg(4, 8), cfg(8, 12))
    assert k.teacher_cls_layers == (2, 4, 6) and k.teacher_cacheable
    assert O.make_objective("pkd", {"projection": "shared", "layer_map": "pkd_last"},
                            cfg(4, 8), cfg(8, 12)).teacher_cls_layers == (5, 6, 7)


def test_projection_params():
    rng = jax.random.PRNGKey(0)
    shared = O.make_objective("tinybert_intermediate", {}, S_CFG, T_CFG).init_projection(rng)
    assert list(shared) == ["fit_dense"]
    assert shared["fit_dense"]["kernel"].shape == (8, 12)
    assert shared["fit_dense"]["bias"].shape == (12,)
    assert float(jnp.abs(shared["fit_dense"]["bias"]).sum()) == 0.0
    per = O.make_objective("tinybert_intermediate", {"projection": "per_layer"}, S_CFG,
                           T_CFG).init_projection(rng)
    assert sorted(per) == ["fit_dense_0", "fit_dense_1", "fit_dense_2"]
    same = O.make_objective("tinybert_intermediate", {"projection": "none"}, cfg(2, 12), T_CFG)
    assert same.init_projection(rng) == {}


# --------------------------------------------------------------------------- values

@pytest.mark.parametrize("projection", ["shared", "per_layer"])
def test_intermediate_matches_numpy(outs, projection):
    batch, so, to = outs
    c = {"projection": projection, "w_embd": 0.5, "w_attn": 2.0, "w_hidn": 3.0,
         "layer_weights": [1.0, 0.25, 4.0]}
    obj = O.make_objective("tinybert_intermediate", c, S_CFG, T_CFG)
    proj = obj.init_projection(jax.random.PRNGKey(3))
    total, terms = obj(proj, so, to, batch)
    mask = batch["attention_mask"]

    def fit(m):
        p = proj["fit_dense"] if projection == "shared" else proj[f"fit_dense_{m}"]
        return np.asarray(so.hidden_states[m]) @ np.asarray(p["kernel"]) + np.asarray(p["bias"])

    att = {m: np_att(so.attention_logits[m - 1], to.attention_logits[2 * m - 1], mask)
           for m in (1, 2)}
    hid = {m: np_hid(fit(m), to.hidden_states[2 * m], mask) for m in (0, 1, 2)}
    np.testing.assert_allclose(float(terms["embd"]), hid[0], rtol=1e-5)
    for m in (1, 2):
        np.testing.assert_allclose(float(terms[f"attn/{m}"]), att[m], rtol=1e-5)
        np.testing.assert_allclose(float(terms[f"hidn/{m}"]), hid[m], rtol=1e-5)
    np.testing.assert_allclose(float(terms["attn"]), att[1] + att[2], rtol=1e-5)
    lw = c["layer_weights"]
    expect = 0.5 * hid[0] + sum(lw[m] * (2.0 * att[m] + 3.0 * hid[m]) for m in (1, 2))
    np.testing.assert_allclose(float(total), expect, rtol=1e-5)


def test_intermediate_attention_kl_and_cosine_match_numpy(outs):
    batch, so, to = outs
    c = {"attn_loss": "kl", "hidn_loss": "cosine", "w_embd": 0.5, "w_attn": 2.0, "w_hidn": 3.0}
    obj = O.make_objective("tinybert_intermediate", c, S_CFG, T_CFG)
    proj = obj.init_projection(jax.random.PRNGKey(3))
    total, terms = obj(proj, so, to, batch)
    mask = batch["attention_mask"]
    p = proj["fit_dense"]
    fit = lambda m: (np.asarray(so.hidden_states[m]) @ np.asarray(p["kernel"])
                     + np.asarray(p["bias"]))
    att = {m: np_att_kl(so.attention_logits[m - 1], to.attention_logits[2 * m - 1], mask)
           for m in (1, 2)}
    hid = {m: np_cos(fit(m), to.hidden_states[2 * m], mask) for m in (0, 1, 2)}
    assert all(v > 0 for v in (*att.values(), *hid.values()))
    np.testing.assert_allclose(float(terms["embd"]), hid[0], rtol=1e-5)
    for m in (1, 2):
        np.testing.assert_allclose(float(terms[f"attn/{m}"]), att[m], rtol=1e-5)
        np.testing.assert_allclose(float(terms[f"hidn/{m}"]), hid[m], rtol=1e-5)
    expect = 0.5 * hid[0] + sum(2.0 * att[m] + 3.0 * hid[m] for m in (1, 2))
    np.testing.assert_allclose(float(total), expect, rtol=1e-5)
    # Equal teacher and student outputs give zero: the terms measure a distance.
    same = O.make_objective("tinybert_intermediate", dict(c, projection="none"), S_CFG, S_CFG)
    assert abs(float(same({}, so, so, batch)[0])) < 1e-5
    g = jax.grad(lambda q: obj(q, so, to, batch)[0])(proj)
    assert float(jnp.abs(g["fit_dense"]["kernel"]).sum()) > 0


@pytest.mark.parametrize("name", ["tinybert_pred", "kd", "pkd"])
def test_kd_loss_mse_is_the_logits_mse(outs, name):
    """kd_loss='mse': the soft-label term is mean over classes of ((s - t) / T)^2 (x T^2 with
    t2), and KD / PKD mix it with the hard-label CE as before."""
    batch, so, to = outs
    c = {"kd_loss": "mse", "temperature": 2.0, "alpha": 0.25, "beta": 0.0}
    if name == "pkd":
        c["projection"] = "shared"
    obj = O.make_objective(name, c, S_CFG, T_CFG)
    total, terms = obj(obj.init_projection(jax.random.PRNGKey(0)), so, to, batch)
    s, t = np.asarray(so.logits, np.float64), np.asarray(to.logits, np.float64)
    t2 = obj.cfg["t2"]
    mse = (((s - t) / 2.0) ** 2).mean(-1).mean() * (4.0 if t2 else 1.0)
    if name == "tinybert_pred":
        assert not t2
        np.testing.assert_allclose(float(terms["pred"]), mse, rtol=1e-5)
        np.testing.assert_allclose(float(total), mse, rtol=1e-5)
        return
    assert t2   # KD's and PKD's default: the raw logits' MSE
    lsm = np_lsm(s)
    ce = -lsm[np.arange(B), batch["labels"]].mean()
    np.testing.assert_allclose(float(terms["kd"]), mse, rtol=1e-5)
    np.testing.assert_allclose(float(total), 0.25 * mse + 0.75 * ce, rtol=1e-5)


@pytest.mark.parametrize("name", ["tinybert_pred", "kd"])
def test_probability_shift_makes_the_soft_targets_peak_at_the_gold_label(outs, name):
    batch, so, to = outs
    t = np.asarray(to.logits, np.float64).copy()
    labels = np.asarray(batch["labels"])
    wrong = t.argmax(-1) != labels
    assert wrong.any() and not wrong.all()            # both kinds of row in the batch
    for b in np.flatnonzero(wrong):
        top = t[b].argmax()
        t[b, top], t[b, labels[b]] = t[b, labels[b]], t[b, top]
    s, temp = np.asarray(so.logits, np.float64), 2.0
    p = np.exp(np_lsm(t / temp))
    if name == "tinybert_pred":
        want = -(p * np_lsm(s / temp)).sum(-1).mean()          # soft CE, masked mode
        key = "pred"
    else:
        want = (p * (np.log(p) - np_lsm(s / temp))).sum(-1).mean() * temp ** 2   # KL x T^2
        key = "kd"
    shifted = O.make_objective(name, {"probability_shift": True, "temperature": temp},
                               S_CFG, T_CFG)
    plain = O.make_objective(name, {"temperature": temp}, S_CFG, T_CFG)
    got = float(shifted({}, so, to, batch)[1][key])
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert abs(float(plain({}, so, to, batch)[1][key]) - got) > 1e-3
    # From the teacher cache (no live teacher) the same shift applies.
    cached = dict(batch, teacher_logits=to.logits)
    np.testing.assert_allclose(float(shifted({}, so, None, cached)[1][key]), want, rtol=1e-5)


def test_intermediate_loss_kinds_are_checked():
    with pytest.raises(ValueError, match=r"attn_loss='ce'; expected one of \('mse', 'kl'\)"):
        O.make_objective("tinybert_intermediate", {"attn_loss": "ce"}, S_CFG, T_CFG)
    with pytest.raises(ValueError, match=r"hidn_loss='cos'; expected one of \('mse', 'cosine'\)"):
        O.make_objective("tinybert_intermediate", {"hidn_loss": "cos"}, S_CFG, T_CFG)
    with pytest.raises(ValueError, match=r"kd_loss='kl'; expected one of \('ce', 'mse'\)"):
        O.make_objective("kd", {"kd_loss": "kl"}, S_CFG, T_CFG)
    with pytest.raises(ValueError, match="attn_loss='kl'.*mode='masked' only"):
        O.make_objective("tinybert_intermediate", {"attn_loss": "kl", "mode": "tinybert"},
                         S_CFG, T_CFG)
    # The cosine term has a parity-mode reduction (a plain mean over every position).
    O.make_objective("tinybert_intermediate", {"hidn_loss": "cosine", "mode": "tinybert"},
                     S_CFG, T_CFG)


def test_intermediate_jit_grad_and_filler_rows(outs):
    batch, so, to = outs
    obj = O.make_objective("tinybert_intermediate", ml_collections.ConfigDict({"mode": "masked"}),
                           S_CFG, T_CFG)
    proj = obj.init_projection(jax.random.PRNGKey(0))
    f = jax.jit(lambda p, s, t, b: obj(p, s, t, b))
    loss, terms = f(proj, so, to, batch)
    np.testing.assert_allclose(float(loss), float(obj(proj, so, to, batch)[0]), rtol=1e-6)
    g = jax.grad(lambda p: obj(p, so, to, batch)[0])(proj)
    assert float(jnp.abs(g["fit_dense"]["kernel"]).sum()) > 0
    # Filler row 2: replacing its student outputs with junk changes nothing.
    b2 = dict(batch, valid=np.array([1, 1, 0], np.float32))
    junk = so.replace(hidden_states=tuple(h.at[2].add(5.0) for h in so.hidden_states),
                      attention_logits=tuple(a.at[2].add(5.0) for a in so.attention_logits))
    np.testing.assert_allclose(float(f(proj, junk, to, b2)[0]), float(f(proj, so, to, b2)[0]),
                               rtol=1e-6)


def test_missing_attention_logits_is_clear(outs):
    batch, so, to = outs
    obj = O.make_objective("tinybert_intermediate", {}, S_CFG, T_CFG)
    bare = so.replace(attention_logits=(None, None))
    with pytest.raises(ValueError, match="attention_logits=obj.student_attention_layers"):
        obj(obj.init_projection(jax.random.PRNGKey(0)), bare, to, batch)


@pytest.mark.parametrize("mode", ["masked", "tinybert"])
def test_pred_classification(outs, mode):
    batch, so, to = outs
    obj = O.make_objective("tinybert_pred", {"mode": mode, "temperature": 2.0}, S_CFG, T_CFG)
    loss, terms = obj({}, so, to, batch)
    p = np.exp(np_lsm(np.asarray(to.logits) / 2.0))
    ce = -(p * np_lsm(np.asarray(so.logits) / 2.0))
    ref = ce.mean() if mode == "tinybert" else ce.sum(-1).mean()
    np.testing.assert_allclose(float(loss), ref, rtol=1e-5)
    # From the teacher cache instead of t_out.
    cached = dict(batch, **{k: np.asarray(v) for k, v in obj.teacher_features(to).items()})
    np.testing.assert_allclose(float(obj({}, so, None, cached)[0]), float(loss), rtol=1e-6)


def test_pred_regression_targets():
    batch = make_batch(labels=1)
    s_cfg, t_cfg = cfg(2, 8, labels=1), cfg(4, 12, labels=1)
    so, to = fake(s_cfg, 1, False), fake(t_cfg, 2, False)
    obj = O.make_objective("tinybert_pred", {}, s_cfg, t_cfg)
    loss, _ = obj({}, so, to, batch)
    ref = ((np.asarray(so.logits)[:, 0] - np.asarray(to.logits)[:, 0]) ** 2).mean()
    np.testing.assert_allclose(float(loss), ref, rtol=1e-5)
    with pytest.raises(ValueError, match="STS-B bug"):
        O.make_objective("tinybert_pred", {"regression_target": "gold"}, s_cfg, t_cfg)
    bug = O.make_objective("tinybert_pred", {"regression_target": "gold", "mode": "tinybert"},
                           s_cfg, t_cfg)
    assert not bug.needs_teacher
    ref = ((np.asarray(so.logits)[:, 0] - batch["labels"]) ** 2).mean()
    np.testing.assert_allclose(float(bug({}, so, None, batch)[0]), ref, rtol=1e-5)
    ft = O.make_objective("finetune", {}, s_cfg)
    np.testing.assert_allclose(float(ft({}, so, None, batch)[0]), ref, rtol=1e-5)


def test_kd_and_finetune(outs):
    batch, so, to = outs
    s, t, y = np.asarray(so.logits), np.asarray(to.logits), batch["labels"]
    ce = -np_lsm(s)[np.arange(B), y].mean()
    ft, terms = O.make_objective("finetune", {}, S_CFG)({}, so, None, batch)
    np.testing.assert_allclose(float(ft), ce, rtol=1e-5)
    kd = O.make_objective("kd", {"temperature": 3.0, "alpha": 0.25}, S_CFG, T_CFG)
    loss, terms = kd({}, so, to, batch)
    lp, lq = np_lsm(t / 3.0), np_lsm(s / 3.0)
    kl = 9.0 * (np.exp(lp) * (lp - lq)).sum(-1).mean()
    np.testing.assert_allclose(float(terms["kd"]), kl, rtol=1e-5)
    np.testing.assert_allclose(float(loss), 0.25 * kl + 0.75 * ce, rtol=1e-5)


@pytest.mark.parametrize("mode", ["masked", "tinybert"])
def test_pkd_composition_and_cache(mode):
    s_cfg, t_cfg = cfg(3, 8), cfg(6, 12)
    batch = make_batch(1)
    so, to = fake(s_cfg, 1, False), fake(t_cfg, 2, False)
    c = {"mode": mode, "projection": "per_layer", "temperature": 5.0, "alpha": 0.6, "beta": 50.0,
         "normalize_patience": True}
    obj = O.make_objective("pkd", c, s_cfg, t_cfg)
    assert obj.teacher_cls_layers == (2, 4)
    proj = obj.init_projection(jax.random.PRNGKey(4))
    assert sorted(proj) == ["fit_dense_1", "fit_dense_2"]
    loss, terms = obj(proj, so, to, batch)
    # Reference from the definition.
    s, t, y = np.asarray(so.logits, np.float64), np.asarray(to.logits, np.float64), batch["labels"]
    ce = -np_lsm(s)[np.arange(B), y].mean()
    lp, lq = np_lsm(t / 5.0), np_lsm(s / 5.0)
    kl = np.exp(lp) * (lp - lq)
    kd = 25.0 * (kl.mean() if mode == "tinybert" else kl.sum(-1).mean())
    sc = np.stack([np.asarray(so.hidden_states[m])[:, 0] @ np.asarray(proj[f"fit_dense_{m}"]["kernel"])
                   + np.asarray(proj[f"fit_dense_{m}"]["bias"]) for m in (1, 2)], 1)
    tc = np.stack([np.asarray(to.hidden_states[n])[:, 0] for n in (2, 4)], 1).astype(np.float64)
    sc /= np.linalg.norm(sc, axis=-1, keepdims=True)
    tc /= np.linalg.norm(tc, axis=-1, keepdims=True)
    pt = ((sc - tc) ** 2).mean()
    np.testing.assert_allclose(float(terms["kd"]), kd, rtol=1e-5)
    np.testing.assert_allclose(float(terms["ce"]), ce, rtol=1e-5)
    if mode == "tinybert":
        pt16 = np.float16(np.float32(pt))
        np.testing.assert_allclose(float(terms["pt"]), float(pt16), rtol=1e-3)
        expect = 0.6 * kd + 0.4 * ce + float(np.float16(50.0 * np.float32(terms["pt"])))
    else:
        pt_sum = pt * 2 * 12  # masked: the formula's sum over the K=2 layers and D=12 units
        np.testing.assert_allclose(float(terms["pt"]), pt_sum, rtol=1e-5)
        expect = 0.6 * kd + 0.4 * ce + 50.0 * pt_sum
    np.testing.assert_allclose(float(loss), expect, rtol=1e-5)
    # The teacher cache path gives the same value.
    feats = obj.teacher_features(to)
    assert feats["teacher_cls"].shape == (B, 2, 12)
    cached = dict(batch, **{k: np.asarray(v) for k, v in feats.items()})
    np.testing.assert_allclose(float(jax.jit(obj)(proj, so, None, cached)[0]), float(loss),
                               rtol=1e-6)
    with pytest.raises(ValueError, match="teacher_cls"):
        obj(proj, so, None, dict(batch, teacher_logits=feats["teacher_logits"]))


@pytest.mark.parametrize("mode", ["masked", "tinybert"])
def test_pkd_default_beta_is_the_published_one_per_mode(mode):
    # beta 500 was tuned for the official mean over B*K*D; the masked sum needs 500 / (K*D).
    obj = O.make_objective("pkd", {"mode": mode, "projection": "shared"}, cfg(3, 8), cfg(6, 12))
    assert obj.cfg["beta"] == (500.0 if mode == "tinybert" else 500.0 / (2 * 12))
    assert O.make_objective("pkd", {"beta": 3.0}, cfg(3, 12), cfg(6, 12)).cfg["beta"] == 3.0


def test_pkd_beta_zero_needs_no_cls(outs):
    batch, so, to = outs
    obj = O.make_objective("pkd", {"beta": 0.0}, S_CFG, T_CFG)  # widths differ, but no PT term
    assert obj.teacher_cls_layers == ()
    loss, terms = obj({}, so, None, dict(batch, teacher_logits=np.asarray(to.logits)))
    assert "pt" not in terms and np.isfinite(float(loss))


# --------------------------------------------------------------------------- cls_only

def _cls_rows_only(out):
    """`out` as a cls_only forward returns it: the last layer's [CLS] row, no [T, T] logits."""
    return out.replace(hidden_states=out.hidden_states[:-1] + (out.hidden_states[-1][:, :1],),
                       attention_logits=out.attention_logits[:-1] + (None,),
                       qkv=out.qkv[:-1] + (None,))


@pytest.mark.parametrize("name", O.OBJECTIVES)
def test_objectives_that_read_no_tokens_see_the_same_loss_from_the_cls_rows(outs, name):
    """An objective declaring reads_tokens=False gets the same loss when the models' last layer
    computed its [CLS] row only (what the train step then runs); one that reads per-token
    outputs (the intermediate loss) must declare it."""
    batch, so, to = outs
    obj = O.make_objective(name, {"projection": "shared"} if name == "pkd" else {}, S_CFG, T_CFG)
    proj = obj.init_projection(jax.random.PRNGKey(0))
    full, _ = obj(proj, so, to, batch)
    try:
        rows, _ = obj(proj, _cls_rows_only(so), _cls_rows_only(to), batch)
    except (ValueError, TypeError, IndexError):
        rows = None
    if obj.reads_tokens:
        assert rows is None or not np.isclose(float(rows), float(full)), name
    else:
        assert rows is not None and float(rows) == pytest.approx(float(full), rel=1e-6), name


@pytest.mark.parametrize("name,expect", [("tinybert_pred", True), ("tinybert_intermediate", False)])
def test_train_step_runs_the_cls_rows_only_when_the_objective_reads_no_tokens(name, expect):
    from jax_tinybert.train import step as step_lib
    from jax_tinybert.model.modeling import BertForSequenceClassification

    seen = []

    class Spy(BertForSequenceClassification):
        def __call__(self, *a, cls_only=False, **kw):
            seen.append(cls_only)
            return super().__call__(*a, cls_only=cls_only, **kw)

    s_cfg, t_cfg = cfg(2, 8).replace(vocab_size=40), cfg(2, 8).replace(vocab_size=40)
    student, teacher = Spy(s_cfg), Spy(t_cfg)
    obj = O.make_objective(name, {}, s_cfg, t_cfg)
    batch = {k: jnp.asarray(v) for k, v in make_batch().items()}
    init = lambda m, seed: m.init(jax.random.PRNGKey(seed), batch["input_ids"],
                                  attention_logits=False)["params"]
    loss_fn = step_lib.make_loss_fn(student, teacher, obj, student_dropout=False)
    params = {"student": init(student, 0), "proj": obj.init_projection(jax.random.PRNGKey(2))}
    teacher_params = init(teacher, 1)
    seen.clear()
    loss, _ = jax.jit(loss_fn)(params, teacher_params, batch, jax.random.PRNGKey(3))
    assert np.isfinite(float(loss)) and seen == [expect, expect]
