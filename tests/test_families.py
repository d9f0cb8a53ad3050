"""RoBERTa, XLM-RoBERTa, ELECTRA and DistilBERT teachers and students: the one model against transformers'
PyTorch classes of each family (random weights of small configs made here), and the export back
to each family's own PyTorch and Flax classes."""
import json

import jax
import numpy as np
import pytest
import torch
import transformers

from jax_tinybert.model import families
from jax_tinybert.model.config import BertConfig, ConfigError
from jax_tinybert.model.export import export_hf
from jax_tinybert.model.hf import load_pretrained
from jax_tinybert.model.modeling import BertForMaskedLM, BertForSequenceClassification

SMALL = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
             num_labels=3, attn_implementation="eager")
# family -> (config class, its extra fields, classification class, masked-LM class or None)
FAMILIES = {
    "roberta": (transformers.RobertaConfig, dict(max_position_embeddings=66, pad_token_id=1,
                                                 type_vocab_size=1),
                "RobertaForSequenceClassification", "RobertaForMaskedLM"),
    "xlm-roberta": (transformers.XLMRobertaConfig, dict(max_position_embeddings=66,
                                                        pad_token_id=1, type_vocab_size=1),
                    "XLMRobertaForSequenceClassification", "XLMRobertaForMaskedLM"),
    "distilbert": (transformers.DistilBertConfig, dict(max_position_embeddings=64, pad_token_id=0),
                   "DistilBertForSequenceClassification", "DistilBertForMaskedLM"),
    "electra": (transformers.ElectraConfig, dict(max_position_embeddings=64, embedding_size=32,
                                                 pad_token_id=0), "ElectraForSequenceClassification",
                None),
}


def _torch_model(family, kind, seed=0):
    cfg_cls, extra, cls_name, mlm_name = FAMILIES[family]
    torch.manual_seed(seed)
    fields = dict(SMALL)
    if family == "distilbert":   # its own names of the same fields
        fields.update(dim=64, n_layers=2, n_heads=4, hidden_dim=128, dropout=0.0,
                      attention_dropout=0.0, seq_classif_dropout=0.0)
        for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                  "hidden_dropout_prob", "attention_probs_dropout_prob"):
            del fields[k]
    model = getattr(transformers, cls_name if kind == "cls" else mlm_name)(
        cfg_cls(**fields, **extra)).eval()
    with torch.no_grad():   # off HF's init (unit LayerNorms, zero biases): names must matter
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _batch(pad):
    rng = np.random.default_rng(0)
    ids = rng.integers(5, 1000, size=(3, 12)).astype(np.int32)
    lens = np.array([12, 9, 4])
    mask = (np.arange(12)[None] < lens[:, None]).astype(np.int32)
    ids[:, 0] = 0 if pad == 1 else 2
    return np.where(mask > 0, ids, pad).astype(np.int32), mask


def _raw_scores(model, family, ids, mask):
    """q k^T / sqrt(d_head) per layer [B, H, T, T], from the inputs transformers' attention
    modules receive (forward hooks), with the modules' own q and k projections."""
    base = getattr(model, model.base_model_prefix)
    layers = base.transformer.layer if family == "distilbert" else base.encoder.layer
    mods = [l.attention if family == "distilbert" else l.attention.self for l in layers]
    seen = {}
    hooks = [m.register_forward_hook(
        lambda mod, a, kw, o, i=i: seen.__setitem__(i, kw.get("query", kw.get(
            "hidden_states", a[0] if a else None))), with_kwargs=True)
        for i, m in enumerate(mods)]
    try:
        _torch_out(model, ids, mask)
    finally:
        for h in hooks:
            h.remove()
    out = []
    for i, m in enumerate(mods):
        q_lin, k_lin = (m.q_lin, m.k_lin) if family == "distilbert" else (m.query, m.key)
        heads = model.config.num_attention_heads if family != "distilbert" else model.config.n_heads
        with torch.no_grad():
            q, k = q_lin(seen[i]), k_lin(seen[i])
        B, T, D = q.shape
        q = q.view(B, T, heads, D // heads).transpose(1, 2)
        k = k.view(B, T, heads, D // heads).transpose(1, 2)
        out.append((q @ k.transpose(-1, -2)).numpy() / np.sqrt(D // heads))
    return out


def _torch_out(model, ids, mask):
    with torch.no_grad():
        return model(torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long(),
                     output_hidden_states=True, output_attentions=True)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_matches_its_pytorch_model(family, tmp_path):
    """Hidden states (1e-4, every layer, real tokens), raw attention scores (1e-4, through hooks),
    attention probabilities (1e-5, real query rows) and classification logits (1e-4), with right
    padding, from a save_pretrained folder of the family's PyTorch class."""
    model = _torch_model(family, "cls")
    model.save_pretrained(tmp_path / "m")
    config, params = load_pretrained(str(tmp_path / "m"))
    assert config.model_type == family and "classifier" in params
    ids, mask = _batch(config.pad_token_id)
    ours = BertForSequenceClassification(config).apply({"params": params}, ids, mask)
    ref = _torch_out(model, ids, mask)
    real = mask.astype(bool)
    assert len(ours.hidden_states) == len(ref.hidden_states) == 3
    for a, b in zip(ours.hidden_states, ref.hidden_states):
        np.testing.assert_allclose(np.asarray(a)[real], b.numpy()[real], atol=1e-4)
    bias = np.where(mask[:, None, None, :] > 0, 0.0, np.finfo(np.float32).min)
    for lg, att in zip(ours.attention_logits, ref.attentions):
        probs = np.asarray(jax.nn.softmax(np.asarray(lg) + bias, axis=-1))
        np.testing.assert_allclose(probs.transpose(0, 2, 1, 3)[real],
                                   att.numpy().transpose(0, 2, 1, 3)[real], atol=1e-5)
    for lg, raw in zip(ours.attention_logits, _raw_scores(model, family, ids, mask)):
        np.testing.assert_allclose(np.asarray(lg), raw, atol=1e-4)   # before mask and softmax
    np.testing.assert_allclose(np.asarray(ours.logits), ref.logits.numpy(), atol=1e-4)
    assert ours.pooled is None                       # no pooler: the first token's row


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_export_loads_in_the_familys_pytorch_and_flax_classes(family, tmp_path):
    model = _torch_model(family, "cls", seed=1)
    model.save_pretrained(tmp_path / "m")
    config, params = load_pretrained(str(tmp_path / "m"))
    out = export_hf(config, params, str(tmp_path / "export"))
    cfg = json.loads((tmp_path / "export" / "config.json").read_text())
    cls_name = FAMILIES[family][2]
    assert cfg["model_type"] == family and cfg["architectures"] == [cls_name]
    ids, mask = _batch(config.pad_token_id)
    ours = np.asarray(BertForSequenceClassification(config).apply({"params": params}, ids,
                                                                  mask).logits)
    back = getattr(transformers, cls_name).from_pretrained(out, attn_implementation="eager")
    np.testing.assert_allclose(_torch_out(back.eval(), ids, mask).logits.numpy(), ours,
                               atol=1e-5)
    flax_model = getattr(transformers, "Flax" + cls_name).from_pretrained(out)
    # Token types given: HF's FlaxElectra defaults them to ones (its PyTorch class to zeros).
    types = {} if family == "distilbert" else {"token_type_ids": np.zeros_like(ids)}
    logits = flax_model(ids, attention_mask=mask, **types).logits
    np.testing.assert_allclose(np.asarray(logits), ours, atol=1e-5)
    again, p2 = load_pretrained(out)                 # and our own loader reads it back
    assert again.model_type == family
    jax.tree_util.tree_map(np.testing.assert_array_equal, p2, params)


@pytest.mark.parametrize("family", ["roberta", "xlm-roberta", "distilbert"])
def test_masked_lm_head_matches_and_exports(family, tmp_path):
    model = _torch_model(family, "mlm", seed=2)
    model.save_pretrained(tmp_path / "m")
    config, params = load_pretrained(str(tmp_path / "m"), mlm_head=True)
    ids, mask = _batch(config.pad_token_id)
    ours = np.asarray(BertForMaskedLM(config).apply({"params": params}, ids, mask).logits)
    real = mask.astype(bool)
    np.testing.assert_allclose(ours[real], _torch_out(model, ids, mask).logits.numpy()[real],
                               atol=1e-4)
    out = export_hf(config, params, str(tmp_path / "export"))
    back = getattr(transformers, FAMILIES[family][3]).from_pretrained(out).eval()
    np.testing.assert_allclose(_torch_out(back, ids, mask).logits.numpy()[real], ours[real],
                               atol=1e-4)


def test_positions_of_a_roberta_model_start_past_the_padding_index():
    """0-based position ids from callers (packing) read RoBERTa's table from row pad + 1, as HF's
    own numbering of the unpacked rows does."""
    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=20, type_vocab_size=1,
                     pad_token_id=1, model_type="roberta")
    from jax_tinybert.model.modeling import random_params
    m = BertForSequenceClassification(cfg)
    p = random_params(m, 0)
    ids = np.array([[0, 7, 8, 9, 2, 1, 1]], np.int32)
    mask = (ids != 1).astype(np.int32)
    implicit = m.apply({"params": p}, ids, mask)
    explicit = m.apply({"params": p}, ids, mask, position_ids=np.arange(7)[None])
    np.testing.assert_allclose(np.asarray(implicit.hidden_states[-1])[0, :5],
                               np.asarray(explicit.hidden_states[-1])[0, :5], atol=1e-6)


def test_an_unsupported_model_type_is_one_line(tmp_path):
    d = BertConfig(vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                   intermediate_size=16).to_dict()
    d["model_type"] = "gpt2"
    with pytest.raises(ConfigError, match="model_type' is 'gpt2'.*bert, roberta, xlm-roberta, "
                                          "electra, distilbert") as e:
        BertConfig.from_dict(d, source="x/config.json")
    assert "\n" not in str(e.value)


def test_family_renames_are_inverse():
    for fam in families.FAMILIES.values():
        for path in (("bert", "embeddings", "embeddings_project", "kernel"),
                     ("bert", "encoder", "layer", "0", "output", "dense", "kernel"),
                     ("cls", "predictions", "transform", "LayerNorm", "scale"),
                     ("classifier", "out_proj", "bias"), ("embeddings", "word_embeddings",
                                                          "embedding")):
            assert families.from_hf(fam, families.to_hf(fam, path)) == path, (fam, path)


def test_a_row_longer_than_robertas_positions_is_refused_before_the_run(tmp_path,
                                                                       bpe_tokenizer_dir):
    """RoBERTa's position table starts past its padding index: 66 rows hold 64 positions."""
    from jax_tinybert.config import check, schema
    from jax_tinybert.model.modeling import BertModel, random_params

    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=66, type_vocab_size=1,
                     pad_token_id=1, model_type="roberta")
    export_hf(cfg, random_params(BertModel(cfg), 0), str(tmp_path / "t"),
              tokenizer_dir=bpe_tokenizer_dir)
    c = schema.base_config()
    c.teacher.path, c.data.kind, c.data.buckets = str(tmp_path / "t"), "synthetic", ()
    c.data.max_len = 64
    check.check_paths(c)
    c.data.max_len = 65
    with pytest.raises(check.ConfigValueError, match="data.max_len=65 is longer than the model's "
                                                      "64 positions"):
        check.check_paths(c)
