"""GLUE task specs, readers (TSV / HF / TFDS mapping), error messages, tokenization cache."""
import logging
import os
import sys
import types

import numpy as np
import pytest

from jax_tinybert.data import glue, tokenize
from jax_tinybert.data.glue import DataError

# (rows, label counts) of the genuine GLUE files in ../shared/data/glue.
OFFICIAL = {
    ("SST-2", "train"): (67349, {"0": 29780, "1": 37569}),
    ("SST-2", "dev"): (872, {"0": 428, "1": 444}),
    ("MRPC", "train"): (3668, {"0": 1194, "1": 2474}),
    ("MRPC", "dev"): (408, {"0": 129, "1": 279}),
    ("STS-B", "train"): (5749, None),
    ("STS-B", "dev"): (1500, None),
}


@pytest.fixture(scope="module")
def tok(teacher_dir):
    return tokenize.load_tokenizer(teacher_dir)


@pytest.mark.parametrize("task,split", list(OFFICIAL))
def test_real_files_have_official_sizes_and_balance(glue_dir, task, split):
    n, counts = OFFICIAL[(task, split)]
    spec = glue.get_task(task)
    ex = glue.load_examples(task, split, glue_dir=str(glue_dir))
    assert len(ex) == n
    assert all(e.text_a.strip() for e in ex)
    if spec.is_pair:
        assert all(e.text_b.strip() for e in ex)
    if counts is None:
        scores = np.array([e.label for e in ex])
        assert scores.min() >= 0.0 and scores.max() <= 5.0
    else:
        assert glue.label_counts(spec, ex) == counts


def test_mrpc_quotes_are_kept_verbatim(glue_dir):
    # csv.QUOTE_NONE: a sentence starting with an unbalanced quote must not swallow the next rows.
    ex = glue.load_examples("mrpc", "dev", glue_dir=str(glue_dir))
    assert ex[0].text_b.startswith('"The foodservice pie business')
    assert ex[0].label == 1


def test_task_specs_and_lookup():
    assert len(glue.TASKS) == 9
    for alias, name in [("SST-2", "sst-2"), ("sst2", "sst-2"), ("Sst_2", "sst-2"), ("stsb", "sts-b"),
                        ("STS-B", "sts-b"), ("CoLA", "cola"), ("MNLI", "mnli"), ("wnli", "wnli")]:
        assert glue.get_task(alias).name == name
    assert glue.get_task("sts-b").num_labels == 1 and glue.get_task("sts-b").is_regression
    assert glue.get_task("mnli").labels == ("contradiction", "entailment", "neutral")
    assert glue.get_task("mrpc").num_labels == 2 and glue.get_task("mrpc").is_pair
    with pytest.raises(KeyError, match="SST-2.*MRPC"):
        glue.get_task("sst3")


def test_mnli_dev_splits_are_separate(tmp_path):
    d = tmp_path / "MNLI"
    d.mkdir()
    header = "\t".join(["index", "promptID", "pairID", "genre", "s1b", "s2b", "s1p", "s2p",
                        "sentence1", "sentence2", "label1", "gold_label"])
    for split, label in [("dev_matched", "neutral"), ("dev_mismatched", "contradiction")]:
        row = "\t".join(["0", "1", "2", "g", "x", "x", "x", "x", f"premise {split}", "hyp",
                         label, label])
        (d / f"{split}.tsv").write_text(header + "\n" + row + "\n")
    spec = glue.get_task("mnli")
    assert spec.eval_splits == ("dev_matched", "dev_mismatched")
    m = glue.load_examples("mnli", "dev_matched", glue_dir=str(tmp_path))
    mm = glue.load_examples("mnli", "dev_mismatched", glue_dir=str(tmp_path))
    assert m[0].text_a == "premise dev_matched" and m[0].label == 2
    assert mm[0].text_a == "premise dev_mismatched" and mm[0].label == 0
    assert glue.load_examples("mnli", "dev", glue_dir=str(tmp_path)) == m


def _copy_with(glue_dir, tmp_path, task, lines_to_edit):
    spec = glue.get_task(task)
    src = glue_dir / spec.dir_name / "train.tsv"
    lines = src.read_text(encoding="utf-8-sig").splitlines()[:20]
    for i, f in lines_to_edit.items():
        lines[i - 1] = f(lines[i - 1])
    dst = tmp_path / spec.dir_name / "train.tsv"
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return dst


@pytest.mark.parametrize("task,line,edit,match", [
    ("mrpc", 5, lambda l: l.rsplit("\t", 1)[0], r"expected 5 tab-separated columns.*got 4"),
    ("sst-2", 7, lambda l: l.rsplit("\t", 1)[0] + "\tpositive", r"unknown label 'positive'.*\['0', '1'\]"),
    ("sst-2", 3, lambda l: " \t1", r"empty sentence"),
    ("sts-b", 4, lambda l: l.rsplit("\t", 1)[0] + "\tfive", r"not a number"),
])
def test_malformed_rows_name_file_and_line(glue_dir, tmp_path, task, line, edit, match):
    path = _copy_with(glue_dir, tmp_path, task, {line: edit})
    with pytest.raises(DataError, match=match) as e:
        glue.load_examples(task, "train", glue_dir=str(tmp_path))
    assert f"{path}:{line}:" in str(e.value)


def test_skip_bad_rows_counts_and_logs(glue_dir, tmp_path, caplog):
    bad = lambda l: l.rsplit("\t", 1)[0]  # noqa: E731
    _copy_with(glue_dir, tmp_path, "mrpc", {4: bad, 9: bad})
    with caplog.at_level(logging.WARNING):
        ex = glue.load_examples("mrpc", "train", glue_dir=str(tmp_path), skip_bad_rows=True)
    assert len(ex) == 19 - 2
    assert "skipped 2 bad rows" in caplog.text


def test_missing_file_and_unknown_source(tmp_path):
    with pytest.raises(DataError, match="file not found.*RTE"):
        glue.load_examples("rte", "train", glue_dir=str(tmp_path))
    with pytest.raises(ValueError, match="unknown source"):
        glue.load_examples("rte", "train", source="csv", glue_dir=str(tmp_path))


def _fake_datasets(records_by_split, names=None):
    mod = types.ModuleType("datasets")

    def load_dataset(path, name, split):
        assert path == "glue"
        return records_by_split[(name, split)]

    mod.load_dataset = load_dataset
    return mod


def test_hf_source_gives_same_examples_as_tsv(glue_dir, monkeypatch):
    tsv = glue.load_examples("mrpc", "dev", glue_dir=str(glue_dir))
    recs = [{"sentence1": e.text_a, "sentence2": e.text_b, "label": e.label, "idx": i}
            for i, e in enumerate(tsv)]
    monkeypatch.setitem(sys.modules, "datasets", _fake_datasets({("mrpc", "validation"): recs}))
    hf = glue.load_examples("MRPC", "dev", source="hf")
    assert [(e.text_a, e.text_b, e.label) for e in hf] == [(e.text_a, e.text_b, e.label) for e in tsv]


def test_hf_mnli_labels_are_mapped_to_glue_order(monkeypatch):
    # HF/TFDS MNLI ClassLabel: entailment=0, neutral=1, contradiction=2; GLUE files: c, e, n.
    recs = [{"premise": "p", "hypothesis": "h", "label": i} for i in range(3)]
    fake = _fake_datasets({("mnli", "validation_mismatched"): recs})
    monkeypatch.setitem(sys.modules, "datasets", fake)
    ex = glue.load_examples("mnli", "dev_mismatched", source="hf")
    spec = glue.get_task("mnli")
    assert [spec.labels[e.label] for e in ex] == ["entailment", "neutral", "contradiction"]


def test_tfds_bytes_are_decoded(monkeypatch):
    tfds = types.ModuleType("tensorflow_datasets")
    rows = [{"sentence": b"a fine film", "label": np.int64(1), "idx": 0}]
    tfds.load = lambda name, split, with_info=False: (rows, None) if with_info else rows
    tfds.as_numpy = lambda ds: ds
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", tfds)
    assert glue.load_examples("sst2", "dev", source="tfds") == [glue.Example("dev-0", "a fine film", None, 1)]


def test_optional_sources_fail_clearly_when_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match="pip install datasets"):
        glue.load_examples("sst2", "train", source="hf")
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)
    with pytest.raises(ImportError, match="tensorflow-datasets"):
        glue.load_examples("sst2", "train", source="tfds")


# -- tokenization ----------------------------------------------------------------------------

def _official_truncate(a, b, max_tokens):
    a, b = list(a), list(b)  # BERT/TinyBERT _truncate_seq_pair
    while len(a) + len(b) > max_tokens:
        (a if len(a) > len(b) else b).pop()
    return a, b


def test_pair_encoding_matches_hf_and_official_truncation(glue_dir, tok):
    ex = glue.load_examples("mrpc", "dev", glue_dir=str(glue_dir))[:200]
    ds = tokenize.encode_examples(tok, "mrpc", ex, max_len=32)
    full = tok([e.text_a for e in ex], [e.text_b for e in ex])
    ta = tok([e.text_a for e in ex], add_special_tokens=False)["input_ids"]
    tb = tok([e.text_b for e in ex], add_special_tokens=False)["input_ids"]
    cls, sep = tok.cls_token_id, tok.sep_token_id
    for i in range(len(ex)):
        s, e = ds.offsets[i], ds.offsets[i + 1]
        if len(full["input_ids"][i]) <= 32:  # untruncated: identical to HF's own pair encoding
            assert list(ds.input_ids[s:e]) == full["input_ids"][i]
            assert list(ds.token_type_ids[s:e]) == full["token_type_ids"][i]
        else:
            a, b = _official_truncate(ta[i], tb[i], 29)
            assert list(ds.input_ids[s:e]) == [cls] + a + [sep] + b + [sep]
            assert list(ds.token_type_ids[s:e]) == [0] * (len(a) + 2) + [1] * (len(b) + 1)
    assert ds.num_truncated == sum(len(x) > 32 for x in full["input_ids"]) > 0


def test_cache_is_reused_and_invalidated(glue_dir, tmp_path, tok):
    src = glue_dir / "MRPC" / "dev.tsv"
    path = tmp_path / "dev.tsv"
    path.write_bytes(src.read_bytes())
    cache = tmp_path / "cache"
    a = tokenize.load_glue_encoded("mrpc", "dev", tok, 128, path=str(path), cache_dir=str(cache))
    files = os.listdir(cache)
    assert len(files) == 1 and files[0].endswith(".npz")
    b = tokenize.load_glue_encoded("mrpc", "dev", tok, 128, path=str(path), cache_dir=str(cache))
    np.testing.assert_array_equal(a.input_ids, b.input_ids)
    np.testing.assert_array_equal(a.labels, b.labels)
    assert a.labels.dtype == np.int32
    tokenize.load_glue_encoded("mrpc", "dev", tok, 64, path=str(path), cache_dir=str(cache))
    path.write_bytes(src.read_bytes().replace(b"foodservice", b"food service"))
    tokenize.load_glue_encoded("mrpc", "dev", tok, 128, path=str(path), cache_dir=str(cache))
    assert len(os.listdir(cache)) == 3  # max_len and content both change the key; no temp files


def test_token_store_is_shared_between_workdirs(glue_dir, tmp_path, tok, monkeypatch, caplog):
    store, a_dir, b_dir = tmp_path / "store", tmp_path / "a", tmp_path / "b"
    kw = dict(glue_dir=str(glue_dir), store_dir=str(store))
    a = tokenize.load_glue_encoded("mrpc", "dev", tok, 128, cache_dir=str(a_dir), **kw)
    assert os.listdir(store) == os.listdir(a_dir) and len(os.listdir(store)) == 1
    # Another run (another workdir) reads the store and tokenizes nothing.
    real_encode = tokenize.encode_examples
    monkeypatch.setattr(tokenize, "encode_examples", lambda *a, **k: pytest.fail("tokenized"))
    b = tokenize.load_glue_encoded("mrpc", "dev", tok, 128, cache_dir=str(b_dir), **kw)
    for k in ("input_ids", "token_type_ids", "offsets", "labels"):
        np.testing.assert_array_equal(getattr(b, k), getattr(a, k), err_msg=k)
    assert os.listdir(b_dir) == os.listdir(store)   # the workdir keeps its own copy
    # A damaged store file is ignored, and replaced by the next tokenization.
    monkeypatch.setattr(tokenize, "encode_examples", real_encode)
    (store / os.listdir(store)[0]).write_bytes(b"PK\x03\x04 torn")
    with caplog.at_level(logging.WARNING, logger="jax_tinybert.data.tokenize"):
        c = tokenize.load_glue_encoded("mrpc", "dev", tok, 128, cache_dir=str(tmp_path / "c"),
                                       **kw)
    assert "ignoring unreadable cache" in caplog.text
    np.testing.assert_array_equal(c.input_ids, a.input_ids)
    np.testing.assert_array_equal(tokenize.EncodedDataset.load_npz(
        str(store / os.listdir(store)[0])).input_ids, a.input_ids)


@pytest.mark.parametrize("value,want", [(None, "HOME/.cache/jax_tinybert/tokens"),
                                        ("off", None), ("0", None), ("", None),
                                        ("STORE", "STORE")])
def test_token_store_location(tmp_path, monkeypatch, value, want):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    if value is None:
        monkeypatch.delenv("JTB_TOKEN_STORE", raising=False)
    else:
        monkeypatch.setenv("JTB_TOKEN_STORE", value.replace("STORE", str(tmp_path / "s")))
    got = tokenize.token_store()
    want = want and want.replace("HOME", str(tmp_path / "home")).replace("STORE",
                                                                          str(tmp_path / "s"))
    assert got == want


@pytest.mark.parametrize("task,split", [("mrpc", "train"), ("sst2", "dev")])
def test_subset_tokenizes_only_its_examples_and_equals_the_whole_then_subset(
        glue_dir, tmp_path, tok, task, split, caplog):
    whole = tokenize.load_glue_encoded(task, split, tok, 64, glue_dir=str(glue_dir))
    idx = tokenize.subset_indices(len(whole), 100, 7)
    assert len(idx) == 100 and np.all(np.diff(idx) > 0)
    want = tokenize.take(whole, idx)
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger="jax_tinybert.data.tokenize"):
        got = tokenize.load_glue_encoded(task, split, tok, 64, glue_dir=str(glue_dir),
                                         cache_dir=str(cache), subset=100, subset_seed=7)
    assert f"100 of {len(whole)} examples (subset)" in caplog.text
    assert not cache.exists() or not os.listdir(cache)   # a subset is not cached as the split
    for k in ("input_ids", "token_type_ids", "offsets", "labels"):
        np.testing.assert_array_equal(getattr(got, k), getattr(want, k), err_msg=k)
    assert got.input_ids.dtype == whole.input_ids.dtype and got.labels.dtype == whole.labels.dtype
    # With the whole split cached, the subset comes from the cache: the same examples.
    tokenize.load_glue_encoded(task, split, tok, 64, glue_dir=str(glue_dir), cache_dir=str(cache))
    again = tokenize.load_glue_encoded(task, split, tok, 64, glue_dir=str(glue_dir),
                                       cache_dir=str(cache), subset=100, subset_seed=7)
    np.testing.assert_array_equal(again.input_ids, want.input_ids)
    np.testing.assert_array_equal(again.offsets, want.offsets)
    # 0 or >= the split's size: all of it.
    assert len(tokenize.load_glue_encoded(task, split, tok, 64, glue_dir=str(glue_dir),
                                          subset=10 ** 6)) == len(whole)
    assert tokenize.subset_indices(len(whole), 0, 7) is None
