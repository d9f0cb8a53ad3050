"""A small labelled sentiment dataset the project generates itself (for `make demo` and tests).

Sentences are built from templates and word lists, e.g. "the acting was wonderful , and
the story never drags ." (positive) or "a dull , lifeless script ." (negative). Some carry a
negation ("not bad at all" is positive) or a contrast ("the cast is great but the plot is
awful": the clause after "but" decides), so a bag of words is not enough and the model has
to read the sentence. Written in GLUE's SST-2 TSV format so the normal readers handle it.
"""
from __future__ import annotations

from typing import List, Tuple

import numpy as np

from jax_tinybert import fs
from jax_tinybert.fs import atomic_open

POS = ("wonderful", "brilliant", "moving", "charming", "delightful", "gripping", "superb",
       "funny", "beautiful", "clever", "touching", "fresh", "great", "enjoyable", "smart")
NEG = ("dull", "awful", "boring", "tedious", "clumsy", "lifeless", "terrible", "bland",
       "predictable", "messy", "weak", "annoying", "flat", "pointless", "stale")
SUBJ = ("the acting", "the story", "the script", "the film", "the movie", "the cast",
        "the plot", "the direction", "the music", "the ending", "the dialogue", "this picture")
TAILS = ("", " from start to finish", " throughout", " for most of its running time",
         " in every scene", " , frankly")


def _clause(rng, positive: bool) -> str:
    s = SUBJ[rng.integers(len(SUBJ))]
    neg = rng.random() < 0.25
    word_pos = positive != neg  # "not dull" is positive
    w = (POS if word_pos else NEG)[rng.integers(len(POS))]
    verb = "is" if rng.random() < 0.5 else "was"
    return f"{s} {verb} {'not ' if neg else ''}{w}{TAILS[rng.integers(len(TAILS))]}"


def sentence(rng: np.random.Generator, positive: bool) -> str:
    """One lower-cased, SST-style tokenised sentence with the given polarity."""
    r = rng.random()
    if r < 0.45:
        return _clause(rng, positive) + " ."
    if r < 0.75:  # contrast: the second clause decides
        return f"{_clause(rng, not positive)} , but {_clause(rng, positive)} ."
    w = (POS if positive else NEG)[rng.integers(len(POS))]
    w2 = (POS if positive else NEG)[rng.integers(len(POS))]
    return f"a {w} , {w2} {SUBJ[rng.integers(len(SUBJ))].split()[-1]} ."


def make_split(n: int, seed: int) -> List[Tuple[str, int]]:
    """n balanced (sentence, label) pairs; label 1 = positive."""
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(n) % 2)
    return [(sentence(rng, bool(y)), int(y)) for y in labels]


def write_sst2_like(out_dir: str, n_train: int = 2000, n_dev: int = 400, seed: int = 0) -> str:
    """Writes out_dir/SST-2/{train,dev}.tsv (GLUE format) atomically; returns out_dir."""
    d = fs.join(out_dir, "SST-2")
    fs.makedirs(d)
    for split, n, s in (("train", n_train, seed), ("dev", n_dev, seed + 1)):
        path = fs.join(d, f"{split}.tsv")
        with atomic_open(path, "w") as fh:
            fh.write("sentence\tlabel\n")
            for text, y in make_split(n, s):
                fh.write(f"{text}\t{y}\n")
    return out_dir


def write_corpus(path: str, n_docs: int = 300, seed: int = 0) -> str:
    """Unlabelled text (one sentence per line, blank line between documents) for general
    distillation in the demo."""
    rng = np.random.default_rng(seed + 7)
    with atomic_open(path, "w") as fh:
        for _ in range(n_docs):
            for _ in range(int(rng.integers(3, 9))):
                fh.write(sentence(rng, bool(rng.integers(2))) + "\n")
            fh.write("\n")
    return path
