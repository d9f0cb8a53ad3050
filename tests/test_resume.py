"""Kill-and-resume of real training runs (issue 6).

A 20-step run straight through vs the same command hard-killed (SIGKILL) or preempted (SIGTERM)
after its step-10 checkpoint, then started again: the resumed run continues from the saved step,
its losses match the straight run's step for step (<= 1e-5) and its final TrainState (student +
projection params, optimizer state, rng) equals the straight run's (<= 1e-6). The same for a
2-process x 4-device job with one process SIGKILLed: tests/test_multiprocess.py.

Runs use a tiny random teacher (tests/helpers/tiny_run.py) so each compiles in seconds; the killed
runs go through tests/helpers/slow_main.py (jax_tinybert.main with a sleep after each logged
step) so that the signal lands mid-run at a known point.
"""
from __future__ import annotations

import os
import pathlib
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


def _check_resumed(straight, resumed, n_before: int, from_step: int):
    """The resumed run's records start at from_step + 1 and run to STEPS; every loss of the
    resumed workdir (before and after the kill) equals the straight run's at that step."""
    ref = T.read_metrics(straight)
    assert sorted(ref) == list(range(1, STEPS + 1))
    lines = (pathlib.Path(resumed) / "metrics.jsonl").read_text().splitlines()
    import json

    after = [json.loads(l) for l in lines[n_before:] if "train/loss" in l]
    assert [r["step"] for r in after] == list(range(from_step + 1, STEPS + 1))
    got = T.read_metrics(resumed)
    worst = 0.0
    for step, losses in got.items():
        for loss in losses:
            worst = max(worst, abs(loss - ref[step][0]))
    assert worst <= 1e-5, f"loss curve differs from the straight run by {worst}"
    d = T.max_abs_diff(T.restore_state(straight, STEPS), T.restore_state(resumed, STEPS))
    assert d <= 1e-6, f"final state differs from the straight run by {d}"
    return worst, d


def _n_records(workdir) -> int:
    p = pathlib.Path(workdir) / "metrics.jsonl"
    return len(p.read_text().splitlines()) if p.exists() else 0


@pytest.fixture(scope="module")
def straight(setup, tmp_path_factory):
    teacher, cache = setup
    wd = tmp_path_factory.mktemp("straight") / "wd"
    res = _run(T.train_args(wd, teacher, steps=STEPS), _env(cache))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return wd


@pytest.mark.timeout(600)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_kill_and_resume_single_process(setup, straight, tmp_path, sig):
    teacher, cache = setup
    wd = tmp_path / "wd"
    args = T.train_args(wd, teacher, steps=STEPS)
    env = _env(cache)
    proc = _start(args, env, tmp_path / "killed.log")
    try:
        T.wait_for(lambda: T.checkpoint_done(wd, 10), RUN_TIMEOUT, proc, "checkpoint 10")
        proc.send_signal(sig)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = (tmp_path / "killed.log").read_text()
    seen = T.read_metrics(wd)
    assert max(seen) < STEPS, "the run finished before the signal: nothing was tested"
    if sig == signal.SIGKILL:
        assert rc == -signal.SIGKILL, out[-3000:]
        saved = max(s for s in range(5, STEPS + 1, 5) if T.checkpoint_done(wd, s))
    else:
        # A final save at the step where the signal arrived, then exit code 143.
        assert rc == 143, out[-3000:]
        lines = [l for l in out.splitlines() if l.startswith("preempted: saved step ")]
        assert len(lines) == 1, out[-3000:]
        saved = int(lines[0].split()[3].rstrip(";"))
        assert saved >= 10 and T.checkpoint_done(wd, saved)
        assert max(seen) == saved                # it stopped right after that step
    n_before = _n_records(wd)
    res = _run(args, env)                        # the same command again
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    from_step = _resumed_step(res.stdout)
    assert from_step == saved
    _check_resumed(straight, wd, n_before, from_step)


def test_metrics_writer_resume_drops_replayed_steps_and_rebuilds_tensorboard(tmp_path):
    """A killed run wrote steps 1..9 (and a torn line); resuming from the step-6 checkpoint
    keeps 1..6, and after steps 7..10 the JSON lines and TensorBoard equal an unbroken run's."""
    import json

    from jax_tinybert.metrics_writer import MetricsWriter, read_jsonl

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
