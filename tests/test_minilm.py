"""MiniLM and MiniLMv2: the losses against NumPy written from the papers' equations, the
model's q, k, v output, the objectives' checks, and a tiny CLI general-distillation run."""
import json
import os
import pathlib
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import tiny_run as T
from jax_tinybert.config import check, schema
from jax_tinybert.distill import losses as L
from jax_tinybert.distill.objectives import ObjectiveConfigError, make_objective
from jax_tinybert.model.modeling import BertConfig, BertModel, init_params
from jax_tinybert.train import build

REPO = pathlib.Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- NumPy references

def _np_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _np_kl_rows(p, q):
    """sum_j p log(p / q) per row of [n, n] distributions."""
    return np.sum(p * (np.log(p) - np.log(q)), -1)


def _np_relation_loss(s_pairs, t_pairs, mask, valid=None):
    """Mean over relation heads and real query rows of KL(R_t || R_s), where R = softmax(a b^T /
    sqrt(d)) is computed on each example's real tokens alone (padding sliced away, no masks).
    s_pairs / t_pairs: per example a list over heads of (a, b) [T, d] arrays."""
    num = den = 0.0
    for b in range(len(mask)):
        w = 1.0 if valid is None else float(valid[b])
        real = np.asarray(mask[b]) > 0
        heads = len(s_pairs[b])
        for (sa, sb), (ta, tb) in zip(s_pairs[b], t_pairs[b]):
            sa, sb, ta, tb = (x[real] for x in (sa, sb, ta, tb))
            rs = _np_softmax(sa @ sb.T / np.sqrt(sa.shape[-1]))
            rt = _np_softmax(ta @ tb.T / np.sqrt(ta.shape[-1]))
            num += w * _np_kl_rows(rt, rs).sum()
        den += w * heads * real.sum()
    return num / den


def _np_minilm(s, t, mask, valid=None):
    """MiniLM eqs. 5-7: (L_AT, L_VR); s, t = (q, k, v) [B, H, T, d] NumPy arrays."""
    (sq, sk, sv), (tq, tk, tv) = s, t
    B, H = sq.shape[:2]
    at = _np_relation_loss([[(sq[b, h], sk[b, h]) for h in range(H)] for b in range(B)],
                           [[(tq[b, h], tk[b, h]) for h in range(H)] for b in range(B)],
                           mask, valid)
    vr = _np_relation_loss([[(sv[b, h], sv[b, h]) for h in range(H)] for b in range(B)],
                           [[(tv[b, h], tv[b, h]) for h in range(H)] for b in range(B)],
                           mask, valid)
    return at, vr


def _np_heads_of(x, relation_heads):
    """MiniLMv2: [B, H, T, d] -> per example, the A_r column blocks of the concatenated [T, H*d]."""
    B, H, T, d = x.shape
    cat = np.concatenate([x[:, h] for h in range(H)], axis=-1)      # [B, T, H*d], head-major
    dr = H * d // relation_heads
    return [[cat[b, :, r * dr:(r + 1) * dr] for r in range(relation_heads)] for b in range(B)]


def _np_minilmv2(s, t, mask, relation_heads, valid=None):
    out = {}
    for name, xs, xt in zip(("qq", "kk", "vv"), s, t):
        hs, ht = _np_heads_of(xs, relation_heads), _np_heads_of(xt, relation_heads)
        out[name] = _np_relation_loss([[(a, a) for a in ex] for ex in hs],
                                      [[(a, a) for a in ex] for ex in ht], mask, valid)
    return out


def _qkv(rng, B, H, T, d, scale=1.0):
    return tuple(scale * rng.standard_normal((B, H, T, d)) for _ in range(3))


MASK = np.array([[1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]])


# --------------------------------------------------------------------------- the losses

def test_minilm_loss_matches_the_papers_formulas_with_padding():
    rng = np.random.default_rng(0)
    # Equal head counts, other head widths (v1 allows it: the relations are [T, T] per head).
    s, t = _qkv(rng, 3, 4, 8, 6, 1.5), _qkv(rng, 3, 4, 8, 10, 1.5)
    at, vr = _np_minilm(s, t, MASK)
    with jax.enable_x64(True):
        total, terms = L.minilm_loss(tuple(map(jnp.asarray, s)), tuple(map(jnp.asarray, t)),
                                     jnp.asarray(MASK))
        np.testing.assert_allclose(float(terms["at"]), at, rtol=1e-10)
        np.testing.assert_allclose(float(terms["vr"]), vr, rtol=1e-10)
        np.testing.assert_allclose(float(total), at + vr, rtol=1e-10)
        # Padding never counts: other values at padded positions give the same loss.
        junk = [np.where(MASK[:, None, :, None] > 0, x, 1e3 * rng.standard_normal(x.shape))
                for x in s]
        again, _ = L.minilm_loss(tuple(map(jnp.asarray, junk)), tuple(map(jnp.asarray, t)),
                                 jnp.asarray(MASK))
        np.testing.assert_allclose(float(again), at + vr, rtol=1e-10)
        # valid: a filler example weighs nothing.
        valid = np.array([1.0, 0.0, 1.0])
        at_v, vr_v = _np_minilm(s, t, MASK, valid)
        got, _ = L.minilm_loss(tuple(map(jnp.asarray, s)), tuple(map(jnp.asarray, t)),
                               jnp.asarray(MASK), valid=jnp.asarray(valid))
        np.testing.assert_allclose(float(got), at_v + vr_v, rtol=1e-10)
    assert at > 0 and vr > 0


def test_minilm_loss_refuses_other_head_counts():
    rng = np.random.default_rng(1)
    with pytest.raises(ValueError, match=r"student has 2 attention heads, teacher 4; .*minilmv2"):
        L.minilm_loss(_qkv(rng, 1, 2, 4, 8), _qkv(rng, 1, 4, 4, 8), jnp.ones((1, 4)))


def test_minilmv2_loss_matches_the_papers_formulas_across_head_counts_and_widths():
    rng = np.random.default_rng(2)
    # Student 3 heads x 8 = 24 wide, teacher 4 heads x 12 = 48 wide; 6 relation heads of 4 / 8.
    s, t = _qkv(rng, 3, 3, 8, 8, 1.5), _qkv(rng, 3, 4, 8, 12, 1.5)
    want = _np_minilmv2(s, t, MASK, 6)
    with jax.enable_x64(True):
        total, terms = L.minilmv2_loss(tuple(map(jnp.asarray, s)), tuple(map(jnp.asarray, t)),
                                       jnp.asarray(MASK), 6)
        for k in ("qq", "kk", "vv"):
            np.testing.assert_allclose(float(terms[k]), want[k], rtol=1e-10)
        np.testing.assert_allclose(float(total), sum(want.values()), rtol=1e-10)
        valid = np.array([0.0, 1.0, 1.0])
        want_v = _np_minilmv2(s, t, MASK, 6, valid)
        got, _ = L.minilmv2_loss(tuple(map(jnp.asarray, s)), tuple(map(jnp.asarray, t)),
                                 jnp.asarray(MASK), 6, valid=jnp.asarray(valid))
        np.testing.assert_allclose(float(got), sum(want_v.values()), rtol=1e-10)
    # A student equal to the teacher has nothing to learn.
    same, _ = L.minilmv2_loss(t, t, jnp.asarray(MASK), 6)
    assert abs(float(same)) < 1e-6
    with pytest.raises(ValueError, match="width 24 does not divide into 5 relation heads"):
        L.minilmv2_loss(s, t, jnp.asarray(MASK), 5)


def test_gradients_are_finite_with_padding_and_filler_rows():
    rng = np.random.default_rng(3)
    s, t = _qkv(rng, 3, 2, 8, 8, 3.0), _qkv(rng, 3, 4, 8, 8, 3.0)
    s, t = tuple(map(jnp.asarray, s)), tuple(map(jnp.asarray, t))
    mask = jnp.asarray(MASK).at[2].set(0)          # an all-padding row
    valid = jnp.array([1.0, 1.0, 0.0])
    g2 = jax.grad(lambda x: L.minilmv2_loss(x, t, mask, 4, valid=valid)[0])(s)
    s1 = tuple(jnp.asarray(x) for x in _qkv(rng, 3, 4, 8, 8, 3.0))
    g1 = jax.grad(lambda x: L.minilm_loss(x, t, mask, valid=valid)[0])(s1)
    for g in (*g1, *g2):
        assert np.all(np.isfinite(np.asarray(g)))
        assert float(jnp.max(jnp.abs(g))) > 0
        # Filler and padded positions get no gradient.
        assert float(jnp.max(jnp.abs(g[2]))) == 0.0
        assert float(jnp.max(jnp.abs(g[1, :, 5:]))) == 0.0


# --------------------------------------------------------------------------- the model

def _tiny(h=32, heads=4, layers=2, vocab=64):
    return BertConfig(vocab_size=vocab, hidden_size=h, num_hidden_layers=layers,
                      num_attention_heads=heads, intermediate_size=2 * h,
                      max_position_embeddings=16)


@pytest.mark.parametrize("remat", [False, True])
def test_the_model_returns_q_k_v_of_the_layers_asked_for(remat):
    cfg = _tiny()
    model = BertModel(cfg, remat=remat)
    params = init_params(model, jax.random.PRNGKey(0))
    ids = (jnp.arange(16).reshape(2, 8) * 7) % 64
    mask = jnp.asarray(MASK[:2])
    plain = model.apply({"params": params}, ids, mask)
    out = model.apply({"params": params}, ids, mask, qkv_layers=(2,))
    assert plain.qkv is None and out.qkv[0] is None
    for a, b in zip(plain.hidden_states, out.hidden_states):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    q, k, v = (np.asarray(x, np.float64) for x in out.qkv[1])
    assert q.shape == k.shape == v.shape == (2, 4, 8, 8)
    # From the layer's input and the HF-named kernels, in NumPy: x W + b, split into heads.
    h = np.asarray(out.hidden_states[1], np.float64)
    p = params["encoder"]["layer"]["1"]["attention"]["self"]
    for got, name in ((q, "query"), (k, "key"), (v, "value")):
        want = h @ np.asarray(p[name]["kernel"]) + np.asarray(p[name]["bias"])
        want = want.reshape(2, 8, 4, 8).transpose(0, 2, 1, 3)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # q unscaled: q k^T / sqrt(d_head) are the attention logits the model returns.
    np.testing.assert_allclose(np.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(8),
                               np.asarray(out.attention_logits[1]), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match=r"q, k, v asked for layers \[3\]"):
        model.apply({"params": params}, ids, mask, qkv_layers=(3,))


# --------------------------------------------------------------------------- the objectives

def test_objectives_run_the_teacher_live_and_check_their_fields():
    teacher, student = _tiny(32, 4, 2), _tiny(24, 2, 1)
    v2 = make_objective("minilmv2", {}, student, teacher)
    assert v2.cfg["relation_heads"] == 4 and v2.cfg["teacher_layer"] == 2
    assert (v2.teacher_qkv_layers, v2.student_qkv_layers) == ((2,), (1,))
    for obj in (v2, make_objective("minilm", {"teacher_layer": 1}, _tiny(16, 4, 1), teacher)):
        assert not obj.teacher_cacheable and not obj.teacher_token_cacheable
        assert obj.intermediate and obj.needs_teacher and obj.reads_tokens
    # A large teacher's default is the paper's 64 relation heads (width 24 does not divide).
    with pytest.raises(ObjectiveConfigError, match=r"objective.relation_heads=64 must divide "
                       r"the student width 24 and the teacher width 1024; valid values: "
                       r"\[1, 2, 4, 8\]"):
        make_objective("minilmv2", {}, student, _tiny(1024, 16, 1))
    with pytest.raises(ObjectiveConfigError, match=r"objective.relation_heads=5 must divide"):
        make_objective("minilmv2", {"relation_heads": 5}, student, teacher)
    with pytest.raises(ObjectiveConfigError, match=r"objective.teacher_layer=3; expected a "
                       r"teacher layer in 1..2"):
        make_objective("minilmv2", {"teacher_layer": 3}, student, teacher)
    with pytest.raises(ObjectiveConfigError, match=r"student num_attention_heads=2 != "
                       r"teacher's 4; .*minilmv2"):
        make_objective("minilm", {}, student, teacher)
    with pytest.raises(ObjectiveConfigError, match="mode=masked"):
        make_objective("minilm", {"mode": "tinybert"}, _tiny(16, 4, 1), teacher)


def test_config_validation_takes_the_new_names_and_fields():
    import configs.general_distill as gd

    c = gd.get_config("tiny")
    c.objective.name, c.objective.relation_heads, c.objective.teacher_layer = "minilmv2", 4, 1
    check.validate_config(build.with_defaults(c), paths=False)   # a corpus stage: no labels
    assert set(schema.base_config().objective) >= {"relation_heads", "teacher_layer"}
    c.objective.name = "kd"
    with pytest.raises(check.ConfigValueError, match=r"use one of \('tinybert_intermediate', "
                       r"'minilm', 'minilmv2'\) for general distillation"):
        check.validate_config(build.with_defaults(c), paths=False)


# --------------------------------------------------------------------------- the CLI

def test_cli_general_distillation_with_minilmv2_and_fewer_student_heads(tmp_path):
    teacher = T.tiny_teacher(tmp_path / "teacher")       # 2 layers, d 32, 4 heads
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    book = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "corpus" / \
        "gutenberg_pg1656_plato_apology_jowett.txt"
    if not book.exists():
        book = pathlib.Path("/work/shared/data/corpus") / book.name
    (corpus / "apology.txt").write_bytes(book.read_bytes()[:60000])
    wd = tmp_path / "wd"
    args = ["--config=configs/general_distill.py:tiny", f"--workdir={wd}",
            f"--config.teacher.path={teacher}", f"--config.data.corpus={corpus}",
            "--config.data.seq_len=32", f"--config.data.cache_dir={tmp_path / 'cache'}",
            "--config.objective.name=minilmv2", "--config.student.num_hidden_layers=1",
            "--config.student.hidden_size=16", "--config.student.intermediate_size=32",
            "--config.student.num_attention_heads=2", "--config.train.batch_size=16",
            "--config.train.num_steps=30", "--config.train.log_every=1",
            "--config.optim.learning_rate=1e-3"]
    res = subprocess.run([T.PYTHON, "-m", "jax_tinybert.main", *args], cwd=REPO, env=T.env(),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    losses = [v[-1] for _, v in sorted(T.read_metrics(wd).items())]
    assert len(losses) == 30 and np.mean(losses[-5:]) < 0.9 * np.mean(losses[:5]), losses
    recs = [json.loads(l) for l in (wd / "metrics.jsonl").read_text().splitlines() if l.strip()]
    assert {"train/qq", "train/kk", "train/vv"} <= set(recs[0])
    cfg = json.loads((wd / "export" / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["hidden_size"]) == (2, 16)
    assert os.path.exists(wd / "export" / "model.safetensors")
    assert not (wd / "cache").exists()                  # the teacher ran in the steps


def test_a_student_of_teacher_layers_split_into_other_heads_is_that_pytorch_model(tmp_path):
    """student.teacher_layers_heads: the copied layers' weights unchanged, split into 2 heads
    instead of the teacher's 4; the forward equals transformers' PyTorch BERT of that config
    with those weights. A head count that does not divide the width is one line."""
    import ml_collections
    import torch
    import transformers
    from jax_tinybert.model import hf
    from jax_tinybert.model.modeling import BertForSequenceClassification, random_params
    from jax_tinybert.train import students

    tcfg = _tiny(h=32, heads=4, layers=3)
    tparams = random_params(BertForSequenceClassification(tcfg), 3)
    sc = ml_collections.ConfigDict(dict(teacher_layers=(1, 3), teacher_layers_heads=2))
    scfg, sp = students.from_teacher_layers(sc, tcfg, tparams, 2, jax.random.PRNGKey(0))
    assert (scfg.num_attention_heads, scfg.num_hidden_layers) == (2, 2)
    np.testing.assert_array_equal(sp["bert"]["encoder"]["layer"]["1"]["attention"]["self"]
                                  ["query"]["kernel"], tparams["bert"]["encoder"]["layer"]["2"]
                                  ["attention"]["self"]["query"]["kernel"])
    tm = transformers.BertForSequenceClassification(transformers.BertConfig(
        **{k: v for k, v in scfg.to_dict().items() if k not in ("id2label", "label2id")})).eval()
    state = {k: torch.from_numpy(np.asarray(v)) for k, v in
             hf.params_to_torch_state_dict(sp).items() if not k.startswith("cls.")}
    missing, _ = tm.load_state_dict(state, strict=False)
    assert not [k for k in missing if "position_ids" not in k], missing
    ids = np.array([[2, 7, 9, 11, 3, 0], [2, 5, 6, 3, 0, 0]], np.int32)
    mask = (ids > 0).astype(np.int32)
    ours = BertForSequenceClassification(scfg).apply({"params": sp}, ids, mask)
    with torch.no_grad():
        ref = tm(torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long(),
                 output_hidden_states=True)
    np.testing.assert_allclose(np.asarray(ours.logits), ref.logits.numpy(), atol=1e-5)
    real = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(ours.hidden_states[-1])[real],
                               ref.hidden_states[-1].numpy()[real], atol=1e-4)
    sc.teacher_layers_heads = 3
    with pytest.raises(check.ConfigValueError, match="teacher_layers_heads=3 does not divide"):
        students.from_teacher_layers(sc, tcfg, tparams, 2, jax.random.PRNGKey(0))
