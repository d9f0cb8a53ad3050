"""The Flax BERT against PyTorch `transformers` and HF Flax, on the real packaged teacher."""
import copy
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tinybert as jtb
from jax_tinybert.model.hf import WeightsError

SENTENCES = [
    ("the movie was a delight from start to finish .", None),
    ("terrible .", None),
    ("a man is playing a guitar on the street", "someone plays an instrument outside"),
    ("it 's a charming and often affecting journey .", "nothing happens"),
]


@pytest.fixture(scope="module")
def teacher(teacher_dir):
    return jtb.load_pretrained(teacher_dir)


@pytest.fixture(scope="module")
def batch(teacher_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(teacher_dir)
    a = [s for s, _ in SENTENCES]
    b = [t if t is not None else "" for _, t in SENTENCES]
    enc = tok(a, b, padding="longest", return_tensors="np")
    # Single sentences: drop the empty second segment so real single-sentence inputs are used.
    singles = tok([s for s, t in SENTENCES if t is None], padding="max_length",
                  max_length=enc["input_ids"].shape[1], return_tensors="np")
    n = len(singles["input_ids"])
    for k in ("input_ids", "attention_mask", "token_type_ids"):
        enc[k][:n] = singles[k]
    assert (enc["attention_mask"] == 0).any(), "the batch must contain padding"
    return {k: enc[k].astype(np.int32) for k in ("input_ids", "attention_mask", "token_type_ids")}


@pytest.fixture(scope="module")
def torch_model(teacher_dir):
    import torch
    from transformers import BertModel as TorchBert

    torch.manual_seed(0)
    m = TorchBert.from_pretrained(teacher_dir, attn_implementation="eager").eval()
    return m


# Hidden states are checked against PyTorch's model in float64, the exact values: two float32
# implementations each ~6e-5 off after six layers (ours and PyTorch's float32 both) can differ by twice that, so a float32-to-float32 tolerance measures whose
# rounding errors happen to cancel. PyTorch's own float32 model must meet the same tolerance.
F32_ATOL = 1e-4


def _assert_close_to_f64(ours, exact, torch_f32, what):
    np.testing.assert_allclose(np.asarray(torch_f32, np.float64), exact, atol=F32_ATOL,
                               err_msg=f"{what}: PyTorch's own float32 (the tolerance's premise)")
    np.testing.assert_allclose(np.asarray(ours, np.float64), exact, atol=F32_ATOL, err_msg=what)


def _torch_forward(model, tb, config):
    """PyTorch's hidden states, pooled output and attention probabilities, and each layer's
    attention logits q k^T / sqrt(d) recomputed from the input its self-attention received."""
    import torch

    inputs = {}
    handles = [layer.attention.self.register_forward_hook(
        lambda m, i, o, idx=idx: inputs.__setitem__(idx, i[0].detach()))
        for idx, layer in enumerate(model.encoder.layer)]
    try:
        with torch.no_grad():
            out = model(**tb, output_hidden_states=True, output_attentions=True)
            d, h = config.head_dim, config.num_attention_heads
            logits = []
            for idx, layer in enumerate(model.encoder.layer):
                x, sa = inputs[idx], layer.attention.self
                q = sa.query(x).view(x.shape[0], x.shape[1], h, d).transpose(1, 2)
                k = sa.key(x).view(x.shape[0], x.shape[1], h, d).transpose(1, 2)
                logits.append((q @ k.transpose(-1, -2) / np.sqrt(d)).numpy())
    finally:
        for handle in handles:
            handle.remove()
    return out, logits


def test_hidden_states_and_attention_match_pytorch(teacher, batch, torch_model):
    import torch

    config, params = teacher
    out = jtb.BertModel(config).apply({"params": params}, batch["input_ids"],
                                      batch["attention_mask"], batch["token_type_ids"])
    tb = {k: torch.tensor(v, dtype=torch.long) for k, v in batch.items()}
    ref, ref_logits = _torch_forward(torch_model, tb, config)
    exact, exact_logits = _torch_forward(copy.deepcopy(torch_model).double(), tb, config)

    assert len(out.hidden_states) == config.num_hidden_layers + 1 == 7
    for i, (ours, theirs) in enumerate(zip(out.hidden_states, exact.hidden_states)):
        _assert_close_to_f64(ours, theirs.numpy(), ref.hidden_states[i].numpy(),
                             f"hidden state {i}")
    _assert_close_to_f64(out.pooled, exact.pooler_output.numpy(), ref.pooler_output.numpy(),
                         "pooled")

    mask = batch["attention_mask"]
    for i in range(config.num_hidden_layers):
        ours = np.asarray(out.attention_logits[i])
        assert ours.shape == (4, 12, mask.shape[1], mask.shape[1])
        _assert_close_to_f64(ours, exact_logits[i], ref_logits[i], f"attention logits {i}")
        # softmax(logits + mask) is PyTorch's own output_attentions.
        z = ours + np.where(mask[:, None, None, :] > 0, 0.0, -1e9)
        probs = np.exp(z - z.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        np.testing.assert_allclose(probs, exact.attentions[i].numpy(), atol=1e-5)
        np.testing.assert_allclose(ref.attentions[i].numpy(), exact.attentions[i].numpy(),
                                   atol=1e-5)


def test_hf_flax_model_agrees(teacher, batch, teacher_dir):
    from transformers import FlaxBertModel

    config, params = teacher
    hf = FlaxBertModel.from_pretrained(teacher_dir, from_pt=True)
    ref = hf(**batch, output_hidden_states=True)
    out = jtb.BertModel(config).apply({"params": params}, batch["input_ids"],
                                      batch["attention_mask"], batch["token_type_ids"])
    for ours, theirs in zip(out.hidden_states, ref.hidden_states):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=1e-4)
    # Same parameter tree, leaf for leaf.
    flat_hf = jax.tree_util.tree_leaves_with_path(hf.params)
    flat_ours = dict(jax.tree_util.tree_leaves_with_path(params))
    assert len(flat_hf) == len(flat_ours)
    for path, leaf in flat_hf:
        np.testing.assert_allclose(np.asarray(flat_ours[path]), np.asarray(leaf), atol=1e-6)


def test_tinybert4_parameter_count():
    cfg = jtb.BertConfig(num_hidden_layers=4, hidden_size=312, intermediate_size=1200,
                         num_attention_heads=12, vocab_size=30522)
    params = jax.eval_shape(lambda: jtb.init_params(jtb.BertModel(cfg), jax.random.PRNGKey(0)))
    n = jtb.count_params(params)
    # 14,350,248 for the encoder + pooler; with the 312->768 fit_dense of the paper's TinyBERT4
    # (312*768 + 768) it is 14,590,632: the paper's "14.5M".
    assert n == 14_350_248
    assert n + 312 * 768 + 768 == 14_590_632


def test_selected_attention_logits_and_jit(teacher, batch):
    config, params = teacher
    model = jtb.BertModel(config)
    full = model.apply({"params": params}, **batch)

    @jax.jit
    def f(p, b):
        return model.apply({"params": p}, **b, attention_logits=(2, 4))

    part = f(params, batch)
    assert [x is None for x in part.attention_logits] == [True, False, True, False, True, True]
    np.testing.assert_allclose(np.asarray(part.attention_logits[1]),
                               np.asarray(full.attention_logits[1]), atol=1e-5)
    with pytest.raises(ValueError, match="layers 1..6"):
        model.apply({"params": params}, **batch, attention_logits=(0,))


def test_bf16_compute_close_to_fp32(teacher, batch):
    config, params = teacher
    f32 = jtb.BertModel(config).apply({"params": params}, **batch)
    b16 = jtb.BertModel(config, dtype=jnp.bfloat16).apply({"params": params}, **batch)
    h32, h16 = np.asarray(f32.hidden_states[-1]), np.asarray(b16.hidden_states[-1], np.float32)
    # bf16 has 8 mantissa bits; after 6 layers the relative error stays a few percent.
    rel = np.linalg.norm(h16 - h32) / np.linalg.norm(h32)
    assert rel < 0.03, rel
    assert b16.hidden_states[-1].dtype == jnp.bfloat16


def test_bf16_embedding_gradient_sums_repeated_ids():
    """With bfloat16 compute the embedding tables' gradients still add up in float32: an id met
    N times gets N times one occurrence's gradient (a bfloat16 sum stops growing at 256 equal
    terms; the padding id and [CLS] repeat thousands of times a step)."""
    cfg = jtb.BertConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                         num_attention_heads=4, vocab_size=100)
    emb = jtb.modeling.BertEmbeddings(cfg, dtype=jnp.bfloat16)
    g = jax.random.normal(jax.random.PRNGKey(7), (32,))

    def grad_row0(n):
        ids = jnp.zeros((1, n), jnp.int32)  # every token: word 0, position 0, type 0
        params = emb.init(jax.random.PRNGKey(0), ids, ids, ids)["params"]

        def loss(p):
            h = emb.apply({"params": p}, ids, ids, ids)
            assert h.dtype == jnp.bfloat16
            return jnp.sum(h.astype(jnp.float32) * g)

        grads = jax.grad(loss)(params)
        assert grads["word_embeddings"]["embedding"].dtype == jnp.float32
        return np.asarray(grads["word_embeddings"]["embedding"][0])

    one, many = grad_row0(1), grad_row0(4096)
    np.testing.assert_allclose(many, 4096 * one, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("cls_only", [False, True])
def test_remat_same_gradients(batch, cls_only):
    cfg = jtb.BertConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                         num_attention_heads=4, vocab_size=30522)
    m0 = jtb.BertForSequenceClassification(cfg)
    m1 = jtb.BertForSequenceClassification(cfg, remat=True)
    params = jtb.init_params(m0, jax.random.PRNGKey(1))
    # cls_only is a static argument of the rematerialised layer, like deterministic.
    extra = {"cls_only": True, "attention_logits": [1]} if cls_only else {}

    def loss(model, p):
        out = model.apply({"params": p}, **batch, deterministic=False,
                          rngs={"dropout": jax.random.PRNGKey(3)}, **extra)
        return jnp.sum(out.logits ** 2) + sum(jnp.mean(a ** 2) for a in out.attention_logits
                                              if a is not None)

    g0 = jax.jit(jax.grad(lambda p: loss(m0, p)))(params)
    g1 = jax.jit(jax.grad(lambda p: loss(m1, p)))(params)
    for a, b in zip(jax.tree_util.tree_leaves(g0), jax.tree_util.tree_leaves(g1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_config_round_trip(teacher_dir, tmp_path):
    cfg = jtb.BertConfig.from_json_file(os.path.join(teacher_dir, "config.json"))
    cfg.to_json_file(str(tmp_path / "config.json"))
    again = jtb.BertConfig.from_json_file(str(tmp_path / "config.json"))
    assert again.to_dict() == cfg.to_dict()
    from transformers import BertConfig as HFConfig

    hf = HFConfig.from_json_file(str(tmp_path / "config.json"))
    assert (hf.hidden_size, hf.num_hidden_layers, hf.intermediate_size) == (384, 6, 1536)


# --- bad input -----------------------------------------------------------------------------

def _copy_teacher(teacher_dir, tmp_path, **overrides):
    d = tmp_path / "m"
    shutil.copytree(teacher_dir, d)
    if overrides:
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(overrides)
        (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_bad_heads(teacher_dir, tmp_path):
    d = _copy_teacher(teacher_dir, tmp_path, num_attention_heads=7)
    with pytest.raises(jtb.ConfigError, match=r"config.json.*'hidden_size' \(384\).*'num_attention_heads' \(7\)"):
        jtb.load_pretrained(str(d))


def test_bad_activation(teacher_dir, tmp_path):
    d = _copy_teacher(teacher_dir, tmp_path, hidden_act="swishy")
    with pytest.raises(jtb.ConfigError, match="'hidden_act' is 'swishy'; expected one of"):
        jtb.load_pretrained(str(d))


def test_weights_do_not_fit_config(teacher_dir, tmp_path):
    d = _copy_teacher(teacher_dir, tmp_path, intermediate_size=1000)
    with pytest.raises(WeightsError, match=r"(?s)model.safetensors.*wrong shape: .*intermediate/dense/kernel: checkpoint \(384, 1536\), config expects \(384, 1000\)"):
        jtb.load_pretrained(str(d))


def test_missing_weights_named(teacher_dir, tmp_path):
    d = _copy_teacher(teacher_dir, tmp_path, num_hidden_layers=8)
    with pytest.raises(WeightsError, match="missing .*encoder/layer/6/"):
        jtb.load_pretrained(str(d))


def test_folder_without_weights(teacher_dir, tmp_path):
    d = _copy_teacher(teacher_dir, tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weights file; expected one of model.safetensors, pytorch_model.bin, flax_model.msgpack"):
        jtb.load_pretrained(str(d))


def test_offline_hub_name_explains(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="not downloadable from the Hugging Face hub.*; "
                       "pass a folder holding config.json"):
        jtb.load_pretrained("bert-base-uncased")
    # A path (more than one '/', or starting with . / ~) is never looked up on the hub.
    with pytest.raises(FileNotFoundError, match=r"'runs/x/export': no such folder \(relative to"):
        jtb.load_pretrained("runs/x/export")


def test_truncated_weights_name_the_file(teacher_dir, tmp_path):
    d = _copy_teacher(teacher_dir, tmp_path)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(WeightsError, match=f"{f}: cannot read the weights.*truncated or damaged"):
        jtb.load_pretrained(str(d))


def test_pytorch_bin_and_msgpack_and_old_names(teacher_dir, teacher, tmp_path):
    """pytorch_model.bin with `bert.` prefix + gamma/beta, and flax_model.msgpack, load the same."""
    import torch
    from flax import serialization
    from safetensors.numpy import load_file

    config, params = teacher
    sd = load_file(os.path.join(teacher_dir, "model.safetensors"))
    old = {}
    for k, v in sd.items():
        k2 = "bert." + k
        k2 = k2.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")
        old[k2] = torch.tensor(v)
    old["classifier.weight"] = torch.zeros(2, 384)
    old["classifier.bias"] = torch.ones(2)
    d = _copy_teacher(teacher_dir, tmp_path)
    (d / "model.safetensors").unlink()
    torch.save(old, d / "pytorch_model.bin")
    cfg2, p2 = jtb.load_pretrained(str(d))
    assert set(p2) == {"bert", "classifier"}
    np.testing.assert_array_equal(p2["classifier"]["bias"], np.ones(2))
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(p2["bert"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    (d / "pytorch_model.bin").unlink()
    (d / "flax_model.msgpack").write_bytes(serialization.to_bytes(p2))
    _, p3 = jtb.load_pretrained(str(d))
    for a, b in zip(jax.tree_util.tree_leaves(p2), jax.tree_util.tree_leaves(p3)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_init_classifier_matches_the_full_init_distribution():
    """init_classifier: the head init_params would give (shape, N(0, 0.02), zero bias), seeded,
    without initialising the encoder."""
    import jax
    import numpy as np

    from jax_tinybert.model.modeling import BertConfig, init_classifier

    cfg = BertConfig(vocab_size=50, hidden_size=256, num_hidden_layers=1, num_attention_heads=4,
                     intermediate_size=32, num_labels=40)
    a = init_classifier(cfg, jax.random.PRNGKey(3))
    b = init_classifier(cfg, jax.random.PRNGKey(3))
    c = init_classifier(cfg, jax.random.PRNGKey(4))
    assert a["kernel"].shape == (256, 40) and a["bias"].shape == (40,)
    np.testing.assert_array_equal(a["kernel"], b["kernel"])
    assert not np.allclose(a["kernel"], c["kernel"])
    np.testing.assert_array_equal(a["bias"], np.zeros(40))
    k = np.asarray(a["kernel"])
    assert abs(k.std() - cfg.initializer_range) < 0.1 * cfg.initializer_range, k.std()
    assert abs(k.mean()) < 0.1 * cfg.initializer_range


@pytest.mark.parametrize("head", ["BertForSequenceClassification", "BertForMaskedLM"])
def test_random_params_draw_what_init_params_draws(head):
    """random_params (NumPy, no forward) against flax's init through the model: the same tree,
    shapes and dtypes; where init_params gives zeros or ones, the same; elsewhere N(0, 0.02).
    Seeded: the same seed gives the same values, another seed others."""
    cfg = jtb.BertConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=4, intermediate_size=128, num_labels=3)
    model = getattr(jtb.modeling, head)(cfg)
    ref = jtb.init_params(model, jax.random.PRNGKey(0))
    got = jtb.modeling.random_params(model, 5)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(ref)
    normal = 0
    for (path, r), g in zip(jax.tree_util.tree_leaves_with_path(ref),
                            jax.tree_util.tree_leaves(got)):
        r, g = np.asarray(r), np.asarray(g)
        assert g.shape == r.shape and g.dtype == r.dtype, path
        if np.all(r == 0) or np.all(r == 1):
            np.testing.assert_array_equal(g, r, err_msg=str(path))
        else:
            normal += 1
            # Five standard errors of each estimate (seeded: the draws are fixed).
            sd, n = cfg.initializer_range, g.size
            assert abs(r.std() - sd) < 5 * sd / np.sqrt(2 * n), (path, r.std())   # the reference
            assert abs(g.std() - sd) < 5 * sd / np.sqrt(2 * n), (path, g.std())
            assert abs(g.mean()) < 5 * sd / np.sqrt(n), (path, g.mean())
    assert normal >= 10
    again, other = jtb.modeling.random_params(model, 5), jtb.modeling.random_params(model, 6)
    for a, b, c in zip(*(jax.tree_util.tree_leaves(t) for t in (got, again, other))):
        np.testing.assert_array_equal(a, b)
        assert a.size < 4 or np.all(a == 0) or np.all(a == 1) or not np.array_equal(a, c)


def test_cls_only_matches_pytorch_outputs_and_gradients(teacher, batch, teacher_dir):
    """cls_only (the last layer computes its [CLS] row only) against the full PyTorch model:
    the same pooled output, logits and [CLS] vector, and the same gradients of a logits loss,
    the last layer's query kernel (which only the [CLS] row reaches) included."""
    import torch
    from transformers import BertForSequenceClassification as TorchCls

    torch.manual_seed(0)
    tm = TorchCls.from_pretrained(teacher_dir, num_labels=3, attn_implementation="eager").eval()
    config, bert_params = teacher
    params = {"bert": bert_params,
              "classifier": {"kernel": tm.classifier.weight.detach().numpy().T,
                             "bias": tm.classifier.bias.detach().numpy()}}
    labels = np.array([0, 2, 1, 2])
    tb = {k: torch.tensor(v, dtype=torch.long) for k, v in batch.items()}
    with torch.no_grad():
        ref32 = tm(**tb, output_hidden_states=True)
    tm.double()   # the exact values and gradients (see F32_ATOL)
    ref = tm(**tb, output_hidden_states=True)
    torch.nn.functional.cross_entropy(ref.logits, torch.tensor(labels), reduction="sum").backward()

    model = jtb.BertForSequenceClassification(config.replace(num_labels=3))

    def loss(p):
        out = model.apply({"params": p}, **batch, attention_logits=False, cls_only=True)
        logp = jax.nn.log_softmax(out.logits)
        return -jnp.sum(logp[jnp.arange(4), labels]), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    L = config.num_hidden_layers
    assert out.hidden_states[-1].shape == (4, 1, config.hidden_size)
    _assert_close_to_f64(out.hidden_states[-1][:, 0], ref.hidden_states[-1][:, 0].detach().numpy(),
                         ref32.hidden_states[-1][:, 0].numpy(), "last [CLS]")
    _assert_close_to_f64(out.hidden_states[L - 1], ref.hidden_states[L - 1].detach().numpy(),
                         ref32.hidden_states[L - 1].numpy(), f"hidden state {L - 1}")
    _assert_close_to_f64(out.logits, ref.logits.detach().numpy(), ref32.logits.numpy(), "logits")

    last = tm.bert.encoder.layer[L - 1]
    g_last = grads["bert"]["encoder"]["layer"][str(L - 1)]
    pairs = {
        "last query": (g_last["attention"]["self"]["query"]["kernel"],
                       last.attention.self.query.weight.grad.T),
        "last key": (g_last["attention"]["self"]["key"]["kernel"],
                     last.attention.self.key.weight.grad.T),
        "last value bias": (g_last["attention"]["self"]["value"]["bias"],
                            last.attention.self.value.bias.grad),
        "last FFN in": (g_last["intermediate"]["dense"]["kernel"],
                        last.intermediate.dense.weight.grad.T),
        "first query": (grads["bert"]["encoder"]["layer"]["0"]["attention"]["self"]["query"]
                        ["kernel"], tm.bert.encoder.layer[0].attention.self.query.weight.grad.T),
        "word embeddings": (grads["bert"]["embeddings"]["word_embeddings"]["embedding"],
                            tm.bert.embeddings.word_embeddings.weight.grad),
        "classifier": (grads["classifier"]["kernel"], tm.classifier.weight.grad.T),
    }
    for name, (ours, theirs) in pairs.items():
        theirs = theirs.numpy()
        assert np.abs(theirs).max() > 0, name
        np.testing.assert_allclose(np.asarray(ours), theirs, rtol=0,
                                   atol=2e-4 * np.abs(theirs).max(), err_msg=name)


def test_cls_only_refuses_the_last_layers_attention_logits(teacher, batch):
    config, params = teacher
    with pytest.raises(ValueError, match="cls_only=True computes layer 6's \\[CLS\\] row only"):
        jtb.BertModel(config).apply({"params": params}, **batch, cls_only=True)
    out = jtb.BertModel(config).apply({"params": params}, **batch, cls_only=True,
                                      attention_logits=[5])
    assert out.attention_logits[4].shape[-2:] == (batch["input_ids"].shape[1],) * 2


def _bf16(x) -> np.ndarray:
    """x rounded to bfloat16 (ml_dtypes: round to nearest even), as float64."""
    import ml_dtypes
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


@pytest.mark.parametrize("eq,shape_a,shape_b", [
    ("nk,km->nm", (48, 40), (40, 24)),                      # a dense layer on rows
    ("bhqd,bhkd->bhqk", (2, 3, 8, 16), (2, 3, 8, 16)),      # attention scores
    ("bhqk,bhkd->bhqd", (2, 3, 8, 8), (2, 3, 8, 16)),       # attention context
])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_half_einsum_matches_numpy(eq, shape_a, shape_b, out_dtype):
    """half_einsum against NumPy in float64 from the definition: operands rounded to bfloat16,
    exact sums, the result in `out_dtype`; the gradients are the products of the bfloat16
    cotangent with the other rounded operand, returned in each operand's dtype. The second
    operand is float32 (a kernel): its gradient must not be rounded to 16 bits."""
    ks = jax.random.split(jax.random.PRNGKey(3), 3)
    a = jax.random.normal(ks[0], shape_a).astype(jnp.bfloat16)
    b = jax.random.normal(ks[1], shape_b)
    from jax_tinybert.speed.dots import half_einsum
    out = half_einsum(eq, a, b, jnp.bfloat16, out_dtype)
    assert out.dtype == out_dtype
    ref = np.einsum(eq, _bf16(a), _bf16(b))
    rtol = 2.0 ** -8 if out_dtype == jnp.bfloat16 else 1e-5   # one bfloat16 rounding, or none
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=rtol,
                               atol=rtol * np.abs(ref).max())

    w = jax.random.normal(ks[2], out.shape)
    ga, gb = jax.grad(lambda a, b: jnp.sum(
        half_einsum(eq, a, b, jnp.bfloat16, out_dtype).astype(jnp.float32) * w),
        argnums=(0, 1))(a, b)
    assert ga.dtype == jnp.bfloat16 and gb.dtype == jnp.float32
    ins, o = eq.split("->")
    ia, ib = ins.split(",")
    g = _bf16(np.asarray(w.astype(out_dtype), np.float32))
    ref_ga = np.einsum(f"{o},{ib}->{ia}", g, _bf16(b))
    ref_gb = np.einsum(f"{ia},{o}->{ib}", _bf16(a), g)
    np.testing.assert_allclose(np.asarray(ga, np.float64), ref_ga, rtol=2.0 ** -8,
                               atol=2.0 ** -8 * np.abs(ref_ga).max())
    # float32 sums of exact products: ~1e-6 relative; a bfloat16-rounded gradient is ~4e-3 off.
    np.testing.assert_allclose(np.asarray(gb, np.float64), ref_gb, rtol=1e-5,
                               atol=1e-5 * np.abs(ref_gb).max())


def test_cpu_bfloat16_runs_bfloat16_products_with_float32_activations(teacher, batch):
    """On a CPU, a bfloat16 config gives the model float32 activations and bfloat16 products
    (build.compute_dtypes): every 2-D product of the compiled forward and backward takes
    bfloat16 operands (XLA's CPU backend upcasts a bfloat16-output dot to float32, which lost
    AMX: the first version of bfloat16 compute ran slower than float32), and the outputs and
    gradients stay within bfloat16's rounding of the float32 model's."""
    from jax_tinybert.speed import dtypes as speed_dtypes
    config, params = teacher
    from jax_tinybert.speed.dots import HalfProducts
    assert speed_dtypes.compute_dtypes("bfloat16", "cpu") == {
        "dtype": jnp.float32, "products": HalfProducts(jnp.bfloat16)}
    assert speed_dtypes.compute_dtypes("bfloat16", "gpu") == {"dtype": jnp.bfloat16}
    assert speed_dtypes.compute_dtypes("float32", "cpu") == {"dtype": jnp.float32}
    m32 = jtb.BertForSequenceClassification(config)
    m16 = m32.clone(**speed_dtypes.compute_dtypes("bfloat16", "cpu"))
    p = m32.init(jax.random.PRNGKey(0), batch["input_ids"])["params"] | {"bert": params}
    # 8 copies of the batch: rows enough that XLA runs every layer's product as a library dot
    # (it emits tiny ones itself, in float32, whatever the operands).
    big = {k: np.tile(v, (8, 1)) for k, v in batch.items()}

    def loss(model, p):
        out = model.apply({"params": p}, **big)
        return jnp.sum(out.logits ** 2) + jnp.sum(out.hidden_states[-1] ** 2) * 1e-3, out

    grad16 = jax.jit(jax.grad(lambda p: loss(m16, p), has_aux=True))
    hlo = grad16.lower(p).compile().as_text()
    # Instruction names are unique in an HLO module; operands are named, typed where defined.
    defs = {n: (t, [int(x) for x in d.split(",") if x])
            for n, t, d in re.findall(r"%([\w.\-]+) = (\w+)\[([\d,]*)\]", hlo)}
    dots = [(defs[a], defs[b]) for a, b in
            re.findall(r"= \w+\[\d+,\d+\]\S* dot\(%([\w.\-]+), %([\w.\-]+)\)", hlo)]
    # The classifier's (2 labels) is left to XLA, too small for the library dot.
    dots = [d for d in dots if min(d[0][1] + d[1][1]) >= 8]
    # 6 layers x 4 dense products (the attention's 3 are one) x forward and 2 gradients.
    assert len(dots) >= 6 * 4 * 3, len(dots)
    not_bf16 = [d for d in dots if (d[0][0], d[1][0]) != ("bf16", "bf16")]
    assert not not_bf16, not_bf16[:3]

    g32, o32 = jax.grad(lambda p: loss(m32, p), has_aux=True)(p)
    g16, o16 = grad16(p)
    assert o16.hidden_states[-1].dtype == jnp.float32
    h32, h16 = np.asarray(o32.hidden_states[-1]), np.asarray(o16.hidden_states[-1])
    assert np.linalg.norm(h16 - h32) / np.linalg.norm(h32) < 0.02
    for k32, k16 in zip(jax.tree_util.tree_leaves(g32), jax.tree_util.tree_leaves(g16)):
        assert k16.dtype == jnp.float32
        n = np.linalg.norm(np.asarray(k32))
        if n > 1e-3:
            assert np.linalg.norm(np.asarray(k16) - np.asarray(k32)) / n < 0.1


def test_teacher_cache_fingerprint_names_the_product_dtype(teacher):
    """A teacher whose products run in bfloat16 gives other outputs: its cache fingerprint
    differs, while a float32 teacher's is the one caches were built under before 16-bit
    products existed (the string is the one those caches recorded)."""
    from jax_tinybert.speed.dots import HalfProducts
    from jax_tinybert.teacher import training as teacher_training
    config, _ = teacher
    m = jtb.BertModel(config)
    assert teacher_training.teacher_model_id(m) == f"BertModel:{jnp.float32}"
    assert teacher_training.teacher_model_id(m.clone(products=HalfProducts(jnp.bfloat16))) == \
        f"BertModel:{jnp.float32}:dots={jnp.bfloat16}"


def test_cpu_bfloat16_attention_products_and_their_gradients_take_bfloat16_operands():
    """At a bucket length (even: q, k, v are written heads-first as rows, _heads_first), every
    product of a compiled bfloat16 train step, the attention's batched ones and their two
    gradients included, takes bfloat16 operands: XLA's CPU backend upcasts a bfloat16 product
    whose operand the library dot cannot read as rows to a float32 Eigen one (the gradients of
    k and v did so until _rows_product_of_columns). The gradients of q, k and v match the
    float32 model's to bfloat16 rounding."""
    from jax_tinybert.speed import dtypes as speed_dtypes
    cfg = jtb.BertConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=256,
                         num_attention_heads=4, vocab_size=100, num_labels=3)
    m32 = jtb.BertForSequenceClassification(cfg)
    m16 = m32.clone(**speed_dtypes.compute_dtypes("bfloat16", "cpu"))
    ids = jax.random.randint(jax.random.PRNGKey(1), (16, 64), 1, 100)
    mask = jnp.ones(ids.shape, jnp.int32).at[0, 40:].set(0)
    p = m32.init(jax.random.PRNGKey(0), ids)["params"]

    def grads(model):
        return jax.jit(jax.grad(lambda p: jnp.sum(model.apply(
            {"params": p}, ids, mask, deterministic=True).logits ** 2)))

    hlo = grads(m16).lower(p).compile().as_text()
    defs = {n: (t, [int(x) for x in d.split(",") if x])
            for n, t, d in re.findall(r"%([\w.\-]+) = (\w+)\[([\d,]*)\]", hlo)}
    dots = [(defs[a], defs[b]) for a, b in
            re.findall(r"= \w+\[[\d,]+\]\S* dot\(%([\w.\-]+), %([\w.\-]+)\)", hlo)]
    batched = [d for d in dots if len(d[0][1]) == 4]
    # 2 layers x (scores, context) x (forward and 2 gradients).
    assert len(batched) >= 2 * 2 * 3, len(batched)
    not_bf16 = [d for d in dots if min(d[0][1][-2:] + d[1][1][-2:]) >= 8
                and (d[0][0], d[1][0]) != ("bf16", "bf16")]
    assert not not_bf16, not_bf16[:3]
    g32, g16 = grads(m32)(p), grads(m16)(p)
    for name in ("query", "key", "value"):
        k32 = np.asarray(g32["bert"]["encoder"]["layer"]["0"]["attention"]["self"][name]["kernel"])
        k16 = np.asarray(g16["bert"]["encoder"]["layer"]["0"]["attention"]["self"][name]["kernel"])
        assert np.linalg.norm(k16 - k32) / np.linalg.norm(k32) < 0.05, name


@pytest.mark.parametrize("B,T", [(1, 8), (3, 13), (32, 16), (8, 64)])
def test_cpu_bfloat16_step_runs_at_odd_shapes(B, T):
    """A bfloat16 forward and backward compiles and runs at shapes a run meets (one example,
    odd lengths, short and long buckets), and its gradients match the float32 model's: XLA's
    CPU backend fails at run time ("Unsupported element type for DotThunk::Execute: BF16 x
    BF16 = F32") on a bfloat16 product it first planned for the library dot and then gave a
    layout the library cannot take."""
    from jax_tinybert.speed import dtypes as speed_dtypes
    cfg = jtb.BertConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=256,
                         num_attention_heads=4, vocab_size=100, num_labels=3)
    m32 = jtb.BertForSequenceClassification(cfg)
    m16 = m32.clone(**speed_dtypes.compute_dtypes("bfloat16", "cpu"))
    ids = jax.random.randint(jax.random.PRNGKey(1), (B, T), 1, 100)
    mask = jnp.ones((B, T), jnp.int32).at[0, T // 2:].set(0)
    p = m32.init(jax.random.PRNGKey(0), ids)["params"]

    def grads(model):
        return jax.jit(jax.grad(lambda p: jnp.sum(model.apply(
            {"params": p}, ids, mask, deterministic=True).logits ** 2)))(p)

    g32, g16 = grads(m32), grads(m16)
    for k32, k16 in zip(jax.tree_util.tree_leaves(g32), jax.tree_util.tree_leaves(g16)):
        n = np.linalg.norm(np.asarray(k32))
        if n > 1e-4:
            assert np.linalg.norm(np.asarray(k16) - np.asarray(k32)) / n < 0.1


def test_gelu_is_the_exact_erf_gelu_within_float32_rounding():
    """modeling.gelu (erf form, the fast one) against x/2 (1 + erf(x/sqrt 2)) in float64 from
    `math.erf`, values and gradient, over [-12, 12]. The values within 1.2e-6, PyTorch's own
    float32 GELU's distance from float64 on these inputs (1.17e-6; ours 1.1e-6 at |x| ~ 12, an
    ulp there is 9.5e-7; negative x lose low bits to 1 + erf, as PyTorch's formula does), and
    exact where GELU is (0, large |x|)."""
    import math

    x = np.concatenate([np.linspace(-12, 12, 200_001),
                        np.random.default_rng(0).standard_normal(50_000) * 3]).astype(np.float32)
    x64 = x.astype(np.float64)
    erf = np.vectorize(math.erf)(x64 / math.sqrt(2))
    ref = 0.5 * x64 * (1 + erf)
    dref = 0.5 * (1 + erf) + x64 * np.exp(-x64 ** 2 / 2) / math.sqrt(2 * math.pi)
    fn = jax.jit(jtb.modeling.gelu)
    np.testing.assert_allclose(np.asarray(fn(x), np.float64), ref, rtol=0, atol=1.2e-6)
    grad = jax.jit(jax.vmap(jax.grad(jtb.modeling.gelu)))(x)
    np.testing.assert_allclose(np.asarray(grad, np.float64), dref, rtol=4e-7, atol=4e-7)
    big = np.float32([0.0, 30.0, 1e4, -30.0])
    np.testing.assert_array_equal(np.asarray(fn(big)), [0.0, 30.0, 1e4, -0.0])
