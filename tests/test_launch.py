"""Launch scripts (launch/*): shellcheck, --help, dry-run commands, fail-fast multi-process runs,
and runs that survive preemption (TPU `run --until-done`, SLURM requeueing) against stubs."""
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
LAUNCH = REPO / "launch"
SCRIPTS = ["tpu_vm.sh", "gpu.sh", "slurm.sbatch", "local_multiprocess.sh"]
TPU_VARS = ("TPU_NAME", "ZONE", "PROJECT", "ACCELERATOR_TYPE", "RUNTIME_VERSION", "QUEUED_RESOURCE_ID")


def _env(**extra):
    """A clean environment: none of the variables the scripts read, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if k not in TPU_VARS and not k.startswith(("JTB_", "SLURM_")) and k not in ("PYTHON", "DRY_RUN")}
    env.update(extra)
    return env


def _run(args, env=None, timeout=60, cwd=REPO):
    return subprocess.run(["bash", *map(str, args)], env=env if env is not None else _env(), cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


# --------------------------------------------------------------------------- static checks


@pytest.mark.parametrize("script", SCRIPTS)
def test_shellcheck_clean(script):
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck binary not installed (make install tries `apt-get install shellcheck`)")
    res = subprocess.run([shellcheck, "--shell=bash", str(LAUNCH / script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_strict_mode_and_help(script):
    text = (LAUNCH / script).read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in text
    res = _run([LAUNCH / script, "--help"])
    assert res.returncode == 0, res.stderr
    assert "jax_tinybert.main" in res.stdout
    assert "--dry-run" in res.stdout or "DRY_RUN" in res.stdout


@pytest.mark.parametrize("script", ["tpu_vm.sh", "gpu.sh", "local_multiprocess.sh"])
def test_executable(script):
    assert os.access(LAUNCH / script, os.X_OK)


# --------------------------------------------------------------------------- TPU VM

TPU_ENV = dict(TPU_NAME="jtb-test", ZONE="us-central2-b", PROJECT="my-proj", ACCELERATOR_TYPE="v4-32")
LOC = "--zone=us-central2-b --project=my-proj"


def _tpu(*args, **env):
    res = _run([LAUNCH / "tpu_vm.sh", "--dry-run", *args], env=_env(**{**TPU_ENV, **env}))
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_tpu_create_dry_run():
    out = _tpu("create")
    assert (f"+ gcloud compute tpus tpu-vm create jtb-test {LOC} --accelerator-type=v4-32 "
            "--version=tpu-ubuntu2204-base") in out
    assert "--spot" not in out
    out = _tpu("create", "--spot", "--runtime-version", "v2-alpha-tpuv5-lite")
    assert "tpu-vm create jtb-test" in out and "--version=v2-alpha-tpuv5-lite --spot" in out


def test_tpu_create_queued_dry_run():
    out = _tpu("create", "--queued", "--spot")
    assert (f"+ gcloud compute tpus queued-resources create jtb-test-qr --node-id=jtb-test {LOC} "
            "--accelerator-type=v4-32 --runtime-version=tpu-ubuntu2204-base --spot") in out
    assert "tpu-vm create" not in out


def test_tpu_setup_dry_run():
    out = _tpu("setup")
    assert f"gcloud compute tpus tpu-vm ssh jtb-test {LOC} --worker=all" in out
    assert "gcloud compute tpus tpu-vm scp --worker=all --recurse" in out
    assert "jtb-test:jax-tinybert" in out
    assert "pip install" in out and "jax\\[tpu\\]" in out and "-e \"$HOME\"/jax-tinybert" in out
    out = _tpu("setup", "--git", "https://example.com/jtb.git", "--ref", "v1")
    assert "git clone --depth 1 --branch v1 https://example.com/jtb.git" in out
    assert "scp" not in out


def test_tpu_run_dry_run():
    out = _tpu("run", "--run-id", "r1", "--env", "FOO=bar", "configs/task_distill.py:sst2",
               "--workdir=gs://bucket/run 1", "--config.train.steps=10")
    assert f"+ gcloud compute tpus tpu-vm ssh jtb-test {LOC} --worker=all '--command=" in out
    assert "nohup env FOO=bar \"$HOME\"/jtb-venv/bin/python -m jax_tinybert.main" in out
    assert "--config=configs/task_distill.py:sst2 --workdir=gs://bucket/run\\ 1 --config.train.steps=10" in out
    assert "jtb-logs/r1/worker-$W.log 2>&1 < /dev/null &" in out   # one log per worker, detached
    assert "agent-worker-number" in out


def test_tpu_tail_stop_delete_dry_run():
    out = _tpu("tail", "-f")
    assert f"tpu-vm ssh jtb-test {LOC} --worker=all" in out and "tail -v -n 40 -F" in out
    assert "--worker=0" in _tpu("tail", "--worker", "0")
    assert "worker-*.pid" in _tpu("stop")
    assert f"+ gcloud compute tpus tpu-vm delete jtb-test {LOC} --quiet" in _tpu("delete")
    assert f"+ gcloud compute tpus queued-resources delete jtb-test-qr {LOC} --force --quiet" in _tpu(
        "delete", "--queued")


def test_tpu_flags_override_env():
    out = _tpu("--name", "other", "--zone=europe-west4-a", "delete")
    assert "tpu-vm delete other --zone=europe-west4-a --project=my-proj" in out


def test_tpu_missing_variables_listed():
    res = _run([LAUNCH / "tpu_vm.sh", "--dry-run", "create"], env=_env())
    assert res.returncode != 0
    assert "missing" in res.stderr
    for var in ("TPU_NAME", "ZONE", "PROJECT", "ACCELERATOR_TYPE"):
        assert var in res.stderr
    assert "gcloud" not in res.stdout
    res = _run([LAUNCH / "tpu_vm.sh", "--dry-run", "create"], env=_env(TPU_NAME="x", PROJECT="p"))
    assert res.returncode != 0
    line = next(l for l in res.stderr.splitlines() if "missing" in l)
    assert "ZONE" in line and "ACCELERATOR_TYPE" in line
    assert "TPU_NAME" not in line and "PROJECT" not in line
    res = _run([LAUNCH / "tpu_vm.sh", "--dry-run", "run", "configs/x.py"], env=_env(ZONE="z"))
    assert res.returncode != 0 and "TPU_NAME" in res.stderr and "PROJECT" in res.stderr


def test_tpu_unknown_subcommand():
    res = _run([LAUNCH / "tpu_vm.sh", "frobnicate"], env=_env(**TPU_ENV))
    assert res.returncode != 0 and "unknown subcommand" in res.stderr


# --------------------------------------------------------------------------- GPU / SLURM


def test_gpu_dry_run():
    res = _run([LAUNCH / "gpu.sh", "--dry-run", "--gpus", "0,1", "--config=configs/a.py:b", "--workdir=runs/x"])
    assert res.returncode == 0, res.stderr
    assert ("JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_MEM_FRACTION=0.90 CUDA_VISIBLE_DEVICES=0,1 ") in res.stderr
    assert "-m jax_tinybert.main --config=configs/a.py:b --workdir=runs/x" in res.stderr


def test_gpu_runs_program_and_passes_exit_code(tmp_path):
    (tmp_path / "probe.py").write_text(textwrap.dedent("""
        import os, sys
        print("ARGS", sys.argv[1:], "CPU", os.environ.get("JTB_CPU_DEVICES"),
              "FRAC", os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"], flush=True)
        sys.exit(7)
    """))
    env = _env(PYTHON=sys.executable, PYTHONPATH=str(tmp_path), JAX_PLATFORMS="cpu", JTB_CPU_DEVICES="4")
    res = _run([LAUNCH / "gpu.sh", "-m", "probe", "--log", tmp_path / "log.txt", "--", "--workdir=w"], env=env)
    assert res.returncode == 7
    assert "ARGS ['--workdir=w'] CPU None FRAC 0.90" in res.stdout
    assert "ARGS" in (tmp_path / "log.txt").read_text()


def test_slurm_dry_run():
    env = _env(DRY_RUN="1", SLURM_GPUS_ON_NODE="4", SLURM_NTASKS_PER_NODE="1", JTB_COORDINATOR="x:1")
    res = _run([LAUNCH / "slurm.sbatch", "--config=configs/a.py", "--workdir=/shared/w"], env=env)
    assert res.returncode == 0, res.stderr
    assert "JAX_LOCAL_DEVICE_IDS=0,1,2,3" in res.stdout
    assert "+ srun --kill-on-bad-exit=1 --output=" in res.stdout
    assert "-m jax_tinybert.main --config=configs/a.py --workdir=/shared/w" in res.stdout
    env = _env(DRY_RUN="1", SLURM_NTASKS_PER_NODE="8")
    res = _run([LAUNCH / "slurm.sbatch", "--config=configs/a.py"], env=env)
    assert res.returncode == 0 and "JAX_LOCAL_DEVICE_IDS=<jax default>" in res.stdout


def test_slurm_outside_job_refuses():
    res = _run([LAUNCH / "slurm.sbatch", "--config=configs/a.py"])
    assert res.returncode != 0 and "sbatch" in res.stderr


# --------------------------------------------------------------------------- local multi-process

STAND_IN = textwrap.dedent("""
    import os, sys, time
    pid = int(os.environ["JTB_PROCESS_ID"])
    out = os.environ["MARK_DIR"]
    with open(os.path.join(out, f"env_{pid}"), "w") as f:
        f.write(" ".join([os.environ["JTB_COORDINATOR"], os.environ["JTB_NUM_PROCESSES"],
                          os.environ["JTB_CPU_DEVICES"], os.environ["JAX_PLATFORMS"], str(os.getpid())]
                         + sys.argv[1:]))
    print(f"hello from process {pid}", flush=True)
    mode = sys.argv[1]
    if mode == "fail" and pid == 1:
        time.sleep(0.5)
        print("process 1 gives up", flush=True)
        sys.exit(3)
    if mode == "peer_killed":   # 1 is SIGKILLed; 0 aborts ~30 ms later, as gloo makes it do
        import signal
        if pid == 1:
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        mark = os.path.join(out, "env_1")
        while not os.path.exists(mark) or not open(mark).read():
            time.sleep(0.01)
        peer = int(open(mark).read().split()[4])
        def gone():
            try:
                return open(f"/proc/{peer}/stat").read().split(")")[-1].split()[0] == "Z"
            except FileNotFoundError:
                return True
        while not gone():
            time.sleep(0.005)
        time.sleep(0.03)
        print("terminate called after throwing an instance of 'gloo::EnforceNotMet'", flush=True)
        os.abort()
    if mode == "save":   # SIGTERM: a save that takes longer than the old 5 s grace, then 143
        import signal
        def saved(*_):
            time.sleep(6)
            open(os.path.join(out, f"saved_{pid}"), "w").close()
            sys.exit(143)
        signal.signal(signal.SIGTERM, saved)
    if mode in ("fail", "hang", "save"):
        time.sleep(600)
""")


def _stand_in(tmp_path):
    (tmp_path / "stand_in.py").write_text(STAND_IN)
    marks = tmp_path / "marks"
    marks.mkdir()
    return _env(PYTHON=sys.executable, PYTHONPATH=str(tmp_path), MARK_DIR=str(marks)), marks


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(pid, 0): look at its state
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(120)
def test_local_multiprocess_success(tmp_path):
    env, marks = _stand_in(tmp_path)
    res = _run([LAUNCH / "local_multiprocess.sh", "-n", "3", "-d", "2", "-m", "stand_in", "--",
                "ok", f"--workdir={tmp_path / 'wd'}"], env=env)
    assert res.returncode == 0, res.stderr
    envs = [(marks / f"env_{i}").read_text().split() for i in range(3)]
    assert len({e[0] for e in envs}) == 1 and envs[0][0].startswith("127.0.0.1:")
    assert all(e[1:4] == ["3", "2", "cpu"] for e in envs)
    assert envs[2][5:] == ["ok", f"--workdir={tmp_path / 'wd'}"]
    assert "hello from process 0" in res.stdout            # process 0 is echoed to the console
    assert "hello from process 1" not in res.stdout
    for i in range(3):                                       # default log dir: <workdir>/logs
        assert f"hello from process {i}" in (tmp_path / "wd" / "logs" / f"process_{i}.log").read_text()


@pytest.mark.timeout(120)
def test_local_multiprocess_failure_kills_the_others(tmp_path):
    env, marks = _stand_in(tmp_path)
    t0 = time.monotonic()
    res = _run([LAUNCH / "local_multiprocess.sh", "-n", "3", "-d", "1", "-l", tmp_path / "logs",
                "-m", "stand_in", "--", "fail"], env=env, timeout=60)
    elapsed = time.monotonic() - t0
    assert res.returncode == 3, res.stderr
    assert elapsed < 30
    assert "process 1 (pid" in res.stderr
    assert str(tmp_path / "logs" / "process_1.log") in res.stderr
    assert "process 1 gives up" in res.stderr               # the tail of its log is shown
    for i in (0, 2):
        pid = int((marks / f"env_{i}").read_text().split()[4])
        assert not _alive(pid), f"process {i} (pid {pid}) survived"


@pytest.mark.timeout(120)
def test_local_multiprocess_names_the_killed_process_not_the_survivor_it_aborted(tmp_path):
    # A peer SIGKILLed (OOM killer, lost node) makes the survivors abort within milliseconds;
    # when the launcher sees both at once it must name the killed one, not process 0's abort.
    env, marks = _stand_in(tmp_path)
    res = _run([LAUNCH / "local_multiprocess.sh", "-n", "2", "-d", "1", "-l", tmp_path / "logs",
                "-m", "stand_in", "--", "peer_killed"], env=env, timeout=60)
    assert res.returncode == 137, res.stderr
    first = next(line for line in res.stderr.splitlines() if "failed with" in line)
    assert first.startswith("local_multiprocess.sh: process 1 (pid "), res.stderr
    assert "failed with exit code 137 (SIGKILL)" in first, res.stderr
    if "had failed too" in res.stderr:   # seen in the same poll (the usual case)
        assert "process 0 (pid " in res.stderr and "exit code 134 (SIGABRT)" in res.stderr
    assert "process 0 (pid" not in first


@pytest.mark.timeout(120)
def test_local_multiprocess_timeout(tmp_path):
    env, marks = _stand_in(tmp_path)
    t0 = time.monotonic()
    res = _run([LAUNCH / "local_multiprocess.sh", "-n", "2", "-d", "1", "-t", "2", "-q",
                "-m", "stand_in", "--", "hang"], env=env, timeout=60)
    assert res.returncode == 124, res.stderr
    assert time.monotonic() - t0 < 30 and "timeout" in res.stderr
    for i in range(2):
        assert not _alive(int((marks / f"env_{i}").read_text().split()[4]))


@pytest.mark.timeout(120)
def test_local_multiprocess_interrupt_lets_every_process_save_then_a_second_kills():
    """Ctrl-C or SIGTERM to the script: each process gets SIGTERM and the time to save its step
    (here 6 s; the script once killed them after 5 s); a second signal kills them at once.
    SIGTERM drives the test: a test runner may start it with SIGINT ignored, which bash then
    cannot trap; both signals take the same path."""
    import signal

    for twice in (False, True):
        env, marks = _stand_in(tmp_path := pathlib.Path(tempfile.mkdtemp()))
        proc = subprocess.Popen(["bash", str(LAUNCH / "local_multiprocess.sh"), "-n", "2", "-d", "1",
                                 "-q", "-l", str(tmp_path / "logs"), "-m", "stand_in", "--", "save"],
                                env=env, cwd=REPO, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not all((marks / f"env_{i}").exists() for i in range(2)):
            assert time.monotonic() < deadline and proc.poll() is None, "the processes did not start"
            time.sleep(0.1)
        time.sleep(0.5)   # their SIGTERM handlers are in place
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        if twice:
            time.sleep(1)
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - t0
        assert proc.returncode == 143, err
        pids = [int((marks / f"env_{i}").read_text().split()[4]) for i in range(2)]
        assert not any(_alive(p) for p in pids), err
        saved = [(marks / f"saved_{i}").exists() for i in range(2)]
        if twice:
            assert saved == [False, False] and elapsed < 5 and "killing all processes now" in err, err
        else:
            assert saved == [True, True] and 6 <= elapsed < 30, (elapsed, err)
            assert "every process saves its step and stops" in err and "rerun the same command" in err
        shutil.rmtree(tmp_path, ignore_errors=True)


def test_local_multiprocess_dry_run_and_bad_args():
    res = _run([LAUNCH / "local_multiprocess.sh", "--dry-run", "-n", "2", "-d", "4", "-p", "1234", "--",
                "--config=configs/demo.py", "--workdir=/tmp/x"])
    assert res.returncode == 0, res.stderr
    assert ("env JTB_COORDINATOR=127.0.0.1:1234 JTB_NUM_PROCESSES=2 JTB_PROCESS_ID=1 JTB_CPU_DEVICES=4 ") in res.stderr
    assert "-m jax_tinybert.main --config=configs/demo.py --workdir=/tmp/x > /tmp/x/logs/process_1.log" in res.stderr
    res = _run([LAUNCH / "local_multiprocess.sh", "-n", "zero", "--", "x"])
    assert res.returncode != 0 and "--num-processes" in res.stderr


# --------------------------------------------------------------------------- the real thing


@pytest.mark.timeout(600)
def test_local_multiprocess_real_distillation_2x4(tmp_path_factory, tmp_path):
    """2 processes x 4 CPU devices = 8 global devices, through jax.distributed + gloo: a short
    general distillation on generated text (tiny teacher, see tests/helpers/tiny_run.py)."""
    from helpers import tiny_run as T
    from jax_tinybert.data import synthetic

    teacher, cache = T.shared_dirs(tmp_path_factory)
    corpus = synthetic.write_corpus(str(tmp_path / "corpus.txt"), n_docs=40)
    env = _env(PYTHON=T.PYTHON, XLA_FLAGS=T.FAST_COMPILE_XLA_FLAGS, **T.MALLOC, **T.cache_env(cache))
    wd = tmp_path / "wd"
    res = _run([LAUNCH / "local_multiprocess.sh", "-n", "2", "-d", "4", "-t", "400", "-q", "--",
                "--config=configs/general_distill.py", f"--workdir={wd}",
                f"--config.teacher.path={teacher}", f"--config.data.corpus={corpus}",
                "--config.data.seq_len=32", "--config.student.num_hidden_layers=1",
                "--config.student.hidden_size=16", "--config.student.intermediate_size=32",
                "--config.student.num_attention_heads=4", "--config.train.batch_size=16",
                "--config.train.num_steps=6", "--config.train.log_every=1",
                "--config.train.checkpoint_every=3"], env=env, timeout=460)
    logs = {i: (wd / "logs" / f"process_{i}.log").read_text() for i in range(2)}
    assert res.returncode == 0, res.stderr[-4000:] + "\n" + logs[1][-4000:]
    assert "Traceback" not in logs[0] + logs[1]
    assert "on 8 device(s)" in logs[0] and "step      6/6" in logs[0]
    assert (wd / "checkpoints" / "6").is_dir() and (wd / "summary.json").exists()
    export = wd / "export"
    assert (export / "config.json").exists() and (export / "flax_model.msgpack").exists()


# --------------------------------------------------------------------------- surviving preemption
# The launchers against stand-ins that record their calls and play the cloud or the cluster
# (tests/helpers/launch_stubs.py): a slice preempted under a running command, a SLURM job
# stopped at its time limit.

UNTIL_DONE = ("--poll", "0.2", "--backoff", "0", "--log-upload", "1")


def _until_done(tmp_path, plan, *extra, workers=2, wd="gs://bkt/runs/general", timeout=120):
    from helpers import launch_stubs as S

    stub_env, stub, gcs = S.tpu_cloud(tmp_path, plan, workers=workers)
    env = _env(**TPU_ENV, **stub_env, TMPDIR=str(tmp_path))
    try:
        res = _run([LAUNCH / "tpu_vm.sh", "--spot", "run", "--until-done", *UNTIL_DONE, *extra,
                    "configs/general_distill.py", f"--workdir={wd}", "--config.train.num_steps=6"],
                   env=env, timeout=timeout)
    finally:
        S.kill_leftovers(stub)
    return res, stub, gcs, S.calls(stub)


def _verbs(calls):
    """('tpu-vm', 'create') style pairs of the slice's lifecycle calls, in order."""
    return [(c[2], c[3]) for c in calls if c[:2] == ["compute", "tpus"] and c[3] in ("create", "delete")]


@pytest.mark.timeout(180)
def test_tpu_until_done_recreates_a_preempted_slice_and_resumes_the_same_workdir(tmp_path):
    res, stub, gcs, calls = _until_done(tmp_path, ["preempt", "done"])
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    # No slice at the start: created; preempted under attempt 1: deleted and created again.
    assert _verbs(calls) == [("tpu-vm", "create"), ("tpu-vm", "delete"), ("tpu-vm", "create")], calls
    creates = [c for c in calls if c[3:4] == ["create"]]
    assert all("--spot" in c and "--accelerator-type=v4-32" in c for c in creates), creates
    assert "TPU VM jtb-test is PREEMPTED: deleting it and creating it again" in res.stdout
    assert "finished: gs://bkt/runs/general/summary.json exists (2 attempt(s)" in res.stdout
    # Every start on every worker ran the same command, on the same workdir.
    argvs = {(stub / f"argv-{n}-{w}").read_text() for n in (1, 2) for w in (0, 1)}
    assert argvs == {"--config=configs/general_distill.py\n--workdir=gs://bkt/runs/general\n"
                     "--config.train.num_steps=6\n"}, argvs
    # The setup ran on each worker of each new slice (the venv the fake interpreter lives in).
    assert (stub / "uv.log").read_text().count("uv venv") == 2 * 2
    # Each worker's log of each attempt is in the bucket, the preempted ones to their last line.
    logs = gcs / "bkt" / "runs" / "general" / "logs"
    assert sorted(p.name for p in logs.iterdir()) == [
        f"worker-{w}-attempt-{k}.log" for w in (0, 1) for k in (1, 2)]
    for w in (0, 1):
        first = (logs / f"worker-{w}-attempt-1.log").read_text()
        assert f"worker {w}, start 1: preempt" in first and "preempted: saved step 3" in first, first
        second = (logs / f"worker-{w}-attempt-2.log").read_text()
        assert "resumed from step 3" in second and "step 6/6" in second, second
    assert "attempt 1 ended: the TPU VM jtb-test was PREEMPTED" in res.stdout


@pytest.mark.timeout(180)
def test_tpu_until_done_queued_resource_waits_for_it_and_recreates_it(tmp_path):
    res, stub, gcs, calls = _until_done(tmp_path, ["preempt", "done"], "--queued", workers=1)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert _verbs(calls) == [("queued-resources", "create"), ("queued-resources", "delete"),
                             ("queued-resources", "create")], calls
    assert "queued resource jtb-test-qr is WAITING_FOR_RESOURCES" in res.stdout
    assert "queued resource jtb-test-qr is SUSPENDED: deleting it and creating it again" in res.stdout
    delete = next(c for c in calls if c[2:4] == ["queued-resources", "delete"])
    assert "--force" in delete and "jtb-test-qr" in delete
    assert (gcs / "bkt" / "runs" / "general" / "logs" / "worker-0-attempt-2.log").exists()


@pytest.mark.timeout(180)
def test_tpu_until_done_gives_up_after_max_attempts_and_at_once_on_a_user_error(tmp_path):
    res, stub, gcs, calls = _until_done(tmp_path / "a", ["crash", "crash", "done"], "--max-attempts", "2")
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert "gave up after 2 attempt(s) (--max-attempts 2) without gs://bkt/runs/general/summary.json" in res.stderr
    assert "worker 0 exited 1 (failed)" in res.stderr and "Rerun the same command" in res.stderr
    assert _verbs(calls) == [("tpu-vm", "create")]   # a crash on a READY slice: the same slice again
    assert not (stub / "argv-3-0").exists()
    # A mistake in the command stops at once: rerunning cannot fix it.
    res, stub, gcs, calls = _until_done(tmp_path / "b", ["usererror", "done"])
    assert res.returncode == 2, res.stdout[-3000:] + res.stderr[-3000:]
    assert "exited 2 (a mistake in the command line, config or data)" in res.stderr
    assert "rerunning cannot help" in res.stderr and not (stub / "argv-2-0").exists()
    # Numbering goes on from the logs already in the bucket: a rerun's logs are attempt 2 and on.
    res, stub, gcs, calls = _until_done(tmp_path / "c", ["done"], workers=1)
    assert res.returncode == 0
    from helpers import launch_stubs as S
    stub_env, stub, gcs2 = S.tpu_cloud(tmp_path / "d", ["done"], workers=1)
    shutil.copytree(gcs / "bkt", gcs2 / "bkt")
    (gcs2 / "bkt" / "runs" / "general" / "summary.json").unlink()
    res = _run([LAUNCH / "tpu_vm.sh", "run", "--until-done", *UNTIL_DONE, "configs/general_distill.py",
                "--workdir=gs://bkt/runs/general"], env=_env(**TPU_ENV, **stub_env, TMPDIR=str(tmp_path)))
    S.kill_leftovers(stub)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (gcs2 / "bkt" / "runs" / "general" / "logs" / "worker-0-attempt-2.log").exists()


def test_tpu_until_done_finished_workdir_and_bad_workdirs(tmp_path):
    from helpers import launch_stubs as S

    stub_env, stub, gcs = S.tpu_cloud(tmp_path, [])
    (gcs / "bkt" / "w").mkdir(parents=True)
    (gcs / "bkt" / "w" / "summary.json").write_text("{}")
    env = _env(**TPU_ENV, **stub_env)
    res = _run([LAUNCH / "tpu_vm.sh", "run", "--until-done", "configs/a.py", "--workdir", "gs://bkt/w/"], env=env)
    assert res.returncode == 0 and "finished: gs://bkt/w/summary.json exists (0 attempt(s)" in res.stdout
    assert not _verbs(S.calls(stub))
    for args, says in ((["--workdir=/mnt/gcs/w"], "is not a gs:// URL"), ([], "needs the program's --workdir")):
        res = _run([LAUNCH / "tpu_vm.sh", "run", "--until-done", "configs/a.py", *args], env=env)
        assert res.returncode == 2 and says in res.stderr, res.stderr
    res = _run([LAUNCH / "tpu_vm.sh", "run", "--until-done", "--max-attempts", "0", "configs/a.py"], env=env)
    assert res.returncode == 2 and "--max-attempts" in res.stderr


def test_tpu_until_done_dry_run():
    out = _tpu("run", "--until-done", "--run-id", "r", "--worker-setup", "gcsfuse b /mnt/b",
               "configs/general_distill.py", "--workdir=gs://b/w")
    assert "+ gcloud storage ls gs://b/w/summary.json" in out
    assert f"+ gcloud compute tpus tpu-vm describe jtb-test {LOC} '--format=value(state)'" in out
    assert "then on every worker: gcsfuse b /mnt/b" in out
    assert "jtb-logs/r-attempt-1/worker-$W.log gs://b/w/logs/worker-$W-attempt-1.log 120 env" in out
    assert "-m jax_tinybert.main --config=configs/general_distill.py --workdir=gs://b/w" in out
    out = _tpu("--queued", "run", "--until-done", "configs/a.py", "--workdir=gs://b/w")
    assert "queued-resources describe jtb-test-qr" in out and "value(state.state)" in out


SLURM_FAKE_RUN = r'''#!/usr/bin/env bash
# One word per start from $STUB_DIR/plan: preempted (exit 143 after "saving"), done (summary.json,
# exit 0), crash (exit 1), wait_term (runs until SIGTERM, then saves and exits 143).
n=$(( $(cat "$STUB_DIR/starts" 2>/dev/null || echo 0) + 1 )); echo "$n" > "$STUB_DIR/starts"
mode=$(sed -n "${n}p" "$STUB_DIR/plan")
shift 2   # -m jax_tinybert.main
wd=""; for a in "$@"; do case "$a" in --workdir=*) wd="${a#--workdir=}" ;; esac; done
echo "start $n: $mode, workdir $wd, task $SLURM_PROCID of $SLURM_NTASKS"
case "$mode" in
  preempted) mkdir -p "$wd/checkpoints/3"; echo "preempted: saved step 3"; exit 143 ;;
  done) mkdir -p "$wd"; echo '{}' > "$wd/summary.json"; exit 0 ;;
  crash) exit 1 ;;
  wait_term)
    trap 'echo "got SIGTERM" > "$STUB_DIR/got_term"; mkdir -p "$wd/checkpoints/5"; exit 143' TERM
    touch "$STUB_DIR/started"
    while :; do sleep 0.05; done ;;
esac
'''


def _slurm_job(tmp_path, plan, **extra):
    from helpers import launch_stubs as S

    stub_env, stub = S.slurm_cluster(tmp_path)
    fake = tmp_path / "fake_python"
    fake.write_text(SLURM_FAKE_RUN)
    fake.chmod(0o755)
    (stub / "plan").write_text("".join(f"{m}\n" for m in plan))
    env = _env(**stub_env, SLURM_JOB_ID="4242", PYTHON=str(fake), JTB_REPO=str(tmp_path),
               JTB_LOG_DIR=str(tmp_path / "logs"), **extra)
    return env, stub


def _lines(path):
    return path.read_text().splitlines() if path.exists() else []


def test_slurm_requeues_a_preempted_run_and_not_a_finished_or_failed_one(tmp_path):
    env, stub = _slurm_job(tmp_path, ["preempted", "done", "crash", "preempted", "preempted"])
    wd = tmp_path / "wd"
    args = [LAUNCH / "slurm.sbatch", "--config=configs/general_distill.py", f"--workdir={wd}"]
    res = _run(args, env=env)                                       # 1: preempted -> requeued
    assert res.returncode == 143, res.stdout + res.stderr
    assert _lines(stub / "scontrol.log") == ["requeue 4242"]
    assert "requeueing job 4242 (restart 1 of at most 20)" in res.stdout
    res = _run(args, env={**env, "SLURM_RESTART_COUNT": "1"})       # 2: the requeued job finishes
    assert res.returncode == 0 and "finished" in res.stdout, res.stdout + res.stderr
    assert _lines(stub / "scontrol.log") == ["requeue 4242"]        # not requeued again
    assert (tmp_path / "logs" / "4242" / "restart-1").is_dir()
    res = _run(args, env=env)                                       # a finished workdir: no srun
    assert res.returncode == 0 and "nothing to do" in res.stdout
    assert len(_lines(stub / "srun.log")) == 2
    # Another workdir: a crash is not requeued; a stop at the limit of restarts, or with
    # JTB_REQUEUE=0, is not either.
    args[-1] = f"--workdir={tmp_path / 'wd2'}"
    res = _run(args, env=env)
    assert res.returncode == 1 and "failed with exit status 1; not requeued" in res.stderr
    res = _run(args, env={**env, "SLURM_RESTART_COUNT": "20"})
    assert res.returncode == 143 and "has been requeued 20 times (JTB_MAX_REQUEUES=20)" in res.stderr
    res = _run(args, env={**env, "JTB_REQUEUE": "0"})
    assert res.returncode == 143 and "not requeued (JTB_REQUEUE=0)" in res.stdout
    assert _lines(stub / "scontrol.log") == ["requeue 4242"]
    assert all(l.startswith("--kill-on-bad-exit=1 --output=") for l in _lines(stub / "srun.log"))


@pytest.mark.timeout(60)
def test_slurm_forwards_sigterm_to_the_run_then_requeues(tmp_path):
    import signal

    env, stub = _slurm_job(tmp_path, ["wait_term"])
    proc = subprocess.Popen(["bash", str(LAUNCH / "slurm.sbatch"), "--config=configs/a.py",
                             f"--workdir={tmp_path / 'wd'}"], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not (stub / "started").exists():
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)    # what --signal=B:TERM@120 sends: the batch shell only
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, out + err
    assert (stub / "got_term").read_text() == "got SIGTERM\n"      # reached the run
    assert (tmp_path / "wd" / "checkpoints" / "5").is_dir()
    assert "passing it on to the run" in out and _lines(stub / "scontrol.log") == ["requeue 4242"]


@pytest.mark.timeout(300)
def test_slurm_real_run_stopped_at_the_time_limit_is_requeued_and_resumes(tmp_path_factory, tmp_path):
    """The real CLI (a tiny task distillation, tests/helpers/tiny_run.py, throttled by
    tests/helpers/slow_main.py) under the batch script: SIGTERM to the batch shell mid-run, the
    run saves and exits 143, the job is requeued; the requeued job resumes and finishes."""
    import signal
    from helpers import launch_stubs as S
    from helpers import tiny_run as T

    teacher, cache = T.shared_dirs(tmp_path_factory)
    stub_env, stub = S.slurm_cluster(tmp_path)
    python = tmp_path / "python"   # `-m jax_tinybert.main` through slow_main: same code path
    python.write_text(f'#!/usr/bin/env bash\nif [ "$1 $2" = "-m jax_tinybert.main" ]; then shift 2; '
                      f'exec {T.PYTHON} -m slow_main "$@"; fi\nexec {T.PYTHON} "$@"\n')
    python.chmod(0o755)
    env = T.env(**T.cache_env(cache), **stub_env, SLURM_JOB_ID="77", PYTHON=str(python),
                JTB_REPO=str(REPO), JTB_LOG_DIR=str(tmp_path / "logs"), JTB_TEST_STEP_SLEEP="0.3",
                PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests' / 'helpers'}")
    wd = tmp_path / "wd"
    args = ["bash", str(LAUNCH / "slurm.sbatch"), *T.train_args(wd, teacher, steps=12, checkpoint_every=100)]
    log = tmp_path / "job1.out"
    rc = T.signal_when(subprocess.Popen(args, env=env, cwd=REPO, stdout=open(log, "w"),
                                        stderr=subprocess.STDOUT),
                       lambda: "step      2/12" in log.read_text(), signal.SIGTERM, 240, "step 2")
    out = log.read_text()
    assert rc == 143, out[-3000:]
    saved = T.saved_step(out)
    assert 2 <= saved < 12 and T.checkpoint_done(wd, saved), out[-2000:]
    assert _lines(stub / "scontrol.log") == ["requeue 77"] and not (wd / "summary.json").exists()
    res = subprocess.run(args, env={**env, "SLURM_RESTART_COUNT": "1"}, cwd=REPO,
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out2 = res.stdout + res.stderr
    assert f"resumed from step {saved}" in out2 and "step     12/12" in out2, out2[-3000:]
    assert (wd / "summary.json").exists() and _lines(stub / "scontrol.log") == ["requeue 77"]
