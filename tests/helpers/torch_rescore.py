"""Exports scored in PyTorch `transformers`, independently of the package's data and metric
code: a classifier on a GLUE dev set (the dev TSV read with the csv module), a span head on
SQuAD (run_qa's windows and n-best search), a token head on CoNLL-2003 (seqeval)."""
from __future__ import annotations

import csv
import os

import numpy as np


def sst2_dev(glue_dir) -> tuple:
    """(sentences, labels int [n]) of SST-2's dev.tsv."""
    with open(os.path.join(glue_dir, "SST-2", "dev.tsv"), newline="") as fh:
        rows = list(csv.DictReader(fh, delimiter="\t", quoting=csv.QUOTE_NONE))
    return [r["sentence"] for r in rows], np.array([int(r["label"]) for r in rows])


def predict(export_dir, sentences, max_len: int, batch: int = 128) -> np.ndarray:
    """argmax class of each sentence, [n] int."""
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    tok = AutoTokenizer.from_pretrained(export_dir)
    model = BertForSequenceClassification.from_pretrained(export_dir).eval()
    out = []
    with torch.no_grad():
        for s in range(0, len(sentences), batch):
            enc = tok(sentences[s:s + batch], truncation=True, max_length=max_len,
                      padding=True, return_tensors="pt")
            out.append(model(**enc).logits.argmax(-1).numpy())
    return np.concatenate(out)


def sst2_accuracy(export_dir, glue_dir, max_len: int = 64) -> tuple:
    """(accuracy, predictions [n]) of the export on SST-2's dev set."""
    sentences, labels = sst2_dev(glue_dir)
    pred = predict(export_dir, sentences, max_len)
    return float(np.mean(pred == labels)), pred


def _torch_finetune():
    """benchmarks/torch_finetune.py: its run_qa-style windows and n-best search, written apart
    from the package's data code."""
    import importlib
    import pathlib
    import sys

    bench = str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    return importlib.import_module("torch_finetune")


def squad(export_dir, data_dir, task: str, *, max_len: int, doc_stride: int,
          max_query_len: int, subset: int, seed: int = 1) -> dict:
    """The official SQuAD scores (v1.1 f1/exact; v2.0 also best_f1) of an exported
    *ForQuestionAnswering on the dev file's `subset` questions drawn as a run draws them: the
    tokenizer's own overflowing windows, transformers' PyTorch model, run_qa's n-best search."""
    import torch
    import transformers

    from jax_tinybert.train import qa_metrics

    tf = _torch_finetune()
    dev = tf._examples(task, str(data_dir), "dev", subset, seed)
    tok = transformers.AutoTokenizer.from_pretrained(export_dir)
    model = transformers.AutoModelForQuestionAnswering.from_pretrained(export_dir).eval()
    feats = tf._qa_features(tok, dev, max_len, doc_stride, max_query_len, train=False)
    keys = ("input_ids", "attention_mask", "token_type_ids")
    with torch.no_grad():
        out = model(**{k: torch.tensor([f[k] for f in feats]) for k in keys})
    # run_qa ranks the padding's logits too (the windows are padded to max_len), so a pad can
    # take one of the 20 n-best slots of a real token; the package's head gives pads
    # heads.MASKED_LOGIT (docs/tasks.md), masked here the same way.
    pad = np.array([f["attention_mask"] for f in feats]) == 0
    start, end = (np.where(pad, -1e9, x.numpy()) for x in (out.start_logits, out.end_logits))
    texts, diffs = tf._qa_predict(start, end, feats, dev)
    return (qa_metrics.squad_v1(texts, dev) if task == "squad11"
            else qa_metrics.squad_v2(texts, diffs, dev))


def conll_f1(export_dir, dev_file, *, subset: int, max_len: int, seed: int = 1) -> float:
    """seqeval's entity F1 of an exported *ForTokenClassification at each word's first piece
    (transformers' tokenizer and model; the dev file read here; `subset` sentences drawn as a
    run draws them; words past max_len tokens count as O)."""
    import torch
    import transformers
    from seqeval.metrics import f1_score

    from jax_tinybert.data.tokenize import subset_indices

    sents, cur = [], []
    for line in open(dev_file, encoding="utf-8"):
        parts = line.split()
        if not parts or parts[0] == "-DOCSTART-":
            if cur:
                sents.append(cur)
            cur = []
            continue
        cur.append((parts[0], parts[-1]))
    if cur:
        sents.append(cur)
    idx = subset_indices(len(sents), subset, seed)
    sents = sents if idx is None else [sents[i] for i in idx]
    tok = transformers.AutoTokenizer.from_pretrained(export_dir)
    model = transformers.AutoModelForTokenClassification.from_pretrained(export_dir).eval()
    id2label = model.config.id2label
    gold, pred = [], []
    for s in sents:
        enc = tok([w for w, _ in s], is_split_into_words=True, truncation=True,
                  max_length=max_len, return_tensors="pt")
        with torch.no_grad():
            best = model(**enc).logits[0].argmax(-1).numpy()
        tags, prev = ["O"] * len(s), None
        for t, w in enumerate(enc.word_ids()):
            if w is not None and w != prev:
                tags[w] = id2label[int(best[t])]
            prev = w
        gold.append([t for _, t in s])
        pred.append(tags)
    return float(f1_score(gold, pred))
