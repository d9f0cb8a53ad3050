#!/usr/bin/env python
"""Fault injection: kills survived, checkpoint damage detected, bad values refused.

Runs the real CLI (`python -m jax_tinybert.main`) on a tiny random teacher and synthetic SST-2
data (tests/helpers/tiny_run.py: a 20-step run compiles and trains in seconds), then:

1. kills: a straight run, then runs killed with SIGKILL or SIGTERM at random steps and rerun
   with the same command. Survived = the rerun resumed (from the last checkpoint, or the
   SIGTERM step) and its final TrainState and loss curve are bit-identical to the straight
   run's. For SIGTERM also the exit code (143) and how many steps after the signal it stopped.
2. damage: copies of a finished workdir with one damage each (4 KiB overwritten inside a data
   chunk -- still decodes --, bytes flipped, a data file truncated, a file deleted, the meta
   JSON garbled; the newest periodic and the best checkpoint). Detected = the restore falls
   back to an older step, moves the damaged one to corrupt_<step> and says so; which layer
   caught it (sha256 digests or an orbax read error) is reported.
3. bad values: the CLI with out-of-range values; refused = non-zero exit, a one-line error
   naming the field, no workdir left behind.
4. clashes with the environment: the same command started twice on one workdir, the teacher's
   weights or the train labels changed in place between two segments of a run, a disk that
   fills up (a small tmpfs, where one can be mounted). Handled = exit 2 with one line saying
   what happened, before anything is written, and the same command resumes once it is fixed.

    .venv/bin/python benchmarks/fault_injection.py                 # ~5 min on 2 busy cores
    .venv/bin/python benchmarks/fault_injection.py --kills 6 --seed 1 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "helpers"))
sys.path.insert(0, str(REPO))

import tiny_run as T  # noqa: E402  (tests/helpers: the tiny teacher and the run's flags)

STEPS = 20
CKPT_EVERY = 5
RUN_TIMEOUT = 600


def _env(cache, **extra):
    return T.env(**T.cache_env(cache), PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests' / 'helpers'}",
                 JTB_TEST_STEP_SLEEP="0.2", **extra)


def _args(wd, teacher, extra=()):
    # Fine-tuning with eval every 5 steps, so that the run also keeps a best checkpoint.
    return T.train_args(wd, teacher, steps=STEPS, checkpoint_every=CKPT_EVERY,
                        extra=("--config.objective.name=finetune",
                               "--config.train.eval_every=5", *extra))


def _run(args, env, module="jax_tinybert.main"):
    return subprocess.run([T.PYTHON, "-m", module, *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT)


def _last_step(wd) -> int:
    p = pathlib.Path(wd) / "metrics.jsonl"
    steps = [json.loads(l)["step"] for l in p.read_text().splitlines()
             if l.strip().endswith("}") and "train/loss" in l] if p.exists() else []
    return max(steps, default=0)


# --------------------------------------------------------------------------- 1. kills

def kills(teacher, cache, work, n, rng):
    straight = work / "straight"
    r = _run(_args(straight, teacher), _env(cache))
    assert r.returncode == 0, r.stderr[-3000:]
    ref_state = T.restore_state(straight, STEPS)
    ref_loss = T.read_metrics(straight)
    rows = []
    for i in range(n):
        sig = (signal.SIGKILL, signal.SIGTERM)[i % 2]
        at = rng.randint(3, STEPS - 3)
        wd = work / f"kill{i}"
        log = open(work / f"kill{i}.log", "w")
        p = subprocess.Popen([T.PYTHON, "-m", "slow_main", *_args(wd, teacher)], env=_env(cache),
                             cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        T.wait_for(lambda: _last_step(wd) >= at, RUN_TIMEOUT, p, f"step {at}")
        seen = _last_step(wd)
        p.send_signal(sig)
        rc = p.wait(timeout=RUN_TIMEOUT)
        log.close()
        out = (work / f"kill{i}.log").read_text()
        saved = [int(l.split()[3].rstrip(";")) for l in out.splitlines()
                 if l.startswith("preempted: saved step ")]
        r = _run(_args(wd, teacher), _env(cache))
        resumed = [int(l.split()[3]) for l in r.stdout.splitlines()
                   if l.startswith("resumed from step ")]
        # No "resumed" line: killed before its first checkpoint was complete, so the rerun
        # starts over (which must still end bit-identical).
        ok = r.returncode == 0 and len(resumed) <= 1
        same_state = ok and T.max_abs_diff(ref_state, T.restore_state(wd, STEPS)) == 0.0
        got = T.read_metrics(wd) if ok else {}
        same_loss = ok and all(got.get(s) == v for s, v in ref_loss.items())
        rows.append(dict(signal=signal.Signals(sig).name, at_step=seen, exit_code=rc,
                         saved_step=saved[0] if saved else None,
                         stop_latency=(saved[0] - seen) if saved else None,
                         rerun_exit=r.returncode,
                         resumed_from=resumed[0] if resumed else "start (no checkpoint yet)",
                         bit_identical=bool(same_state and same_loss),
                         survived=bool(ok and same_state and same_loss
                                       and (sig == signal.SIGKILL or rc == 143))))
    return straight, rows


# --------------------------------------------------------------------------- 2. damage

def _abstract(step_dir):
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    tree = ocp.PyTreeCheckpointer().metadata(step_dir / "state").item_metadata.tree
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, np.dtype(m.dtype), sharding=dev),
                        tree)


def _data_files(step_dir):
    return sorted((p for p in (step_dir / "state").rglob("*") if p.is_file()
                   and p.parent.name == "d"), key=lambda p: -p.stat().st_size)


def _damage(step_dir, how, rng):
    """Applies one damage; returns the file it hit (relative to the step)."""
    f = _data_files(step_dir)[0]
    raw = bytearray(f.read_bytes())
    if how == "overwrite 4 KiB mid-file":
        mid = len(raw) // 2
        raw[mid:mid + 4096] = rng.randbytes(4096)
        f.write_bytes(bytes(raw))
    elif how == "flip 1 byte":
        k = rng.randrange(len(raw))
        raw[k] ^= 0xFF
        f.write_bytes(bytes(raw))
    elif how == "truncate data file":
        f.write_bytes(bytes(raw[: len(raw) // 2]))
    elif how == "delete data file":
        f.unlink()
    elif how == "delete random file":
        f = rng.choice(sorted(p for p in step_dir.rglob("*") if p.is_file()))
        f.unlink()
    elif how == "garble meta JSON":
        f = step_dir / "meta" / "metadata"
        f.write_text('{"data": {"epo')
    else:
        raise ValueError(how)
    return str(f.relative_to(step_dir))


def _reference(straight, sub, step, abstract):
    from jax_tinybert.train.checkpoints import Checkpointer

    c = Checkpointer(straight, best_metric="main")
    try:
        return c.restore(step, abstract, best=sub == "best")[1]
    finally:
        c.close()


def _equal(a, b):
    import jax
    import numpy as np

    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _orbax_alone(directory, step, abstract, reference):
    """What plain orbax (no digests) makes of the damaged step."""
    import orbax.checkpoint as ocp

    m = ocp.CheckpointManager(directory, item_names=("state", "meta"))
    try:
        got = m.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))["state"]
    except Exception as e:  # noqa: BLE001 - reported
        return f"raises {type(e).__name__}"
    finally:
        m.close()
    return "same values" if _equal(got, reference) else "WRONG VALUES, no error"


def damage(straight, work, rng):
    import logging

    from jax_tinybert.train.checkpoints import Checkpointer

    kinds = ["overwrite 4 KiB mid-file", "flip 1 byte", "truncate data file",
             "delete data file", "delete random file", "garble meta JSON"]
    rows = []
    for which in ("latest", "best"):
        for how in kinds:
            wd = work / f"damage_{which}_{len(rows)}"
            shutil.copytree(straight, wd)
            sub = "checkpoints" if which == "latest" else "best"
            steps = sorted(int(p.name) for p in (wd / sub).iterdir() if p.name.isdigit())
            target = steps[-1]
            hit = _damage(wd / sub / str(target), how, rng)
            abstract = _abstract(straight / "checkpoints" / str(STEPS))
            alone = _orbax_alone(wd / sub, target, abstract,
                                 _reference(straight, sub, target, abstract))
            records = []
            handler = logging.Handler()
            handler.emit = records.append
            logging.getLogger("jax_tinybert.train.checkpoints").addHandler(handler)
            try:
                c = Checkpointer(wd, best_metric="main")
                try:
                    got = c.restore_latest(abstract) if which == "latest" \
                        else c.restore_best(abstract)
                    restored = None if got is None else got[0]
                    error = None
                    intact = restored == target and _equal(got[1], _reference(straight, sub,
                                                                              target, abstract))
                except Exception as e:  # noqa: BLE001 - reported
                    restored, error = None, f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
                    intact = False
                c.close()
            finally:
                logging.getLogger("jax_tinybert.train.checkpoints").removeHandler(handler)
            msgs = [r.getMessage() for r in records]
            by = ("sha256 digest" if any("damaged (" in m for m in msgs) else
                  "orbax read error" if any("unreadable" in m for m in msgs) else "-")
            moved = (wd / sub / f"corrupt_{target}").is_dir()
            detected = bool(moved and (restored is None or restored < target))
            rows.append(dict(checkpoint=which, damage=how, file=hit, step=target,
                             orbax_alone=alone,
                             restored=restored, caught_by=by, moved_aside=moved, error=error,
                             # a file the restore does not read (orbax's own bookkeeping):
                             # restored unchanged, nothing to detect
                             outcome="detected" if detected else
                             "harmless (restored intact)" if intact else "MISSED",
                             detected=detected or intact))
            shutil.rmtree(wd)
    return rows


# --------------------------------------------------------------------------- 3. bad values

BAD_VALUES = [
    "--config.optim.learning_rate=-3e-5",
    "--config.train.num_steps=-1",
    "--config.train.num_epochs=-2",
    "--config.optim.warmup_ratio=1.5",
    "--config.optim.weight_decay=-0.1",
    "--config.train.batch_size=0",
    "--config.train.eval_every=-5",
    "--config.objective.temperature=0",
]


def bad_values(teacher, cache, work):
    rows = []
    for i, flag in enumerate(BAD_VALUES):
        wd = work / f"bad{i}"
        r = _run(_args(wd, teacher, extra=flag.split()), _env(cache))
        err = [l for l in (r.stderr + r.stdout).splitlines() if l.strip()]
        last = err[-1][:160] if err else ""
        leftovers = sorted(p.name for p in wd.iterdir()) if wd.exists() else []
        rows.append(dict(flag=flag, exit_code=r.returncode, message=last,
                         workdir_left=leftovers, refused=r.returncode != 0 and not leftovers))
    return rows


# --------------------------------------------------------------------------- 4. clashes

def _err(r) -> str:
    lines = [l for l in (r.stderr + r.stdout).splitlines() if l.startswith("error: ")]
    return lines[-1][:170] if lines else ""


def _resumed(r):
    got = [int(l.split()[3]) for l in r.stdout.splitlines() if l.startswith("resumed from step ")]
    return got[0] if got else None


def _row(case, r, needle, fix, rerun):
    """One clash: refused (exit 2, one line holding `needle`), then `fix`ed and rerun."""
    refused = r.returncode == 2 and needle in _err(r) and "Traceback" not in r.stderr
    return dict(case=case, exit_code=r.returncode, message=_err(r), fix=fix,
                rerun_exit=rerun.returncode, resumed_from=_resumed(rerun),
                handled=bool(refused and rerun.returncode == 0 and _resumed(rerun)))


def clashes(teacher, cache, work):
    """What a user's environment does to a run: the same command twice, a teacher fine-tuned
    again in place, labels fixed in the train file, a disk that fills up. Handled = refused in
    one line (exit 2) before anything is written, and the same command resumes once fixed."""
    from jax_tinybert.data import synthetic

    rows, env = [], _env(cache)
    # The same command twice: the second stops at once; the first goes on until SIGTERM.
    wd, log = work / "twice", work / "twice.log"
    p = subprocess.Popen([T.PYTHON, "-m", "slow_main", *_args(wd, teacher)],
                         env=dict(env, JTB_TEST_STEP_SLEEP="2"), cwd=REPO,
                         stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        T.wait_for(lambda: _last_step(wd) >= 1, RUN_TIMEOUT, p, "the first step")
        second = _run(_args(wd, teacher), env)
        still = p.poll() is None
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=RUN_TIMEOUT)
    finally:
        if p.poll() is None:
            p.kill()
    row = _row("the same command twice", second, "is in use by another run",
               "SIGTERM the first", _run(_args(wd, teacher), env))
    row["handled"] = row["handled"] and still
    rows.append(row)
    # The files behind the config's paths change between two segments of a distillation run.
    glue = work / "glue"
    synthetic.write_sst2_like(str(glue), 64, 16, seed=0)
    tcopy = work / "teacher_copy"
    shutil.copytree(teacher, tcopy)
    dist = lambda wd, steps: T.train_args(wd, tcopy, steps=steps, checkpoint_every=CKPT_EVERY,
                                          extra=("--config.data.kind=glue",
                                                 f"--config.data.glue_dir={glue}"))
    wd = work / "inputs"
    assert _run(dist(wd, 10), env).returncode == 0
    weights = tcopy / "model.safetensors"
    original = weights.read_bytes()
    from safetensors.numpy import load_file, save_file
    t = load_file(str(weights))
    t = {k: v + np.asarray(0.01, v.dtype) for k, v in t.items()}
    save_file(t, str(weights), metadata={"format": "np"})
    r = _run(dist(wd, 20), env)
    weights.write_bytes(original)
    rows.append(_row("teacher weights changed in place", r, "other teacher weights",
                     "the old weights back", _run(dist(wd, 25), env)))
    train = glue / "SST-2" / "train.tsv"
    text = train.read_text()
    head, *body = text.splitlines()
    train.write_text("\n".join([head] + [b[:-1] + ("0" if b.endswith("1") else "1")
                                         for b in body]) + "\n")
    r = _run(dist(wd, 30), env)
    train.write_text(text)
    rows.append(_row("train labels changed in place", r, "other data", "the old file back",
                     _run(dist(wd, 35), env)))
    # A disk that fills up: a tmpfs with room for two checkpoints (root only).
    disk = work / "disk"
    disk.mkdir()
    size = 30 << 20
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)],
                      capture_output=True).returncode == 0:
        try:
            wd = disk / "wd"
            r = _run(_args(wd, teacher), env)
            moved = work / "moved"
            shutil.copytree(wd, moved)
            rows.append(_row("disk full (a 30 MB tmpfs)", r, "no room for the checkpoint",
                             "workdir copied to a larger disk", _run(_args(moved, teacher), env)))
        finally:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)
    return rows


# --------------------------------------------------------------------------- report

def _table(rows, cols):
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(str(r.get(c, "")).replace("|", "\\|") for c in cols) + " |")
    return "\n".join(out)


def record_rows(k, d, b, c) -> list:
    """One row per section for benchmarks/results (key: section): cases run and cases that
    ended as they must (survived, detected or harmless, refused, refused then resumed)."""
    return [{"section": name, "cases": len(rows), "as_required": sum(bool(r[ok]) for r in rows),
             "required": want}
            for name, rows, ok, want in (
                ("kills", k, "survived", "the rerun resumes and ends bit-identical"),
                ("checkpoint damage", d, "detected", "detected by the digests, or harmless"),
                ("bad values", b, "refused", "exit 2, one line, nothing written"),
                ("clashes", c, "handled", "refused in one line, then resumed once fixed"))
            if rows]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=4, help="killed runs (alternating -9 / TERM)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--record", action="store_true",
                    help="merge the sections' counts into benchmarks/results/")
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder")
    ap.add_argument("--sections", default="kills,damage,bad,clashes",
                    help="comma-separated subset of kills,damage,bad,clashes (damage needs "
                         "kills' straight run, which is made anyway)")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    work = pathlib.Path(tempfile.mkdtemp(prefix="jtb_faults_"))
    t0 = time.time()
    try:
        teacher = T.tiny_teacher(work / "teacher")
        cache = str(work / "jax_cache")
        want = set(a.sections.split(","))
        straight, k = kills(teacher, cache, work, a.kills if "kills" in want else 0, rng)
        d = damage(straight, work, rng) if "damage" in want else []
        b = bad_values(teacher, cache, work) if "bad" in want else []
        c = clashes(teacher, cache, work) if "clashes" in want else []
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n## Kills ({sum(r['survived'] for r in k)}/{len(k)} survived)\n")
    print(_table(k, ["signal", "at_step", "exit_code", "saved_step", "stop_latency",
                     "rerun_exit", "resumed_from", "bit_identical", "survived"]))
    print(f"\n## Checkpoint damage ({sum(r['detected'] for r in d)}/{len(d)} detected or "
          "harmless)\n")
    print(_table(d, ["checkpoint", "damage", "file", "step", "orbax_alone", "restored",
                     "caught_by", "moved_aside", "outcome"]))
    print(f"\n## Bad values ({sum(r['refused'] for r in b)}/{len(b)} refused)\n")
    print(_table(b, ["flag", "exit_code", "refused", "message"]))
    print(f"\n## Clashes ({sum(r['handled'] for r in c)}/{len(c)} refused, then resumed)\n")
    print(_table(c, ["case", "exit_code", "message", "fix", "rerun_exit", "resumed_from",
                     "handled"]))
    print(f"\n{time.time() - t0:.0f} s")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"kills": k, "damage": d, "bad_values": b, "clashes": c}, fh, indent=1)
    if a.record:
        import results

        path = results.record("fault_injection", results.machine_kind(),
                              record_rows(k, d, b, c), ("section",))
        print(f"recorded {os.path.relpath(path)}")


if __name__ == "__main__":
    main()
