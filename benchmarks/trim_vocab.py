#!/usr/bin/env python
"""Vocabulary trimming (jax_tinybert/data/trim_vocab.py) on a large Unigram vocabulary: the
pieces SST-2 + MRPC training text uses, and what the embedding table and its Adam state weigh
before and after.

    .venv/bin/python benchmarks/trim_vocab.py [--vocab 120000] [--record]

A SentencePiece-style Unigram (XLM-R's layout, tests/helpers/tokenizers_here.py) is trained on
the whole shared corpus (20 MB; the trainer stops where the corpus has no more pieces), a
random BERT-shaped model of that vocab is written, and it is trimmed to the task text. Checked:
every line tokenizes into the same pieces with the same embedding vectors. Sizes at hidden 768
(a base model; XLM-R base has 250,002 pieces: 192.0M embedding parameters, 1,465 MiB of Adam
m + v): fp32 weights 4 bytes a parameter, Adam's two moments 8.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from helpers import tokenizers_here  # noqa: E402
from jax_tinybert.data import glue, tokenize, trim_vocab  # noqa: E402
from jax_tinybert.model import hf  # noqa: E402
from jax_tinybert.model.export import export_hf  # noqa: E402
from jax_tinybert.model.modeling import BertConfig, BertModel, random_params  # noqa: E402

HIDDEN = 768


def _task_text(path: pathlib.Path, glue_dir: pathlib.Path) -> int:
    texts = []
    for task in ("sst2", "mrpc"):
        for e in glue.load_examples(task, "train", glue_dir=str(glue_dir)):
            texts += [e.text_a] + ([e.text_b] if e.text_b else [])
    path.write_text("\n".join(texts) + "\n", encoding="utf-8")
    return len(texts)


def _same(src: str, out: str, text: pathlib.Path) -> bool:
    """Every line: the same pieces and, id for id, the same embedding vectors."""
    old, new = tokenize.load_tokenizer(src), tokenize.load_tokenizer(out)
    emb = [np.asarray(hf.bert_params(hf.load_pretrained(d)[1])["embeddings"]["word_embeddings"]
                      ["embedding"]) for d in (src, out)]
    lines = [ln for ln in text.read_text(encoding="utf-8").splitlines() if ln.strip()]
    a, b = old(lines)["input_ids"], new(lines)["input_ids"]
    return all(old.convert_ids_to_tokens(x) == new.convert_ids_to_tokens(y)
               and np.array_equal(emb[0][x], emb[1][y]) for x, y in zip(a, b))


def _row(name: str, vocab: int, **extra) -> dict:
    p = vocab * HIDDEN
    return {"vocab": name, "pieces": vocab, "embedding_params_M": round(p / 1e6, 2),
            "fp32_MiB": round(4 * p / 2 ** 20, 1), "adam_MiB": round(8 * p / 2 ** 20, 1), **extra}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=120000, help="the Unigram trainer's target")
    p.add_argument("--record", action="store_true")
    a = p.parse_args()
    shared = REPO.parent / "shared" / "data"
    tokenizers_here.TRAIN_FILES = tuple(sorted(f for f in os.listdir(shared / "corpus")
                                               if f.endswith(".txt")))
    with tempfile.TemporaryDirectory(prefix="trim_vocab-") as work:
        w = pathlib.Path(work)
        t0 = time.perf_counter()
        tokenizers_here.xlmr_unigram(str(w / "tok"), a.vocab, corpus=shared / "corpus")
        train_s = time.perf_counter() - t0
        n = len(tokenize.load_tokenizer(str(w / "tok")))
        cfg = BertConfig(vocab_size=n, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=128, pad_token_id=1)
        export_hf(cfg, random_params(BertModel(cfg), 0), str(w / "model"),
                  tokenizer_dir=str(w / "tok"))
        lines = _task_text(w / "task.txt", shared / "glue")
        t0 = time.perf_counter()
        r = trim_vocab.trim(str(w / "model"), [str(w / "task.txt")], str(w / "trimmed"))
        trim_s = time.perf_counter() - t0
        same = _same(str(w / "model"), str(w / "trimmed"), w / "task.txt")
    rows = [_row("unigram, whole corpus", r["vocab_before"], train_s=round(train_s, 1)),
            _row("trimmed to SST-2 + MRPC train", r["vocab_after"], trim_s=round(trim_s, 1),
                 lines=lines, same_pieces_and_vectors=same)]
    for row in rows:
        print(json.dumps(row), flush=True)
    if not same:
        sys.exit("trimmed tokenizer or embeddings differ on the task text")
    if a.record:
        import results

        meta = {"note": f"Unigram trained to {a.vocab:,} pieces at most on the 20 MB shared "
                        f"corpus; sizes at hidden {HIDDEN}"}
        print("recorded", results.record("trim_vocab", results.machine_kind(), rows, ("vocab",),
                                         meta))


if __name__ == "__main__":
    main()
