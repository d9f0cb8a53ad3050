"""One run at a time per workdir.

The same command started twice on one workdir (a second terminal, a job resubmitted while the
first still runs, `make demo` twice) used to run twice, silently: both wrote the same
checkpoints, config record and metrics.jsonl, and one run could restore the other's
half-finished steps. Now the second run stops before it writes anything:

    error: workdir runs/sst2/teacher is in use by another run (pid 4242 on host h, since
    06:31:02 UTC: python -m jax_tinybert.main ...); wait for it to end or stop it ...

The lock is an `flock` on `<workdir>/.jtb-lock`, which the kernel drops when the holding
process ends, however it ends (SIGKILL, a crash, a lost node): there is never a stale lock to
clear by hand. The file stays (removing it would let two runs lock two different files); it
holds who has the lock, for the message, and is emptied on release. Only process 0 of a
multi-process run takes it. A gs:// workdir is not locked (object stores have no such lock):
there, the scheduler has to start one job per workdir; a filesystem that refuses `flock` (some
FUSE mounts) gets a warning and runs unlocked.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import time
from typing import Iterator

import jax

from jax_tinybert import fs
from jax_tinybert.errors import UserError

try:
    import fcntl
except ImportError:   # not POSIX: no lock
    fcntl = None

log = logging.getLogger(__name__)

LOCK_NAME = ".jtb-lock"


class WorkdirBusy(UserError):
    """Another live process holds the workdir."""


def _holder(fd: int) -> dict:
    """The lock file's record of its holder ({} when unreadable or not written yet)."""
    try:
        rec = json.loads(os.pread(fd, 1 << 16, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}
    return rec if isinstance(rec, dict) else {}


def _busy_message(workdir: str, rec: dict) -> str:
    if rec.get("pid"):
        since = time.strftime("%H:%M:%S UTC", time.gmtime(float(rec.get("started", 0))))
        cmd = str(rec.get("command", ""))
        who = (f"pid {rec['pid']} on host {rec.get('host')}, since {since}"
               + (f": {cmd[:160]}{'...' if len(cmd) > 160 else ''}" if cmd else ""))
        stop = f"stop it with kill -TERM {rec['pid']}"
    else:
        who, stop = "a process that has not written its name yet", "stop it with kill -TERM"
    return (f"workdir {workdir} is in use by another run ({who}); wait for it to end, or {stop} "
            "(it saves its step, and the same command then resumes), or pass another --workdir")


def _command() -> str:
    argv = list(sys.argv)
    if argv and argv[0].replace(os.sep, "/").endswith("jax_tinybert/main.py"):
        argv[0:1] = ["python", "-m", "jax_tinybert.main"]   # how `python -m` was typed
    return " ".join(argv)


@contextlib.contextmanager
def hold(workdir: str) -> Iterator[None]:
    """Holds `workdir` (created if missing) for this process while the block runs.

    Raises WorkdirBusy, naming the holder and the fix, when another live process holds it."""
    if fcntl is None or fs.is_remote(workdir) or jax.process_index() != 0:
        yield
        return
    os.makedirs(workdir, exist_ok=True)
    fd = os.open(os.path.join(workdir, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise WorkdirBusy(_busy_message(workdir, _holder(fd))) from None
        except OSError as e:
            log.warning("workdir %s: cannot lock %s (%s); running without the one-run-per-"
                        "workdir check", workdir, LOCK_NAME, e)
            yield
            return
        rec = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
               "command": _command()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(rec).encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)   # drops the lock


__all__ = ["hold", "WorkdirBusy", "LOCK_NAME"]
