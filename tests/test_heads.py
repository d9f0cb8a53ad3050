"""The span (SQuAD) and token-classification (NER) heads of every family against transformers'
PyTorch *ForQuestionAnswering / *ForTokenClassification models (random weights of small configs
made here), and the export back to each family's PyTorch and Flax classes."""
import jax
import numpy as np
import pytest
import torch
import transformers

from jax_tinybert.model import heads
from jax_tinybert.model.export import export_hf
from jax_tinybert.model.hf import load_pretrained
from tests.test_families import SMALL, FAMILIES, _batch

STEMS = {"bert": "Bert", "roberta": "Roberta", "xlm-roberta": "XLMRoberta",
         "distilbert": "DistilBert", "electra": "Electra"}
SUFFIX = {"span": "ForQuestionAnswering", "token": "ForTokenClassification"}
# The HF Flax classes read back (each costs a Flax init): BERT's two, one head of each other family.
FLAX_CHECKED = {("bert", "span"), ("bert", "token"), ("roberta", "span"), ("distilbert", "token"),
                ("electra", "span"), ("xlm-roberta", "token")}


def _torch_model(family, head, seed=0):
    torch.manual_seed(seed)
    fields = dict(SMALL, num_labels=2 if head == "span" else 5)
    if family == "bert":
        cfg = transformers.BertConfig(**fields, max_position_embeddings=64)
    else:
        cfg_cls, extra, _, _ = FAMILIES[family]
        if family == "distilbert":
            fields.update(dim=64, n_layers=2, n_heads=4, hidden_dim=128, dropout=0.0,
                          attention_dropout=0.0, qa_dropout=0.0)
            for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                      "intermediate_size", "hidden_dropout_prob", "attention_probs_dropout_prob"):
                del fields[k]
        cfg = cfg_cls(**fields, **extra)
    model = getattr(transformers, STEMS[family] + SUFFIX[head])(cfg).eval()
    with torch.no_grad():   # off HF's init: names must matter
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _torch_logits(model, head, ids, mask):
    with torch.no_grad():
        out = model(torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long())
    if head == "span":
        return np.stack([out.start_logits.numpy(), out.end_logits.numpy()], axis=1)  # [B, 2, T]
    return out.logits.numpy()


def _ours(config, params, head, ids, mask):
    return np.asarray(heads.MODELS[head](config).apply({"params": params}, ids, mask).logits)


def _real(head, logits, mask):
    """The logits at real tokens (ours mask the rest; HF's do not)."""
    m = mask.astype(bool)
    return logits.transpose(0, 2, 1)[m] if head == "span" else logits[m]


@pytest.mark.parametrize("head", ["span", "token"])
@pytest.mark.parametrize("family", ["bert", "roberta", "xlm-roberta", "distilbert", "electra"])
def test_head_matches_pytorch_and_exports(family, head, tmp_path):
    """Loaded from the family's PyTorch class: logits within 1e-4 on real tokens, padding at
    MASKED_LOGIT (span); exported: the family's own PyTorch class (and Flax class, FLAX_CHECKED)
    gives our logits within 1e-5, with architectures and (token) id2label written."""
    model = _torch_model(family, head)
    model.save_pretrained(tmp_path / "m")
    config, params = load_pretrained(str(tmp_path / "m"), for_classification=True, head=head)
    name = heads.NAMES[head][0]
    assert set(params) == {"bert", name}, sorted(params)
    ids, mask = _batch(config.pad_token_id)
    ours = _ours(config, params, head, ids, mask)
    ref = _torch_logits(model, head, ids, mask)
    assert ours.shape == ref.shape
    np.testing.assert_allclose(_real(head, ours, mask), _real(head, ref, mask), atol=1e-4)
    if head == "span":
        assert np.all(ours.transpose(0, 2, 1)[~mask.astype(bool)] == heads.MASKED_LOGIT)

    id2label = {i: t for i, t in enumerate(("O", "B-PER", "I-PER", "B-LOC", "I-LOC"))}
    out = export_hf(config, params, str(tmp_path / "export"),
                    id2label=id2label if head == "token" else None)
    cls = STEMS[family] + SUFFIX[head]
    back = getattr(transformers, cls).from_pretrained(out).eval()
    assert back.config.architectures == [cls]
    if head == "token":
        assert back.config.id2label == id2label
    np.testing.assert_allclose(_real(head, _torch_logits(back, head, ids, mask), mask),
                               _real(head, ours, mask), atol=1e-5)
    # ... our loader reads the export back to the same head
    config2, params2 = load_pretrained(out, head=head)
    assert name in params2
    np.testing.assert_allclose(_ours(config2, params2, head, ids, mask), ours, atol=1e-6)
    if (family, head) not in FLAX_CHECKED:
        return
    flax_model = getattr(transformers, "Flax" + cls).from_pretrained(out)
    # Token types given: HF's FlaxElectra defaults them to ones (its PyTorch class to zeros).
    types = {} if family == "distilbert" else {"token_type_ids": np.zeros_like(ids)}
    fo = flax_model(ids, attention_mask=mask, **types)
    flax_logits = (np.stack([np.asarray(fo.start_logits), np.asarray(fo.end_logits)], 1)
                   if head == "span" else np.asarray(fo.logits))
    np.testing.assert_allclose(_real(head, flax_logits, mask), _real(head, ours, mask), atol=1e-5)


def test_a_new_head_for_a_bare_encoder(tmp_path):
    """An encoder checkpoint without the head: a new one of the right shape (span: 2 outputs)."""
    model = transformers.BertModel(transformers.BertConfig(**dict(SMALL, num_labels=2),
                                                           max_position_embeddings=64))
    model.save_pretrained(tmp_path / "m")
    config, params = load_pretrained(str(tmp_path / "m"), for_classification=True, head="span")
    assert params["qa_outputs"]["kernel"].shape == (64, 2) and config.num_labels == 2
    config, params = load_pretrained(str(tmp_path / "m"), for_classification=True, head="token",
                                     num_labels=9)
    assert params["token_classifier"]["kernel"].shape == (64, 9) and config.num_labels == 9
    assert np.all(params["token_classifier"]["bias"] == 0)


def test_export_refuses_a_head_without_its_encoder(tmp_path):
    """One line naming the missing part."""
    config, params = load_pretrained(str(_saved(tmp_path)), for_classification=True, head="span")
    with pytest.raises(ValueError, match="qa_outputs head without 'bert'"):
        export_hf(config, {"qa_outputs": params["qa_outputs"]}, str(tmp_path / "x"))


def _saved(tmp_path):
    _torch_model("bert", "span").save_pretrained(tmp_path / "s")
    return tmp_path / "s"


def test_a_hub_ner_model_is_relabelled_by_name(tmp_path):
    """A token classifier whose id2label orders the tags otherwise (as hub NER models do) is put
    in the data's order: its logits, columns permuted, equal the original's by tag name; a model
    naming other tags stops with one line."""
    from jax_tinybert.data.conll import HF_LABELS
    from jax_tinybert.data.glue import DataError

    theirs = ("O", "B-MISC", "I-MISC", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC")
    model = transformers.BertForTokenClassification(transformers.BertConfig(
        **dict(SMALL, num_labels=9), max_position_embeddings=64,
        id2label=dict(enumerate(theirs)))).eval()
    model.save_pretrained(tmp_path / "m")
    config, params = load_pretrained(str(tmp_path / "m"), head="token")
    ids, mask = _batch(0)
    before = _ours(config, params, "token", ids, mask)
    config2, params2 = heads.relabel(config, params, HF_LABELS)
    after = _ours(config2, params2, "token", ids, mask)
    for j, tag in enumerate(HF_LABELS):
        np.testing.assert_allclose(after[..., j], before[..., theirs.index(tag)], atol=1e-6)
    assert config2.id2label == dict(enumerate(HF_LABELS))
    with pytest.raises(DataError, match=r"missing \['B-FOO'\]"):
        heads.relabel(config, params, ("O", "B-FOO") + HF_LABELS[1:])


def test_a_span_checkpoint_reads_as_an_encoder_and_a_classifier(tmp_path):
    """A QA export read as a bare encoder (augmentation's embeddings, another task's student):
    its encoder weights as they are, a new pooler where the layout has one."""
    path = _saved(tmp_path)
    config, qa = load_pretrained(str(path), head="span")
    config2, enc = load_pretrained(str(path), for_classification=False)
    assert "pooler" in enc and "pooler" not in qa["bert"]
    np.testing.assert_array_equal(enc["embeddings"]["word_embeddings"]["embedding"],
                                  qa["bert"]["embeddings"]["word_embeddings"]["embedding"])
    _, cls = load_pretrained(str(path), for_classification=True, num_labels=3)
    assert cls["classifier"]["kernel"].shape == (64, 3)
