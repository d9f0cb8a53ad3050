"""benchmarks/paired_dev.py: the exact McNemar test against hand-computed binomial tails."""
import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

import paired_dev  # noqa: E402


def test_mcnemar_counts_only_discordant_pairs():
    # 5 both right, 3 only a right, 0 only b right, 2 both wrong.
    a = np.array([1] * 5 + [1] * 3 + [0] * 2, bool)
    b = np.array([1] * 5 + [0] * 3 + [0] * 2, bool)
    nb, nc, p = paired_dev.mcnemar_exact(a, b)
    assert (nb, nc) == (3, 0)
    assert p == pytest.approx(2 * 0.5 ** 3)          # two-sided: both tails of Bin(3, 1/2)


def test_mcnemar_symmetric_and_balanced():
    a = np.array([1, 0, 1, 0, 1, 1], bool)
    b = np.array([0, 1, 0, 1, 1, 1], bool)
    nb, nc, p = paired_dev.mcnemar_exact(a, b)
    assert (nb, nc) == (2, 2) and p == pytest.approx(1.0)
    # 9 vs 1 discordant: p = 2 * (1 + 10) / 2**10
    a = np.array([1] * 9 + [0], bool)
    _, _, p = paired_dev.mcnemar_exact(a, ~a)
    assert p == pytest.approx(2 * 11 / 1024)
    assert paired_dev.mcnemar_exact(a, a)[2] == 1.0
