#!/usr/bin/env python
"""The teacher's fine-tuning on SQuAD or CoNLL-2003, ours against a plain PyTorch/transformers
fine-tune of the same model on the same files, side by side, seeds each.

    .venv/bin/python benchmarks/torch_finetune.py --task conll2003 --seeds 0,1 --record
    .venv/bin/python benchmarks/torch_finetune.py --task squad11 --seeds 0,1 --epochs 2

Both sides start from the same HF folder (default the packaged all-MiniLM-L6-v2), train the same
epochs with the same batch, learning rate, AdamW (weight decay 0.01 off biases and LayerNorms,
global-norm clip 1.0), warmup-linear schedule (10%), dropout on, and score the same dev file.
Ours: `configs/finetune_teacher.py:<task>` through `train_and_evaluate` (the CLI's function).
PyTorch: written here as HF's examples do it, independently of the package's data code:
SQuAD run_qa's windows (the tokenizer's overflowing windows, `stride` = doc_stride, answers
mapped through its offsets), its n-best span search (20, answers up to 30 tokens); CoNLL
run_ner's first-piece labels (-100 elsewhere), each batch padded to its longest row, and
seqeval's entity F1 (SQuAD windows are padded to max_len, as run_qa pads them). The official SQuAD
formulas score both sides (train/qa_metrics.py, tested against evaluate-v1.1/v2.0's rules).
torch runs on the same cores (torch.set_num_threads(os.cpu_count())). Rows (--record):
benchmarks/results/torch_finetune-<machine>.json, {task, side, seed, f1, wall_s, steps}.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Dict, List

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(_HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, _HERE)

DATA = {"squad11": "squad/v1.1", "squad20": "squad/v2.0", "conll2003": "conll2003"}
MAX_LEN = {"squad11": 384, "squad20": 384, "conll2003": 128}


def _examples(task: str, data_dir: str, split: str, n: int, seed: int):
    """The split's examples drawn as the run draws them (subset_indices, seed)."""
    from jax_tinybert.data import position_tasks
    from jax_tinybert.data.tokenize import subset_indices

    ex = position_tasks.read(position_tasks.get(task), split, data_dir=data_dir)
    idx = subset_indices(len(ex), n, seed)
    return ex if idx is None else [ex[i] for i in idx]


# --------------------------------------------------------------------------- PyTorch side

def _qa_features(tok, examples, max_len, stride, max_query, train: bool):
    """run_qa's prepare_{train,validation}_features: the tokenizer's own windows."""
    qs = [e.question.lstrip() for e in examples]
    # run_qa truncates the question to max_query tokens by the tokenizer (truncation=only_second
    # on the context); questions longer than that are cut here the same way as ours.
    qs = [q if len(tok.tokenize(q)) <= max_query else
          tok.convert_tokens_to_string(tok.tokenize(q)[:max_query]) for q in qs]
    enc = tok(qs, [e.context for e in examples], truncation="only_second", max_length=max_len,
              stride=stride, return_overflowing_tokens=True, return_offsets_mapping=True,
              padding="max_length")
    feats = []
    for i in range(len(enc["input_ids"])):
        ex = enc["overflow_to_sample_mapping"][i]
        seq = enc.sequence_ids(i)
        offs = [o if seq[k] == 1 else None for k, o in enumerate(enc["offset_mapping"][i])]
        f = {"input_ids": enc["input_ids"][i], "attention_mask": enc["attention_mask"][i],
             "token_type_ids": enc["token_type_ids"][i], "example": ex, "offsets": offs}
        if train:
            e, s, t = examples[ex], 0, 0
            if e.answers:
                a0, a1 = e.answer_starts[0], e.answer_starts[0] + len(e.answers[0])
                ctx = [k for k, o in enumerate(offs) if o is not None]
                if offs[ctx[0]][0] <= a0 and offs[ctx[-1]][1] >= a1:
                    s = max(k for k in ctx if offs[k][0] <= a0)
                    t = min(k for k in ctx if offs[k][1] >= a1)
            f["start"], f["end"] = s, t
        feats.append(f)
    return feats


def _qa_predict(start, end, feats, examples, n_best=20, max_answer=30):
    """run_qa's postprocess_qa_predictions: the best valid span over an example's windows, and
    the null score difference (v2.0)."""
    best: Dict[int, tuple] = {}
    null: Dict[int, float] = {}
    for i, f in enumerate(feats):
        ex, offs = f["example"], f["offsets"]
        s, e = start[i], end[i]
        null[ex] = min(null.get(ex, np.inf), float(s[0] + e[0]))
        for a in np.argsort(s)[::-1][:n_best]:
            for b in np.argsort(e)[::-1][:n_best]:
                if offs[a] is None or offs[b] is None or b < a or b - a + 1 > max_answer:
                    continue
                score = float(s[a] + e[b])
                if ex not in best or score > best[ex][0]:
                    best[ex] = (score, examples[ex].context[offs[a][0]:offs[b][1]])
    texts = {e.id: best.get(k, (0, ""))[1] for k, e in enumerate(examples)}
    diffs = {e.id: null.get(k, np.inf) - best.get(k, (-np.inf, ""))[0]
             for k, e in enumerate(examples)}
    return texts, diffs


def _ner_features(tok, sentences, labels, max_len):
    index = {t: i for i, t in enumerate(labels)}
    feats = []
    for s in sentences:
        # Unpadded: run_ner pads each batch to its longest row (pad_to_max_length is off by
        # default; DataCollatorForTokenClassification), as _batch does.
        enc = tok(list(s.words), is_split_into_words=True, truncation=True, max_length=max_len)
        lab, prev = [], None
        for w in enc.word_ids():
            lab.append(index[s.tags[w]] if w is not None and w != prev else -100)
            prev = w
        feats.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                      "token_type_ids": enc["token_type_ids"], "labels": lab,
                      "word_ids": enc.word_ids()})
    return feats


def _batch(rows, keys, labels: bool):
    """Tensors of `rows` padded to their longest (pads 0, labels -100): run_ner's collator.
    SQuAD's windows all have max_len already (run_qa pads to max_seq_length by default)."""
    import torch

    n = max(len(r["input_ids"]) for r in rows)
    fill = {"labels": -100}
    names = list(keys) + (["labels"] if labels else [])
    return {k: torch.tensor([list(r[k]) + [fill.get(k, 0)] * (n - len(r[k])) for r in rows])
            for k in names}


def _optimizer(model, lr, steps):
    import torch
    import transformers

    no_decay = ("bias", "LayerNorm.weight")
    groups = [{"params": [p for n, p in model.named_parameters()
                          if not any(k in n for k in no_decay)], "weight_decay": 0.01},
              {"params": [p for n, p in model.named_parameters()
                          if any(k in n for k in no_decay)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr, eps=1e-6)
    sched = transformers.get_linear_schedule_with_warmup(opt, int(0.1 * steps), steps)
    return opt, sched


def torch_side(task, model_dir, data_dir, seed, epochs, lr, batch, train_n, eval_n, max_len,
               stride=128, max_query=64) -> dict:
    """One PyTorch fine-tune and its dev score; wall time from model load to the score."""
    import torch
    import transformers
    from seqeval.metrics import f1_score

    from jax_tinybert.data import conll
    from jax_tinybert.train import qa_metrics

    t0 = time.time()
    torch.manual_seed(seed)
    torch.set_num_threads(os.cpu_count() or 1)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    train = _examples(task, data_dir, "train", train_n, seed)
    dev = _examples(task, data_dir, "dev", eval_n, seed + 1)
    span = task.startswith("squad")
    if span:
        model = transformers.AutoModelForQuestionAnswering.from_pretrained(model_dir)
        tf = _qa_features(tok, train, max_len, stride, max_query, True)
        df = _qa_features(tok, dev, max_len, stride, max_query, False)
    else:
        labels = conll.label_order(train)
        model = transformers.AutoModelForTokenClassification.from_pretrained(
            model_dir, num_labels=len(labels), id2label=dict(enumerate(labels)))
        tf, df = (_ner_features(tok, x, labels, max_len) for x in (train, dev))
    keys = ("input_ids", "attention_mask", "token_type_ids")
    steps = max(1, int(np.ceil(epochs * (len(tf) // min(batch, len(tf))))))  # full batches, as ours
    opt, sched = _optimizer(model, lr, steps)
    rng = np.random.default_rng(seed)
    batch = min(batch, len(tf))
    model.train()
    done = 0
    while done < steps:
        order = rng.permutation(len(tf))
        for s in range(0, len(order) - batch + 1, batch):
            if done == steps:
                break
            rows = [tf[i] for i in order[s:s + batch]]
            t = _batch(rows, keys, labels=not span)
            if span:
                t["start_positions"] = torch.tensor([r["start"] for r in rows])
                t["end_positions"] = torch.tensor([r["end"] for r in rows])
            loss = model(**t).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            done += 1
    model.eval()
    outs = []
    with torch.no_grad():
        for s in range(0, len(df), 64):
            o = model(**_batch(df[s:s + 64], keys, labels=False))
            if span:
                outs.append(np.stack([o.start_logits.numpy(), o.end_logits.numpy()], 1))
            else:   # back to one row per sentence at max_len (the pads' logits are not read)
                lg = o.logits.numpy()
                outs.append(np.pad(lg, ((0, 0), (0, max_len - lg.shape[1]), (0, 0))))
    logits = np.concatenate(outs)
    if span:
        texts, diffs = _qa_predict(logits[:, 0], logits[:, 1], df, dev)
        m = (qa_metrics.squad_v1(texts, dev) if task == "squad11"
             else qa_metrics.squad_v2(texts, diffs, dev))
        f1 = m["f1"] if task == "squad11" else m["best_f1"]
    else:
        pred = []
        for k, s in enumerate(dev):
            tags, prev = ["O"] * len(s.words), None
            for t_i, w in enumerate(df[k]["word_ids"]):
                if w is not None and w != prev:
                    tags[w] = labels[int(logits[k, t_i].argmax())]
                prev = w
            pred.append(tags)
        f1 = float(f1_score([list(s.tags) for s in dev], pred))
    return {"f1": round(float(f1), 4), "wall_s": round(time.time() - t0, 1), "steps": steps}


# --------------------------------------------------------------------------- our side

def ours_side(task, model_dir, data_dir, seed, epochs, lr, batch, train_n, eval_n, max_len,
              workdir) -> dict:
    """configs/finetune_teacher.py:<task> through train_and_evaluate, the same recipe."""
    from glue import _load_config, _set

    from jax_tinybert.train.loop import train_and_evaluate

    c = _load_config("finetune_teacher", task)
    c = _set(c, {"teacher.path": model_dir, "data.data_dir": data_dir, "train.seed": seed,
                 "train.num_epochs": epochs, "optim.learning_rate": lr,
                 "train.batch_size": batch, "train.eval_batch_size": batch,
                 "data.train_subset": train_n, "data.eval_subset": eval_n,
                 "data.max_len": max_len, "train.log_every": 50, "train.eval_every": 10 ** 9,
                 "train.checkpoint_every": 10 ** 9})
    t0 = time.time()
    s = train_and_evaluate(c, workdir)
    best = s["best"]
    f1 = best["f1"] if task != "squad20" else best["best_f1"]
    return {"f1": round(float(f1), 4), "wall_s": round(time.time() - t0, 1), "steps": s["steps"]}


def main(argv=None) -> List[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", choices=sorted(DATA), required=True)
    ap.add_argument("--data_dir", default="")
    ap.add_argument("--model", default="packaged", help="an HF folder (default the packaged MiniLM)")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--epochs", type=float, default=0.0, help="default: 2 (SQuAD), 3 (CoNLL)")
    ap.add_argument("--lr", type=float, default=0.0, help="default: 1e-4 (SQuAD), 5e-5 (CoNLL)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max_len", type=int, default=0)
    ap.add_argument("--train_subset", type=int, default=0)
    ap.add_argument("--eval_subset", type=int, default=0)
    ap.add_argument("--sides", default="ours,torch")
    ap.add_argument("--workdir", default="/tmp/jtb_torch_finetune")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args(argv)
    span = args.task.startswith("squad")
    data_dir = os.path.abspath(args.data_dir or os.path.join(REPO, "..", "shared", "data",
                                                             DATA[args.task]))
    model = args.model
    if model == "packaged":
        from jax_tinybert.train.build import resolve_model_path

        model = str(resolve_model_path("packaged"))
    epochs = args.epochs or (2.0 if span else 3.0)
    lr = args.lr or (1e-4 if span else 5e-5)
    max_len = args.max_len or MAX_LEN[args.task]
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for side in args.sides.split(","):
            common = (args.task, model, data_dir, seed, epochs, lr, args.batch,
                      args.train_subset, args.eval_subset, max_len)
            r = (ours_side(*common, os.path.join(args.workdir, f"{args.task}_s{seed}"))
                 if side == "ours" else torch_side(*common))
            rows.append({"task": args.task, "side": side, "seed": seed, **r})
            print(json.dumps(rows[-1]), flush=True)
    for side in args.sides.split(","):
        got = [r for r in rows if r["side"] == side]
        print(f"{side}: f1 mean {np.mean([r['f1'] for r in got]):.4f}, wall s mean "
              f"{np.mean([r['wall_s'] for r in got]):.0f}", flush=True)
    if args.record:
        import results

        path = results.record("torch_finetune", results.machine_kind(results.gpu_name()), rows,
                              ("task", "side", "seed"))
        print(f"recorded {os.path.relpath(path)}")
    return rows


if __name__ == "__main__":
    main()
