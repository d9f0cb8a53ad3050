"""tinybert-mode parity with the official TinyBERT and PKD code (../shared/oracle*/README.md).

TinyBERT: the packaged all-MiniLM-L6-v2 teacher and oracle_student on oracle_batch.npz must give
the official float32 attention, hidden and prediction losses within 1e-5 relative.
PKD: the official loss functions on fixed arrays, for every listed (T, alpha, beta) and both
normalisations, including the float16 rounding of the patience term.
"""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_tinybert.distill import losses as L
from jax_tinybert.distill import objectives as O
from jax_tinybert.model.hf import load_pretrained
from jax_tinybert.model.modeling import BertConfig, BertModel, BertOutput

RTOL = 1e-5


@pytest.fixture(scope="module")
def oracle(shared_dir, teacher_dir):
    d = shared_dir / "oracle"
    t_cfg, t_params = load_pretrained(teacher_dir)
    s_cfg, s_params = load_pretrained(str(d / "oracle_student"))
    b = np.load(d / "oracle_batch.npz")
    batch = {k: jnp.asarray(b[k], jnp.int32) for k in ("input_ids", "attention_mask",
                                                       "token_type_ids", "labels")}

    def forward(cfg, params):
        f = jax.jit(lambda p, i, m, t: BertModel(cfg).apply({"params": p}, i, m, t))
        return f(params, batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])

    so, to = forward(s_cfg, s_params), forward(t_cfg, t_params)
    head = np.load(d / "oracle_student" / "classifier.npz")
    # The official head: classifier(relu(pooled)); PyTorch Linear is x @ W.T + b.
    logits = lambda out, who: (jax.nn.relu(out.pooled) @ head[f"{who}_weight"].T
                               + head[f"{who}_bias"])
    so = so.replace(logits=logits(so, "student"))
    to = to.replace(logits=logits(to, "teacher"))
    # What the prediction stage runs: the last layer's [CLS] row only.
    cls_only = {who: logits(jax.jit(lambda p, i, m, t, cfg=cfg: BertModel(cfg).apply(
        {"params": p}, i, m, t, attention_logits=False, cls_only=True))(
        params, batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]), who)
        for who, cfg, params in (("student", s_cfg, s_params), ("teacher", t_cfg, t_params))}
    fd = np.load(d / "oracle_student" / "fit_dense.npz")
    proj = {"fit_dense": {"kernel": jnp.asarray(fd["weight"].T), "bias": jnp.asarray(fd["bias"])}}
    ref = json.loads((d / "oracle_losses.json").read_text())
    return dict(s_cfg=s_cfg.replace(num_labels=2), t_cfg=t_cfg.replace(num_labels=2), so=so, to=to,
                batch=batch, proj=proj, ref=ref, cls_only=cls_only)


def rel(a, b):
    return abs(float(a) - float(b)) / abs(float(b))


def test_model_outputs_match_official_logits(oracle):
    ref = oracle["ref"]["float32"]
    np.testing.assert_allclose(np.asarray(oracle["so"].logits), ref["student_logits"], atol=1e-4)
    np.testing.assert_allclose(np.asarray(oracle["to"].logits), ref["teacher_logits"], atol=1e-4)
    for who in ("student", "teacher"):
        np.testing.assert_allclose(np.asarray(oracle["cls_only"][who]), ref[f"{who}_logits"],
                                   atol=1e-4, err_msg=f"{who}, cls_only")


def test_intermediate_losses_match_official(oracle):
    ref = oracle["ref"]["float32"]
    obj = O.make_objective("tinybert_intermediate", {"mode": "tinybert"}, oracle["s_cfg"],
                           oracle["t_cfg"])
    assert obj.teacher_attention_layers == tuple(
        i + 1 for i in oracle["ref"]["meta"]["teacher_att_layers_0based"])
    assert obj.layer_map.teacher_hidden_layers == tuple(
        oracle["ref"]["meta"]["teacher_rep_layers_0based_0_is_embeddings"])
    total, terms = obj(oracle["proj"], oracle["so"], oracle["to"], oracle["batch"])
    for m, v in enumerate(ref["att_loss_per_layer"], start=1):
        assert rel(terms[f"attn/{m}"], v) < RTOL, (m, float(terms[f"attn/{m}"]), v)
    assert rel(terms["embd"], ref["rep_loss_per_layer"][0]) < RTOL
    for m, v in enumerate(ref["rep_loss_per_layer"][1:], start=1):
        assert rel(terms[f"hidn/{m}"], v) < RTOL, (m, float(terms[f"hidn/{m}"]), v)
    assert rel(terms["attn"], ref["att_loss"]) < RTOL
    assert rel(terms["embd"] + terms["hidn"], ref["rep_loss"]) < RTOL
    assert rel(total, ref["intermediate_loss"]) < RTOL
    # The clean mode ignores the 759 padded positions and so gives other numbers.
    masked, _ = O.make_objective("tinybert_intermediate", {}, oracle["s_cfg"], oracle["t_cfg"])(
        oracle["proj"], oracle["so"], oracle["to"], oracle["batch"])
    assert rel(masked, ref["intermediate_loss"]) > 1e-2


@pytest.mark.parametrize("temperature,key", [(1.0, "cls_loss_T1"), (2.0, "cls_loss_T2")])
def test_prediction_loss_matches_official(oracle, temperature, key):
    obj = O.make_objective("tinybert_pred", {"mode": "tinybert", "temperature": temperature},
                           oracle["s_cfg"], oracle["t_cfg"])
    loss, _ = obj({}, oracle["so"], oracle["to"], oracle["batch"])
    assert rel(loss, oracle["ref"]["float32"][key]) < RTOL
    # Also on the official logits themselves (no model in the loop).
    ref = oracle["ref"]["float32"]
    direct = L.soft_cross_entropy(np.float32(ref["student_logits"]),
                                  np.float32(ref["teacher_logits"]), temperature, mode="tinybert")
    assert rel(direct, ref[key]) < RTOL


# --------------------------------------------------------------------------- PKD

@pytest.fixture(scope="module")
def pkd(shared_dir):
    d = shared_dir / "oracle_pkd"
    x = dict(np.load(d / "inputs.npz"))
    res = json.loads((d / "pkd_losses.json").read_text())["results"]
    return x, res


def _pkd_outputs(x):
    """Student/teacher outputs whose [CLS] rows are the oracle's patience vectors."""
    b, k, dim = x["student_patience"].shape
    s_cfg = BertConfig(hidden_size=dim, num_hidden_layers=k + 1, num_attention_heads=12,
                       intermediate_size=4 * dim, num_labels=x["student_logits"].shape[1])
    t_cfg = s_cfg.replace(num_hidden_layers=2 * (k + 1))
    zeros = jnp.zeros((b, 1, dim), jnp.float32)
    hs = (zeros,) + tuple(jnp.asarray(x["student_patience"][:, i, None]) for i in range(k)) + (
        zeros,)
    so = BertOutput(hidden_states=hs, attention_logits=(None,) * (k + 1),
                    logits=jnp.asarray(x["student_logits"]))
    batch = {"labels": jnp.asarray(x["labels"], jnp.int32),
             "teacher_logits": jnp.asarray(x["teacher_logits"]),
             "teacher_cls": jnp.asarray(x["teacher_patience"]),
             "attention_mask": jnp.ones((b, 1), jnp.int32)}
    return s_cfg, t_cfg, so, batch


def test_pkd_matches_official(pkd):
    x, res = pkd
    s_cfg, t_cfg, so, batch = _pkd_outputs(x)
    assert len(res) == 6
    for name, r in res.items():
        c = {"mode": "tinybert", "temperature": r["T"], "alpha": r["alpha"], "beta": r["beta"],
             "normalize_patience": r["normalize_patience"]}
        obj = O.make_objective("pkd", c, s_cfg, t_cfg)
        assert obj.teacher_cls_layers == (2, 4)  # pkd_skip, 0-based fc_layer_idx 1,3
        total, terms = jax.jit(obj)({}, so, None, batch)
        off = r["distillation_loss_returned"]
        assert rel(terms["kd"], off["d_loss"]) < RTOL, (name, float(terms["kd"]), off["d_loss"])
        assert rel(terms["ce"], off["nll_loss"]) < RTOL, name
        assert rel(r["alpha"] * terms["kd"] + (1 - r["alpha"]) * terms["ce"], off["tol_loss"]) \
            < RTOL, name
        # float16 values are reproduced exactly.
        assert float(terms["pt"]) == r["patience_loss_returned"], name
        assert float(L.round_f16(r["beta"] * terms["pt"])) == r["pt_loss_beta_times_patience"]
        assert rel(total, r["total_loss"]) < RTOL, (name, float(total), r["total_loss"])


def test_pkd_clean_formula_float64(pkd):
    # Without the float16 rounding, the same reductions in float64 hit the float64 references.
    x, res = pkd
    with jax.enable_x64(True):
        s, t = np.float64(x["student_logits"]), np.float64(x["teacher_logits"])
        sp, tp = np.float64(x["student_patience"]), np.float64(x["teacher_patience"])
        for name, r in res.items():
            ref = r["reference_not_official"]
            kd = L.kl_divergence(s, t, r["T"], mode="tinybert", t2=True)
            ce = L.cross_entropy(s, x["labels"])
            pt = L.patience_loss(sp, tp, normalize=r["normalize_patience"], mode="masked")
            assert kd.dtype == jnp.float64
            np.testing.assert_allclose(float(kd), ref["distillation_loss_float64_inputs"]["d_loss"],
                                       rtol=1e-10)
            np.testing.assert_allclose(float(ce),
                                       ref["distillation_loss_float64_inputs"]["nll_loss"],
                                       rtol=1e-10)
            # masked is the formula's sum over K layers x D units: the official mean x K*D.
            kd_units = sp.shape[1] * sp.shape[2]
            np.testing.assert_allclose(float(pt), ref["patience_mse_float64_unrounded"] * kd_units,
                                       rtol=1e-10)
            total = r["alpha"] * kd + (1 - r["alpha"]) * ce + r["beta"] / kd_units * pt
            np.testing.assert_allclose(float(total), ref["total_float64_without_fp16_rounding"],
                                       rtol=1e-10)
