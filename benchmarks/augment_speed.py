#!/usr/bin/env python
"""Data augmentation speed: sentences/s of the candidate search, ours vs the official
TinyBERT data_augmentation.py approach, on the first --n sentences of a GLUE train set.

Rows:
- official approach (PyTorch transformers BertForMaskedLM on the same MLM folder): one forward
  per eligible one-piece word, batch 1, input = the masked sentence + [SEP] + the sentence with
  segment ids 0/1, as `_masked_language_model` builds it (no torch.no_grad, as the official code);
  multi-piece words are skipped (the official code uses GloVe for them: not timed).
- ours, mode "mlm": jax_tinybert.data.augment.Augmenter, every masked copy of every sentence in
  fixed-shape batches (one jitted forward per batch, MLM head only at the mask positions).
- ours, mode "embedding": no MLM, cosine neighbours in the word-embedding table.
Each "ours" row is timed after a warm-up pass (compiles), then over the same sentences again;
sampling N = 20 augmented sentences is included. The first-pass time (with compiles) is shown too.

    .venv/bin/python benchmarks/augment_speed.py --mlm runs/mlm_head/export --n 200 \
        --glue_dir ../shared/data/glue --json benchmarks/out/augment_speed.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))


def official_way(mlm_dir: str, sentences, max_words: int = 0) -> dict:
    """One PyTorch MLM call per eligible one-piece word (the official script's loop)."""
    import torch
    import transformers

    from jax_tinybert.data import augment

    tok = transformers.BertTokenizer.from_pretrained(mlm_dir)
    model = transformers.BertForMaskedLM.from_pretrained(mlm_dir).eval()
    calls = 0
    t0, c0 = time.time(), time.process_time()
    for sent in sentences:
        words = tok.basic_tokenizer.tokenize(sent)
        pieces = ["[CLS]"] + tok.tokenize(sent)
        for idx, word in enumerate(words):
            if not (augment.is_candidate_word(word)):
                continue
            # the word's piece positions, as _word_augment finds them
            ids, token_idx = [], -1
            for i in range(1, len(pieces)):
                if "##" not in pieces[i]:
                    token_idx += 1
                    if token_idx == idx:
                        ids = [i]
                    elif token_idx > idx:
                        break
                elif ids:
                    ids.append(i)
            if len(ids) != 1:
                continue
            masked = list(pieces)
            masked[ids[0]] = "[MASK]"
            text = masked + ["[SEP]"] + pieces[1:] + ["[SEP]"]
            seg = [0] * (len(pieces) + 1) + [1] * (len(text) - len(pieces) - 1)
            pred = model(torch.tensor([tok.convert_tokens_to_ids(text)]),
                         torch.tensor([seg])).logits
            torch.argsort(pred[0, ids[0]], descending=True)[:15].tolist()
            calls += 1
    dt, cpu = time.time() - t0, time.process_time() - c0
    return {"sentences_per_s": len(sentences) / dt, "wall_s": dt, "cpu_s": cpu,
            "mlm_calls": calls}


def ours(mode: str, mlm_dir: str, sentences, N: int = 20) -> dict:
    from jax_tinybert.model import hf
    from jax_tinybert.data import augment, tokenize
    from jax_tinybert.model.modeling import BertForMaskedLM

    tok = tokenize.load_tokenizer(mlm_dir)
    if mode == "mlm":
        cfg, params = hf.load_pretrained(mlm_dir, mlm_head=True)
        aug = augment.Augmenter(tok, BertForMaskedLM(cfg), params, N=N, K=15, max_seq_len=64,
                                batch_size=64, buckets=(32, 64))
    else:
        _, params = hf.load_pretrained(mlm_dir, for_classification=False)
        emb = hf.bert_params(params)["embeddings"]["word_embeddings"]["embedding"]
        aug = augment.Augmenter(tok, mode="embedding", word_embeddings=emb, N=N, K=15)
    keys = [(i, 0) for i in range(len(sentences))]
    t0 = time.time()
    aug.augment_sentences(sentences, keys)
    first = time.time() - t0
    t0, c0 = time.time(), time.process_time()
    aug.augment_sentences(sentences, keys)
    dt, cpu = time.time() - t0, time.process_time() - c0
    return {"sentences_per_s": len(sentences) / dt, "wall_s": dt, "cpu_s": cpu,
            "first_pass_s": first}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mlm", required=True, help="HF BertForMaskedLM folder (e.g. the export of "
                    "configs/mlm_head.py)")
    ap.add_argument("--glue_dir", default=os.path.join(_HERE, "..", "..", "shared", "data", "glue"))
    ap.add_argument("--task", default="sst2")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from jax_tinybert.data import glue

    ex = glue.load_examples(args.task, "train", glue_dir=os.path.abspath(args.glue_dir))
    sentences = [e.text_a for e in ex[:args.n]]
    rows = {"official approach (PyTorch, 1 MLM call per word)": official_way(args.mlm, sentences),
            "ours, mlm mode (batched JAX)": ours("mlm", args.mlm, sentences),
            "ours, embedding mode (no MLM)": ours("embedding", args.mlm, sentences)}
    base = rows["official approach (PyTorch, 1 MLM call per word)"]["sentences_per_s"]
    print(f"\n{args.n} {args.task} train sentences, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, {datetime.datetime.now().isoformat(timespec='minutes')}\n")
    # CPU-seconds (all threads) per sentence compare the work even on a shared machine.
    base_cpu = rows["official approach (PyTorch, 1 MLM call per word)"]["cpu_s"]
    print("| method | sentences/s | vs official | CPU-s | vs official (CPU-s) | timed s | "
          "first pass s (with compiles) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['sentences_per_s']:.2f} | {r['sentences_per_s'] / base:.1f}x | "
              f"{r['cpu_s']:.1f} | {base_cpu / max(r['cpu_s'], 1e-9):.1f}x | {r['wall_s']:.1f} | "
              f"{r.get('first_pass_s', float('nan')):.1f} |")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump({"n": args.n, "task": args.task, "rows": rows}, fh, indent=1)
    return rows


if __name__ == "__main__":
    main()
