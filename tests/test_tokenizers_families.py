"""The data path with the tokenizers of other model families: byte-level BPE (RoBERTa) and
Unigram / SentencePiece (XLM-R), trained here on the shared corpus (helpers/tokenizers_here.py),
next to BERT's WordPiece (the packaged teacher). References are transformers' own tokenizer
calls and the official `_truncate_seq_pair` rule, written out here."""
import pytest

from jax_tinybert.data import glue, tokenize, wordpiece

FAMILIES = ("bert", "bpe", "unigram")


@pytest.fixture(scope="module")
def family_dirs(teacher_dir, bpe_tokenizer_dir, unigram_tokenizer_dir):
    return {"bert": teacher_dir, "bpe": bpe_tokenizer_dir, "unigram": unigram_tokenizer_dir}


@pytest.fixture(scope="module")
def mrpc(glue_dir):
    return glue.load_examples("mrpc", "dev", glue_dir=str(glue_dir))


def test_trained_tokenizers_have_their_family_layout(family_dirs):
    bpe = tokenize.load_tokenizer(family_dirs["bpe"])
    uni = tokenize.load_tokenizer(family_dirs["unigram"])
    assert type(bpe).__name__ == "RobertaTokenizerFast"
    assert type(uni).__name__ == "XLMRobertaTokenizerFast"
    assert bpe.convert_ids_to_tokens([0, 1, 2, 3, 4]) == ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    assert uni.convert_ids_to_tokens([0, 1, 2, 3]) == ["<s>", "<pad>", "</s>", "<unk>"]
    assert uni.mask_token_id == len(uni) - 1
    assert any(t.startswith("Ġ") for t in bpe.get_vocab())
    assert any(t.startswith("▁") for t in uni.get_vocab())
    assert 2000 <= len(bpe) <= 4000 and 2000 <= len(uni) <= 4000


def _official_truncate(a, b, max_tokens):
    """BERT's / TinyBERT's `_truncate_seq_pair`: pop from the longer list (b on ties)."""
    a, b = list(a), list(b)
    while len(a) + len(b) > max_tokens:
        (a if len(a) > len(b) else b).pop()
    return a, b


@pytest.mark.parametrize("family", FAMILIES)
def test_pairs_match_the_tokenizers_own_call(family, family_dirs, mrpc):
    tok = tokenize.load_tokenizer(family_dirs[family])
    a = [e.text_a for e in mrpc]
    b = [e.text_b for e in mrpc]
    max_len = 128
    ds = tokenize.encode_texts(tok, a, b, max_len)
    ref = tok(a, b, truncation="longest_first", max_length=max_len, return_token_type_ids=True)
    n_special = {"bert": 3, "bpe": 4, "unigram": 4}[family]
    pa = tok(a, add_special_tokens=False)["input_ids"]
    pb = tok(b, add_special_tokens=False)["input_ids"]
    n_cut = 0
    for i in range(len(a)):
        s, e = ds.offsets[i], ds.offsets[i + 1]
        ids, tts = ds.input_ids[s:e].tolist(), ds.token_type_ids[s:e].tolist()
        if len(pa[i]) + len(pb[i]) + n_special <= max_len:
            assert ids == ref["input_ids"][i]
            assert tts == ref["token_type_ids"][i]
        else:   # truncation: the next test
            n_cut += 1
    assert ds.num_truncated == n_cut
    first = ds.input_ids[ds.offsets[0]:ds.offsets[1]].tolist()
    if family == "bert":
        assert set(ds.token_type_ids[:ds.offsets[-1]].tolist()) == {0, 1}
    else:   # <s> a </s></s> b </s>, token types all 0
        assert first[0] == tok.cls_token_id == 0 and first[-1] == tok.sep_token_id == 2
        assert first[1 + len(pa[0]):3 + len(pa[0])] == [2, 2]
        assert not ds.token_type_ids.any()


@pytest.mark.parametrize("family", FAMILIES)
def test_truncated_pairs_follow_the_official_rule(family, family_dirs, mrpc):
    tok = tokenize.load_tokenizer(family_dirs[family])
    a = [e.text_a for e in mrpc[:200]]
    b = [e.text_b for e in mrpc[:200]]
    max_len = 24   # cuts nearly every pair
    ds = tokenize.encode_texts(tok, a, b, max_len)
    pa = tok(a, add_special_tokens=False)["input_ids"]
    pb = tok(b, add_special_tokens=False)["input_ids"]
    n_special = len(tok.build_inputs_with_special_tokens([], []))
    assert n_special == {"bert": 3, "bpe": 4, "unigram": 4}[family]
    for i in range(len(a)):
        ta, tb = _official_truncate(pa[i], pb[i], max_len - n_special)
        want = tok.build_inputs_with_special_tokens(ta, tb)
        want_tt = tok.create_token_type_ids_from_sequences(ta, tb)
        s, e = ds.offsets[i], ds.offsets[i + 1]
        assert ds.input_ids[s:e].tolist() == want
        assert ds.token_type_ids[s:e].tolist() == want_tt
    assert ds.num_truncated == sum(len(x) + len(y) > max_len - n_special for x, y in zip(pa, pb))


@pytest.mark.parametrize("family", FAMILIES)
def test_single_sentences_match_the_tokenizers_own_call(family, family_dirs, mrpc):
    tok = tokenize.load_tokenizer(family_dirs[family])
    a = [e.text_a for e in mrpc[:300]]
    ds = tokenize.encode_texts(tok, a, None, 16)
    ref = tok(a, truncation=True, max_length=16)["input_ids"]
    got = [ds.input_ids[ds.offsets[i]:ds.offsets[i + 1]].tolist() for i in range(len(a))]
    assert got == ref


def test_wordpiece_fast_path_keeps_bert_template(teacher_dir, mrpc):
    lw = wordpiece.load(teacher_dir)
    hf = tokenize.load_tokenizer(teacher_dir)
    a = [e.text_a for e in mrpc[:100]]
    b = [e.text_b for e in mrpc[:100]]
    x, y = tokenize.encode_texts(lw, a, b, 64), tokenize.encode_texts(hf, a, b, 64)
    assert x.input_ids.tolist() == y.input_ids.tolist()
    assert x.token_type_ids.tolist() == y.token_type_ids.tolist()
    t = tokenize.special_template(lw, True)
    assert t.ids == ((101,), (102,), (102,)) and t.seg_types == (0, 1)
