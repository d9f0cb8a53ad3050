#!/usr/bin/env python
"""What one length bucket costs in compilation, in steps: the number behind
`config.data.bucket_compile_steps` (batching.choose_buckets weighs a bucket's compilations
against the padding it saves).

For each stage's train step (built by `plan.build_step`, i.e. `build.build_step`, the program
training runs), the eval step and the teacher-cache forward (batch 64), at each length T: the
seconds to lower + compile (a split step's gradient program: its update program compiles once
per run, reported apart), and the seconds of one train step at the longest T (median of
`--steps`, after one warm-up). The ratio (all three compilations of one bucket) / (one step at
max length) is what a bucket costs in steps at max length.

    .venv/bin/python benchmarks/compile_cost.py --lengths 32,64 --json out.json
    .venv/bin/python benchmarks/compile_cost.py --lengths 64,128     # sentence pairs (MRPC)

Run it with the persistent compilation cache off (the script turns it off itself).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

if __name__ == "__main__":
    # As a script only: a test that imports this module would otherwise leave the variable in
    # its process's environment, and every CLI run the suite starts after it would run without
    # the compile cache (tests/test_cli.py's cache test failed in such an order).
    os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_tinybert.speed.cpu import cpu_name  # noqa: E402
from jax_tinybert.train import build  # noqa: E402
from jax_tinybert.cli import plan  # noqa: E402
from jax_tinybert.teacher import cache as teacher_cache  # noqa: E402
from jax_tinybert.parallel import sharding as shd  # noqa: E402
from jax_tinybert.train import step as step_lib  # noqa: E402
from jax_tinybert.model.modeling import BertConfig, init_params  # noqa: E402

STAGES = {"finetune": "finetune", "intermediate": "tinybert_intermediate",
          "pred": "tinybert_pred"}


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def _concrete(abstract, seed=0):
    """Arrays of `abstract`'s shapes/shardings: small random floats, ids in [0, 100)."""
    leaves, tree = jax.tree_util.tree_flatten(abstract)
    rng = np.random.default_rng(seed)
    out = []
    for a in leaves:
        if jnp.issubdtype(a.dtype, jnp.integer):
            v = rng.integers(0, 2 if a.shape and a.shape[-1] == 0 else 100, a.shape)
        else:
            v = rng.standard_normal(a.shape) * 0.02
        x = np.asarray(v, a.dtype)
        out.append(jax.device_put(x, a.sharding) if getattr(a, "sharding", None) else x)
    return jax.tree_util.tree_unflatten(tree, out)


def measure(stage: str, tcfg, scfg, lengths, batch: int, steps: int,
            split_update: str = "always", dtype: str = "float32") -> dict:
    """Compile times per length and the step time at the longest; tcfg/scfg: BertConfigs;
    dtype: both models' compute dtype (config student.dtype / teacher.dtype)."""
    dtypes = dict(student_dtype=dtype, teacher_dtype=dtype)
    objective = STAGES[stage]
    mesh = shd.make_mesh({"data": -1, "fsdp": 1, "model": 1}, None)
    if stage == "finetune":   # the teacher fine-tuned alone: it is the "student" of the step
        scfg, tcfg = tcfg, None
    train_step, state_abs, teacher_abs, obj, cached = plan.build_step(
        tcfg or scfg, scfg, objective=objective, mesh=mesh, split_update=split_update, **dtypes)
    bsh = shd.batch_sharding(mesh)
    evaluate = jax.jit(step_lib.make_eval_step(build.student_module(plan.plan_config(**dtypes),
                                                                    scfg)))
    forward = None
    if cached:   # the teacher-cache build's forward (stages whose teacher outputs are cached)
        t = build.teacher_module(plan.plan_config(**dtypes), tcfg,
                                 classifier=objective == "tinybert_pred")
        tparams = jax.eval_shape(lambda: init_params(t, jax.random.PRNGKey(0)))
        forward = teacher_cache.make_forward(t, feature_fn=obj.teacher_features)
    rows = []
    # A split step's update program is compiled once per run, not per bucket.
    split = isinstance(train_step, step_lib.SplitTrainStep)
    c_update = 0.0
    if split:
        update, c_update = _timed(
            lambda: train_step.update.lower(state_abs, state_abs.params).compile())
        print(f"{stage:12s} compile update (once per run) {c_update:5.1f} s", flush=True)
    for T in lengths:
        spec = plan.batch_spec(batch, T, labels=objective != "tinybert_intermediate",
                               cached=cached)
        babs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=bsh) for k, v in spec.items()}
        if split:
            grads, c_train = _timed(
                lambda: train_step.grads.lower(state_abs, teacher_abs, babs).compile())
            compiled = step_lib.SplitCompiled(grads, update)
        else:
            compiled, c_train = _timed(
                lambda: train_step.lower(state_abs, teacher_abs, babs).compile())
        ids = jax.ShapeDtypeStruct((batch, T), jnp.int32)
        eval_in = {k: ids for k in step_lib.MODEL_KEYS}
        eval_in["example_id"] = jax.ShapeDtypeStruct((batch,), jnp.int32)
        _, c_eval = _timed(lambda: evaluate.lower(state_abs.params["student"], eval_in).compile())
        c_fwd = 0.0
        if forward is not None:
            ids64 = jax.ShapeDtypeStruct((64, T), jnp.int32)
            _, c_fwd = _timed(lambda: forward.lower(tparams, ids64, ids64, ids64).compile())
        row = {"T": T, "compile_train_s": c_train, "compile_eval_s": c_eval,
               "compile_teacher_forward_s": c_fwd}
        if T == max(lengths):
            state = _concrete(state_abs)
            tparams_c = _concrete(teacher_abs) if teacher_abs is not None else None
            b = _concrete(babs, seed=1)
            b["attention_mask"] = jax.device_put(np.ones((batch, T), np.int32), bsh)
            times = []
            for _ in range(steps + 1):
                t0 = time.perf_counter()
                state, metrics = compiled(state, tparams_c, b)
                jax.block_until_ready(metrics)
                times.append(time.perf_counter() - t0)
            row["step_s"] = statistics.median(times[1:])
        rows.append(row)
        print(f"{stage:12s} T={T:4d}  compile train {c_train:5.1f} s  eval {c_eval:4.1f} s  "
              f"teacher forward {c_fwd:4.1f} s" + (f"  step {row['step_s']:.3f} s"
                                                  if "step_s" in row else ""), flush=True)
    step_s = rows[-1]["step_s"]
    per_bucket = statistics.mean(r["compile_train_s"] + r["compile_eval_s"]
                                 + r["compile_teacher_forward_s"] for r in rows)
    return {"stage": stage, "dtype": dtype, "rows": rows, "compile_update_s": c_update,
            "compile_per_bucket_s": per_bucket,
            "step_at_max_len_s": step_s, "bucket_in_steps": per_bucket / step_s}


RECORD_KEY = ("stage", "dtype", "max_length")


def record_rows(out: dict) -> list:
    """The rows benchmarks/results keeps of a run (key RECORD_KEY): per stage, what one length
    bucket's programs take to compile, the step at the longest length, and their ratio."""
    rows = []
    for r in out["stages"]:
        rows.append({"stage": r["stage"], "dtype": r.get("dtype", "float32"),
                     "max_length": r["rows"][-1]["T"], "batch": out["batch"],
                     "compile_update_s": round(r["compile_update_s"], 2),
                     "compile_per_bucket_s": round(r["compile_per_bucket_s"], 2),
                     "step_s": round(r["step_at_max_len_s"], 3),
                     "bucket_in_steps": round(r["bucket_in_steps"], 1)})
    return rows


def record(out: dict, command: str = None) -> str:
    """Merge a run's rows into benchmarks/results/compile_cost-<machine>.json; the path."""
    import results

    meta = {"date": out["date"], "cpu": out["cpu"], "jax": out["jax"]}
    if command:
        meta["command"] = command
    kind = results.machine_kind(jax.devices()[0].device_kind)
    return results.record("compile_cost", kind, record_rows(out), RECORD_KEY, meta)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", default="finetune,intermediate,pred")
    p.add_argument("--teacher", default="minilm-l6")
    p.add_argument("--student", default="tinybert4")
    p.add_argument("--lengths", default="32,64", help="comma list; the last is max length")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", default="")
    p.add_argument("--record", action="store_true", help="merge the rows into benchmarks/results/")
    p.add_argument("--fused", action="store_true",
                   help="the one-program train step (train.split_update=never; default: always)")
    p.add_argument("--smoke", action="store_true", help="tiny random models (tests the wiring)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="both models' compute dtype (on a CPU, bfloat16 products)")
    a = p.parse_args(argv)
    if a.record and a.smoke:
        p.error("--record: a --smoke run times tiny models; record a real run")
    lengths = [int(x) for x in a.lengths.split(",")]
    if a.smoke:
        tiny = lambda n, d: BertConfig(vocab_size=128, hidden_size=d, num_hidden_layers=n,  # noqa
                                       num_attention_heads=2, intermediate_size=2 * d,
                                       max_position_embeddings=max(lengths), num_labels=2)
        tcfg, scfg = tiny(2, 32), tiny(1, 16)
    else:
        tcfg = plan.bert_config(a.teacher, max_len=max(lengths))
        scfg = plan.bert_config(a.student, max_len=max(lengths))
    out = {"cpu": cpu_name(), "jax": jax.__version__, "backend": jax.default_backend(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "batch": a.batch,
           "stages": []}
    for s in a.stages.split(","):
        r = measure(s, tcfg, scfg, lengths, a.batch, a.steps,
                    split_update="never" if a.fused else "always", dtype=a.dtype)
        out["stages"].append(r)
        print(f"{s}: one bucket = {r['compile_per_bucket_s']:.1f} s of compilation = "
              f"{r['bucket_in_steps']:.1f} steps at T={max(lengths)} "
              f"({r['step_at_max_len_s']:.3f} s each)", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    if a.record:
        print(f"recorded {os.path.relpath(record(out))}")


if __name__ == "__main__":
    main()
