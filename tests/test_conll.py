"""CoNLL-2003 reading (counts of the shared files, IOB1, bad lines), first-piece labels, and the
entity-level metrics against seqeval's default mode on fixed predictions."""
import pathlib

import numpy as np
import pytest

from jax_tinybert.data import conll
from jax_tinybert.data.glue import DataError
from jax_tinybert.train import ner_metrics

CONLL = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "conll2003"
if not CONLL.exists():
    CONLL = pathlib.Path("/work/shared/data/conll2003")


@pytest.fixture(scope="module")
def dev():
    return conll.read_conll(str(CONLL / "dev.txt"))


@pytest.mark.parametrize("split,n,tokens,ents", [
    ("train", 14041, 203621, {"PER": 6600, "LOC": 7140, "ORG": 6321, "MISC": 3438}),
    ("dev", 3250, 51362, {"PER": 1842, "LOC": 1837, "ORG": 1341, "MISC": 922})])
def test_the_shared_files_read_with_their_counts(split, n, tokens, ents):
    s = conll.read_conll(str(CONLL / f"{split}.txt"), scheme="iob2")
    assert len(s) == n and sum(len(x.words) for x in s) == tokens
    assert conll.entity_counts(s) == ents
    assert conll.label_order(s) == conll.HF_LABELS


def test_iob1_is_detected_and_converted(tmp_path):
    p = tmp_path / "iob1.txt"
    p.write_text("-DOCSTART- -X- -X- O\n\nU.N. NNP I-NP I-ORG\nofficial NN I-NP O\n"
                 "Ekeus NNP I-NP I-PER\nJohn NNP I-NP B-PER\nheads VBZ I-VP O\n\n")
    s = conll.read_conll(str(p))
    assert s[0].tags == ("B-ORG", "O", "B-PER", "B-PER", "O") and s[0].line == 3
    with pytest.raises(DataError, match=r"iob1.txt:3: I-ORG opens a chunk"):
        conll.read_conll(str(p), scheme="iob2")


@pytest.mark.parametrize("line,msg", [("EU\n", r":1: 1 column\(s\)"),
                                      ("EU NNP B-NP ORG\n", r":1: tag 'ORG' is not IOB")])
def test_bad_lines_name_file_and_line(tmp_path, line, msg):
    p = tmp_path / "bad.txt"
    p.write_text(line)
    with pytest.raises(DataError, match=msg) as e:
        conll.read_conll(str(p))
    assert str(p) in str(e.value)


def test_tfds_reader_maps_its_classlabel_by_name_and_converts_iob1(tmp_path, monkeypatch):
    """TFDS records (tokens as bytes, ner as ids of info's ClassLabel names, here in another
    order than HF's and in IOB1) read as the same file in IOB2 reads."""
    import sys
    import types

    text = "EU I-ORG\nrejects O\nGerman I-MISC\ncall O\n\nPeter I-PER\nBlackburn I-PER\n"
    (tmp_path / "f.txt").write_text(text)
    names = ["O", "I-PER", "I-ORG", "I-MISC", "B-PER", "B-ORG", "B-MISC", "I-LOC", "B-LOC"]
    records = []
    for block in text.strip().split("\n\n"):
        words, tags = zip(*(line.split() for line in block.splitlines()))
        records.append({"tokens": np.array([w.encode() for w in words], dtype=object),
                        "ner": np.array([names.index(t) for t in tags], np.int64)})
    info = types.SimpleNamespace(features={"ner": types.SimpleNamespace(
        feature=types.SimpleNamespace(names=names))})
    calls = []
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", types.SimpleNamespace(
        load=lambda name, split, with_info=False: calls.append((name, split)) or (records, info),
        as_numpy=lambda ds: iter(ds)))
    got = conll.read_tfds_conll("validation")
    assert calls == [("conll2003", "dev")]
    want = conll.read_conll(str(tmp_path / "f.txt"))
    assert [(s.words, s.tags) for s in got] == [(s.words, s.tags) for s in want]
    assert got[0].tags == ("B-ORG", "O", "B-MISC", "O")


def test_teacher_label_order_is_remapped_by_name():
    id2label = {0: "B-LOC", 1: "O", 2: "I-LOC"}
    assert conll.remap(id2label, ("O", "B-LOC", "I-LOC")).tolist() == [1, 0, 2]
    with pytest.raises(DataError, match=r"missing \['B-PER'\]"):
        conll.remap(id2label, ("O", "B-LOC", "I-LOC", "B-PER"))


def test_first_piece_labels_and_cut_off_words(dev, teacher_dir):
    from jax_tinybert.data import tokenize
    tok = tokenize.load_tokenizer(teacher_dir)
    sents = dev[:50]
    f = conll.encode_ner(tok, sents, conll.HF_LABELS, max_len=16)
    for k, s in enumerate(sents):
        enc = tok(list(s.words), is_split_into_words=True, truncation=True, max_length=16)
        wids = enc.word_ids()
        for t, w in enumerate(wids):
            first = w is not None and (t == 0 or wids[t - 1] != w)
            want = conll.HF_LABELS.index(s.tags[w]) if first else conll.IGNORE
            assert f.labels[k, t] == want
    assert (f.words_kept < [len(s.words) for s in sents]).any()   # some sentences were cut
    # Predictions: the gold labels at the first pieces; cut-off words come back as O.
    logits = np.eye(len(conll.HF_LABELS))[np.where(f.labels >= 0, f.labels, 0)]
    tags = conll.word_tags(logits, f, sents, conll.HF_LABELS)
    for k, s in enumerate(sents):
        n = int(f.words_kept[k])
        assert tags[k][:n] == list(s.tags[:n]) and set(tags[k][n:]) <= {"O"}


def _perturb(tags, rng):
    types = ["PER", "ORG", "LOC", "MISC"]
    out = list(tags)
    for i in range(len(out)):
        r = rng.random()
        if r < 0.05:
            out[i] = "O"
        elif r < 0.10:
            out[i] = "I-" + rng.choice(types)       # IOB1-style openings, type changes
        elif r < 0.13:
            out[i] = "B-" + rng.choice(types)
    return out


def test_entity_scores_equal_seqeval_default_mode(dev):
    from seqeval.metrics import classification_report, f1_score, precision_score, recall_score
    rng = np.random.default_rng(0)
    gold = [list(s.tags) for s in dev[:800]]
    pred = [_perturb(t, rng) for t in gold]
    ours = ner_metrics.entity_scores(gold, pred)
    assert ours["precision"] == pytest.approx(precision_score(gold, pred), abs=1e-12)
    assert ours["recall"] == pytest.approx(recall_score(gold, pred), abs=1e-12)
    assert ours["f1"] == pytest.approx(f1_score(gold, pred), abs=1e-12)
    report = classification_report(gold, pred, output_dict=True)
    for typ in ("PER", "ORG", "LOC", "MISC"):
        assert ours[f"f1_{typ}"] == pytest.approx(report[typ]["f1-score"], abs=1e-12)
    # IOB1 input scores as seqeval scores it too.
    g1 = [["I-PER", "I-PER", "O", "I-ORG", "B-ORG"]]
    p1 = [["B-PER", "I-PER", "O", "I-ORG", "I-ORG"]]
    assert ner_metrics.entity_scores(g1, p1)["f1"] == pytest.approx(f1_score(g1, p1))
