"""The mlm_head stage: BERT masking, the masked-LM loss against NumPy from the formula, and a
tiny end-to-end fit whose export loads in hf.load_pretrained, transformers and augment.py."""
import json

import jax
import numpy as np
import pytest

from jax_tinybert.train import mlm_head
from jax_tinybert.model.modeling import BertConfig, BertForMaskedLM, BertForSequenceClassification, init_params

SPECIAL = (0, 1, 2, 3)  # pad, cls, sep, mask in the toy vocabulary below


def test_mask_batch_follows_bert_masking():
    rng = np.random.default_rng(0)
    B, T, V = 400, 40, 50
    ids = rng.integers(4, V, size=(B, T)).astype(np.int32)
    ids[:, 0], mask = 1, np.ones((B, T), np.int32)
    mask[:, 30:] = 0
    ids[:, 29] = 2
    inputs, pos, lab, w = mlm_head.mask_batch(ids, mask, rng, mask_id=3, vocab_size=V,
                                             special_ids=SPECIAL, max_predictions=5, rate=0.15)
    assert pos.shape == lab.shape == w.shape == (B, 5)
    k = round(0.15 * 28)  # 28 real non-special tokens per row
    assert (w.sum(1) == min(5, k)).all()
    sel = w > 0
    rows = np.repeat(np.arange(B)[:, None], 5, 1)[sel]
    p = pos[sel]
    assert ((p >= 1) & (p <= 28)).all()                    # never [CLS], [SEP] or padding
    np.testing.assert_array_equal(lab[sel], ids[rows, p])  # labels are the original tokens
    masked = inputs[rows, p] == 3
    kept = inputs[rows, p] == ids[rows, p]
    frac_mask, frac_kept = masked.mean(), (kept & ~masked).mean()
    assert abs(frac_mask - 0.8) < 0.04 and 0.06 < frac_kept < 0.16
    # outside the chosen positions nothing changes
    other = np.ones((B, T), bool)
    other[rows, p] = False
    np.testing.assert_array_equal(inputs[other], ids[other])


def _np_gelu(x):
    from scipy.special import erf
    return 0.5 * x * (1 + erf(x / np.sqrt(2)))


def test_masked_lm_loss_matches_numpy_formula():
    cfg = BertConfig(vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=16, max_position_embeddings=16)
    rng = np.random.default_rng(1)
    head = mlm_head.init_head(cfg, jax.random.PRNGKey(0), rng.normal(size=30))
    head = jax.tree_util.tree_map(lambda x: x + 0.1 * rng.normal(size=x.shape), head)
    hidden = rng.normal(size=(3, 6, 8)).astype(np.float32)
    emb = rng.normal(size=(30, 8)).astype(np.float32)
    pos = np.array([[1, 2], [0, 5], [3, 3]], np.int32)
    lab = np.array([[4, 7], [9, 0], [29, 1]], np.int32)
    w = np.array([[1, 1], [1, 0], [1, 1]], np.float32)
    loss, st = mlm_head.masked_lm_loss(head, hidden, emb, pos, lab, w, cfg)
    t = head["predictions"]["transform"]
    nll, correct = [], 0
    for b in range(3):
        for m in range(2):
            if not w[b, m]:
                continue
            x = hidden[b, pos[b, m]].astype(np.float64) @ t["dense"]["kernel"] + t["dense"]["bias"]
            x = _np_gelu(x)
            x = (x - x.mean()) / np.sqrt(x.var() + cfg.layer_norm_eps)
            x = x * t["LayerNorm"]["scale"] + t["LayerNorm"]["bias"]
            logits = emb.astype(np.float64) @ x + head["predictions"]["bias"]
            lse = np.log(np.exp(logits - logits.max()).sum()) + logits.max()
            nll.append(lse - logits[lab[b, m]])
            correct += int(np.argmax(logits) == lab[b, m])
    np.testing.assert_allclose(float(loss), np.mean(nll), rtol=1e-5)
    assert float(st["count"]) == 5 and float(st["correct"]) == correct


def test_log_unigram_prior():
    p = mlm_head.log_unigram_prior(np.array([1, 1, 2]), 4, smoothing=1.0)
    np.testing.assert_allclose(np.exp(p), [1 / 7, 3 / 7, 2 / 7, 1 / 7], rtol=1e-6)


@pytest.fixture(scope="module")
def tiny_encoder(tmp_path_factory, teacher_dir):
    """A random 1-layer d32 BERT classifier export on the teacher's tokenizer (encoders of
    fine-tuned classifiers are a supported input)."""
    from jax_tinybert.data import tokenize
    from jax_tinybert.model.export import export_hf

    tok = tokenize.load_tokenizer(teacher_dir)
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=1,
                     num_attention_heads=2, intermediate_size=64, max_position_embeddings=64)
    params = init_params(BertForSequenceClassification(cfg), jax.random.PRNGKey(0))
    d = tmp_path_factory.mktemp("enc") / "export"
    export_hf(cfg, jax.tree_util.tree_map(np.asarray, params), str(d), tokenizer_dir=teacher_dir)
    return str(d)


def test_fit_export_loads_everywhere(tiny_encoder, tmp_path, teacher_dir):
    import torch
    import transformers

    from configs.mlm_head import get_config
    from jax_tinybert.data import augment, tokenize
    from jax_tinybert.model.hf import load_pretrained

    text = tmp_path / "corpus.txt"
    text.write_text("\n\n".join("the cat sat on the mat . the dog ran to the park ." for _ in range(60)))
    c = get_config()
    c.mlm.encoder, c.mlm.eval_sequences = tiny_encoder, 8
    c.data.corpus, c.data.seq_len = str(text), 32
    c.train.num_steps, c.train.batch_size, c.train.eval_every, c.train.log_every = 40, 16, 0, 20
    c.optim.learning_rate = 3e-2
    s = mlm_head.fit(c, str(tmp_path / "wd"))
    # A 10-word vocabulary in a frozen random encoder: the head alone learns the frequent words.
    assert s["after"]["masked_token_acc"] > s["before"]["masked_token_acc"]
    assert s["after"]["masked_token_acc"] > 0.3 and s["eval_sequences"] == 8
    assert json.loads((tmp_path / "wd" / "summary.json").read_text())["steps"] == 40
    # frozen encoder: the exported encoder is the input one, bit for bit
    _, enc = load_pretrained(tiny_encoder)
    cfg, p = load_pretrained(s["export"], mlm_head=True)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(enc["bert"]),
                                                    jax.tree_util.tree_leaves(p["bert"])))
    # transformers reads it as BertForMaskedLM with the same logits (tied decoder)
    ids = np.array([[101, 1996, 4937, 103, 2006, 102]], np.int32)
    ours = np.asarray(BertForMaskedLM(cfg).apply({"params": p}, ids, np.ones_like(ids),
                                                 np.zeros_like(ids)).logits)
    tm = transformers.BertForMaskedLM.from_pretrained(s["export"]).eval()
    with torch.no_grad():
        theirs = tm(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=2e-4)
    # and it drives augment.py in mlm mode
    tok = tokenize.load_tokenizer(s["export"])
    aug = augment.Augmenter(tok, BertForMaskedLM(cfg), p, N=2, K=3, batch_size=8, buckets=(32,))
    out = aug.augment_sentences(["the cat sat on the mat"], [(0, 0)])[0]
    assert all(len(o.split()) == 6 for o in out)
    with pytest.raises(ValueError, match="config.data.corpus"):
        c2 = get_config()
        mlm_head.fit(c2, str(tmp_path / "wd2"))
