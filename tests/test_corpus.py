"""General-distillation corpus: exact packing, streaming resume, memmapped batches, pregenerated json."""
import json

import numpy as np
import pytest

from jax_tinybert import data
from jax_tinybert.data import corpus, tokenize

SEQ = 128


@pytest.fixture(scope="module")
def tok(teacher_dir):
    return tokenize.load_tokenizer(teacher_dir)


@pytest.fixture(scope="module")
def files(shared_dir):
    # Three small books (CRLF and LF endings, a BOM) keep the test well under 30 s.
    names = ["gutenberg_pg1656_plato_apology_jowett.txt",
             "gutenberg_pg1974_aristotle_poetics_butcher.txt",
             "gutenberg_pg1342_austen_pride_and_prejudice.txt"]
    return [str(shared_dir / "data" / "corpus" / n) for n in names]


def _expected_stream(paths, tok):
    """Independent reference: whole paragraphs (blank-line separated) tokenized as one text."""
    out = []
    for p in paths:
        text = open(p, encoding="utf-8-sig", errors="replace").read()
        paras, cur = [], []
        for line in text.splitlines():
            if line.strip():
                cur.append(line.strip())
            elif cur:
                paras.append(" ".join(cur))
                cur = []
        if cur:
            paras.append(" ".join(cur))
        for ids in tok(paras, add_special_tokens=False, verbose=False)["input_ids"]:
            if ids:
                out.extend(ids + [tok.sep_token_id])
    return out


def test_packing_loses_and_duplicates_no_token(files, tok):
    seqs = list(corpus.PackedTextStream(files, tok, SEQ))
    assert all(s[0] == tok.cls_token_id and s[-1] == tok.sep_token_id for s in seqs)
    assert {len(s) for s in seqs[:-1]} == {SEQ} and 3 <= len(seqs[-1]) <= SEQ
    inner = np.concatenate([s[1:-1] for s in seqs])
    expected = np.asarray(_expected_stream(files, tok))
    print(f"\npacked {len(expected)} tokens of {len(files)} files into {len(seqs)} sequences")
    np.testing.assert_array_equal(inner, expected)


def test_documents_mode_and_resume(tmp_path, tok):
    p = tmp_path / "docs.txt"
    docs = [f"document number {i} " + "word " * (i * 7 % 50) for i in range(200)]
    p.write_text("\n".join(docs) + "\n\n")  # blank lines are ignored in documents mode
    s = corpus.PackedTextStream([str(p)], tok, 32, mode="documents", lines_per_batch=16)
    seqs = list(s)
    inner = np.concatenate([x[1:-1] for x in seqs])
    exp = [t for d in tok(docs, add_special_tokens=False)["input_ids"] for t in d + [tok.sep_token_id]]
    np.testing.assert_array_equal(inner, exp)
    for stop in (0, 1, 37, len(seqs) - 1):
        a = corpus.PackedTextStream([str(p)], tok, 32, mode="documents", lines_per_batch=16)
        for _ in range(stop):
            next(a)
        state = json.loads(json.dumps(a.state_dict()))  # must survive JSON (checkpoint metadata)
        b = corpus.PackedTextStream([str(p)], tok, 32, mode="documents", lines_per_batch=16)
        b.load_state_dict(state)
        rest = list(b)
        assert len(rest) == len(seqs) - stop
        for x, y in zip(rest, seqs[stop:]):
            np.testing.assert_array_equal(x, y)


def test_packed_corpus_batches_are_memmapped_sharded_resumable(files, tok, tmp_path):
    ds = corpus.build_packed_corpus(files[:2], tok, SEQ, cache_dir=str(tmp_path))
    assert isinstance(ds.input_ids, np.memmap)  # ids stay on disk
    again = corpus.build_packed_corpus(files[:2], tok, SEQ, cache_dir=str(tmp_path))
    assert len(again) == len(ds)
    its = [data.corpus_train_iterator(files[:2], tok, global_batch_size=16, seq_len=SEQ,
                                      cache_dir=str(tmp_path), seed=1, process_index=p,
                                      process_count=2) for p in range(2)]
    b0, b1 = next(its[0]), next(its[1])
    for b in (b0, b1):
        assert set(b) == {"input_ids", "attention_mask", "token_type_ids", "example_id", "valid"}
        assert b["input_ids"].shape == (8, SEQ) and b["input_ids"].dtype == np.int32
        assert np.all(b["token_type_ids"] == 0)
    assert not set(b0["example_id"]) & set(b1["example_id"])
    state = its[0].state_dict()
    nxt = next(its[0])
    its[0].load_state_dict(state)
    np.testing.assert_array_equal(next(its[0])["input_ids"], nxt["input_ids"])


def test_pregenerated_reader_official_format(tmp_path, tok):
    words = ["[CLS]", "the", "cat", "[MASK]", "[SEP]", "sat", "down", "[SEP]"]
    lines = []
    for i in range(2):
        for j in range(5):
            toks = words[: 5 + (j % 4)]
            lines.append(json.dumps({"tokens": toks, "segment_ids": [0] * 5 + [1] * (len(toks) - 5),
                                     "is_random_next": bool(j % 2), "masked_lm_positions": [3],
                                     "masked_lm_labels": ["sat"]}))
        (tmp_path / f"epoch_{i}.json").write_text("\n".join(lines[-5:]) + "\n")
        (tmp_path / f"epoch_{i}_metrics.json").write_text(
            json.dumps({"num_training_examples": 5, "max_seq_len": 128}))
    ds = corpus.read_pregenerated(str(tmp_path), tok, epoch=3)  # cycles to epoch_1.json
    assert len(ds) == 5
    ids = ds.input_ids[ds.offsets[3]:ds.offsets[4]]
    assert list(ids) == tok.convert_tokens_to_ids(words[:8])
    assert list(ds.token_type_ids[ds.offsets[3]:ds.offsets[4]]) == [0] * 5 + [1] * 3
    cached = corpus.read_pregenerated(str(tmp_path), tok, epoch=1, cache_dir=str(tmp_path / "c"))
    np.testing.assert_array_equal(np.asarray(cached.input_ids), ds.input_ids)
    it = data.pregenerated_train_iterator(str(tmp_path), tok, epoch=1, global_batch_size=4,
                                          seq_len=32, process_index=0, process_count=1)
    b = next(it)
    assert b["input_ids"].shape == (4, 32) and "labels" not in b
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "epoch_0.json").write_text('{"tokens": ["[CLS]"]}\n')
    with pytest.raises(ValueError, match=r"epoch_0.json:1"):
        corpus.read_pregenerated(str(tmp_path / "bad"), tok)
