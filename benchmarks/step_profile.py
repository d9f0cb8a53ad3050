#!/usr/bin/env python
"""Where a training step's time goes: the step the CLI runs, profiled by XLA's thunks.

Builds a stage exactly as `python -m jax_tinybert.main` does (`build.build_run` from the same
config file and `--config.*` flags, teacher cache and stores included), compiles every length
bucket the first steps meet, then:
  1. times `--steps` steps one by one, per length bucket: the host's part (batching, the teacher
     cache's lookup, the transfer), and the step until its outputs are ready; with the step split
     in two programs (step.SplitTrainStep) the gradient program and the optimizer's update
     program each, waiting for one before starting the other; and the process's CPU time over
     the wall time (2.0 = both cores busy on a 2-core machine);
  2. runs `--profile_steps` more under `jax.profiler` (0: skipped) and sums the duration of every
     XLA CPU thunk (per-op events on XLA's threads) by op name and by kind (dots, the
     attention's batched dots, fusions, ...), as a share of the traced thunk time.

Caveat on 2.: a YNNPACK dot fusion is traced on the thread that starts it only; the help the
other thread gives it (YNNPACK's own tasks on XLA's pool) is not an event. So the kinds are
shares of traced time, and a timeline of the trace shows one thread idle while it works on a
dot. Per-program times (1.) do not depend on the trace.

    .venv/bin/python benchmarks/step_profile.py --config=configs/task_distill.py:sst2_pred \
        --workdir=/tmp/prof --config.teacher.path=<fine-tuned teacher> \
        --config.data.glue_dir=../shared/data/glue --config.student.init=random

The workdir is a scratch folder (nothing is saved there but what the build itself writes).
The printed table and `--json` name the CPU; compare numbers only within one run.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jax_tinybert.speed.malloc import restart_unless_set  # noqa: E402  (no JAX yet)

if __name__ == "__main__":
    restart_unless_set()

import collections  # noqa: E402
import glob  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from jax_tinybert.speed.cpu import cpu_name  # noqa: E402
from jax_tinybert.train import build, loop as train  # noqa: E402
from jax_tinybert.train import step as step_lib  # noqa: E402
from jax_tinybert.config.check import validate_config  # noqa: E402

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "a CLI config, e.g. "
                                "configs/task_distill.py:sst2_pred", lock_config=True)
flags.DEFINE_string("workdir", None, "scratch folder for the build")
flags.DEFINE_integer("steps", 200, "steps timed one by one, after the warm-up")
flags.DEFINE_integer("profile_steps", 100, "steps run under the profiler (0: none)")
flags.DEFINE_integer("top", 25, "op names listed")
flags.DEFINE_string("json", None, "write the results here")
flags.mark_flags_as_required(["config", "workdir"])

# Op kinds by the thunk's name (XLA CPU names a thunk after its HLO instruction).
KINDS = (("dot fusion (YNNPACK/oneDNN)", re.compile(r"^(ynn|onednn|.*dot_fusion|.*dot\.fusion)")),
         ("dot (Eigen: batched dots)", re.compile(r"^dot(_general)?(\.\d+)?$")),
         ("scatter / gather", re.compile(r"scatter|gather|dynamic")),
         ("random bits (threefry)", re.compile(r"threefry|bitcast_concatenate|shift")),
         ("reduce", re.compile(r"reduce")),
         ("copy / transpose", re.compile(r"copy|transpose")),
         ("other fusion", re.compile(r"fusion")))


def kind_of(name: str, kinds=KINDS) -> str:
    """The label of the first (label, regex) of `kinds` whose regex finds `name`; "other"."""
    for label, rx in kinds:
        if rx.search(name):
            return label
    return "other"


def trace_events(trace_dir: str) -> list:
    """The events of the last perfetto trace `jax.profiler.trace(trace_dir,
    create_perfetto_trace=True)` wrote."""
    path = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"),
                            recursive=True))[-1]
    with gzip.open(path, "rt") as f:
        events = json.load(f)
    return events["traceEvents"] if isinstance(events, dict) else events


def thunk_times(trace_dir: str) -> dict:
    """perfetto trace -> {op name: (total seconds, count)} over XLA's thunk events."""
    events = trace_events(trace_dir)
    threads = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    out = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        thread = threads.get((e["pid"], e["tid"]), "")
        # Thunks run on XLA's threads ("tf_XLA..."); the Python thread's events are dispatches,
        # and the executor's own events contain the thunks'.
        name = e["name"]
        if not thread.startswith("tf_XLA") or name.startswith(
                ("ThunkExecutor", "SlinkyThreadPool", "ThreadpoolListener", "end: ")):
            continue
        out[name][0] += e["dur"] * 1e-6
        out[name][1] += 1
    return dict(out)


def main(argv):
    del argv
    print(f"# {cpu_name()}", flush=True)
    config = build.with_defaults(FLAGS.config)
    validate_config(config)
    run = build.build_run(config, FLAGS.workdir)
    state = run.step.init_state(run.models.student_params, config.train.seed)
    run.ensure_cache()
    step_fn = run.step.train_step
    batches = run.data.train_batches

    split = isinstance(step_fn, step_lib.SplitTrainStep)

    def one(parts: bool = False):
        """One train step -> (length, host s, {program: s})."""
        nonlocal state
        t0 = time.perf_counter()
        batch = next(batches)
        length = batch["input_ids"].shape[1]
        fed = train._feed(run, batch)
        t1 = time.perf_counter()
        if parts and split:
            grads, _ = step_fn.grads(state, run.teacher_params, fed)
            jax.block_until_ready(grads)
            t2 = time.perf_counter()
            state, _ = step_fn.update(state, grads)
            jax.block_until_ready(state)
            t3 = time.perf_counter()
            return length, t1 - t0, {"step": t3 - t1, "gradient": t2 - t1, "update": t3 - t2}
        state, metrics = step_fn(state, run.teacher_params, fed)
        jax.block_until_ready((state, metrics))
        return length, t1 - t0, {"step": time.perf_counter() - t1}

    # Warm-up: compile every bucket the data meets (a bucket no example reaches never comes).
    buckets = set(batches.buckets)
    seen, t0 = set(), time.perf_counter()
    for _ in range(min(batches.steps_per_epoch, 300)):
        seen.add(one()[0])
        if seen == buckets:
            break
    print(f"# warm-up: {time.perf_counter() - t0:.1f} s, buckets {sorted(seen)} "
          f"of {sorted(buckets)}", flush=True)
    per = collections.defaultdict(lambda: collections.defaultdict(list))
    host = []
    cpu0, t0 = _cpu_seconds(), time.perf_counter()
    for _ in range(FLAGS.steps):
        length, th, times = one(parts=True)
        for k, v in times.items():
            per[length][k].append(v)
        host.append(th)
    wall = time.perf_counter() - t0
    cpu_per_wall = (_cpu_seconds() - cpu0) / wall
    print(f"# {FLAGS.steps} steps in {wall:.2f} s: {1e3 * wall / FLAGS.steps:.1f} ms a step, "
          f"host part {1e3 * np.mean(host):.2f} ms; CPU / wall {cpu_per_wall:.2f}")
    cols = ["step", "gradient", "update"] if split else ["step"]
    print("| T | steps | " + " | ".join(f"{c} (median ms)" for c in cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for length in sorted(per):
        v = per[length]
        print(f"| {length} | {len(v['step'])} | "
              + " | ".join(f"{1e3 * np.median(v[c]):.1f}" for c in cols) + " |")
    summary = {c: 1e3 * float(np.mean([x for v in per.values() for x in v[c]])) for c in cols}
    print("| all (mean) | " + str(FLAGS.steps) + " | "
          + " | ".join(f"{summary[c]:.1f}" for c in cols) + " |", flush=True)
    res = {"cpu": cpu_name(), "steps": FLAGS.steps, "wall_s": wall, "cpu_per_wall": cpu_per_wall,
           "host_ms": 1e3 * float(np.mean(host)), "mean_ms": summary,
           "median_ms": {int(k): {c: 1e3 * float(np.median(v[c])) for c in cols}
                         for k, v in per.items()},
           "steps_per_bucket": {int(k): len(v["step"]) for k, v in per.items()}}
    if FLAGS.profile_steps > 0:
        res.update(_profile(one))
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump(res, f, indent=1)


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _profile(one) -> dict:
    """--profile_steps steps under jax.profiler -> {"thunk_s", "kinds", "ops"} (printed)."""
    trace_dir = tempfile.mkdtemp(prefix="jtb-profile-")
    t0 = time.perf_counter()
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(FLAGS.profile_steps):
            one()
    prof_wall = time.perf_counter() - t0
    ops = thunk_times(trace_dir)
    shutil.rmtree(trace_dir, ignore_errors=True)
    n = FLAGS.profile_steps
    total = sum(v[0] for v in ops.values()) or 1.0
    kinds = collections.defaultdict(float)
    for name, (sec, _) in ops.items():
        kinds[kind_of(name)] += sec
    print(f"\n# profiled {n} steps: {prof_wall:.2f} s wall, {total:.2f} s of traced thunks "
          "summed over XLA's threads")
    print("| kind | share of traced thunk time | ms a step |\n|---|---|---|")
    for k, sec in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"| {k} | {100 * sec / total:.1f}% | {1e3 * sec / n:.2f} |")
    print(f"\n| op (top {FLAGS.top}) | kind | share | calls a step | ms a step |\n"
          "|---|---|---|---|---|")
    top = sorted(ops.items(), key=lambda kv: -kv[1][0])[:FLAGS.top]
    for name, (sec, calls) in top:
        print(f"| `{name}` | {kind_of(name)} | {100 * sec / total:.1f}% | "
              f"{calls / n:.1f} | {1e3 * sec / n:.2f} |")
    return {"profile_steps": n, "thunk_s": total, "kinds": dict(kinds),
            "ops": {k: v for k, v in top}}


if __name__ == "__main__":
    app.run(main)
