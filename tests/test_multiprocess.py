"""Multi-process runs on one machine: 2 processes x 4 CPU devices through
launch/local_multiprocess.sh and jax.distributed (gloo).

- the 2 x 4 job computes what 1 process on 1 device computes (same global batch, dropout off:
  dropout masks depend on the layout): losses at every step within 1e-5, final state within 1e-5;
- one process SIGKILLed mid-run: the other exits with an error within a bounded time (JAX's
  heartbeat timeout, set to 10 s with JTB_HEARTBEAT_TIMEOUT, or gloo's abort on the broken
  connection, whichever comes first), not a hang; the same launch
  command then resumes the job from its last checkpoint and ends where the uninterrupted
  2 x 4 job ends (state within 1e-6; metrics.jsonl, TensorBoard and summary.json equal apart
  from timings);
- a process that cannot reach the coordinator fails within --init_timeout with
  jax_tinybert.parallel.sharding.DistributedInitError naming the address.

Tiny random teacher and throttled killed runs as in tests/test_resume.py.
"""
from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import time

import pytest

from helpers import tiny_run as T

REPO = T.REPO
RUN_TIMEOUT = 300
STEPS = 20
HEARTBEAT = 10
# What the surviving process prints, whichever notices first (see docs/scaling.md).
DEAD_PEER_REPORTS = ("another task died", "unhealthy",
                     "Received data size doesn't match expected size", "Connection closed by peer")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return T.shared_dirs(tmp_path_factory)


def _env(cache, **extra):
    return T.env(**T.cache_env(cache), PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests' / 'helpers'}",
                 JTB_TEST_STEP_SLEEP="0.25", JTB_HEARTBEAT_TIMEOUT=str(HEARTBEAT), **extra)


def _args(wd, teacher):
    return T.train_args(wd, teacher, steps=STEPS, dropout=False)


def _launch(args, env, log_dir, module="jax_tinybert.main", timeout=RUN_TIMEOUT):
    res = subprocess.run(["bash", str(REPO / "launch" / "local_multiprocess.sh"), "-n", "2", "-d", "4",
                          "-q", "-t", str(timeout), "-l", str(log_dir), "-m", module, "--",
                          *map(str, args)], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=timeout + 60)
    assert res.returncode == 0, res.stderr[-4000:]
    return (pathlib.Path(log_dir) / "process_0.log").read_text()


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture(scope="module")
def straight_1p(setup, tmp_path_factory):
    teacher, cache = setup
    wd = tmp_path_factory.mktemp("mp_1p") / "wd"
    res = subprocess.run([T.PYTHON, "-m", "jax_tinybert.main", *_args(wd, teacher)],
                         env=_env(cache), cwd=REPO, capture_output=True, text=True,
                         timeout=RUN_TIMEOUT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "on 1 device(s)" in res.stdout
    return wd


@pytest.fixture(scope="module")
def straight_2p(setup, tmp_path_factory):
    teacher, cache = setup
    base = tmp_path_factory.mktemp("mp_2p")
    # checkpoint_seconds: the first process's clock decides each periodic save for both (the
    # steps sleep 0.25 s, so saves 5 steps apart are all due; a split decision would hang).
    log0 = _launch(_args(base / "wd", teacher) + ["--config.train.checkpoint_seconds=0.5"],
                   _env(cache), base / "logs")
    assert "on 8 device(s)" in log0 and "'data': 8" in log0
    assert "at least 0.5 s apart" in log0
    assert sorted(int(n) for n in os.listdir(base / "wd" / "checkpoints") if n.isdigit()) \
        == [10, 15, 20]
    return base / "wd"


def _losses(wd):
    m = T.read_metrics(wd)
    assert sorted(m) == list(range(1, STEPS + 1))
    return m


# The two heavy runs belong to the multi-host tier (make test-multihost): make test keeps the
# cheap start-up check below.
@pytest.mark.multihost
@pytest.mark.timeout(600)
def test_two_processes_equal_one_process(straight_1p, straight_2p):
    one, two = _losses(straight_1p), _losses(straight_2p)
    worst = max(abs(one[s][0] - two[s][0]) for s in one)
    assert worst <= 1e-5, worst
    assert abs(one[STEPS][0] - one[1][0]) > 1e-2       # training moved: the check has teeth
    d = T.max_abs_diff(T.restore_state(straight_1p, STEPS), T.restore_state(straight_2p, STEPS))
    assert d <= 1e-5, d


@pytest.mark.multihost
@pytest.mark.timeout(600)
def test_killed_process_fails_the_other_then_resume(setup, straight_2p, tmp_path):
    teacher, cache = setup
    wd = tmp_path / "wd"
    args = _args(wd, teacher)
    port = _free_port()
    procs = []
    try:
        for i in range(2):
            env = _env(cache, JTB_COORDINATOR=f"127.0.0.1:{port}", JTB_NUM_PROCESSES=2,
                       JTB_PROCESS_ID=i, JTB_CPU_DEVICES=4)
            procs.append(subprocess.Popen([T.PYTHON, "-m", "slow_main", *args], env=env, cwd=REPO,
                                          stdout=open(tmp_path / f"p{i}.log", "w"),
                                          stderr=subprocess.STDOUT))
        T.wait_for(lambda: T.checkpoint_done(wd, 10), RUN_TIMEOUT, procs[0], "checkpoint 10")
        procs[1].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        rc = procs[0].wait(timeout=HEARTBEAT + 60)   # raises TimeoutExpired on a hang
        waited = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    log0 = (tmp_path / "p0.log").read_text()
    assert rc != 0, log0[-3000:]
    assert waited < HEARTBEAT + 30, waited
    # Either JAX's coordination service ends it (the dead task's heartbeats stop), or gloo,
    # blocked in a collective with the dead peer, aborts first on the broken connection.
    assert any(s in log0 for s in DEAD_PEER_REPORTS), log0[-3000:]
    seen = T.read_metrics(wd)
    assert max(seen) < STEPS, "the run finished before the kill: nothing was tested"

    log0 = _launch(args, _env(cache), tmp_path / "logs_resumed")   # the same job again
    resumed = [l for l in log0.splitlines() if l.startswith("resumed from step ")]
    assert len(resumed) == 1, log0[-3000:]
    from_step = int(resumed[0].split()[3])
    assert from_step >= 10 and from_step % 5 == 0
    # Outputs (metrics.jsonl, TensorBoard, summary.json) as the uninterrupted job's, apart
    # from timings; final state within 1e-6 (2-process reductions).
    T.assert_same_outputs(straight_2p, wd)
    d = T.max_abs_diff(T.restore_state(straight_2p, STEPS), T.restore_state(wd, STEPS))
    assert d <= 1e-6, d


@pytest.mark.timeout(300)
def test_unreachable_coordinator_fails_with_address(tmp_path):
    port = _free_port()                              # nobody listens there
    env = T.env(JTB_COORDINATOR=f"127.0.0.1:{port}", JTB_NUM_PROCESSES=2, JTB_PROCESS_ID=1,
                JTB_CPU_DEVICES=1)
    code = ("import sys, time\n"
            "from jax_tinybert import main\n"            # what the CLI imports first
            "from jax_tinybert.parallel import sharding\n"
            "t = time.monotonic()\n"
            "try:\n"
            "    sharding.maybe_initialize_distributed(timeout_s=5)\n"
            "except sharding.DistributedInitError as e:\n"
            "    print('ELAPSED', time.monotonic() - t); print('MSG', e); sys.exit(3)\n")
    res = subprocess.run([T.PYTHON, "-c", code], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 3, res.stdout + res.stderr[-3000:]
    elapsed = float(res.stdout.split("ELAPSED")[1].split()[0])
    assert 4 <= elapsed <= 7, elapsed
    assert f"127.0.0.1:{port}" in res.stdout
    # The CLI: a non-zero exit and the error with the address, no C++ abort.
    res = subprocess.run([T.PYTHON, "-m", "jax_tinybert.main", "--config=configs/demo.py",
                          f"--workdir={tmp_path / 'wd'}", "--init_timeout=5"], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1, res.stderr[-3000:]
    assert "DistributedInitError" in res.stderr and f"127.0.0.1:{port}" in res.stderr
    assert not (tmp_path / "wd").exists()
