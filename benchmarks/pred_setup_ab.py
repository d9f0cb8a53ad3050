#!/usr/bin/env python
"""Start to first steps of a prediction stage through the CLI, two source trees alternating.

What a change to the teacher pass or to the compilations beside it saves a user: each round runs
`python -m jax_tinybert.main --config=configs/task_distill.py:<task>_pred` from tree A, then B
(B, then A in even rounds), with the teacher store and the compile cache off (so every run
forwards the teacher and compiles its programs), and kills the process at train step 20.
Prints the seconds from start to the end of the teacher pass and to step 20.

    python3 benchmarks/pred_setup_ab.py --a /path/old_checkout --b /path/new_checkout \\
        --teacher_path EXPORT --glue_dir ../shared/data/glue [--task sst2] [--rounds 2] [--json F]

Each tree needs its .venv (a link to one is fine); make worktrees with `git worktree add`.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time


def run_once(tree, args, workdir):
    env = dict(os.environ, JTB_TEACHER_STORE="off", JTB_COMPILE_CACHE="off",
               PYTHONUNBUFFERED="1")
    cmd = [os.path.join(tree, ".venv", "bin", "python"), "-m", "jax_tinybert.main",
           f"--config=configs/task_distill.py:{args.task}_pred", f"--workdir={workdir}",
           f"--config.data.glue_dir={os.path.abspath(args.glue_dir)}",
           "--config.train.num_epochs=1", f"--config.teacher.path={args.teacher_path}",
           "--config.student.init=random"]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    marks, tail = {}, []
    for line in p.stdout:
        t = time.perf_counter() - t0
        tail = (tail + [line])[-20:]
        if "[teacher cache]" in line and " ex in " in line:
            marks["teacher_done_s"] = round(t, 2)
        if "step     20/" in line:
            marks["step20_s"] = round(t, 2)
            break
    p.kill()
    p.wait()
    if "step20_s" not in marks:
        raise SystemExit(f"{tree}: the run ended before step 20:\n" + "".join(tail))
    return marks


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--a", required=True, help="checkout A (e.g. the commit before a change)")
    p.add_argument("--b", required=True, help="checkout B")
    p.add_argument("--teacher_path", required=True, help="a fine-tuned teacher export")
    p.add_argument("--glue_dir", required=True)
    p.add_argument("--task", default="sst2")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    trees = [("a", os.path.abspath(args.a)), ("b", os.path.abspath(args.b))]
    res = {"command": " ".join(sys.argv), "trees": dict(trees), "rounds": []}
    scratch = tempfile.mkdtemp(prefix="pred_setup_ab_")
    try:
        for r in range(args.rounds):
            for name, tree in (trees if r % 2 == 0 else trees[::-1]):
                wd = os.path.join(scratch, name)
                shutil.rmtree(wd, ignore_errors=True)
                marks = run_once(tree, args, wd)
                res["rounds"].append(dict(marks, round=r + 1, tree=name,
                                          load=round(os.getloadavg()[0], 2)))
                print(f"round {r + 1} {name}: teacher pass done {marks.get('teacher_done_s')} s, "
                      f"step 20 at {marks['step20_s']} s (load {os.getloadavg()[0]:.2f})",
                      flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return res


if __name__ == "__main__":
    main()
