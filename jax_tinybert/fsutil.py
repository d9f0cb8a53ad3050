"""Atomic-write helpers: temporaries named after their owner, stale ones cleaned, umask modes.

Every output that is written in several steps is first written to a hidden temporary beside its
final path and renamed into place. The temporary's name records who writes it
(`.<name>.tmp-<host>-<pid>-<random>`), so a later run can tell a temporary left by a killed
process (same host, pid no longer alive) from one another process is still writing.
"""
from __future__ import annotations

import errno
import os
import shutil
import socket
import tempfile
import time
from typing import List

__all__ = ["umask_mode", "mkstemp", "mkdtemp", "clean_stale_temps"]

# Temporaries of other hosts (shared filesystem) cannot be checked by pid: those older than this
# are taken as abandoned.
FOREIGN_STALE_S = 24 * 3600


def umask_mode(mode: int = 0o666) -> int:
    """`mode` with the process umask applied (what `open(path, "w")` would create)."""
    mask = os.umask(0)
    os.umask(mask)
    return mode & ~mask


def _host() -> str:
    return socket.gethostname().replace("-", "_") or "host"


def _prefix(name: str) -> str:
    return f".{name}.tmp-{_host()}-{os.getpid()}-"


def mkstemp(path: str, suffix: str = ""):
    """(fd, tmp) of a new hidden temporary file beside `path`, mode per the umask (not 0600)."""
    d, name = os.path.split(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=_prefix(name), suffix=suffix, dir=d)
    os.fchmod(fd, umask_mode(0o666))
    return fd, tmp


def mkdtemp(path: str) -> str:
    """A new hidden temporary folder beside `path`, mode per the umask (not 0700)."""
    d, name = os.path.split(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=_prefix(name), dir=d)
    os.chmod(tmp, umask_mode(0o777))
    return tmp


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno == errno.EPERM   # exists, owned by someone else
    return True


def _process_start_time() -> float:
    """Wall-clock start of this process (Linux /proc; else 'now', which is conservative)."""
    try:
        with open("/proc/self/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


def clean_stale_temps(path: str) -> List[str]:
    """Delete the temporaries of `path` left by dead writers; returns what was removed.

    Stale: this host and the pid in the name is not running; another host's and older than
    FOREIGN_STALE_S; or an old-style name without host/pid that predates this process.
    """
    d, name = os.path.split(os.path.abspath(path))
    head = f".{name}.tmp-"
    try:
        entries = os.listdir(d)
    except FileNotFoundError:
        return []
    host, started, removed = _host(), None, []
    for e in entries:
        if not e.startswith(head):
            continue
        full = os.path.join(d, e)
        parts = e[len(head):].split("-")
        try:
            mtime = os.lstat(full).st_mtime
        except FileNotFoundError:
            continue
        if len(parts) >= 3 and parts[1].isdigit():
            if parts[0] == host:
                stale = not _pid_alive(int(parts[1]))
            else:
                stale = time.time() - mtime > FOREIGN_STALE_S
        else:
            started = _process_start_time() if started is None else started
            stale = mtime < started
        if not stale:
            continue
        if os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full, ignore_errors=True)
        else:
            try:
                os.unlink(full)
            except FileNotFoundError:
                pass
        removed.append(full)
    return removed
