"""The data path with the tokenizers of other model families: byte-level BPE (RoBERTa) and
Unigram / SentencePiece (XLM-R), trained here on the shared corpus (helpers/tokenizers_here.py),
next to BERT's WordPiece (the packaged teacher). References are transformers' own tokenizer
calls and the official `_truncate_seq_pair` rule, written out here."""
import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from jax_tinybert.data import (augment, corpus, glue, prepare, prepared, synthetic, tokenize,
                               trim_vocab, vocab_match, wordpiece, words)
from jax_tinybert.model import hf
from jax_tinybert.model.export import export_hf
from jax_tinybert.model.modeling import BertConfig, BertForMaskedLM, BertModel, random_params

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from helpers import run_files, tiny_run  # noqa: E402
from jax_tinybert.train import build  # noqa: E402

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


# --------------------------------------------------------------------------- tokenizer mismatch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.txt", "vocab.json", "merges.txt")


def _with_tokenizer(model_dir, tok_dir, out):
    """A copy of model folder `model_dir` whose tokenizer files are those of `tok_dir`."""
    shutil.copytree(model_dir, out)
    for f in TOKENIZER_FILES:
        (out / f).unlink(missing_ok=True)
        if (pathlib.Path(tok_dir) / f).exists():
            shutil.copy(pathlib.Path(tok_dir) / f, out / f)
    return out


def test_a_student_with_the_bpe_tokenizer_is_refused_by_the_cli(tmp_path, tmp_path_factory,
                                                                 bpe_tokenizer_dir, teacher_dir):
    """The packaged MiniLM teacher (BERT WordPiece) and a student folder (the tiny random
    model's weights) carrying the byte-level BPE tokenizer."""
    teacher, cache = tiny_run.shared_dirs(tmp_path_factory)
    (tmp_path / "configs").symlink_to(tiny_run.REPO / "configs")
    _with_tokenizer(teacher, bpe_tokenizer_dir, tmp_path / "student_bpe")
    synthetic.write_sst2_like(str(tmp_path / "glue"), 32, 16, seed=0)
    args = ["--config=configs/task_distill.py:sst2_intermediate", "--workdir=runs/s",
            "--config.teacher.path=packaged", "--config.student.path=student_bpe",
            "--config.data.glue_dir=glue", "--config.train.num_steps=1"]
    r = subprocess.run([tiny_run.PYTHON, "-m", "jax_tinybert.main", *args], cwd=tmp_path,
                       env=tiny_run.env(**tiny_run.cache_env(cache)), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("error: ") and sum(ln.startswith("error: ") for ln in lines) == 1
    n_bpe = len(tokenize.load_tokenizer(bpe_tokenizer_dir))
    for needle in ("config.student.path='student_bpe'", f"teacher's ({teacher_dir})",
                   f"vocab size {n_bpe:,} vs "
                   "the teacher's 30,522", "student.init=teacher_layers", "student.init=random"):
        assert needle in lines[-1], (needle, lines[-1])
    assert not (tmp_path / "runs").exists()


def test_same_size_but_other_pieces_is_refused_and_the_same_tokenizer_passes(teacher_dir,
                                                                              tmp_path):
    vocab_match.check_student(teacher_dir, str(_with_tokenizer(teacher_dir, teacher_dir,
                                                               tmp_path / "same")))
    other = _with_tokenizer(teacher_dir, teacher_dir, tmp_path / "swapped")
    d = json.loads((other / "tokenizer.json").read_text())
    v = d["model"]["vocab"]
    v["the"], v["of"] = v["of"], v["the"]
    (other / "tokenizer.json").write_text(json.dumps(d))
    with pytest.raises(vocab_match.TokenizerMismatch) as e:
        vocab_match.check_student(teacher_dir, str(other))
    msg = str(e.value)
    assert "\n" not in msg and "same vocab size (30,522) but 2 pieces differ" in msg
    assert str(teacher_dir) in msg and str(other) in msg


# --------------------------------------------------------------------------- large vocabularies

def _wordlevel_70k(out):
    """A WordLevel tokenizer of 70,005 pieces (`w0` .. `w69999` after BERT's 5 specials), as a
    fast-tokenizer folder: ids above uint16's range."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"w{k}": len(specials) + k for k in range(70000)})
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    PreTrainedTokenizerFast(tokenizer_object=t, pad_token="[PAD]", unk_token="[UNK]",
                            cls_token="[CLS]", sep_token="[SEP]",
                            mask_token="[MASK]").save_pretrained(str(out))
    return str(out)


def test_a_vocab_over_65536_pieces_is_stored_as_uint32(tmp_path):
    tok = tokenize.load_data_tokenizer(_wordlevel_70k(tmp_path / "tok"))
    assert len(tok.get_vocab()) == 70005
    rng = np.random.default_rng(0)
    text = tmp_path / "text"
    text.mkdir()
    with open(text / "a.txt", "w") as f:   # ids all over the range, most above 65,535
        for d in range(40):
            for _ in range(3):
                f.write(" ".join(f"w{k}" for k in rng.integers(0, 70000, 9)) + "\n")
            f.write("\n")
    m = prepare.prepare([str(text)], str(tmp_path / "prep"), tok,
                        prepare.Settings(seq_len=16, dedup=False, rows_per_shard=50))
    assert m["dtype"] == "uint32"
    got = prepared.read_rows(str(tmp_path / "prep"))
    ref = corpus.build_packed_corpus([str(text / "a.txt")], tok, 16,
                                     cache_dir=str(tmp_path / "cache"))
    assert got.offsets.tolist() == ref.offsets.tolist()
    assert np.asarray(got.input_ids).tolist() == np.asarray(ref.input_ids).tolist()
    assert int(np.max(got.input_ids)) > 65535
    # The word ids the text names, in order: no id was cut to 16 bits.
    words = (text / "a.txt").read_text().split()
    body = [int(i) for i in np.asarray(got.input_ids) if i > 4]
    assert body == [5 + int(w[1:]) for w in words]



# --------------------------------------------------------------------------- augmentation words

def _clean_sentences(tok, mrpc, n=150):
    """MRPC sentences in ASCII that the tokenizer encodes without an unknown piece."""
    out = []
    for e in mrpc:
        for s in (e.text_a, e.text_b):
            ids = tok(s, add_special_tokens=False)["input_ids"]
            if s.isascii() and tok.unk_token_id not in ids:
                out.append(s)
    return out[:n]


@pytest.mark.parametrize("family", FAMILIES)
def test_pieces_group_into_the_pre_tokenizers_words(family, family_dirs, mrpc):
    tok = tokenize.load_tokenizer(family_dirs[family])
    scheme = words.scheme_of(tok)
    assert (scheme.kind, scheme.marker) == {"bert": ("wordpiece", "##"), "bpe": ("byte_level", "Ġ"),
                                            "unigram": ("metaspace", "▁")}[family]
    sents = _clean_sentences(tok, mrpc)
    assert len(sents) >= 100
    backend = tok.backend_tokenizer
    for s in sents:
        pieces = tok.convert_ids_to_tokens(tok(s, add_special_tokens=False)["input_ids"])
        got = [scheme.text([pieces[i] for i in g]) for g in scheme.group(pieces)]
        if family == "bert":   # BERT's pre-tokenizer words (punctuation apart), lower-cased
            want = [w for w, _ in backend.pre_tokenizer.pre_tokenize_str(
                backend.normalizer.normalize_str(s))]
        else:                  # a marker starts a word: the whitespace words come back
            want = s.split()
        assert got == want, (s, pieces)


@pytest.mark.parametrize("family", FAMILIES)
def test_candidate_words_are_whole_words_decoded_right(family, family_dirs):
    tok = tokenize.load_tokenizer(family_dirs[family])
    emb = np.zeros((len(tok), 4), np.float32)
    aug = augment.Augmenter(tok, mode="embedding", word_embeddings=emb)
    ok = np.flatnonzero(aug.whole_word)
    assert len(ok) > 300
    special = set(tok.all_special_ids)
    for i in range(len(tok)):
        piece = tok.convert_ids_to_tokens(i)
        if family == "bert":
            whole = not piece.startswith("##")
        else:
            whole = piece.startswith({"bpe": "Ġ", "unigram": "▁"}[family])
        text = tok.decode([i]).strip()   # transformers' own decoding of the piece
        expect = i not in special and whole and text.isalpha()
        assert bool(aug.whole_word[i]) == expect, (i, piece, text)
        if expect:
            assert aug.id2word[i] == text
    if family == "bpe":   # byte-level decoding: "Ġ" is the space, "Ã©" is "é"
        assert all(not w.startswith("Ġ") for w in aug.id2word.values())


def test_augment_end_to_end_with_a_random_roberta_mlm_on_the_bpe_vocab(bpe_tokenizer_dir, mrpc):
    """A RoBERTa-family MLM (positions past the padding index, lm_head) behind `<mask>`."""
    tok = tokenize.load_tokenizer(bpe_tokenizer_dir)
    cfg = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1,
                     num_attention_heads=2, intermediate_size=64, max_position_embeddings=130,
                     pad_token_id=1, type_vocab_size=1, model_type="roberta")
    model = BertForMaskedLM(cfg)
    aug = augment.Augmenter(tok, model, random_params(model, 0), N=4, K=5, p=0.5,
                            batch_size=32, buckets=(64,))
    assert tok.mask_token_id == aug.mask_id == 4
    sents = [e.text_a for e in mrpc[:12]]
    cands = aug.candidates(sents)
    single = [w for s in sents for w in s.split() if augment.is_candidate_word(w)
              and len(tok(" " + w, add_special_tokens=False)["input_ids"]) == 1]
    assert single and sum(len(c) for c in cands) > 0   # the MLM path ran
    vocab_words = {w.lower() for w in aug.id2word.values()}
    out = aug.augment_sentences(sents, [(i, 0) for i in range(len(sents))])
    changed = 0
    for s, new in zip(sents, out):
        for n in new:
            old, got = s.split(), n.split()
            assert len(old) == len(got)
            for a, b in zip(old, got):
                if a != b:
                    changed += 1
                    assert b.lower() in vocab_words and b.isalpha(), (a, b)
    assert changed > 10


@pytest.mark.parametrize("family", ("bpe", "unigram"))
def test_corpus_rows_are_s_chunk_s_and_prepare_matches_the_reference(family, family_dirs,
                                                                    shared_dir, tmp_path):
    tok = tokenize.load_data_tokenizer(family_dirs[family])
    src = shared_dir / "data" / "corpus" / "gutenberg_pg1656_plato_apology_jowett.txt"
    text = tmp_path / "a.txt"
    text.write_text("\n".join(src.read_text(encoding="utf-8").splitlines()[:400]))
    ref = corpus.build_packed_corpus([str(text)], tok, 64, cache_dir=str(tmp_path / "c"))
    assert len(ref) > 20
    for i in range(len(ref)):
        row = ref.input_ids[ref.offsets[i]:ref.offsets[i + 1]].tolist()
        assert row[0] == 0 and row[-1] == 2   # <s> ... </s>
    assert ref.pad_id == 1
    prepare.prepare([str(text)], str(tmp_path / "p"), tok,
                    prepare.Settings(seq_len=64, dedup=False, rows_per_shard=64))
    got = prepared.read_rows(str(tmp_path / "p"))
    assert np.asarray(got.input_ids).tolist() == np.asarray(ref.input_ids).tolist()


# --------------------------------------------------------------------------- vocabulary trimming

def _random_model(tok_dir, out, vocab_size, pad_id):
    cfg = BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=1,
                     num_attention_heads=2, intermediate_size=64, max_position_embeddings=128,
                     pad_token_id=pad_id)
    export_hf(cfg, random_params(BertModel(cfg, add_pooling_layer=True), 0), str(out),
              tokenizer_dir=str(tok_dir))
    return str(out)


def _check_trimmed(src, out, corpus_text):
    r = trim_vocab.trim(src, [str(corpus_text)], str(out))
    old_tok, new_tok = tokenize.load_tokenizer(src), tokenize.load_tokenizer(str(out))
    assert len(new_tok) == r["vocab_after"] < r["vocab_before"] == len(old_tok)
    _, old_p = hf.load_pretrained(src)
    cfg, new_p = hf.load_pretrained(str(out))
    assert cfg.vocab_size == len(new_tok)
    old_e = np.asarray(hf.bert_params(old_p)["embeddings"]["word_embeddings"]["embedding"])
    new_e = np.asarray(hf.bert_params(new_p)["embeddings"]["word_embeddings"]["embedding"])
    lines = [ln for ln in corpus_text.read_text().splitlines() if ln.strip()]
    a = old_tok(lines)["input_ids"]
    b = new_tok(lines)["input_ids"]
    for x, y in zip(a, b):   # same pieces, same vectors; specials included
        assert old_tok.convert_ids_to_tokens(x) == new_tok.convert_ids_to_tokens(y)
        np.testing.assert_array_equal(old_e[x], new_e[y])
    for name in ("cls_token", "sep_token", "pad_token", "mask_token", "unk_token"):
        assert getattr(new_tok, name) == getattr(old_tok, name)
    assert new_tok.pad_token_id == cfg.pad_token_id
    return r


def test_trim_a_unigram_vocab_keeps_the_corpus_pieces_and_their_vectors(
        unigram_tokenizer_dir, tmp_path, mrpc):
    n = len(tokenize.load_tokenizer(unigram_tokenizer_dir))
    src = _random_model(unigram_tokenizer_dir, tmp_path / "m", n, 1)
    text = tmp_path / "c.txt"
    text.write_text("\n".join(e.text_a for e in mrpc[:60]) + "\n")
    r = _check_trimmed(src, tmp_path / "t", text)
    assert r["vocab_after"] < n // 2


def test_trim_a_wordpiece_vocab(teacher_dir, tmp_path, mrpc):
    text = tmp_path / "c.txt"
    text.write_text("\n".join(e.text_b for e in mrpc[:80]) + "\n")
    r = _check_trimmed(teacher_dir, tmp_path / "t", text)
    assert r["vocab_before"] == 30522 and r["vocab_after"] < 3000


def test_trim_refuses_bpe_in_one_line(bpe_tokenizer_dir, tmp_path):
    src = _random_model(bpe_tokenizer_dir, tmp_path / "m", 3000, 1)
    (tmp_path / "c.txt").write_text("a few words\n")
    r = subprocess.run([tiny_run.PYTHON, "-m", "jax_tinybert.data.trim_vocab", "--model", src,
                        "--corpus", str(tmp_path / "c.txt"), "--out", str(tmp_path / "t")],
                       capture_output=True, text=True, env=tiny_run.env(), timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("error: trim_vocab: a BPE tokenizer cannot be trimmed"), r.stderr
    assert not (tmp_path / "t").exists()


def test_build_models_refuses_the_bpe_student_too(tmp_path, tmp_path_factory, bpe_tokenizer_dir,
                                                   teacher_dir):
    """The same refusal where the config's path check is not run (validate_config(paths=False),
    the functional API): build_models compares the tokenizers before the vocab sizes."""
    teacher, _ = tiny_run.shared_dirs(tmp_path_factory)
    student = _with_tokenizer(teacher, bpe_tokenizer_dir, tmp_path / "student_bpe")
    c = build.with_defaults(run_files.config("task_distill.py", "sst2_intermediate"))
    c.teacher.path, c.student.path = "packaged", str(student)
    with pytest.raises(vocab_match.TokenizerMismatch, match="vocab size 3,000 vs the teacher's "
                       "30,522"):
        build.build_models(c, 2, None)
    c.student.init = "random"   # a fix the message names
    assert build.build_models(c, 2, None).student_config.vocab_size == 30522
