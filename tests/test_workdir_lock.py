"""One run per workdir (jax_tinybert/train/workdir_lock.py): a workdir held by a live process is
refused with its holder named; the kernel frees it when the holder dies, SIGKILL included.
The same through the CLI, as a user meets it: tests/test_resume.py
(test_a_second_run_on_a_busy_workdir_stops_at_once_and_the_rerun_resumes)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from jax_tinybert.train import workdir_lock
from jax_tinybert.errors import UserError

HOLDER = ("import sys, time\n"
          "from jax_tinybert.train import workdir_lock\n"
          "with workdir_lock.hold(sys.argv[1]):\n"
          "    print('held', flush=True)\n"
          "    time.sleep(600)\n")


def _holder(wd):
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(wd)], stdout=subprocess.PIPE,
                         text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_held_workdir_is_refused_naming_the_holder_until_it_dies(tmp_path):
    wd = tmp_path / "runs" / "t"
    p = _holder(wd)
    try:
        rec = json.loads((wd / workdir_lock.LOCK_NAME).read_text())
        assert rec["pid"] == p.pid and rec["host"] == socket.gethostname()
        with pytest.raises(workdir_lock.WorkdirBusy) as e:
            with workdir_lock.hold(str(wd)):
                raise AssertionError("entered a held workdir")
        msg = str(e.value)
        assert isinstance(e.value, UserError) and "\n" not in msg
        assert msg.startswith(f"workdir {wd} is in use by another run (pid {p.pid} on host "
                              f"{socket.gethostname()}, since "), msg
        assert f"kill -TERM {p.pid}" in msg and msg.endswith("or pass another --workdir"), msg
        # Held again from this process too: a second hold is refused the same way.
        with pytest.raises(workdir_lock.WorkdirBusy):
            with workdir_lock.hold(str(wd)):
                pass
    finally:
        p.send_signal(signal.SIGKILL)   # no clean-up runs: the kernel drops the lock
        p.wait()
    with workdir_lock.hold(str(wd)):
        assert json.loads((wd / workdir_lock.LOCK_NAME).read_text())["pid"] == os.getpid()
        with pytest.raises(workdir_lock.WorkdirBusy, match=f"pid {os.getpid()} "):
            with workdir_lock.hold(str(wd)):
                pass
    assert (wd / workdir_lock.LOCK_NAME).read_text() == ""   # released: no holder named


def test_released_on_an_exception_and_held_again(tmp_path):
    wd = tmp_path / "w"
    with pytest.raises(RuntimeError):
        with workdir_lock.hold(str(wd)):
            raise RuntimeError("the stage failed")
    with workdir_lock.hold(str(wd)):
        pass
    assert os.listdir(wd) == [workdir_lock.LOCK_NAME]


def test_a_bucket_workdir_whose_lease_cannot_be_taken_runs_unlocked(tmp_path, monkeypatch,
                                                                    caplog):
    """gs:// workdirs are held by a lease object (tests/test_gcs_workdir.py, on the emulator);
    where the store cannot be used for it, the run goes on unlocked with a warning, as on a
    filesystem without flock, and writes nothing locally."""
    import logging

    from jax_tinybert import fs

    def no_backend(path):
        raise fs.RemoteFSError("gs:// URLs need gcsfs: pip install gcsfs")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(workdir_lock.fs, "url_fs", no_backend)
    with caplog.at_level(logging.WARNING, logger="jax_tinybert.train.workdir_lock"):
        with workdir_lock.hold("gs://bucket/run"):
            with workdir_lock.hold("gs://bucket/run"):
                pass
    assert caplog.text.count("cannot take its lock (gs:// URLs need gcsfs") == 2, caplog.text
    assert "running without the one-run-per-workdir check" in caplog.text
    assert os.listdir(tmp_path) == []   # nothing written locally


def test_the_holder_command_reads_as_typed(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/x/jax_tinybert/main.py", "--config=c.py", "--workdir=w"])
    assert workdir_lock._command() == "python -m jax_tinybert.main --config=c.py --workdir=w"
    monkeypatch.setattr(sys, "argv", ["/usr/bin/jax-tinybert", "--workdir=w"])
    assert workdir_lock._command() == "/usr/bin/jax-tinybert --workdir=w"


@pytest.mark.parametrize("entry", ["train_and_evaluate", "run_demo", "mlm_head"])
def test_every_entry_point_refuses_a_held_workdir_before_writing(entry, tmp_path):
    """The three ways a stage starts (the CLI calls one of them) check the lock after the
    config's own checks and before any output: a held workdir gains nothing."""
    from helpers.run_files import config
    from jax_tinybert.train import mlm_head, loop as train
    from jax_tinybert.cli import demo as pipeline

    wd = tmp_path / "wd"
    if entry == "mlm_head":
        cfg = config("mlm_head.py")
        cfg.data.corpus = str(tmp_path / "corpus.txt")   # read only after the lock
        fn = mlm_head.fit
    else:
        cfg = config("demo.py")
        cfg.data.kind, cfg.data.task = "synthetic", "sst2"
        fn = pipeline.run_demo if entry == "run_demo" else train.train_and_evaluate
    p = _holder(wd)
    try:
        with pytest.raises(workdir_lock.WorkdirBusy, match=f"pid {p.pid} "):
            fn(cfg, str(wd))
        assert os.listdir(wd) == [workdir_lock.LOCK_NAME]
    finally:
        p.kill()
        p.wait()
