"""GLUE metrics agree with scikit-learn / SciPy."""
import numpy as np
import pytest
from scipy import stats
from sklearn import metrics as skm

from jax_tinybert.train import metrics


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def test_classification_metrics_match_sklearn(rng):
    for n, c in [(500, 2), (300, 3), (17, 2)]:
        y = rng.integers(0, c, n)
        logits = rng.normal(size=(n, c)) + np.eye(c)[y]  # better than chance
        p = logits.argmax(-1)
        assert metrics.accuracy(logits, y) == pytest.approx(skm.accuracy_score(y, p))
        assert metrics.matthews_corrcoef(p, y) == pytest.approx(skm.matthews_corrcoef(y, p))
        if c == 2:
            assert metrics.f1(p, y) == pytest.approx(skm.f1_score(y, p))


def test_degenerate_cases_match_sklearn():
    y = np.array([0, 1, 0, 1])
    p = np.zeros(4, int)  # constant prediction: MCC undefined -> 0, F1 0
    assert metrics.matthews_corrcoef(p, y) == skm.matthews_corrcoef(y, p) == 0.0
    assert metrics.f1(p, y) == skm.f1_score(y, p, zero_division=0) == 0.0


def test_correlations_match_scipy(rng):
    x = rng.normal(size=400)
    y = 0.7 * x + rng.normal(size=400)
    assert metrics.pearson(x, y) == pytest.approx(stats.pearsonr(x, y)[0], abs=1e-12)
    assert metrics.spearman(x, y) == pytest.approx(stats.spearmanr(x, y)[0], abs=1e-12)
    # ties (STS-B gold scores are on a 0.2 grid)
    yt = np.round(rng.uniform(0, 5, 400) * 5) / 5
    xt = np.round(yt + rng.normal(size=400), 1)
    assert metrics.spearman(xt, yt) == pytest.approx(stats.spearmanr(xt, yt)[0], abs=1e-12)
    assert metrics.pearson(xt[:, None], yt) == pytest.approx(stats.pearsonr(xt, yt)[0], abs=1e-12)


def test_compute_by_task_and_main_metric(rng):
    y = rng.integers(0, 2, 200)
    logits = rng.normal(size=(200, 2))
    p = logits.argmax(-1)
    r = metrics.compute("MRPC", logits, y)
    assert set(r) == {"acc", "f1", "acc_and_f1"}
    assert r["acc_and_f1"] == pytest.approx((skm.accuracy_score(y, p) + skm.f1_score(y, p)) / 2)
    s = rng.uniform(0, 5, 100)
    g = s + rng.normal(size=100)
    r = metrics.compute("stsb", s[:, None], g)
    assert r["corr"] == pytest.approx((stats.pearsonr(s, g)[0] + stats.spearmanr(s, g)[0]) / 2)
    assert metrics.compute("cola", p, y)["mcc"] == pytest.approx(skm.matthews_corrcoef(y, p))
    assert metrics.compute(["acc"], p, y) == {"acc": pytest.approx(skm.accuracy_score(y, p))}
    assert [metrics.main_metric(t) for t in ("sst-2", "mrpc", "sts-b", "cola", "mnli")] == \
        ["acc", "acc_and_f1", "corr", "mcc", "acc"]
    assert metrics.score("sst2", p, y) == pytest.approx(skm.accuracy_score(y, p))
    with pytest.raises(KeyError):
        metrics.compute(["bleu"], p, y)


def test_valid_mask_drops_filler_rows():
    y = np.array([1, 0, 1, 1])
    p = np.array([1, 0, 0, 0])
    assert metrics.compute(["acc"], p, y, valid=np.array([1, 1, 0, 0]))["acc"] == 1.0
