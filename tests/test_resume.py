"""Kill-and-resume of real training runs.

A 20-step fine-tuning run (eval every 5 steps, so a best checkpoint and an eval history)
straight through vs the same command hard-killed (SIGKILL) or preempted (SIGTERM) after its
step-10 checkpoint, then started again: the resumed run continues from the saved step, and its
outputs equal the straight run's apart from timings -- every metrics.jsonl record, the
TensorBoard scalars (one events file), summary.json (eval history, best, last train metrics)
-- and so does its final TrainState (student params, optimizer state, rng). A finished run
rerun in place keeps its outputs. The same for a 2-process x 4-device job with one process
SIGKILLed: tests/test_multiprocess.py.

Runs use a tiny random teacher (tests/helpers/tiny_run.py) so each compiles in seconds; the killed
runs go through tests/helpers/slow_main.py (jax_tinybert.main with a sleep after each logged
step) so that the signal lands mid-run at a known point.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess

import pytest

from helpers import tiny_run as T

REPO = T.REPO
RUN_TIMEOUT = 300
STEPS = 20


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return T.shared_dirs(tmp_path_factory)


def _env(cache, **extra):
    return T.env(**T.cache_env(cache), PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests' / 'helpers'}",
                 JTB_TEST_STEP_SLEEP="0.25", **extra)


def _run(args, env, module="jax_tinybert.main", timeout=RUN_TIMEOUT):
    return subprocess.run([T.PYTHON, "-m", module, *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def _start(args, env, log, module="slow_main"):
    return subprocess.Popen([T.PYTHON, "-m", module, *args], env=env, cwd=REPO,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)


def _resumed_step(out: str) -> int:
    lines = [l for l in out.splitlines() if l.startswith("resumed from step ")]
    assert len(lines) == 1, out[-3000:]
    return int(lines[0].split()[3])


def _args(wd, teacher):
    return T.train_args(wd, teacher, steps=STEPS, extra=("--config.objective.name=finetune",
                                                         "--config.train.eval_every=5"))


def _check_resumed(straight, resumed):
    T.assert_same_outputs(straight, resumed)
    d = T.max_abs_diff(T.restore_state(straight, STEPS), T.restore_state(resumed, STEPS))
    assert d == 0.0, f"final state differs from the straight run by {d}"


@pytest.fixture(scope="module")
def straight(setup, tmp_path_factory):
    teacher, cache = setup
    wd = tmp_path_factory.mktemp("straight") / "wd"
    res = _run(_args(wd, teacher), _env(cache))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return wd


@pytest.mark.timeout(600)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT],
                         ids=["sigkill", "sigterm", "ctrl-c"])
def test_kill_and_resume_single_process(setup, straight, tmp_path, sig):
    teacher, cache = setup
    wd = tmp_path / "wd"
    args = _args(wd, teacher)
    env = _env(cache)
    rc = T.signal_when(_start(args, env, tmp_path / "killed.log"),
                       lambda: T.checkpoint_done(wd, 10), sig, RUN_TIMEOUT, "checkpoint 10")
    out = (tmp_path / "killed.log").read_text()
    seen = T.read_metrics(wd)
    assert max(seen) < STEPS, "the run finished before the signal: nothing was tested"
    if sig == signal.SIGKILL:
        assert rc == -signal.SIGKILL, out[-3000:]
        saved = max(s for s in range(5, STEPS + 1, 5) if T.checkpoint_done(wd, s))
    else:
        # A final save at the step where the signal arrived, then exit code 128 + signal.
        assert rc == 128 + sig, out[-3000:]
        saved = T.saved_step(out, "preempted" if sig == signal.SIGTERM else "interrupted (Ctrl-C)")
        assert saved >= 10 and T.checkpoint_done(wd, saved)
        # Acted on within one step: the host runs at most one step ahead of the device, and
        # the slowed-down run had logged (finished) at least step saved - 1 when signalled.
        assert max(seen) == saved
    res = _run(args, env)                        # the same command again
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert _resumed_step(res.stdout) == saved
    # The closing line's work is this segment's, and says so.
    assert re.search(rf"done in \d+s; work [\d.]+ [GT]FLOP, \d+ GFLOP/s since the resume at "
                     rf"step {saved}; ", res.stdout), res.stdout[-2000:]
    _check_resumed(straight, wd)


@pytest.mark.timeout(600)
def test_the_export_holds_the_best_checkpoints_params(setup, tmp_path):
    """The export is the best eval's student, on both of its paths: read back from
    workdir/best when the best eval came before the last step, the final state itself (written
    while the last checkpoint's save finishes) when it was the last. Compared with the student
    params orbax wrote to disk at that step."""
    import json

    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from jax_tinybert.model.hf import load_pretrained

    def saved_student(path):
        ck = ocp.PyTreeCheckpointer()
        tree = ck.metadata(path).item_metadata.tree
        args = jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        return ck.restore(path, args=ocp.args.PyTreeRestore(restore_args=args))["params"][
            "student"]

    teacher, cache = setup
    paths = set()
    # 20 steps, evals every 5 (the straight run's: its best is at step 5); 10 steps, one eval.
    for name, steps, every in (("early", 20, 5), ("last", 10, 10)):
        wd = tmp_path / name
        args = T.train_args(wd, teacher, steps=steps, extra=(
            "--config.objective.name=finetune", f"--config.train.eval_every={every}",
            "--config.export.enabled=True"))
        res = _run(args, _env(cache))
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        summary = json.loads((wd / "summary.json").read_text())
        best = summary["best"]["step"]
        assert summary["export_step"] == best
        paths.add("final state" if best == steps else "best read back")
        _, exported = load_pretrained(str(wd / "export"))
        assert T.max_abs_diff(exported, saved_student(wd / "best" / str(best) / "state")) == 0.0
        if best == steps:
            assert T.max_abs_diff(exported, T.restore_state(wd, best)["params"]["student"]) == 0
    assert paths == {"final state", "best read back"}


def test_finished_run_rerun_in_place_keeps_its_outputs(setup, straight, tmp_path):
    import json
    import shutil

    teacher, cache = setup
    wd = tmp_path / "wd"
    shutil.copytree(straight, wd)
    before = json.loads((wd / "summary.json").read_text())
    assert before["eval_history"] and before["last_train"]
    res = _run(_args(wd, teacher), _env(cache))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert _resumed_step(res.stdout) == STEPS
    _check_resumed(straight, wd)
    after = json.loads((wd / "summary.json").read_text())
    assert after["wall_s"] > before["wall_s"]     # both segments


def test_metrics_writer_resume_drops_replayed_steps_and_rebuilds_tensorboard(tmp_path):
    """A killed run wrote steps 1..9 (and a torn line); resuming from the step-6 checkpoint
    keeps 1..6, and after steps 7..10 the JSON lines and TensorBoard equal an unbroken run's."""
    import json

    from jax_tinybert.train.metrics_writer import MetricsWriter, read_jsonl

    def run(w, steps):
        for s in steps:
            w.write(s, {"loss": 1.0 / s, "lr": 0.1}, prefix="train")
            if s % 5 == 0:
                w.write(s, {"accuracy": s / 10}, prefix="eval")

    straight = tmp_path / "straight"
    w = MetricsWriter(str(straight))
    run(w, range(1, 11))
    w.close()
    killed = tmp_path / "killed"
    w = MetricsWriter(str(killed))
    run(w, range(1, 10))
    w.close()
    with open(killed / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 10, "train/lo')             # killed mid-write
    w = MetricsWriter(str(killed), start_step=6)
    assert [r["step"] for r in read_jsonl(str(killed / "metrics.jsonl"))] == [1, 2, 3, 4, 5, 5, 6]
    run(w, range(7, 11))
    w.close()
    strip = lambda recs: [{k: v for k, v in r.items() if k != "time"} for r in recs]
    assert strip(read_jsonl(str(killed / "metrics.jsonl"))) == \
        strip(read_jsonl(str(straight / "metrics.jsonl")))
    n_files, scalars = T.read_tb(killed / "tb")
    assert n_files == 1 and scalars == T.read_tb(straight / "tb")[1] and len(scalars) == 22
    assert all(json.loads(l) for l in (killed / "metrics.jsonl").read_text().splitlines())


def test_metrics_writer_writes_tensorboard_without_importing_torch(tmp_path):
    """tensorboardX imports torch when it can (most of its import time); the writer keeps it
    out, and torch still imports afterwards for whoever needs it."""
    code = ("import sys\n"
            "from jax_tinybert.train.metrics_writer import MetricsWriter\n"
            f"w = MetricsWriter({str(tmp_path)!r})\n"
            "w.write(3, {'loss': 0.25}, prefix='train')\n"
            "w.close()\n"
            "print('torch' in sys.modules)\n"
            "import torch\n"
            "print(float(torch.ones(3).sum()))\n")
    out = subprocess.run([T.PYTHON, "-c", code], capture_output=True, text=True, timeout=300,
                         env=T.env(), cwd=str(T.REPO))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "3.0"], out.stdout
    assert T.read_tb(tmp_path / "tb") == (1, [(3, "train/loss", 0.25)])


@pytest.mark.timeout(600)
def test_sigterm_through_the_cli_stops_within_a_step_and_exits_143(setup, tmp_path):
    """Each step is slow on the device (~0.3 s of extra matmuls) and metrics are logged at
    step 1 and then only at step 20 (no eval or checkpoint before), so no logging, eval or
    save blocks the loop in between. Sent right after step 1 is logged, SIGTERM stops the run
    a couple of steps later (the one running, the one queued behind it, plus the test's own
    polling delay) with a checkpoint and exit code 143. (On CPU, the host-to-device copy of
    each batch already waits behind queued steps, so the unbounded run-ahead that
    tests/test_preemption.py shows does not arise here; on accelerators it does.)"""
    teacher, cache = setup
    wd = tmp_path / "wd"
    args = [a for a in _args(wd, teacher) if not a.startswith(("--config.train.log_every",
                                                               "--config.train.eval_every"))]
    args += ["--config.train.log_every=20", "--config.train.checkpoint_every=100",
             "--config.train.eval_every=100"]   # no blocking call (log, eval, save) before 20
    env = _env(cache, JTB_TEST_DEVICE_STEP_MATMULS="30")
    log = tmp_path / "run.log"
    rc = T.signal_when(_start(args, env, log), lambda: "step      1/20" in log.read_text(),
                       signal.SIGTERM, RUN_TIMEOUT, "step 1")
    out = log.read_text()
    assert rc == 143, out[-3000:]
    saved = T.saved_step(out)
    assert 2 <= saved <= 6, (saved, out[-2000:])
    assert T.checkpoint_done(wd, saved)


@pytest.mark.timeout(600)
def test_intermediate_run_with_teacher_cache_resumes_on_the_same_cache(setup, tmp_path):
    """34 steps over 256 rows (32 an epoch), cache_tokens=always: the run caches the teacher's
    attention logits and hidden states first. Preempted after step 10 and rerun, it reuses that cache (no second
    build record) and ends exactly where the unbroken run does; both delete it at the end."""
    teacher, cache = setup
    steps = 34
    args = lambda wd: T.train_args(wd, teacher, steps=steps, extra=(  # noqa: E731
        "--config.teacher.cache_dtype=float32", "--config.teacher.cache_tokens=always"))
    straight = tmp_path / "straight"
    res = _run(args(straight), _env(cache))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    wd = tmp_path / "wd"
    # At checkpoint 10 the per-token cache is in the workdir: training reads it.
    attn = wd / "cache" / "teacher" / "teacher_attn.bin"
    assert T.signal_when(_start(args(wd), _env(cache), tmp_path / "killed.log"),
                         lambda: T.checkpoint_done(wd, 10) and attn.exists(), signal.SIGTERM,
                         RUN_TIMEOUT, "checkpoint 10 with the per-token cache") == 143
    assert (wd / "cache" / "teacher" / "meta.json").exists()   # kept for the rerun
    res = _run(args(wd), _env(cache))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert _resumed_step(res.stdout) >= 10
    T.assert_same_outputs(straight, wd)   # incl. metrics.jsonl: one teacher_cache record
    d = T.max_abs_diff(T.restore_state(straight, steps), T.restore_state(wd, steps))
    assert d == 0.0, f"final state differs from the straight run by {d}"
    assert not (wd / "cache" / "teacher").exists() and not (straight / "cache" / "teacher").exists()


@pytest.mark.parametrize("build", ["before", "beside"])
def test_ctrl_c_during_the_teacher_cache_build_exits_130_and_the_rerun_builds_it(setup, tmp_path,
                                                                                build):
    """Ctrl-C while the per-token teacher cache is built (each teacher forward slowed down),
    exit 130 and no traceback. Built before the steps (the training loop not started): one
    line, and the same command again builds the cache from scratch and finishes. Built beside
    the steps (the default on CPU): the step reached is saved and the build stopped, and the
    same command again resumes from that step, builds the cache again and finishes."""
    teacher, cache = setup
    wd = tmp_path / "wd"
    # 40 steps of 8 read all 256 examples: the build forwards 32 batches, 0.5 s each.
    args = T.train_args(wd, teacher, steps=40, extra=("--config.teacher.cache_tokens=always",
                                                      f"--config.teacher.cache_build={build}"))
    # Python's own Ctrl-C handler, as in a terminal (as slow_main.py), whatever the test
    # runner's workers do with SIGINT (an ignored SIGINT is inherited).
    slow = ("import signal, sys, time\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "import jax_tinybert.main as m, jax_tinybert.teacher.cache as tc\n"
            "orig = tc.forwarded\n"
            "def forwarded(*a, **k):\n"
            "    for out in orig(*a, **k):\n"
            "        print('a teacher forward', flush=True)\n"
            "        time.sleep(0.5)\n"
            "        yield out\n"
            "tc.forwarded = forwarded\n"
            "sys.argv = ['jax-tinybert'] + sys.argv[1:]\n"
            "m.run()\n")
    env = T.env(**T.cache_env(cache), JTB_TEACHER_STORE="off")
    log = tmp_path / "interrupted.log"
    proc = subprocess.Popen([T.PYTHON, "-c", slow, *args], env=env, cwd=REPO,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    rc = T.signal_when(proc, lambda: log.read_text().count("a teacher forward") >= 2,
                       signal.SIGINT, RUN_TIMEOUT, "the cache build")
    out = log.read_text()
    assert rc == 130, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert "[teacher cache] stopped after " in out and " of 256 ex in " in out
    # No cache folder and no temporary one beside it.
    assert not [p for p in os.listdir(wd / "cache") if "teacher" in p], os.listdir(wd / "cache")
    if build == "before":
        assert out.rstrip().splitlines()[-1] == (
            "interrupted (Ctrl-C); rerun the same command to resume from the last checkpoint, "
            "or start over where there is none"), out[-3000:]
    else:
        saved = re.search(r"interrupted \(Ctrl-C\): saved step (\d+); rerun the same command to "
                          r"resume", out)
        assert saved and 1 <= int(saved.group(1)) < 32, out[-3000:]
    res = _run(args, env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout + res.stderr
    assert "stopped after" not in out, out[-3000:]
    assert ("resumed from step" in out) == (build == "beside"), out[-3000:]
    assert "teacher per-token cache: yes (0.00 GB (float16) for 256 rows)" in out, out[-3000:]
    built = [json.loads(x) for x in (wd / "metrics.jsonl").read_text().splitlines()
             if "teacher_cache/rows" in x]
    assert [b["teacher_cache/rows"] for b in built] == [256]   # built again, in full, once
    assert json.loads((wd / "summary.json").read_text())["steps"] == 40


def test_a_second_run_on_a_busy_workdir_stops_at_once_and_the_rerun_resumes(setup, tmp_path):
    """The same command started again while the first still runs (a second terminal, a job
    resubmitted), with a relative --workdir: the second stops at once, exit 2, one line naming
    the first run's pid, and writes nothing; the first goes on. Once the first is stopped
    (SIGTERM: it saves its step), the same command resumes it and finishes."""
    teacher, cache = setup
    args = [a.replace("--config=configs/", f"--config={REPO}/configs/")
            for a in _args("runs/busy", teacher)]
    env = dict(_env(cache), JTB_TEST_STEP_SLEEP="2")
    wd, log = tmp_path / "runs" / "busy", tmp_path / "first.log"
    first = subprocess.Popen([T.PYTHON, "-m", "slow_main", *args], env=env, cwd=tmp_path,
                             stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        T.wait_for(lambda: "\nstep " in log.read_text(), RUN_TIMEOUT, first, "the first step")
        record = (wd / "config.json").stat().st_mtime_ns
        second = subprocess.run([T.PYTHON, "-m", "jax_tinybert.main", *args], env=env,
                                cwd=tmp_path, capture_output=True, text=True, timeout=RUN_TIMEOUT)
        assert first.poll() is None, log.read_text()[-3000:]   # still running: a real overlap
        assert second.returncode == 2, second.stderr[-3000:]
        errors = [ln for ln in second.stderr.splitlines() if ln.startswith("error: ")]
        assert len(errors) == 1 and "Traceback" not in second.stderr, second.stderr[-3000:]
        assert errors[0].startswith(f"error: workdir runs/busy is in use by another run (pid "
                                    f"{first.pid} on host "), errors[0]
        assert "slow_main.py --config=" in errors[0]   # the first run's command line
        assert f"kill -TERM {first.pid}" in errors[0], errors[0]
        assert (wd / "config.json").stat().st_mtime_ns == record
        rc = T.signal_when(first, lambda: True, signal.SIGTERM, RUN_TIMEOUT)
    finally:
        if first.poll() is None:
            first.kill()
    out = log.read_text()
    assert rc == 143, out[-3000:]
    saved = T.saved_step(out)
    res = subprocess.run([T.PYTHON, "-m", "jax_tinybert.main", *args], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert _resumed_step(res.stdout + res.stderr) == saved
    assert json.loads((wd / "summary.json").read_text())["steps"] == STEPS
