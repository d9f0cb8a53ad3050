"""Faults across hosts, each test with several local processes (jax.distributed, gloo, CPU
devices), tiny models and short runs of the CLI (tests/helpers/multihost_main.py: the CLI with
the faults injected by env):

- the best and the periodic checkpoint of the same step, 20 times over and at the end of the
  run (eval and both saves at every step, 2 processes x 4 devices): the job ends with exit 0
  (two async saves at once used to meet at one orbax barrier and abort it);
- one process SIGKILLed: the other stops within the heartbeat timeout, and the job then
  resumes on another process count (2 x 4 -> 4 x 2, the same global batch) and ends where the
  unbroken job ends;
- one process that cannot restore the newest steps (its view of step 20 damaged, its read of
  step 19 failing): every process resumes from the same older step, and the job ends there too;
- a workdir held by another run: every process of a second job stops with the same one-line
  error before building any data (not only process 0, which takes the lock).

The tier runs alone: `pytest -m multihost` (tests/conftest.py leaves it out of `make test`);
about 2-3 minutes on 2 cores.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from helpers import tiny_run as T
from jax_tinybert.errors import EXIT_USER_ERROR

pytestmark = pytest.mark.multihost

REPO = T.REPO
RUN_TIMEOUT = 240
STEPS = 20
HEARTBEAT = 10
# What the survivor of a killed peer prints (docs/scaling.md, "When a process dies"): JAX's
# coordination service names the dead task on the line after JAX_DEAD; gloo, when a collective
# with the dead peer fails first, names no process.
JAX_DEAD = "The following tasks are unhealthy (stopped sending heartbeats):"
GLOO_DEAD = ("Received data size doesn't match expected size", "Connection closed by peer")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(a tiny task teacher with a classifier head, a JAX compile cache for every run here)."""
    base = tmp_path_factory.getbasetemp()
    cache = base / "jax_compile_cache"
    cache.mkdir(exist_ok=True)
    return T.tiny_teacher(base / "tiny_task_teacher", num_labels=2), str(cache)


def _env(cache, **extra):
    return T.env(**T.cache_env(cache), PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests' / 'helpers'}",
                 JTB_HEARTBEAT_TIMEOUT=str(HEARTBEAT), JTB_TEST_ALWAYS_BEST="1", **extra)


def _args(wd, teacher):
    """Prediction-layer distillation; eval, best save and periodic save at every step."""
    return T.train_args(wd, teacher, steps=STEPS, checkpoint_every=1, dropout=False,
                        config="configs/task_distill.py:sst2_pred",
                        extra=("--config.train.eval_every=1", "--config.train.eval_batch_size=16"))


def _launch(n, d, args, env, log_dir):
    """launch/local_multiprocess.sh -n n -d d -> (its CompletedProcess, [process logs])."""
    res = subprocess.run(["bash", str(REPO / "launch" / "local_multiprocess.sh"), "-n", str(n),
                          "-d", str(d), "-q", "-t", str(RUN_TIMEOUT), "-l", str(log_dir),
                          "-m", "multihost_main", "--", *map(str, args)],
                         env=dict(env, PYTHON=T.PYTHON), cwd=REPO,   # this venv, not python3
                         capture_output=True, text=True, timeout=RUN_TIMEOUT + 60)
    logs = [(pathlib.Path(log_dir) / f"process_{i}.log").read_text() for i in range(n)]
    return res, logs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(n, d, args, env, out_dir, module="multihost_main"):
    """n processes of one job, started directly (no launcher stops the others when one ends)."""
    port = _free_port()
    return [subprocess.Popen([T.PYTHON, "-m", module, *map(str, args)],
                             env=dict(env, JTB_COORDINATOR=f"127.0.0.1:{port}",
                                      JTB_NUM_PROCESSES=str(n), JTB_PROCESS_ID=str(i),
                                      JTB_CPU_DEVICES=str(d)),
                             cwd=REPO, stdout=open(out_dir / f"p{i}.log", "w"),
                             stderr=subprocess.STDOUT) for i in range(n)]


def _stop(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def _steps(d):
    return sorted(int(n) for n in os.listdir(d) if n.isdigit())


@pytest.fixture(scope="module")
def unbroken(setup, tmp_path_factory):
    """The job without faults, 2 processes x 4 devices: (workdir, [process logs])."""
    teacher, cache = setup
    base = tmp_path_factory.mktemp("mh_unbroken")
    res, logs = _launch(2, 4, _args(base / "wd", teacher), _env(cache), base / "logs")
    assert res.returncode == 0, res.stderr[-4000:]
    return base / "wd", logs


@pytest.mark.timeout(600)
def test_best_and_periodic_saves_of_one_step_never_collide(unbroken):
    wd, logs = unbroken
    log0 = logs[0]
    assert "on 8 device(s)" in log0 and "'data': 8" in log0
    # 20 steps, each with its best and its periodic save started together (the last one too).
    for what in ("best checkpoint step", "checkpoint step"):
        saved = [int(l.split(what)[1].split()[0]) for l in log0.splitlines()
                 if f"] {what} " in l]
        assert saved == list(range(1, STEPS + 1)), (what, saved)
    assert _steps(wd / "best") == [STEPS]
    assert _steps(wd / "checkpoints") == [STEPS - 2, STEPS - 1, STEPS]
    assert not any("already ongoing" in l for l in logs)
    assert (wd / "summary.json").exists()


@pytest.mark.timeout(600)
def test_killed_process_stops_the_other_then_resumes_on_another_process_count(
        setup, unbroken, tmp_path):
    teacher, cache = setup
    wd = tmp_path / "wd"
    args = _args(wd, teacher)
    procs = _start(2, 4, args, _env(cache, JTB_TEST_STEP_SLEEP="0.25"), tmp_path)
    try:
        T.wait_for(lambda: T.checkpoint_done(wd, 10), RUN_TIMEOUT, procs[0], "checkpoint 10")
        procs[1].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        rc = procs[0].wait(timeout=HEARTBEAT + 60)   # TimeoutExpired on a hang
        waited = time.monotonic() - t0
    finally:
        _stop(procs)
    log0 = (tmp_path / "p0.log").read_text()
    assert rc != 0 and waited < HEARTBEAT + 30, (rc, waited, log0[-3000:])
    lines = log0.splitlines()
    if any(JAX_DEAD in l for l in lines):      # JAX names the dead process: process 1
        after = lines[next(i for i, l in enumerate(lines) if JAX_DEAD in l) + 1]
        assert after.strip() == "1", after
    else:
        assert any(s in log0 for s in GLOO_DEAD), log0[-3000:]
    assert max(T.read_metrics(wd)) < STEPS, "the job finished before the kill: nothing tested"

    # The same job on 4 processes x 2 devices: the same 8 devices' global batch.
    res, logs = _launch(4, 2, args, _env(cache), tmp_path / "logs_4x2")
    assert res.returncode == 0, res.stderr[-4000:]
    assert "on 8 device(s)" in logs[0]
    resumed = [l for l in logs[0].splitlines() if l.startswith("resumed from step ")]
    assert len(resumed) == 1 and int(resumed[0].split()[3]) >= 10, logs[0][-3000:]
    _assert_ends_as(unbroken[0], wd)


def _assert_ends_as(straight, wd):
    """metrics.jsonl, TensorBoard and summary.json as the unbroken job's (apart from timings);
    the final state within 1e-6 (reductions over other process layouts)."""
    T.assert_same_outputs(straight, wd)
    d = T.max_abs_diff(T.restore_state(straight, STEPS), T.restore_state(wd, STEPS))
    assert d <= 1e-6, d


@pytest.mark.timeout(600)
def test_steps_one_process_cannot_restore_are_skipped_by_every_process(setup, unbroken, tmp_path):
    """Process 1 sees step 20 damaged (its digests) and cannot read step 19 (orbax): both
    processes resume from step 18, none waits for the other at a barrier of its own."""
    teacher, cache = setup
    wd = tmp_path / "wd"
    shutil.copytree(unbroken[0], wd)
    t0 = time.monotonic()
    res, logs = _launch(2, 4, _args(wd, teacher),
                        _env(cache, JTB_TEST_DAMAGED_VIEW="1:20", JTB_TEST_UNREADABLE="1:19"),
                        tmp_path / "logs")
    assert res.returncode == 0, res.stderr[-4000:]
    assert time.monotonic() - t0 < 120
    assert "simulated: this host's view" in logs[1] and "simulated: input/output" in logs[1]
    for log in logs:
        assert (f"restored checkpoint step {STEPS - 2} in {wd / 'checkpoints'} instead of the "
                f"newer, damaged step(s) [{STEPS - 1}, {STEPS}]") in log, log[-3000:]
    assert f"resumed from step {STEPS - 2} " in logs[0]
    assert {f"corrupt_{STEPS - 1}", f"corrupt_{STEPS}"} <= set(os.listdir(wd / "checkpoints"))
    _assert_ends_as(unbroken[0], wd)


HOLDER = ("import sys, time\n"
          "from jax_tinybert.train import workdir_lock\n"
          "with workdir_lock.hold(sys.argv[1]):\n"
          "    print('held', flush=True)\n"
          "    time.sleep(600)\n")


@pytest.mark.timeout(300)
def test_a_held_workdir_stops_every_process_of_a_second_job_before_its_data(setup, tmp_path):
    teacher, cache = setup
    wd = tmp_path / "wd"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(wd)], stdout=subprocess.PIPE,
                              text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    procs = []
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        procs = _start(2, 1, _args(wd, teacher), _env(cache), tmp_path,
                       module="jax_tinybert.main")
        rcs = [p.wait(timeout=120) for p in procs]
        waited = time.monotonic() - t0
    finally:
        _stop(procs)
        holder.kill()
        holder.wait()
    logs = [(tmp_path / f"p{i}.log").read_text() for i in range(2)]
    assert rcs == [EXIT_USER_ERROR] * 2, (rcs, logs[1][-3000:])
    assert waited < 60, waited
    for log in logs:
        errors = [l for l in log.splitlines() if l.startswith("error: ")]
        assert len(errors) == 1 and errors[0].startswith(
            f"error: workdir {wd} is in use by another run (pid {holder.pid} "), log[-3000:]
        assert "Traceback" not in log and "SST-2 train:" not in log
    assert os.listdir(wd) == [".jtb-lock"]    # no data, cache or record of the second job


# ----------------------------------------------------------------------------- general distillation
# A prepared corpus read per host through Grain (data/reader.py): the rows each process reads are
# recorded by multihost_main (JTB_TEST_ROWS_OUT), step by step.

CORPUS_STEPS = 16


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory, shared_dir, teacher_dir):
    """Two books prepared at seq_len 32 in shards of 300 rows (read in place by every run)."""
    from jax_tinybert.data import prepare, tokenize

    tok = tokenize.load_data_tokenizer(teacher_dir)
    books = [str(shared_dir / "data" / "corpus" / n) for n in
             ("gutenberg_pg1656_plato_apology_jowett.txt",
              "gutenberg_pg1974_aristotle_poetics_butcher.txt")]
    out = str(tmp_path_factory.mktemp("mh_corpus") / "prep")
    prepare.prepare(books, out, tok, prepare.Settings(seq_len=32, rows_per_shard=300))
    return out


def _gd_args(wd, teacher, corpus):
    return ["--config=configs/general_distill.py:tiny", f"--workdir={wd}",
            f"--config.teacher.path={teacher}", f"--config.data.corpus={corpus}",
            "--config.data.seq_len=32", "--config.data.corpus_memory_tokens=0",
            "--config.student.dropout=False", "--config.train.batch_size=16",
            f"--config.train.num_steps={CORPUS_STEPS}", "--config.train.checkpoint_every=4",
            "--config.train.log_every=1", "--config.train.max_to_keep=3",
            "--config.export.enabled=False"]


def _rows_read(out_dir, n):
    """{step: rows of the global batch, process 0's first} from the processes' records (the last
    record of a step wins: a resumed run reads its steps again)."""
    per = []
    for p in range(n):
        recs = {}
        for line in (pathlib.Path(out_dir) / f"rows_p{p}.jsonl").read_text().splitlines():
            r = json.loads(line)
            recs[r["step"]] = r["rows"]
        per.append(recs)
    assert all(set(r) == set(per[0]) for r in per), [sorted(r) for r in per]
    return {s: sum((per[p][s] for p in range(n)), []) for s in per[0]}


def _losses(wd):
    return {s: v[-1] for s, v in T.read_metrics(wd).items()}


def _close(a, b, rel=1e-5):
    assert sorted(a) == sorted(b) == list(range(1, CORPUS_STEPS + 1)), (sorted(a), sorted(b))
    worst = max(abs(a[s] - b[s]) / abs(b[s]) for s in a)
    assert worst <= rel, worst


@pytest.fixture(scope="module")
def corpus_unbroken(setup, corpus_dir, tmp_path_factory):
    """General distillation on 1 process x 8 devices and on 2 x 4 (interleaved): (workdir, rows)
    of each."""
    teacher = T.tiny_teacher(tmp_path_factory.getbasetemp() / "tiny_teacher")
    out = {}
    for n, d, order in ((1, 8, "plain"), (2, 4, "interleaved")):
        base = tmp_path_factory.mktemp(f"gd_{n}x{d}")
        env = _env(setup[1], JTB_TEST_ROWS_OUT=str(base), JTB_TEST_DEVICE_ORDER=order)
        res, logs = _launch(n, d, _gd_args(base / "wd", teacher, corpus_dir), env, base / "logs")
        assert res.returncode == 0, res.stderr[-4000:]
        assert "reading " in logs[0] and "in place from" in logs[0], logs[0][-3000:]
        out[n] = (base / "wd", _rows_read(base, n))
    return teacher, out


@pytest.mark.timeout(600)
def test_hosts_read_disjoint_rows_whose_union_is_the_one_process_batch(corpus_unbroken):
    _, runs = corpus_unbroken
    (wd1, rows1), (wd2, rows2) = runs[1], runs[2]
    for s in range(1, CORPUS_STEPS + 1):
        assert len(set(rows2[s])) == 16                       # no row read by both hosts
        assert rows2[s] == rows1[s], s                        # the same global batch
    epoch = [r for s in sorted(rows1) for r in rows1[s]]
    assert len(set(epoch)) == len(epoch)                      # 16 steps inside one epoch
    _close(_losses(wd2), _losses(wd1))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("killed_on,resumed_on", [((2, 4), (2, 4)), ((4, 2), (2, 4))])
def test_general_distillation_killed_then_resumed(killed_on, resumed_on, setup, corpus_dir,
                                                  corpus_unbroken, tmp_path):
    """Every process killed after checkpoint 8 (a preempted slice), resumed: on the same process
    count the run's outputs are the unbroken run's exactly; on another, the rows of every step
    are the same and the losses agree to 1e-5 relative."""
    teacher, runs = corpus_unbroken
    wd, (n, d) = tmp_path / "wd", killed_on
    args = _gd_args(wd, teacher, corpus_dir)
    env = _env(setup[1], JTB_TEST_DEVICE_ORDER="interleaved")
    (tmp_path / "killed").mkdir()
    (tmp_path / "resumed").mkdir()
    procs = _start(n, d, args, dict(env, JTB_TEST_STEP_SLEEP="0.3",
                                    JTB_TEST_ROWS_OUT=str(tmp_path / "killed")), tmp_path)
    try:
        T.wait_for(lambda: T.checkpoint_done(wd, 8), RUN_TIMEOUT, procs[0], "checkpoint 8")
    finally:
        _stop(procs)
    assert max(T.read_metrics(wd)) < CORPUS_STEPS, "finished before the kill: nothing tested"
    res, logs = _launch(*resumed_on, args, dict(env, JTB_TEST_ROWS_OUT=str(tmp_path / "resumed")),
                        tmp_path / "logs")
    assert res.returncode == 0, res.stderr[-4000:]
    resumed = [l for l in logs[0].splitlines() if l.startswith("resumed from step ")]
    assert len(resumed) == 1 and int(resumed[0].split()[3]) >= 8, logs[0][-3000:]
    straight_wd, straight = runs[2]
    before, after = _rows_read(tmp_path / "killed", n), _rows_read(tmp_path / "resumed", 2)
    assert sorted(after) == list(range(int(resumed[0].split()[3]) + 1, CORPUS_STEPS + 1))
    for rows in (before, after):
        assert {s: straight[s] for s in rows} == rows
    if killed_on == resumed_on:
        T.assert_same_outputs(straight_wd, wd)
    else:
        _close(_losses(wd), _losses(straight_wd))
