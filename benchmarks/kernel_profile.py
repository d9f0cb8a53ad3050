#!/usr/bin/env python
"""Where one train step's device time goes, kernel by kernel (GPU), and which dots XLA left
out of the GEMM library.

Builds the step `benchmarks/step_throughput.py` times (build.build_step from a run config, a live
teacher, student dropout on, random weights of the named shapes), compiles it, times
`--steps` pipelined steps, then runs `--steps` more under `jax.profiler` and sums the device's
kernel events of the perfetto trace by name and by kind (library GEMM, Triton, XLA fusion,
scatter, copy, ...). From the optimised HLO it counts the dots that became library calls
(cuBLAS / cuBLASLt / cuDNN custom calls) and lists the `dot` instructions left to XLA's own
emitters, with their operand shapes and types: on a GPU those are the slow ones.

    python benchmarks/kernel_profile.py --stage intermediate --length 128 --batch-size 256 \
        --dtype bfloat16 --json bf16.json --hlo bf16.hlo.txt.gz
    .venv/bin/python benchmarks/kernel_profile.py --smoke      # tiny models on CPU (wiring)

On CPU there are no kernels: the table sums XLA's thunk events instead (step_profile.py's
reading, with its caveat on YNNPACK's untraced helper thread).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import collections  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

from benchmarks import step_profile  # noqa: E402
from benchmarks import step_throughput as st  # noqa: E402

STAGES = {"intermediate": "tinybert_intermediate", "pred": "tinybert_pred", "pkd": "pkd",
          "finetune": "finetune"}

# First match wins; the names are cuBLAS's / CUTLASS's / Triton's / XLA's kernel names.
KERNEL_KINDS = (
    ("library GEMM (cuBLAS/CUTLASS)", re.compile(r"gemm|xmma|cutlass|cublas|sm\d+_", re.I)),
    ("Triton", re.compile(r"triton", re.I)),
    ("memcpy / memset", re.compile(r"memcpy|memset", re.I)),
    ("scatter / gather", re.compile(r"scatter|gather|dynamic", re.I)),
    ("random bits", re.compile(r"threefry|rng|random", re.I)),
    ("reduce", re.compile(r"reduce|reduction", re.I)),
    ("copy / transpose", re.compile(r"copy|transpose", re.I)),
    ("XLA fusion", re.compile(r"fusion", re.I)),
)


def kernel_kind(name: str) -> str:
    return step_profile.kind_of(name, KERNEL_KINDS)


def device_kernel_times(trace_dir: str) -> dict:
    """perfetto trace -> {kernel name: [total seconds, count]} over the events of the device
    processes ("/device:GPU:N ..."); {} when the trace has none (CPU)."""
    events = step_profile.trace_events(trace_dir)
    device_pids = {e["pid"] for e in events if e.get("ph") == "M"
                   and e.get("name") == "process_name"
                   and str(e.get("args", {}).get("name", "")).startswith("/device:")}
    out = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("ph") == "X" and "dur" in e and e.get("pid") in device_pids:
            out[e["name"]][0] += e["dur"] * 1e-6
            out[e["name"]][1] += 1
    return dict(out)


_DEF = re.compile(r"^\s*(?:ROOT\s+)?(%?[\w.\-]+)\s*=\s*(\S+)\s", re.M)
_DOT = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(\S+)\s+dot\(([^)]*)\)(.*)$", re.M)
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_LIB_CALL = re.compile(r'custom_call_target="(__cublas[^"]*|__cudnn[^"]*)"')


def hlo_dots(hlo_text: str) -> dict:
    """Optimised HLO text -> {"library_calls": {target: n}, "xla_dots": [line, ...]}: the dots
    that became library custom calls, and the `dot` instructions left to XLA, each as
    "result = dot(operand types)  <JAX op name>"."""
    calls = collections.Counter(_LIB_CALL.findall(hlo_text))
    types = dict(_DEF.findall(hlo_text))
    xla_dots = []
    for result, operands, rest in _DOT.findall(hlo_text):
        ops = ", ".join(types.get(o.strip(), o.strip()) for o in operands.split(","))
        name = _OP_NAME.search(rest)
        xla_dots.append(f"{result} = dot({ops})" + (f"  {name.group(1)}" if name else ""))
    return {"library_calls": dict(calls), "xla_dots": xla_dots}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", default="intermediate", choices=sorted(STAGES))
    p.add_argument("--teacher", default="minilm", choices=("minilm", "bert_base"))
    p.add_argument("--student", default="tinybert4")
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--steps", type=int, default=10, help="steps timed, then as many profiled")
    p.add_argument("--top", type=int, default=25, help="kernel names listed")
    p.add_argument("--json", default=None)
    p.add_argument("--hlo", default=None, help="write the optimised HLO here (.gz: gzipped)")
    p.add_argument("--smoke", action="store_true", help="tiny models, T 16, B 4, 2 steps")
    args = p.parse_args(argv)
    if args.smoke:
        args.length, args.batch_size, args.steps = 16, 4, 2
    stage = STAGES[args.stage]
    tcfg, tparams, _ = st.load_teacher_labelled(args.teacher, args.smoke, random_teacher=True)
    if stage == "finetune":
        scfg, sparams = None, None
    else:
        scfg = st.student_config(args.student, tcfg, args.smoke)
        sparams = st._random_params(scfg, 2)
    case = st.Case(stage, tcfg, tparams, scfg, sparams, total_steps=4 + 3 * args.steps,
                   dtype=args.dtype)
    state = case.fresh_state()
    batch = case.shard(st.make_batch(tcfg, args.batch_size, args.length, seed=args.length))
    t0 = time.perf_counter()
    compiled = case.step.lower(state, case.teacher_params, batch).compile()
    compile_s = time.perf_counter() - t0
    texts = [c.as_text() for c in getattr(compiled, "parts", [compiled])]
    hlo = "\n".join(texts)
    per_module = [hlo_dots(t) for t in texts]  # instruction names repeat across modules
    dots = {"library_calls": dict(sum((collections.Counter(d["library_calls"])
                                       for d in per_module), collections.Counter())),
            "xla_dots": [x for d in per_module for x in d["xla_dots"]]}
    if args.hlo:
        opener = gzip.open if args.hlo.endswith(".gz") else open
        with opener(args.hlo, "wt") as f:
            f.write(hlo)

    def run(n):
        nonlocal state
        for _ in range(n):
            state, metrics = compiled(state, case.teacher_params, batch)
        jax.block_until_ready((state, metrics))
        return metrics

    run(3)
    t0 = time.perf_counter()
    run(args.steps)
    ms = 1e3 * (time.perf_counter() - t0) / args.steps
    trace_dir = tempfile.mkdtemp(prefix="jtb-kprof-")
    try:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            run(args.steps)
        kernels = device_kernel_times(trace_dir)
        source, kind_of = "device kernels", kernel_kind
        if not kernels:
            kernels = {k: list(v) for k, v in step_profile.thunk_times(trace_dir).items()}
            source, kind_of = "XLA CPU thunks", step_profile.kind_of
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)

    dev = jax.devices()[0]
    head = (f"{args.teacher} -> {args.student}, {stage}, T {args.length}, B {args.batch_size}, "
            f"{args.dtype} compute; {dev.platform}: {dev.device_kind}; "
            f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    print(f"# {head}\n# compile {compile_s:.1f} s; {ms:.2f} ms a step (pipelined, "
          f"{args.steps} steps)")
    total = sum(v[0] for v in kernels.values()) or float("nan")
    kinds = collections.defaultdict(float)
    for name, (s, _) in kernels.items():
        kinds[kind_of(name)] += s
    print(f"\n# {source}: {1e3 * total / args.steps:.2f} ms a step in all")
    print("| kind | ms a step | share |\n|---|---:|---:|")
    for k, s in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"| {k} | {1e3 * s / args.steps:.2f} | {100 * s / total:.1f}% |")
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:args.top]
    print("\n| kernel | kind | calls a step | ms a step | share |\n|---|---|---:|---:|---:|")
    for name, (s, n) in top:
        short = name if len(name) <= 90 else name[:87] + "..."
        print(f"| `{short}` | {kind_of(name)} | {n / args.steps:g} | "
              f"{1e3 * s / args.steps:.3f} | {100 * s / total:.1f}% |")
    print(f"\n# dots in the optimised HLO: library calls {dots['library_calls']}; "
          f"{len(dots['xla_dots'])} left to XLA")
    for line in dots["xla_dots"][:40]:
        print(f"#   {line}")
    res = {"case": head, "compile_s": compile_s, "ms_per_step": ms, "source": source,
           "kernel_ms_per_step": 1e3 * total / args.steps,
           "kinds_ms_per_step": {k: 1e3 * s / args.steps for k, s in kinds.items()},
           "kernels": {k: {"ms_per_step": 1e3 * s / args.steps, "calls": n}
                       for k, (s, n) in top},
           "hlo_dots": dots, "loss": float(run(1)["loss"])}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
