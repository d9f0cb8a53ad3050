"""Memory / FLOPs planner: compile the real train step for a teacher/student/batch/length on a
simulated mesh, from abstract shapes only, and report per-device memory and FLOPs per step.

    python -m jax_tinybert.cli.plan --teacher bert-base --student tinybert4 --batch 256 --seq_len 128 \
        --devices 8 32 --mesh dp fsdp --peak_tflops 197 --step_time 0.5

No parameter is ever allocated: params, optimizer state and the batch are
`jax.ShapeDtypeStruct`s (with their shardings), the step is built by the same
`jax_tinybert.train.build.build_step` that training uses, from the run config the plan stands for
(`plan_config`: config_base's defaults plus the options below), then `.lower(...).compile()`.
Stages whose teacher outputs training caches (tinybert_pred, kd, pkd) are planned as trained:
no teacher in the step, its cached outputs in the batch. The numbers come
from XLA: `compiled.memory_analysis()` (per device: arguments = the state shard + teacher shard +
batch shard, outputs, temporaries, generated code) and `compiled.cost_analysis()` (FLOPs of the
per-device program). `--devices N` simulates N CPU devices (XLA_FLAGS, set before JAX starts),
so BERT-base -> TinyBERT4 on 32 devices plans on a laptop.

Caveat: the program is compiled for the CPU backend. Argument/output bytes (what the state and
batch occupy) are exact for any backend; temporaries depend on the backend's fusion and
scheduling (TPU/GPU usually need less than CPU, which keeps more intermediates live), so
treat "temp" as an upper-bound estimate. `--platform default` compiles for the real local
backend instead (e.g. on a GPU host, for its own device count).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jax_tinybert.train import build
from jax_tinybert.config import schema as config_base
from jax_tinybert.distill import objectives
from jax_tinybert.train.checkpoints import state_bytes
from jax_tinybert.config.check import DTYPES
from jax_tinybert.errors import tool_exit
from jax_tinybert.parallel import sharding as shd
from jax_tinybert import flops as work
from jax_tinybert.model.modeling import BertConfig, BertForSequenceClassification, init_params

# name -> (layers, hidden, intermediate, heads); all use BERT's uncased vocab (30522).
PRESETS = {
    "bert-base": (12, 768, 3072, 12),
    "bert-large": (24, 1024, 4096, 16),
    "minilm-l6": (6, 384, 1536, 12),     # all-MiniLM-L6-v2 (the packaged teacher)
    "tinybert4": (4, 312, 1200, 12),
    "tinybert6": (6, 768, 3072, 12),
}
MESHES = {"dp": {"data": -1, "fsdp": 1, "model": 1}, "fsdp": {"data": 1, "fsdp": -1, "model": 1}}
GIB = 1024 ** 3


def parse_mesh(s: str) -> Dict[str, int]:
    """'dp' | 'fsdp' | 'data=4,fsdp=2,model=1' (one axis may be -1)."""
    if s in MESHES:
        return dict(MESHES[s])
    out = {"data": 1, "fsdp": 1, "model": 1}
    for part in s.split(","):
        k, _, v = part.partition("=")
        if k not in out or not v.lstrip("-").isdigit():
            raise ValueError(f"--mesh {s!r}: expected dp, fsdp or e.g. data=4,fsdp=2,model=1")
        out[k] = int(v)
    return out


def bert_config(name: str, num_labels: int = 2, max_len: int = 512) -> BertConfig:
    """A preset (see PRESETS) as a BertConfig with BERT's uncased vocab."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; expected one of {sorted(PRESETS)}")
    layers, hidden, inter, heads = PRESETS[name]
    return BertConfig(vocab_size=30522, hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, intermediate_size=inter,
                      max_position_embeddings=max(512, max_len), num_labels=num_labels)


def plan_config(*, objective: str = "tinybert_intermediate", objective_cfg: Optional[dict] = None,
                optim_cfg: Optional[dict] = None, grad_accum: int = 1,
                fsdp_min_size: int = 16384, student_dropout: bool = True,
                teacher_dtype: str = "float32", student_dtype: str = "float32",
                remat: bool = False, split_update: str = "auto",
                teacher_placement: str = "auto") -> ml_collections.ConfigDict:
    """The run config the plan stands for: config_base's defaults plus the planner's options."""
    c = config_base.base_config()
    c.objective.name = objective
    with c.objective.ignore_type():
        c.objective.update(objective_cfg or {})
    c.optim.update(optim_cfg or {})
    c.train.grad_accum = grad_accum
    c.train.split_update = split_update
    c.mesh.fsdp_min_size = fsdp_min_size
    c.mesh.teacher = teacher_placement
    c.student.update(dict(dropout=student_dropout, dtype=student_dtype, remat=remat))
    c.teacher.dtype = teacher_dtype
    return c


def batch_spec(batch: int, seq_len: int, labels: bool, cached: Optional[dict] = None
               ) -> Dict[str, Any]:
    """Shapes/dtypes of one global batch as the train loop feeds it (no example_id).
    cached: {field: per-example shape} of teacher-cache fields the batch carries."""
    d = {k: jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
         for k in ("input_ids", "attention_mask", "token_type_ids")}
    if labels:
        d["labels"] = jax.ShapeDtypeStruct((batch,), jnp.int32)
    d["valid"] = jax.ShapeDtypeStruct((batch,), jnp.float32)
    for k, shape in (cached or {}).items():
        d[k] = jax.ShapeDtypeStruct((batch,) + tuple(shape), jnp.float32)
    return d


def build_step(teacher_cfg, student_cfg, *, mesh=None, **options):
    """The jitted train step and abstract (state, teacher params) with their shardings, built by
    `build.build_step` from `plan_config(**options)` with abstract params.
    Returns (train_step, abstract_state, abstract_teacher or None, objective, cached) where
    cached = {field: per-example shape} of the teacher-cache fields the batch must carry
    (stages whose teacher outputs are cached run no teacher in the step, as in training)."""
    config = plan_config(**options)
    obj = build.build_objective(config, student_cfg, teacher_cfg)
    key = jax.random.PRNGKey(0)
    student = build.student_module(config, student_cfg)
    sparams = jax.eval_shape(lambda: init_params(BertForSequenceClassification(student_cfg), key))
    teacher = tparams = None
    cached = {}
    # A teacher that must give logits is a fine-tuned classifier; else the bare encoder.
    classifier = obj.name in ("tinybert_pred", "kd", "pkd")
    if build.teacher_in_step(config, obj):
        teacher = build.teacher_module(config, teacher_cfg, classifier=classifier)
        tparams = jax.eval_shape(lambda: init_params(teacher, key))
    elif obj.needs_teacher:
        # What the teacher cache stores per example (obj.teacher_features of a forward).
        t = build.teacher_module(config, teacher_cfg, classifier=classifier)
        ids = jnp.ones((1, 8), jnp.int32)
        out = jax.eval_shape(lambda: obj.teacher_features(t.apply(
            {"params": init_params(t, key)}, ids, ids, 0 * ids, deterministic=True,
            attention_logits=False)))
        cached = {k: v.shape[1:] for k, v in out.items()}
    step = build.build_step(config, student=student, teacher=teacher, objective=obj,
                            student_params=sparams, teacher_params=tparams, mesh=mesh,
                            total_steps=10000)
    return step.train_step, step.abstract_state, step.abstract_teacher, obj, cached


def per_device_bytes(tree) -> int:
    """Bytes of the largest per-device shard of a pytree of ShapeDtypeStructs with shardings."""
    total = 0
    for x in jax.tree_util.tree_leaves(tree):
        shape = x.sharding.shard_shape(x.shape)
        total += int(np.prod(shape)) * np.dtype(x.dtype).itemsize
    return total


def plan_one(teacher: str, student: str, *, batch: int, seq_len: int, mesh_spec: Dict[str, int],
             devices=None, objective: str = "tinybert_intermediate", grad_accum: int = 1,
             fsdp_min_size: int = 16384, teacher_dtype: str = "float32",
             student_dtype: str = "float32", remat: bool = False,
             peak_tflops: Optional[float] = None, step_time: Optional[float] = None,
             teacher_placement: str = "auto") -> dict:
    """Compile one configuration; the report as a dict. teacher/student: preset names or
    `BertConfig`s. devices: the devices of the mesh (default: all)."""
    tcfg = bert_config(teacher, max_len=seq_len) if isinstance(teacher, str) else teacher
    scfg = bert_config(student, max_len=seq_len) if isinstance(student, str) else student
    mesh = shd.make_mesh(mesh_spec, devices)
    shd.check_batch_size(batch, mesh, grad_accum)
    step, state_abs, teacher_abs, obj, cached = build_step(
        tcfg, scfg, objective=objective, mesh=mesh, grad_accum=grad_accum,
        fsdp_min_size=fsdp_min_size, teacher_dtype=teacher_dtype, student_dtype=student_dtype,
        remat=remat, teacher_placement=teacher_placement)
    bsh = shd.batch_sharding(mesh)
    spec = batch_spec(batch, seq_len, labels=not obj.intermediate, cached=cached)
    batch_abs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=bsh) for k, v in spec.items()}
    compiled = step.lower(state_abs, teacher_abs, batch_abs).compile()
    mem = compiled.memory_analysis()
    flops = work.program_flops(compiled)
    n = mesh.size
    out = {
        "teacher": teacher if isinstance(teacher, str) else "custom",
        "student": student if isinstance(student, str) else "custom", "objective": objective, "batch": batch,
        "seq_len": seq_len, "devices": n, "mesh": dict(mesh.shape), "grad_accum": grad_accum,
        "student_params": state_bytes(state_abs.params["student"]) // 4,
        "teacher_params": state_bytes(teacher_abs) // 4 if teacher_abs is not None else 0,
        "state_bytes_per_device": per_device_bytes(state_abs),
        "teacher_bytes_per_device": per_device_bytes(teacher_abs) if teacher_abs is not None else 0,
        "batch_bytes_per_device": per_device_bytes(batch_abs),
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
        "alias_bytes": int(mem.alias_size_in_bytes),
        "temp_bytes": int(mem.temp_size_in_bytes),
        "generated_code_bytes": int(mem.generated_code_size_in_bytes),
        "flops_per_device": flops,
        "flops_per_step": flops * n,
    }
    # What the device holds between steps: the state shard, the teacher shard and the batch
    # shard. XLA's argument size can be a little smaller (inputs the step never reads, e.g. the
    # teacher's pooler, are left out of it) but those arrays still occupy memory.
    out["held_bytes_per_device"] = (out["state_bytes_per_device"]
                                    + out["teacher_bytes_per_device"]
                                    + out["batch_bytes_per_device"])
    # Live at the peak: inputs (outputs that alias donated inputs take no extra room), the
    # outputs that do not alias, temporaries and the executable.
    out["peak_bytes_per_device"] = (max(out["argument_bytes"], out["held_bytes_per_device"])
                                    + out["output_bytes"] - out["alias_bytes"]
                                    + out["temp_bytes"] + out["generated_code_bytes"])
    if peak_tflops and step_time:
        out["required_mfu"] = flops / (step_time * peak_tflops * 1e12)
    if step_time:
        out["examples_per_s"] = batch / step_time
    return out


def _fmt_table(rows: List[dict]) -> str:
    head = ("| devices | mesh | state/dev GiB | teacher/dev GiB | args GiB | temp GiB | "
            "peak GiB | GFLOP/dev | TFLOP/step |" + (" MFU needed |" if any(
                "required_mfu" in r for r in rows) else ""))
    sep = "|" + "---|" * (head.count("|") - 1)
    lines = [head, sep]
    for r in rows:
        mesh = ",".join(f"{k}={v}" for k, v in r["mesh"].items() if v > 1) or "1"
        line = (f"| {r['devices']} | {mesh} | {r['state_bytes_per_device'] / GIB:.3f} | "
                f"{r['teacher_bytes_per_device'] / GIB:.3f} | {r['argument_bytes'] / GIB:.3f} | "
                f"{r['temp_bytes'] / GIB:.2f} | {r['peak_bytes_per_device'] / GIB:.2f} | "
                f"{r['flops_per_device'] / 1e9:.0f} | {r['flops_per_step'] / 1e12:.2f} |")
        if "required_mfu" in r:
            line += f" {100 * r['required_mfu']:.1f}% |"
        lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jax_tinybert.cli.plan", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", default="bert-base", help=f"preset: {', '.join(PRESETS)}")
    p.add_argument("--student", default="tinybert4", help=f"preset: {', '.join(PRESETS)}")
    p.add_argument("--objective", default="tinybert_intermediate",
                   help=f"one of {', '.join(objectives.OBJECTIVES)}")
    p.add_argument("--batch", type=int, default=256, help="global batch")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--devices", type=int, nargs="+", default=[8],
                   help="simulated device counts (one compile each)")
    p.add_argument("--mesh", nargs="+", default=["dp", "fsdp"],
                   help="dp | fsdp | data=D,fsdp=F,model=M (one axis may be -1)")
    p.add_argument("--grad_accum", type=int, default=1)
    p.add_argument("--fsdp_min_size", type=int, default=16384)
    for who in ("teacher", "student"):
        p.add_argument(f"--{who}_dtype", default="float32", choices=DTYPES)
    p.add_argument("--teacher_placement", default="auto", choices=("auto", "replicated", "sharded"))
    p.add_argument("--remat", action="store_true")
    p.add_argument("--peak_tflops", type=float, default=None,
                   help="the chip's peak TFLOP/s (e.g. 197 for a TPU v5e bf16, 989 H100 bf16 dense)")
    p.add_argument("--step_time", type=float, default=None, help="target seconds per step")
    p.add_argument("--platform", default="cpu",
                   help="cpu (simulated devices, default) or 'default' (the real local backend)")
    p.add_argument("--json", default=None, help="also write the rows as JSON to this file")
    args = p.parse_args(argv)
    # The arguments' mistakes before anything compiles: one line each (argparse's status 2).
    for flag in ("teacher", "student"):
        if getattr(args, flag) not in PRESETS:
            p.error(f"--{flag} {getattr(args, flag)!r}: not a preset; use one of "
                    f"{', '.join(PRESETS)}")
    if args.objective not in objectives.REGISTRY:
        p.error(f"--objective {args.objective!r}: use one of {', '.join(objectives.REGISTRY)}")
    for m in args.mesh:
        try:
            spec = parse_mesh(m)
        except ValueError as e:
            p.error(str(e))
        for n in args.devices:
            try:
                shd.mesh_shape(spec, n)
            except ValueError as e:
                p.error(f"--mesh {m} --devices {n}: {e}")

    if args.platform == "cpu":
        # Before JAX starts: enough simulated CPU devices for the largest plan.
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
                 if "xla_force_host_platform_device_count" not in f]
        flags.append(f"--xla_force_host_platform_device_count={max(args.devices)}")
        os.environ["XLA_FLAGS"] = " ".join(flags)
        jax.config.update("jax_platforms", "cpu")
    rows = []
    for n in args.devices:
        devs = jax.devices()
        if n > len(devs):
            p.error(f"--devices {n}: only {len(devs)} devices on this backend")
        for m in args.mesh:
            r = plan_one(args.teacher, args.student, batch=args.batch, seq_len=args.seq_len,
                         mesh_spec=parse_mesh(m), devices=devs[:n], objective=args.objective,
                         grad_accum=args.grad_accum, fsdp_min_size=args.fsdp_min_size,
                         teacher_dtype=args.teacher_dtype, student_dtype=args.student_dtype,
                         remat=args.remat, peak_tflops=args.peak_tflops,
                         step_time=args.step_time, teacher_placement=args.teacher_placement)
            r["mesh_name"] = m
            rows.append(r)
            print(f"compiled {n} devices, mesh {m}: peak {r['peak_bytes_per_device'] / GIB:.2f} "
                  f"GiB/device, {r['flops_per_device'] / 1e9:.0f} GFLOP/device", file=sys.stderr,
                  flush=True)
    r0 = rows[0]
    print(f"{args.teacher} ({r0['teacher_params'] / 1e6:.1f}M) -> {args.student} "
          f"({r0['student_params'] / 1e6:.1f}M), {args.objective}, global batch {args.batch} x "
          f"length {args.seq_len}, grad_accum {args.grad_accum}, backend "
          f"{jax.default_backend()}"
          + (f"; MFU needed for {args.step_time}s/step at {args.peak_tflops} TFLOP/s peak"
             if args.peak_tflops and args.step_time else ""))
    print(_fmt_table(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(tool_exit(main))
