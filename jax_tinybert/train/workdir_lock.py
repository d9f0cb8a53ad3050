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
multi-process run takes it, and tells the others what it found: refused, every process stops
with the same line (the others would otherwise build their data and wait at their first
collective for a process 0 that has gone). A filesystem that refuses `flock` (some FUSE mounts)
gets a warning and runs unlocked.

A workdir in an object store (gs://) has no flock: there the lock is a lease, an object
`<workdir>/.jtb-lock.<n>` created only if absent (GCS's ifGenerationMatch=0 precondition, so of
two runs starting together one gets it) that names its holder and the time it was last seen.
A thread rewrites that time every HEARTBEAT_S seconds, and the run deletes the object when it
ends. A run killed without its exit (SIGKILL, a lost host) leaves it behind: the next run is
refused until LEASE_TTL_S seconds after its holder was last seen, then takes it over by creating
`.jtb-lock.<n+1>` (again only if absent, so two takers cannot both win) and deleting the old
one. A holder that was silent that long (a frozen VM) and comes back finds the newer lease and
says so in an error line. Clocks of different hosts are compared, so the TTL is minutes, far
over their skew.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import sys
import threading
import time
from typing import Dict, Iterator, Optional, Tuple

import jax

from jax_tinybert import fs
from jax_tinybert.errors import UserError, one_line
from jax_tinybert.parallel.coordination import Coordinator

try:
    import fcntl
except ImportError:   # not POSIX: no lock
    fcntl = None

log = logging.getLogger(__name__)

LOCK_NAME = ".jtb-lock"
# Object-store leases: a holder not seen for LEASE_TTL_S is gone; it shows it lives every
# HEARTBEAT_S (a quarter of the TTL, so a slow request or two does not lose the lease).
LEASE_TTL_S = 120.0
HEARTBEAT_S = 30.0


class WorkdirBusy(UserError):
    """Another live process holds the workdir."""


def _holder(fd: int) -> dict:
    """The lock file's record of its holder ({} when unreadable or not written yet)."""
    try:
        rec = json.loads(os.pread(fd, 1 << 16, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}
    return rec if isinstance(rec, dict) else {}


def _busy_message(workdir: str, rec: dict, seen_s_ago: Optional[float] = None) -> str:
    if rec.get("pid"):
        since = time.strftime("%H:%M:%S UTC", time.gmtime(float(rec.get("started", 0))))
        cmd = str(rec.get("command", ""))
        seen = "" if seen_s_ago is None else f", last seen {max(seen_s_ago, 0):.0f} s ago"
        who = (f"pid {rec['pid']} on host {rec.get('host')}, since {since}{seen}"
               + (f": {cmd[:160]}{'...' if len(cmd) > 160 else ''}" if cmd else ""))
        stop = f"stop it with kill -TERM {rec['pid']}"
    else:
        who, stop = "a process that has not written its name yet", "stop it with kill -TERM"
    msg = (f"workdir {workdir} is in use by another run ({who}); wait for it to end, or {stop} "
           "(it saves its step, and the same command then resumes), or pass another --workdir")
    if seen_s_ago is not None:
        msg += (f"; a run killed without its exit holds a bucket workdir until {LEASE_TTL_S:.0f} s "
                "after it was last seen")
    return msg


def _command() -> str:
    argv = list(sys.argv)
    if argv and argv[0].replace(os.sep, "/").endswith("jax_tinybert/main.py"):
        argv[0:1] = ["python", "-m", "jax_tinybert.main"]   # how `python -m` was typed
    return " ".join(argv)


def _record() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
            "command": _command()}


# --------------------------------------------------------------------------- object stores

def _leases(fsys, root: str) -> Dict[int, str]:
    """{n: object path} of the `.jtb-lock.<n>` objects directly under `root`."""
    try:
        names = fsys.ls(root, detail=False)
    except FileNotFoundError:
        return {}
    out = {}
    for name in names:
        base = name.rstrip("/").rsplit("/", 1)[-1]
        suffix = base[len(LOCK_NAME) + 1:]
        if base.startswith(LOCK_NAME + ".") and suffix.isdigit():
            out[int(suffix)] = name
    return out


def _read_lease(fsys, path: str) -> Optional[dict]:
    """A lease's record; None when it is gone (released meanwhile), {} when unreadable."""
    try:
        rec = json.loads(fsys.cat_file(path))
    except FileNotFoundError:
        return None
    except ValueError:
        return {}
    return rec if isinstance(rec, dict) else {}


def _take_lease(workdir: str, fsys, root: str) -> Tuple[int, str, dict]:
    """-> (n, path, record) of the lease this run now holds; WorkdirBusy while a live one
    exists."""
    for _ in range(5):   # each pass ends unless another run changed the leases meanwhile
        leases = _leases(fsys, root)
        n = max(leases, default=0)
        if n:
            rec = _read_lease(fsys, leases[n])
            if rec is None:
                continue
            age = time.time() - float(rec.get("heartbeat") or rec.get("started") or 0)
            if age < LEASE_TTL_S:
                raise WorkdirBusy(_busy_message(workdir, rec, age))
        mine = dict(_record(), heartbeat=time.time())
        path = f"{root}/{LOCK_NAME}.{n + 1}"
        try:
            fsys.pipe_file(path, json.dumps(mine).encode(), mode="create")
        except FileExistsError:   # another run created it first: look again
            continue
        if n:
            log.warning("workdir %s: took the lock over from pid %s on host %s, last seen %.0f s "
                        "ago (killed without its exit, or its host lost)", workdir,
                        rec.get("pid"), rec.get("host"), age)
        for k, old in leases.items():
            with contextlib.suppress(OSError):
                fsys.rm_file(old)
        return n + 1, path, mine
    raise WorkdirBusy(f"workdir {workdir}: other runs keep taking its lock ({LOCK_NAME}.*); "
                      "start one run per workdir, or pass another --workdir")


class _Heartbeat:
    """Rewrites the lease's time every HEARTBEAT_S until stopped; stops with an error line
    when a newer lease shows another run took the workdir over."""

    def __init__(self, workdir: str, fsys, root: str, n: int, path: str, rec: dict):
        self.workdir, self.fsys, self.root, self.n, self.path, self.rec = (
            workdir, fsys, root, n, path, rec)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jtb-lease", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                leases = _leases(self.fsys, self.root)
                newer = max((k for k in leases if k > self.n), default=None)
                if newer is not None:
                    other = _read_lease(self.fsys, leases[newer]) or {}
                    log.error("workdir %s: another run (pid %s on host %s) took its lock over: "
                              "this run was not seen for over %.0f s; both now write there, stop one",
                              self.workdir, other.get("pid"), other.get("host"), LEASE_TTL_S)
                    return
                self.rec["heartbeat"] = time.time()
                self.fsys.pipe_file(self.path, json.dumps(self.rec).encode())
            except Exception as e:   # noqa: BLE001 - a failed request is retried next beat
                log.warning("workdir %s: renewing its lock failed (%s); trying again in %.0f s",
                            self.workdir, e, HEARTBEAT_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        with contextlib.suppress(OSError):
            self.fsys.rm_file(self.path)


@contextlib.contextmanager
def _hold_remote(workdir: str) -> Iterator[None]:
    beat = None
    try:
        fsys, root = fs.url_fs(workdir)
        root = root.rstrip("/")
        n, path, rec = _take_lease(workdir, fsys, root)
        beat = _Heartbeat(workdir, fsys, root, n, path, rec)
    except WorkdirBusy:
        raise
    except Exception as e:   # noqa: BLE001 - as for a filesystem without flock
        log.warning("workdir %s: cannot take its lock (%s); running without the one-run-per-"
                    "workdir check", workdir, e)
    try:   # the run's own exceptions are not raised inside the handler above
        yield
    finally:
        if beat is not None:
            beat.stop()


# --------------------------------------------------------------------------- hold

@contextlib.contextmanager
def hold(workdir: str) -> Iterator[None]:
    """Holds `workdir` (created if missing) for this job while the block runs.

    Raises WorkdirBusy, naming the holder and the fix, when another live process holds it; in
    a multi-process job on every process (process 0 takes the lock, the others hear from it)."""
    if jax.process_count() == 1:
        with _hold_here(workdir):
            yield
        return
    # Every process of the job enters hold() for the same workdirs in the same order.
    coord = Coordinator("jtb_lock_" + hashlib.sha1(workdir.encode()).hexdigest()[:10])
    with contextlib.ExitStack() as stack:
        verdict = ""
        if jax.process_index() == 0:
            try:
                stack.enter_context(_hold_here(workdir))
            except WorkdirBusy as e:
                verdict = _BUSY + str(e)
            except BaseException as e:
                coord.from_process_0(f"process 0 could not take the lock of workdir {workdir} "
                                     f"({one_line(e)[:300]}); see its log", "verdict")
                raise
        verdict = coord.from_process_0(verdict, "verdict")
        if verdict.startswith(_BUSY):
            raise WorkdirBusy(verdict[len(_BUSY):])
        if verdict:
            raise UserError(verdict)
        yield


_BUSY = "busy:"   # process 0's verdict: refused (its message follows); "" = held


@contextlib.contextmanager
def _hold_here(workdir: str) -> Iterator[None]:
    """hold() on this process alone."""
    if fs.is_remote(workdir):
        with _hold_remote(workdir):
            yield
        return
    if fcntl is None:
        yield
        return
    os.makedirs(workdir, exist_ok=True)
    fd = os.open(os.path.join(workdir, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        locked = True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise WorkdirBusy(_busy_message(workdir, _holder(fd))) from None
        except OSError as e:
            log.warning("workdir %s: cannot lock %s (%s); running without the one-run-per-"
                        "workdir check", workdir, LOCK_NAME, e)
            locked = False
        if locked:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(_record()).encode(), 0)
        try:   # the run's own exceptions are not raised inside the handler above
            yield
        finally:
            if locked:
                os.ftruncate(fd, 0)
    finally:
        os.close(fd)   # drops the lock


__all__ = ["hold", "WorkdirBusy", "LOCK_NAME"]
