#!/usr/bin/env python
"""Which XLA CPU settings give the fastest train step on this CPU: one command, any machine.

XLA's CPU backend can run the step's dots through YNNPACK (jaxlib 0.10's default), Eigen,
XNNPACK or oneDNN, chosen by XLA_FLAGS before JAX starts, and which is fastest depends on the
CPU (MKL beat XLA's matmul on one Intel Xeon and lost to it on an AMD EPYC). This script
times the real train step (benchmarks/step_throughput.py: MiniLM-L6 teacher, 4L-312 student,
batch 32, student dropout on, no PyTorch) under each setting in its own child process, the
settings alternating round by round so that the host's drift hits all of them alike, and prints
per (stage, length) the median seconds per step of each setting and its speed against
`default`, with the jitted fp32 2048^3 matmul rate each child measured. A setting whose child
dies (the oneDNN dot fusion is killed by SIGILL on every CPU tried: see
benchmarks/onednn_dot_fusion_repro.py) is reported as such, not as a time.

    .venv/bin/python benchmarks/xla_cpu_settings.py                          # all settings
    .venv/bin/python benchmarks/xla_cpu_settings.py --settings default,eigen \
        --stages tinybert_pred --lengths 16,64 --rounds 3 --json out.json
    .venv/bin/python benchmarks/xla_cpu_settings.py --smoke                  # wiring (tests)

The flags of a setting are added to the XLA_FLAGS of the environment it is started from.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from typing import Dict, List

from jax_tinybert.speed.cpu import cpu_name

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

# name -> XLA_FLAGS added for it. An empty --xla_cpu_experimental_ynn_fusion_type turns
# YNNPACK off, so the dots fall to Eigen (or to XNNPACK / oneDNN where those are on).
SETTINGS: Dict[str, str] = {
    "default": "",
    "eigen": "--xla_cpu_experimental_ynn_fusion_type=",
    "xnnpack": "--xla_cpu_use_xnnpack=true --xla_cpu_experimental_ynn_fusion_type=",
    "onednn": "--xla_cpu_use_onednn=true",
    "onednn_dot": "--xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_fusion_type=dot",
    # YNNPACK also for elementwise ops and reductions (its kernels use every core; XLA's own
    # loop fusions run one thunk on one core).
    "ynn_eltwise": "--xla_cpu_experimental_ynn_fusion_type=dot,eltwise,reduce",
    # YNNPACK for the dots alone: reductions (softmax's, layer norm's) back in XLA's loops.
    "ynn_dot": "--xla_cpu_experimental_ynn_fusion_type=dot",
    "xnn_graph": "--xla_cpu_use_xnnpack=true "
                 "--xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY",
    "vector512": "--xla_cpu_prefer_vector_width=512",
    "onednn_vector512": "--xla_cpu_use_onednn=true --xla_cpu_prefer_vector_width=512",
    "fast_runtime": "--xla_cpu_opt_preset=CPU_OPT_PRESET_FAST_RUNTIME",
    "fast_compile": "--xla_cpu_opt_preset=CPU_OPT_PRESET_FAST_COMPILE",
    # Flags of jaxlib 0.10.2 that change the schedule or the fusions, not the math
    # (`xla_cpu_use_multi_output_fusion` and `xla_cpu_flatten_after_fusion` are in its binary
    # but refused in XLA_FLAGS).
    "sched_concurrency": "--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_CONCURRENCY_OPTIMIZED",
    "sched_memory": "--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
    "tiling_propagation": "--xla_cpu_experimental_enable_tiling_propagation=true",
}


def _csv(s: str) -> List[str]:
    return [x for x in s.split(",") if x]


def run_setting(name: str, args, out_json: str) -> dict:
    """One child process of step_throughput.py under setting `name` -> its results, or
    {'failed': why} when the child exits non-zero or is killed (the signal named)."""
    env = dict(os.environ)
    env.pop("JTB_BENCH_REEXEC", None)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {SETTINGS[name]}".strip()
    cmd = [sys.executable, os.path.join(HERE, "step_throughput.py"), "--no-torch",
           "--stages", ",".join(args.stages), "--dtype", args.dtype, "--json", out_json]
    if args.smoke:
        cmd.append("--smoke")
    else:
        cmd += ["--lengths", ",".join(map(str, args.lengths)), "--steps", str(args.steps),
                "--warmup", str(args.warmup)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=args.timeout)
    if proc.returncode != 0:
        rc = proc.returncode
        why = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"
        tail = (proc.stderr.strip().splitlines() or [""])[-1][:200]
        return {"failed": why, "stderr_tail": tail}
    with open(out_json) as fh:
        return json.load(fh)


def summarise(runs: Dict[str, List[dict]]) -> List[dict]:
    """Per (stage, T): the median s/step of each setting over its rounds."""
    rows: Dict[tuple, dict] = {}
    for name, results in runs.items():
        for res in results:
            for r in res.get("results", []):
                key = (r["stage"], r["length"])
                rows.setdefault(key, {"stage": r["stage"], "T": r["length"], "times": {}})
                rows[key]["times"].setdefault(name, []).append(r["s_per_step"])
    out = []
    for key in sorted(rows, key=lambda k: (k[0], k[1])):
        row = rows[key]
        row["median_s"] = {n: statistics.median(ts) for n, ts in row["times"].items()}
        base = row["median_s"].get("default")
        row["speed_vs_default"] = {n: base / s for n, s in row["median_s"].items()} \
            if base else {}
        out.append(row)
    return out


def render(res: dict) -> str:
    names = res["settings"]
    lines = [f"# {res['cpu']}; rounds {res['rounds']}; {res.get('dtype', 'float32')}; "
             "XLA_FLAGS of each setting:"]
    lines += [f"#   {n}: {SETTINGS[n] or '(none)'}" for n in names]
    head = "| stage | T | " + " | ".join(f"{n} s/step" for n in names) + " | " + \
        " | ".join(f"{n} vs default" for n in names if n != "default") + " |"
    lines += [head, "|" + "---|" * (2 + len(names) + len(names) - 1)]
    for r in res["rows"]:
        cells = [f"{r['median_s'][n]:.3f}" if n in r["median_s"] else
                 res["failed"].get(n, "-") for n in names]
        ratios = [f"{r['speed_vs_default'][n]:.2f}x" if n in r["speed_vs_default"] else "-"
                  for n in names if n != "default"]
        lines.append(f"| {r['stage'].replace('tinybert_', '')} | {r['T']} | "
                     + " | ".join(cells + ratios) + " |")
    mm = ", ".join(f"{n} {statistics.median(v) / 1e9:.0f}" for n, v in res["matmul"].items())
    lines.append(f"jitted fp32 matmul 2048^3, GFLOP/s (median of the rounds): {mm or '-'}")
    for n, why in res["failed"].items():
        lines.append(f"{n}: {why} (flags: {SETTINGS[n]})")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--settings", type=_csv, default=list(SETTINGS),
                   help=f"comma list of {','.join(SETTINGS)}")
    p.add_argument("--stages", type=_csv,
                   default=["tinybert_intermediate", "tinybert_pred", "finetune"])
    p.add_argument("--lengths", type=lambda s: [int(x) for x in _csv(s)], default=[16, 64, 128])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the steps' compute dtype (step_throughput.py --dtype)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=int, default=1800, help="seconds per child process")
    p.add_argument("--smoke", action="store_true",
                   help="tiny models, every stage at T=16 (step_throughput --smoke): wiring only")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    unknown = [s for s in args.settings if s not in SETTINGS]
    if unknown:
        p.error(f"--settings: unknown {','.join(unknown)}; choose from {','.join(SETTINGS)}")
    if "default" not in args.settings:
        args.settings.insert(0, "default")
    runs: Dict[str, List[dict]] = {n: [] for n in args.settings}
    failed: Dict[str, str] = {}
    matmul: Dict[str, List[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for name in args.settings:
                if name in failed:
                    continue
                res = run_setting(name, args, os.path.join(tmp, f"{name}_{rnd}.json"))
                if "failed" in res:
                    failed[name] = res["failed"]
                    print(f"round {rnd + 1} {name}: {res['failed']} ({res['stderr_tail']})",
                          flush=True)
                    continue
                runs[name].append(res)
                matmul.setdefault(name, []).append(res["matmul_peak"]["jax_flop_s"])
                steps = ", ".join(f"{r['stage'].replace('tinybert_', '')}/{r['length']} "
                                  f"{r['s_per_step']:.3f}" for r in res["results"])
                print(f"round {rnd + 1} {name}: {steps}", flush=True)
    out = {"cpu": cpu_name(), "rounds": args.rounds, "dtype": args.dtype,
           "settings": args.settings,
           "flags": {n: SETTINGS[n] for n in args.settings}, "failed": failed,
           "matmul": matmul, "rows": summarise(runs)}
    print(render(out))
    if args.json:
        tmp_path = args.json + ".tmp"
        with open(tmp_path, "w") as fh:
            json.dump(out, fh, indent=1)
        os.replace(tmp_path, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
