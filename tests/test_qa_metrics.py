"""SQuAD's metrics on fixed predictions against the official scripts' formulas, written out
here; answers picked over several windows of a question by example_id."""
import numpy as np
import pytest

from jax_tinybert.data import squad
from jax_tinybert.train import qa_metrics as Q


def E(qid, context, answers=(), impossible=False):
    starts = tuple(context.index(a) for a in answers)
    return squad.QAExample(qid, "t", context, "q?", tuple(answers), starts, impossible)


@pytest.mark.parametrize("pred,gold,em,f1", [
    ("The Cat!", "cat", 1.0, 1.0),                 # case, article, punctuation
    ("a big cat", "big dog", 0.0, 0.5),            # 1 common of 2 and 2 tokens
    ("Denver Broncos", "the Denver Broncos", 1.0, 1.0),
    ("in 1990 and 1991", "1990", 0.0, 0.4),        # p 1/4, r 1: 2 * 0.25 / 1.25
    ("", "", 1.0, 1.0), ("x", "", 0.0, 0.0),
])
def test_per_answer_scores(pred, gold, em, f1):
    assert Q.exact(pred, gold) == em
    assert Q.f1(pred, gold) == pytest.approx(f1)


def test_v1_takes_the_best_gold_answer_and_averages_in_percent():
    ex = [E("a", "the big red cat sat", ("red cat", "big red cat")),
          E("b", "the dog ran home", ("dog",))]
    out = Q.squad_v1({"a": "big red cat", "b": "dog ran"}, ex)
    assert out["exact_match"] == pytest.approx(50.0)
    assert out["f1"] == pytest.approx(100 * (1.0 + 2 / 3) / 2)


def test_v2_threshold_and_best_threshold():
    """Four questions: two answerable, two not; null-score differences -1, 2, 0.5, -3."""
    ex = [E("h1", "alpha beta gamma", ("beta",)), E("h2", "one two three", ("two",)),
          E("n1", "red green", impossible=True), E("n2", "sun moon", impossible=True)]
    preds = {"h1": "beta", "h2": "two", "n1": "red", "n2": "moon"}
    diffs = {"h1": -1.0, "h2": 2.0, "n1": 0.5, "n2": -3.0}
    out = Q.squad_v2(preds, diffs, ex)
    # threshold 0: h1 answered (right), h2 null (wrong), n1 null (right), n2 answered (wrong)
    assert out["exact"] == pytest.approx(50.0)
    assert out["HasAns_exact"] == pytest.approx(50.0) and out["NoAns_exact"] == pytest.approx(50.0)
    # official find_best_thresh, by hand: start 2 (all null); sorted n2(-3): -1 -> 1; h1(-1): +1
    # -> 2; n1(0.5): -1 -> 1; h2(2): +1 -> 2. Never above 2: best 50% at threshold 0.
    assert out["best_exact"] == pytest.approx(50.0) and out["best_exact_thresh"] == 0.0
    diffs["n2"] = 3.0   # now: h1(-1) +1 -> 3 best at -1
    out = Q.squad_v2(preds, diffs, ex)
    assert out["best_exact"] == pytest.approx(75.0) and out["best_exact_thresh"] == -1.0


def _features(tok, examples):
    return squad.encode_qa(tok, examples, max_len=24, doc_stride=8, train=False)


def test_predict_picks_the_best_span_over_windows_by_example_id(teacher_dir):
    from jax_tinybert.data import tokenize
    tok = tokenize.load_tokenizer(teacher_dir)
    ctx = ("the river flows north through the old town and then turns east past the mill "
           "where the baker lives with his three dogs and a cat")
    ex = [E("q0", ctx, ("three dogs",)), E("q1", "a short one here", ("short",))]
    feats = _features(tok, ex)
    rows = [i for i in range(len(feats)) if feats.example_id[i] == 0]
    assert len(rows) >= 2
    T = max(int(n) for n in feats.encoded.lengths)
    s = np.zeros((len(feats), T))
    e = np.zeros((len(feats), T))
    # In the last window of q0, put the highest scores on "three dogs".
    last = rows[-1]
    offs = feats.row_offsets(last)
    a = ctx.index("three dogs")
    ts = int(np.nonzero(offs[:, 0] == a)[0][0])
    te = int(np.nonzero(offs[:, 1] == a + len("three dogs"))[0][0])
    s[last, ts], e[last, te] = 5.0, 5.0
    s[rows[0], 1], e[rows[0], 1] = 3.0, 3.0   # a question token: never an answer
    # q1's own row scores higher still: each question takes only the rows its example_id names.
    r1 = int(np.nonzero(feats.example_id == 1)[0][0])
    o1 = feats.row_offsets(r1)
    k = int(np.nonzero(o1[:, 0] == ex[1].context.index("short"))[0][0])
    s[r1, k], e[r1, k] = 9.0, 9.0
    texts, diffs = Q.predict(s, e, feats, ex)
    assert texts == {"q0": "three dogs", "q1": "short"}
    assert diffs["q0"] == pytest.approx(-10.0)     # null score 0 (start[0] + end[0]) - 10
    assert Q.squad_v1(texts, ex)["exact_match"] == 100.0


def test_v1_keeps_golds_that_normalise_to_nothing_as_the_official_script():
    # evaluate-v1.1.py: exact compares normalised strings ("" == ""), f1 has no common tokens
    from jax_tinybert.data.squad import QAExample
    from jax_tinybert.train import qa_metrics
    ex = [QAExample("q", "t", "the cat", "?", ("the",), (0,))]
    assert qa_metrics.squad_v1({"q": "The"}, ex) == {"exact_match": 100.0, "f1": 0.0}
