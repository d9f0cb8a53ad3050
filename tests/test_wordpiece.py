"""wordpiece.BertWordPiece against the transformers tokenizer it stands in for (the reference):
same ids on real GLUE text, same special ids, vocab and cache fingerprint; the config's casing
options applied as BertTokenizerFast applies them; a fallback wherever it would differ; and the
CLI's data path never importing transformers."""
import json
import shutil
import subprocess
import sys

import pytest

from jax_tinybert.data import glue, tokenize, wordpiece

MIXED = ["Héllo WORLD, naïve Café!", "Ünïcödé façade — 北京 résumé",
         "[MASK] is a [SEP] token", "It's  a   SPLENDIDLY  odd  day.", ""]


@pytest.fixture(scope="module")
def hf_tok(teacher_dir):
    return tokenize.load_tokenizer(teacher_dir)


def _texts(glue_dir):
    out = []
    for task in ("sst-2", "mrpc", "sts-b"):
        for e in glue.load_examples(task, "dev", glue_dir=str(glue_dir)):
            out += [e.text_a] + ([e.text_b] if e.text_b else [])
    return out


def test_same_ids_specials_vocab_and_fingerprint_as_transformers(teacher_dir, hf_tok, glue_dir):
    lw = wordpiece.load(teacher_dir)
    assert lw is not None
    texts = _texts(glue_dir) + MIXED
    assert len(texts) > 4000
    for special in (False, True):
        assert (lw(texts, add_special_tokens=special)["input_ids"]
                == hf_tok(texts, add_special_tokens=special)["input_ids"])
    assert lw(MIXED[0])["input_ids"] == hf_tok(MIXED[0])["input_ids"]
    for a in ("cls_token_id", "sep_token_id", "pad_token_id", "unk_token_id", "mask_token_id",
              "all_special_ids", "vocab_size", "special_tokens_map"):
        assert getattr(lw, a) == getattr(hf_tok, a), a
    assert lw.get_vocab() == hf_tok.get_vocab()
    # The token cache key: a run with either tokenizer finds the other's cache.
    assert tokenize.tokenizer_fingerprint(lw) == tokenize.tokenizer_fingerprint(hf_tok)
    # The packaged tokenizer.json pads and truncates to 128; an untruncated call must not.
    long = " ".join(["word"] * 300)
    assert len(lw([long], add_special_tokens=False)["input_ids"][0]) == 300


def _copy(teacher_dir, dst, special_map=None, **config_changes):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "vocab.txt"):
        shutil.copy(f"{teacher_dir}/{name}", dst / name)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg.update(config_changes)
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    smap = json.loads((dst / "special_tokens_map.json").read_text())
    (dst / "special_tokens_map.json").write_text(json.dumps(dict(smap, **(special_map or {}))))
    return str(dst)


@pytest.mark.parametrize("changes", [{"do_lower_case": False},
                                     {"strip_accents": False},
                                     {"tokenize_chinese_chars": False}])
def test_config_casing_options_win_as_in_transformers(teacher_dir, hf_tok, tmp_path, changes):
    d = _copy(teacher_dir, tmp_path, **changes)
    lw, ref = wordpiece.load(d), tokenize.load_tokenizer(d)
    assert lw is not None
    got = lw(MIXED, add_special_tokens=False)["input_ids"]
    assert got == ref(MIXED, add_special_tokens=False)["input_ids"]
    assert got != hf_tok(MIXED, add_special_tokens=False)["input_ids"]   # the option mattered
    assert tokenize.tokenizer_fingerprint(lw) == tokenize.tokenizer_fingerprint(ref)


def test_falls_back_to_transformers_where_it_would_differ(teacher_dir, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    assert wordpiece.load(_copy(teacher_dir, other, tokenizer_class="DistilBertTokenizer")) is None
    extra = tmp_path / "extra"
    extra.mkdir()
    # A special token outside the vocab: transformers adds it as a new token (id 30522).
    d = _copy(teacher_dir, extra, special_map={"mask_token": "[NEWMASK]"})
    assert tokenize.load_tokenizer(d).mask_token_id == 30522
    assert wordpiece.load(d) is None
    # In the config only, it loses to special_tokens_map.json, in both.
    same = tmp_path / "same"
    same.mkdir()
    d = _copy(teacher_dir, same, mask_token="[NEWMASK]")
    assert wordpiece.load(d).mask_token_id == tokenize.load_tokenizer(d).mask_token_id == 103
    vocab_only = tmp_path / "vocab_only"
    vocab_only.mkdir()
    shutil.copy(f"{teacher_dir}/vocab.txt", vocab_only / "vocab.txt")
    shutil.copy(f"{teacher_dir}/config.json", vocab_only / "config.json")
    assert wordpiece.load(str(vocab_only)) is None
    tok = tokenize.load_data_tokenizer(str(vocab_only))
    assert type(tok).__name__ == "BertTokenizerFast"
    assert tok("hello world", add_special_tokens=False)["input_ids"] == [7592, 2088]
    assert isinstance(tokenize.load_data_tokenizer(teacher_dir), wordpiece.BertWordPiece)


def test_only_input_ids(teacher_dir):
    with pytest.raises(ValueError, match="input_ids only"):
        wordpiece.load(teacher_dir)(["a"], return_attention_mask=True)


def test_training_data_path_does_not_import_transformers(teacher_dir, glue_dir, tmp_path):
    code = (
        "import sys\n"
        "from jax_tinybert import main\n"
        "from jax_tinybert.train import loop, build\n"
        "from jax_tinybert.data import tokenize\n"
        f"tok = tokenize.load_data_tokenizer({str(teacher_dir)!r})\n"
        f"ds = tokenize.load_glue_encoded('sst-2', 'dev', tok, 64, glue_dir={str(glue_dir)!r},"
        f" cache_dir={str(tmp_path)!r})\n"
        "assert len(ds) == 872, len(ds)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'torch')))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
