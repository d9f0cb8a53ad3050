"""Paired comparison of exported classifiers on a GLUE dev set, with PyTorch `transformers`.

Scores every model on the same dev examples and, for classification tasks, tests each pair of
models with an exact McNemar test (the two-sided binomial test on the examples where exactly one
of the two is right). Differences of a few examples between students are common on small dev
sets (SST-2: 872); this says whether one is real.

The models are loaded with `transformers` (PyTorch), not with this package: an independent check
of the exports as well. `--init NAME=TEACHER:1,2,3` adds the untrained student that
`student.init=teacher_layers` builds (the teacher's embeddings, its 1-based layers, pooler and
classifier head): what every student row of `benchmarks/glue.py --budget cpu` starts from.

    .venv/bin/python benchmarks/paired_dev.py --task sst2 --glue_dir ../shared/data/glue \\
        --model teacher=W/sst2/teacher/export --model tinybert=W/sst2/pred/export \\
        --init init=W/sst2/teacher/export:1,2,3 --json out.json
"""
import argparse
import itertools
import json
import os
import sys
from typing import Dict, List, Tuple

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def mcnemar_exact(right_a: np.ndarray, right_b: np.ndarray) -> Tuple[int, int, float]:
    """(a right & b wrong, a wrong & b right, two-sided exact p) for two bool [N] arrays."""
    from scipy.stats import binomtest

    b = int(np.sum(right_a & ~right_b))
    c = int(np.sum(~right_a & right_b))
    p = 1.0 if b + c == 0 else float(binomtest(b, b + c, 0.5).pvalue)
    return b, c, p


def load_model(spec: str, init_layers: Tuple[int, ...] = ()):
    import torch
    from transformers import BertForSequenceClassification

    model = BertForSequenceClassification.from_pretrained(spec)
    if init_layers:
        keep = [model.bert.encoder.layer[i - 1] for i in init_layers]
        model.bert.encoder.layer = torch.nn.ModuleList(keep)
        model.config.num_hidden_layers = len(keep)
    return model.eval()


def predict(model, tok, examples, max_len: int, batch: int = 64) -> np.ndarray:
    """[N] predicted class ids (classification) or [N] scores (regression)."""
    import torch

    out = []
    with torch.inference_mode():
        for i in range(0, len(examples), batch):
            ex = examples[i:i + batch]
            a = [e.text_a for e in ex]
            b = [e.text_b for e in ex] if ex[0].text_b is not None else None
            enc = tok(a, b, truncation=True, max_length=max_len, padding=True,
                      return_tensors="pt")
            logits = model(**enc).logits.float().numpy()
            out.append(logits[:, 0] if logits.shape[1] == 1 else logits.argmax(-1))
    return np.concatenate(out)


def main(argv=None) -> Dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", required=True)
    ap.add_argument("--glue_dir", default=os.path.join(REPO, "..", "shared", "data", "glue"))
    ap.add_argument("--model", action="append", default=[], help="NAME=HF_FOLDER (repeat)")
    ap.add_argument("--init", action="append", default=[],
                    help="NAME=TEACHER_FOLDER:1,2,3 (the untrained teacher-layer student)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import torch
    from transformers import AutoTokenizer

    from jax_tinybert.data import glue

    torch.set_num_threads(args.threads)
    spec = glue.get_task(args.task)
    examples = glue.load_examples(args.task, "dev", glue_dir=args.glue_dir)
    max_len = 128 if spec.is_pair else 64
    models: List[Tuple[str, str, Tuple[int, ...]]] = []
    for m in args.model:
        name, _, path = m.partition("=")
        models.append((name, path, ()))
    for m in args.init:
        name, _, rest = m.partition("=")
        path, _, layers = rest.rpartition(":")
        models.append((name, path, tuple(int(x) for x in layers.split(","))))
    if not models:
        ap.error("give at least one --model or --init")
    labels = np.array([e.label for e in examples])
    regression = spec.num_labels == 1
    preds, rows = {}, []
    for name, path, layers in models:
        tok = AutoTokenizer.from_pretrained(path)
        p = predict(load_model(path, layers), tok, examples, max_len)
        preds[name] = p
        if regression:
            from scipy.stats import pearsonr, spearmanr

            row = {"model": name, "pearson": float(pearsonr(p, labels.astype(float))[0]),
                   "spearman": float(spearmanr(p, labels.astype(float))[0])}
        else:
            row = {"model": name, "acc": float(np.mean(p == labels)),
                   "right": int(np.sum(p == labels))}
        rows.append(row)
        print(json.dumps(row), flush=True)
    pairs = []
    if not regression:
        print(f"\n{spec.dir_name} dev, {len(examples)} examples; exact McNemar test per pair "
              "(b = first right & second wrong, c = the reverse)\n")
        print("| first | second | acc first | acc second | b | c | p |")
        print("|---|---|---:|---:|---:|---:|---:|")
        acc = {r["model"]: r["acc"] for r in rows}
        for x, y in itertools.combinations(preds, 2):
            b, c, p = mcnemar_exact(preds[x] == labels, preds[y] == labels)
            pairs.append({"first": x, "second": y, "b": b, "c": c, "p": p})
            print(f"| {x} | {y} | {acc[x]:.4f} | {acc[y]:.4f} | {b} | {c} | {p:.3f} |")
    result = {"task": spec.dir_name, "n": len(examples), "models": rows, "pairs": pairs}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return result


if __name__ == "__main__":
    main()
