"""SQuAD readers and windows against the shared files, transformers' own overflowing windows and
offsets, and the bad inputs a user's file can have."""
import json
import pathlib
import re
import string

import numpy as np
import pytest

from jax_tinybert.data import squad
from jax_tinybert.data.glue import DataError

SQUAD = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "squad"
if not SQUAD.exists():
    SQUAD = pathlib.Path("/work/shared/data/squad")


@pytest.fixture(scope="module")
def tok(teacher_dir):
    from jax_tinybert.data import tokenize
    return tokenize.load_tokenizer(teacher_dir)


@pytest.fixture(scope="module")
def v11_train():
    return squad.read_squad_file(str(SQUAD / "v1.1" / "train.json"))


@pytest.mark.parametrize("version,split,n,impossible", [("v1.1", "train", 7235, 0),
                                                        ("v1.1", "dev", 1347, 0),
                                                        ("v2.0", "train", 7453, 3816),
                                                        ("v2.0", "dev", 1508, 711)])
def test_the_shared_files_read_with_their_counts(version, split, n, impossible):
    ex = squad.read_squad_file(str(SQUAD / version / f"{split}.json"))
    assert len(ex) == n and sum(e.is_impossible for e in ex) == impossible
    assert all(e.context[s:s + len(a)] == a for e in ex for a, s in zip(e.answers, e.answer_starts))


def _norm(s):
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


def test_windows_equal_transformers_overflowing_windows(tok, v11_train):
    """Our windows (max_len 128, stride 32) have the ids HF's tokenizer gives with
    truncation='only_second', stride and return_overflowing_tokens (run_qa's call)."""
    ex = [e for e in v11_train[:400] if len(tok(e.question)["input_ids"]) <= 40][:150]
    feats = squad.encode_qa(tok, ex, max_len=128, doc_stride=32, train=False)
    ours = {}
    for i in range(len(feats)):
        o = feats.encoded.offsets
        ours.setdefault(int(feats.example_id[i]), []).append(
            list(feats.encoded.input_ids[o[i]:o[i + 1]]))
    multi = 0
    for k, e in enumerate(ex):
        ref = tok(e.question.lstrip(), e.context, truncation="only_second", max_length=128,
                  stride=32, return_overflowing_tokens=True)["input_ids"]
        assert ours[k] == ref, e.id
        multi += len(ref) > 1
    assert multi > 20          # long contexts were cut into several windows


def test_answer_spans_map_back_to_the_gold_text(tok, v11_train):
    """Every labelled window's token span covers the first gold answer's chars (through the
    tokenizer's offsets), a window holding only part of it is labelled [CLS], and each answer
    is labelled in at least one window."""
    ex = v11_train[:600]
    feats = squad.encode_qa(tok, ex, max_len=128, doc_stride=32, train=True)
    labelled, crossing = set(), 0
    for i in range(len(feats)):
        e = ex[int(feats.example_id[i])]
        s, t = (int(v) for v in feats.encoded.labels[i])
        offs = feats.row_offsets(i)
        a0 = e.answer_starts[0]
        a1 = a0 + len(e.answers[0])
        ctx = offs[offs[:, 0] >= 0]
        if (s, t) == (0, 0):
            inside = len(ctx) and ctx[0, 0] <= a0 and ctx[-1, 1] >= a1
            assert not inside, e.id
            if len(ctx) and ctx[0, 0] < a1 and ctx[-1, 1] > a0:
                crossing += 1          # the answer crosses this window's edge
            continue
        span = e.context[offs[s, 0]:offs[t, 1]]
        assert offs[s, 0] <= a0 and offs[t, 1] >= a1, (e.id, span, e.answers[0])
        assert _norm(e.answers[0]) in _norm(span) and len(span) <= len(e.answers[0]) + 12
        labelled.add(int(feats.example_id[i]))
    assert crossing > 0
    assert len(labelled) >= 0.97 * len(ex)   # the rest: answers longer than a window


def test_unicode_and_whitespace_contexts(tok):
    ctx = "Café  Müller\u00a0opened in 1992 —  the  “Zürich” branch\tclosed later."
    start = ctx.index("Zürich")
    ex = [squad.QAExample("q1", "t", ctx, "  Which branch closed?", ("Zürich",), (start,))]
    feats = squad.encode_qa(tok, ex, max_len=64, doc_stride=16)
    s, t = (int(v) for v in feats.encoded.labels[0])
    offs = feats.row_offsets(0)
    assert ctx[offs[s, 0]:offs[t, 1]] == "Zürich"


def test_v2_impossible_questions_are_labelled_at_cls(tok):
    ex = squad.read_squad_file(str(SQUAD / "v2.0" / "dev.json"))[:200]
    feats = squad.encode_qa(tok, ex, max_len=384, doc_stride=128)
    for i in range(len(feats)):
        if ex[int(feats.example_id[i])].is_impossible:
            assert tuple(feats.encoded.labels[i]) == (0, 0)


def _write(tmp_path, qas, version="1.1"):
    doc = {"version": version, "data": [{"title": "T", "paragraphs": [
        {"context": "The cat sat on the mat.", "qas": qas}]}]}
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(doc))
    return str(p)


@pytest.mark.parametrize("qa,msg", [
    ({"id": "x1", "question": "Who?", "answers": [{"text": "cat", "answer_start": 0}]},
     "x1.*answer 'cat' is not at answer_start=0"),
    ({"id": "x2", "question": "Who?", "answers": []}, "x2.*no answers"),
    ({"id": "x3", "answers": [{"text": "cat", "answer_start": 4}]}, "x3.*missing field 'question'"),
])
def test_bad_records_name_the_file_and_question(tmp_path, qa, msg):
    path = _write(tmp_path, [qa])
    with pytest.raises(DataError, match=msg) as e:
        squad.read_squad_file(path)
    assert path in str(e.value) and "\n" not in str(e.value)


def test_v2_impossible_with_answers_is_refused(tmp_path):
    path = _write(tmp_path, [{"id": "y", "question": "Q?", "is_impossible": True,
                              "answers": [{"text": "cat", "answer_start": 4}]}], version="v2.0")
    with pytest.raises(DataError, match="y.*is_impossible=true but 1 answers"):
        squad.read_squad_file(path)


def test_hf_reader_through_a_fake_loader(monkeypatch):
    import types
    rows = [{"id": "h1", "title": "T", "context": "The cat sat.", "question": "Who sat?",
             "answers": {"text": ["cat"], "answer_start": [4]}},
            {"id": "h2", "title": "T", "context": "The cat sat.", "question": "Who flew?",
             "answers": {"text": [], "answer_start": []}}]
    seen = {}
    fake = types.SimpleNamespace(load_dataset=lambda name, split, **kw: seen.update(
        name=name, split=split) or rows)
    monkeypatch.setitem(__import__("sys").modules, "datasets", fake)
    ex = squad.read_hf_squad("squad_v2", "dev")
    assert seen == {"name": "squad_v2", "split": "validation"}
    assert [e.is_impossible for e in ex] == [False, True] and ex[0].answers == ("cat",)


def _fake_tfds(monkeypatch, records, info=None):
    """A `tensorflow_datasets` stand-in: load(name, split, with_info) -> (records, info) as
    NumPy dicts of bytes, as tfds.as_numpy gives them; the calls it got."""
    import sys
    import types

    calls = []

    def load(name, split, with_info=False, **kw):
        calls.append((name, split))
        return (records, info) if with_info else records

    monkeypatch.setitem(sys.modules, "tensorflow_datasets",
                        types.SimpleNamespace(load=load, as_numpy=lambda ds: iter(ds)))
    return calls


def test_tfds_reader_gives_the_official_files_examples(monkeypatch):
    """The real dev contexts as TFDS records (bytes, NumPy arrays): the same examples as the
    official JSON; a v2.0 question without answers is impossible."""
    doc = json.loads((SQUAD / "v2.0" / "dev.json").read_text())
    records = [{"id": qa["id"].encode(), "title": art["title"].encode(),
                "context": p["context"].encode(), "question": qa["question"].encode(),
                "answers": {"text": np.array([a["text"].encode() for a in qa["answers"]],
                                             dtype=object),
                            "answer_start": np.array([a["answer_start"] for a in qa["answers"]],
                                                     np.int32)}}
               for art in doc["data"] for p in art["paragraphs"] for qa in p["qas"]]
    calls = _fake_tfds(monkeypatch, records)
    got = squad.read_tfds_squad("2.0", "dev")
    assert calls == [("squad/v2.0", "validation")]
    want = squad.read_squad_file(str(SQUAD / "v2.0" / "dev.json"))
    assert got == want and any(e.is_impossible for e in got)
    from jax_tinybert.data import position_tasks    # --config.data.source=tfds
    assert position_tasks.read(position_tasks.get("squad20"), "dev", source="tfds") == want


def _hf_windows(tok, ex, max_len, stride):
    """transformers' own overflowing windows, labelled as run_qa's prepare_train_features."""
    enc = tok(ex.question.lstrip(), ex.context, truncation="only_second", max_length=max_len,
              stride=stride, return_overflowing_tokens=True, return_offsets_mapping=True)
    out = []
    for i, ids in enumerate(enc["input_ids"]):
        seq, offs = enc.sequence_ids(i), enc["offset_mapping"][i]
        ctx = [k for k, s in enumerate(seq) if s == 1]
        sc = ex.answer_starts[0]
        ec = sc + len(ex.answers[0])
        a, b = ctx[0], ctx[-1]
        label = (0, 0)
        if offs[a][0] <= sc and offs[b][1] >= ec:
            while a < len(offs) and a <= ctx[-1] and offs[a][0] <= sc:
                a += 1
            while offs[b][1] >= ec:
                b -= 1
            label = (a - 1, b + 1)
        out.append((ids, enc["token_type_ids"][i], [tuple(offs[k]) if seq[k] == 1 else (-1, -1)
                                                    for k in range(len(ids))], label))
    return out


@pytest.mark.parametrize("max_len,stride", [(384, 128), (64, 16)])
def test_windows_match_transformers_on_real_contexts(tok, v11_train, max_len, stride):
    exs = [e for e in v11_train[::20] if len(tok(e.question)["input_ids"]) <= 60]
    feats = squad.encode_qa(tok, exs, max_len=max_len, doc_stride=stride)
    want = [w for ex in exs for w in _hf_windows(tok, ex, max_len, stride)]
    assert len(feats) == len(want)
    e = feats.encoded
    for i, (ids, tt, offs, label) in enumerate(want):
        s, t = e.offsets[i], e.offsets[i + 1]
        assert e.input_ids[s:t].tolist() == ids
        assert e.token_type_ids[s:t].tolist() == tt
        assert [tuple(o) for o in feats.row_offsets(i).tolist()] == offs
        assert tuple(e.labels[i]) == label, i


def test_roberta_style_template_from_the_tokenizer():
    class Rob:
        model_input_names = ["input_ids", "attention_mask"]

        def build_inputs_with_special_tokens(self, a, b):
            return [0] + a + [2, 2] + b + [2]

        def num_special_tokens_to_add(self, pair):
            return 4

    assert squad.pair_template(Rob()) == [("special", 0, 0), ("seq", 0, 0), ("special", 2, 0),
                                          ("special", 2, 0), ("seq", 1, 0), ("special", 2, 0)]
