"""An exported classifier scored on a GLUE dev set in PyTorch `transformers`, independently of
the package: its own tokenizer and model classes, the dev TSV read with the csv module."""
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
