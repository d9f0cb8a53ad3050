#!/usr/bin/env python
"""A/B of two versions of `jax_tinybert/model/modeling.py` (and its `dropout.py`) in one process,
steps alternating.

A change to the model's code (dropout, attention layout) moves a train step by 5-10%, less than
the drift between two benchmark runs on a shared CPU. This script builds the same train step
twice, once with the working tree's `modeling.py` and once with the file at git revision
`--baseline`, and times them in alternating order (ABBA...) so that a change of machine load
hits both alike; it prints the median of each and the median of the paired ratios.

    .venv/bin/python benchmarks/ab_modeling.py --baseline HEAD~1 \
        --stages cached_intermediate,intermediate,pred,finetune --lengths 64,128 --rounds 8

Stages are those of benchmarks/step_throughput.py (MiniLM-L6 teacher, 4L-312 student, batch 32,
student dropout on, teacher live) plus `cached_intermediate`: the intermediate step reading the
teacher's attention and hidden states from the batch (what a run with the per-token teacher cache
trains), and `cached_pred`: the prediction step reading the teacher's logits from the batch (what
the prediction stage trains with its teacher cache), and `teacher_forward`: the teacher's forward
alone in eval mode, every hidden state and attention logit out (a teacher cache build's program;
run it with `--batch-size 64`, the cache build's batch). Only `modeling.py` and `dropout.py` differ between the two sides; every other module
is the working tree's, so the baseline files must import against it.

`--baseline full-last-layer` compares the working tree with itself, the A side built with every
objective's `reads_tokens` set to True: the models then compute every row of their last layer,
as before `cls_only` (what the prediction, KD, PKD and fine-tuning steps skip now).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

# The glibc malloc settings of the CLI and the Makefile, as step_throughput.py.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jax_tinybert.speed.malloc import restart_unless_set  # noqa: E402  (no JAX yet)

if __name__ == "__main__":
    restart_unless_set()

# --smoke checks the wiring: cheaper XLA optimisation (as step_throughput.py --smoke), set
# before JAX starts its backend.
if __name__ == "__main__" and "--smoke" in sys.argv[1:] and \
        "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
                               " --xla_llvm_disable_expensive_passes=true").strip()

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]

import jax  # noqa: E402
import numpy as np  # noqa: E402

import step_throughput as st  # noqa: E402
from jax_tinybert.train import build  # noqa: E402
from jax_tinybert.model import modeling  # noqa: E402
from jax_tinybert.distill import objectives  # noqa: E402
from jax_tinybert.cli import plan  # noqa: E402
from jax_tinybert.parallel import sharding as shd  # noqa: E402
from jax_tinybert.speed.cpu import cpu_name  # noqa: E402


def _load_source(name: str, src: str):
    fd, path = tempfile.mkstemp(suffix=f"_{name}.py")
    with os.fdopen(fd, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    os.unlink(path)
    return mod


def load_baseline(rev: str):
    """The module `jax_tinybert/model/modeling.py` as of git revision `rev`, using that revision's
    `jax_tinybert/speed/dropout.py` (the dropout masks' code is part of the model's step)."""
    def show(path):
        return subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{path}"],
                              check=True, capture_output=True, text=True).stdout

    _load_source("dropout_baseline", show("jax_tinybert/speed/dropout.py"))
    src, line = show("jax_tinybert/model/modeling.py"), "from jax_tinybert.speed.dropout import"
    if line not in src:  # else the baseline would silently use the tree's dropout.py
        raise SystemExit(f"--baseline {rev}: its modeling.py has no '{line}' line to redirect")
    return _load_source("modeling_baseline", src.replace(line, "from dropout_baseline import"))


FULL_LAST_LAYER = "full-last-layer"


@contextlib.contextmanager
def every_objective_reads_tokens():
    """Steps built inside run the models without `cls_only` (the full last layer)."""
    saved = {c: c.__dict__.get("reads_tokens") for c in objectives.REGISTRY.values()}
    try:
        for c in saved:
            c.reads_tokens = True
        yield
    finally:
        for c, v in saved.items():
            if v is None:
                del c.reads_tokens
            else:
                c.reads_tokens = v


# Short names -> step_throughput's stage names (which are accepted as they are, too).
STAGE_NAMES = {"intermediate": "tinybert_intermediate", "pred": "tinybert_pred"}


TEACHER_FORWARD = "teacher_forward"


def _teacher_forward(bert_model, params, cfg, batch_size, T, dtype):
    """make_step's list for the teacher's forward in eval mode (no dropout), every hidden state
    and attention logit returned (what a per-token teacher cache build computes), in `dtype` as
    the CLI's teacher computes it (build.compute_dtypes). Its "state" is the last call's
    outputs, so that waiting on it waits for all of them."""
    model = bert_model(cfg, **build.compute_dtypes(dtype))
    hb = st.make_batch(cfg, batch_size, T)
    batch = {k: jax.device_put(hb[k]) for k in ("input_ids", "attention_mask", "token_type_ids")}

    def forward(_, p, b):
        return model.apply({"params": p}, **b, deterministic=True, attention_logits=True), None

    state = jax.tree_util.tree_map(lambda a: jax.numpy.zeros(a.shape, a.dtype),
                                   jax.eval_shape(lambda p, b: forward(None, p, b)[0],
                                                  params, batch))
    t0 = time.perf_counter()
    compiled = jax.jit(forward).lower(state, params, batch).compile()
    compile_s = time.perf_counter() - t0
    for _ in range(2):
        state, _ = compiled(state, params, batch)
        jax.block_until_ready(state)
    return [compiled, state, params, batch, [], compile_s]


def make_step(stage, T, models, tcfg, tparams, scfg, sparams, batch_size, dtype="float32"):
    """-> [compiled step, state, teacher params, sharded batch, timings, compile s] built with
    `models`."""
    build.BertForSequenceClassification, build.BertModel = models
    if stage == TEACHER_FORWARD:
        return _teacher_forward(models[1], tparams["bert"], tcfg, batch_size, T, dtype)
    hb = st.make_batch(scfg, batch_size, T)
    if stage in ("cached_intermediate", "cached_pred"):
        name = "tinybert_" + stage[len("cached_"):]
        obj_cfg = st.objective_cfg(name, scfg, tcfg)
        config = plan.plan_config(objective=name, objective_cfg=obj_cfg, optim_cfg=st.OPT_CFG)
        config.student.dtype = dtype
        obj = build.build_objective(config, scfg, tcfg)
        mesh = shd.make_mesh({"data": 1}, devices=jax.devices()[:1])
        r = np.random.RandomState(0)
        if stage == "cached_pred":
            hb["teacher_logits"] = r.standard_normal(
                (batch_size, scfg.num_labels)).astype(np.float32)
        else:
            hb["teacher_attn"] = r.standard_normal(
                (batch_size, len(obj.teacher_attention_layers), tcfg.num_attention_heads, T, T)
            ).astype(np.float32)
            hb["teacher_hidden"] = 0.5 * r.standard_normal(
                (batch_size, len(obj.teacher_hidden_layers), T, tcfg.hidden_size)
            ).astype(np.float32)
            hb.pop("labels")
        built = build.build_step(config, student=build.student_module(config, scfg), teacher=None,
                                 objective=obj, student_params=sparams, teacher_params=None,
                                 mesh=mesh, total_steps=100)
        state, batch, tp, step = built.init_state(sparams, 0), shd.shard_batch(hb, mesh), None, \
            built.train_step
    else:
        case = st.Case(STAGE_NAMES.get(stage, stage), tcfg, tparams, scfg, sparams,
                       student_dropout=True, dtype=dtype)
        state, batch, tp, step = case.fresh_state(), case.shard(hb), case.teacher_params, case.step
    t0 = time.perf_counter()
    compiled = step.lower(state, tp, batch).compile()
    compile_s = time.perf_counter() - t0
    for _ in range(2):
        state, _ = compiled(state, tp, batch)
        jax.block_until_ready(state)
    return [compiled, state, tp, batch, [], compile_s]


def alternate(sides, stages, lengths, rounds, models_and_params, batch_size, dtype="float32",
              full_last_layer=False):
    """Times each (stage, T)'s step built with `sides["baseline"]` and `sides["tree"]` (each
    (BertForSequenceClassification, BertModel)) in alternating order, `rounds` steps each;
    prints a line per (stage, T) -> its rows. full_last_layer: the baseline built without
    `cls_only`."""
    tcfg, tparams, scfg, sparams = models_and_params
    rows = []
    for stage in stages:
        for T in lengths:
            runs = {}
            for k, m in sides.items():
                full = k == "baseline" and full_last_layer
                with every_objective_reads_tokens() if full else contextlib.nullcontext():
                    runs[k] = make_step(stage, T, m, tcfg, tparams, scfg, sparams,
                                        batch_size, dtype)
            for i in range(rounds):
                for k in (("baseline", "tree") if i % 2 == 0 else ("tree", "baseline")):
                    compiled, state, tp, batch, ts, _ = runs[k]
                    t0 = time.perf_counter()
                    state, _ = compiled(state, tp, batch)
                    jax.block_until_ready(state)
                    ts.append(time.perf_counter() - t0)
                    runs[k][1] = state
            a, b = (statistics.median(runs[k][4]) for k in ("baseline", "tree"))
            pairs = [x / y for x, y in zip(runs["baseline"][4], runs["tree"][4])]
            print(f"{stage:20s} T={T:3d}: baseline {a:.3f} s  tree {b:.3f} s  speed-up {a / b:.3f}x"
                  f"  paired median {statistics.median(pairs):.3f} "
                  f"[{min(pairs):.2f}, {max(pairs):.2f}]", flush=True)
            print(f"{'':20s}        compile: baseline {runs['baseline'][5]:.1f} s  tree "
                  f"{runs['tree'][5]:.1f} s", flush=True)
            rows.append({"stage": stage, "T": T, "baseline_s": a, "tree_s": b,
                         "baseline_compile_s": runs["baseline"][5],
                         "tree_compile_s": runs["tree"][5],
                         "speedup": a / b, "paired_median": statistics.median(pairs),
                         "baseline_times": runs["baseline"][4], "tree_times": runs["tree"][4]})
            del runs
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", default="HEAD~1",
                   help=f"git revision of the A side's modeling.py and dropout.py, or "
                        f"'{FULL_LAST_LAYER}' (the tree without cls_only)")
    p.add_argument("--stages", default="cached_intermediate,intermediate,pred,finetune")
    p.add_argument("--lengths", default="64,128")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--smoke", action="store_true",
                   help="tiny random models (seconds): a check of the wiring, not a measurement")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="both models' compute dtype (bfloat16 on a CPU: bf16 products, float32 "
                   "activations)")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    tree = (modeling.BertForSequenceClassification, modeling.BertModel)
    if args.baseline == FULL_LAST_LAYER:
        sides = {"baseline": tree, "tree": tree}
    else:
        base = load_baseline(args.baseline)
        sides = {"baseline": (base.BertForSequenceClassification, base.BertModel), "tree": tree}
    tcfg, tparams = st.load_teacher("minilm", smoke=args.smoke)
    scfg = st.student_config("tinybert4", tcfg, smoke=args.smoke)
    sparams = st._random_params(scfg, 2)
    print(f"baseline = {args.baseline}, tree = working tree, {args.dtype}; {cpu_name()}",
          flush=True)
    rows = alternate(sides, args.stages.split(","), [int(x) for x in args.lengths.split(",")],
                     args.rounds, (tcfg, tparams, scfg, sparams), args.batch_size, args.dtype,
                     full_last_layer=args.baseline == FULL_LAST_LAYER)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"baseline": args.baseline, "cpu": cpu_name(), "rounds": args.rounds,
                       "dtype": args.dtype,
                       "batch_size": args.batch_size, "smoke": args.smoke, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
