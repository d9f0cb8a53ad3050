"""File-system helpers: every file or folder the package writes appears complete or not at all.

    with atomic_open(path, "w") as fh: ...      # a file: temporary beside it, then os.replace
    write_json_atomic(path, obj)                # the same for one JSON document
    tmp = mkdtemp(out_dir); ...; swap_into_place(tmp, out_dir)   # a whole folder

Temporaries are hidden and sit beside their final path (same file system, so the final rename
is atomic); their name records who writes them (`.<name>.tmp-<host>-<pid>-<random>`), so a later
run can tell a temporary left by a killed process (same host, pid no longer alive) from one
another process is still writing (`clean_stale_temps`). Files and folders get the modes the
umask gives (`open(path, "w")`'s), not tempfile's owner-only ones.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import tempfile
import time
import uuid
from typing import IO, Any, Iterator, List

__all__ = ["umask_mode", "mkstemp", "mkdtemp", "clean_stale_temps", "atomic_open",
           "write_json_atomic", "swap_into_place"]

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


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "w", **open_kwargs) -> Iterator[IO]:
    """An open temporary file beside `path` (`mkstemp`), renamed onto `path` when the block
    ends without an exception and deleted otherwise. mode: "w" or "wb" (plus open() keywords,
    e.g. encoding, newline)."""
    fd, tmp = mkstemp(path)
    try:
        with os.fdopen(fd, mode, **open_kwargs) as fh:
            yield fh
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json_atomic(path: str, obj: Any, **dump_kwargs) -> None:
    """json.dump(obj) to `path` atomically (dump_kwargs: indent, sort_keys, default, ...)."""
    with atomic_open(path, "w") as fh:
        json.dump(obj, fh, **dump_kwargs)


def swap_into_place(tmp: str, out_dir: str) -> None:
    """Rename the complete folder tmp -> out_dir; an existing out_dir is moved aside first and
    deleted afterwards (a reader sees the old folder or the new one, never a mix)."""
    old = None
    if os.path.exists(out_dir):
        parent, name = os.path.split(out_dir)
        old = os.path.join(parent, f".{name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(out_dir, old)
    try:
        os.rename(tmp, out_dir)
    except BaseException:
        if old is not None:
            os.rename(old, out_dir)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


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
