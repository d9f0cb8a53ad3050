"""The one path layer of the package: every file or folder a run reads or writes goes through here,
local paths and object-store URLs (gs://bucket/run, through etils.epath, as orbax does) alike.
Whatever is written appears complete or not at all.

    exists(p), isdir(p), isfile(p), listdir(p), getsize(p), makedirs(p), remove(p), rmtree(p)
    open_file(p, "r"|"rb"|"w"|"wb"|"a")         # local: open(); remote: epath.Path(p).open()
    with atomic_open(path, "w") as fh: ...      # a file that appears whole or not at all
    write_json_atomic(path, obj)                # the same for one JSON document
    tmp = staging_dir(out_dir); (write files under tmp with plain local I/O); publish_dir(tmp, out_dir, last=...)
    local = local_mirror(remote_dir)            # a local copy of a remote folder (np.memmap needs one)

Local paths behave exactly as before this module knew object stores: temporaries are hidden and
sit beside their final path (same file system, so the final os.replace/os.rename is atomic);
their name records who writes them (`.<name>.tmp-<host>-<pid>-<random>`), so a later run can
tell a temporary left by a killed process (same host, pid no longer alive) from one another
process is still writing (`clean_stale_temps`). Files and folders get the modes the umask gives
(`open(path, "w")`'s), not tempfile's owner-only ones.

Object stores (any "scheme://" other than file://; tested against a GCS emulator, see
docs/checkpoints.md) have no rename and no append, so "atomic" means there:

- a file (`atomic_open`): buffered in memory and uploaded as ONE object when the block ends
  without an exception (nothing is uploaded otherwise). A GCS object upload is atomic: a reader
  sees the previous generation or the new one, never part of it. No temporary object at all.
- a folder (`publish_dir`): uploaded under a hidden temporary prefix beside it (named like a
  local temporary, so `clean_stale_temps` removes the leftovers of a killed upload), then the old
  folder is deleted and each object copied into place (a server-side copy; GCS's "rename" is
  copy + delete), the `last` file(s) after all others, then the temporary deleted. A reader that
  requires the `last` file (the teacher cache's meta.json, the export's config.json) sees the
  old folder, no folder, or the new one, never a mix; unlike a local rename there is a moment
  with no folder.
- appended files (metrics.jsonl, TensorBoard events) are written locally and re-uploaded whole
  (metrics_writer.py).
"""
from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import shutil
import socket
import tempfile
import time
import uuid
from typing import IO, Any, Iterator, List, Mapping, Optional, Sequence

from etils import epath

__all__ = ["is_remote", "abspath", "join", "exists", "isdir", "isfile", "listdir", "getsize",
           "makedirs", "remove", "rmtree", "open_file", "umask_mode", "mkstemp", "mkdtemp",
           "clean_stale_temps", "atomic_open", "write_json_atomic", "swap_into_place",
           "scratch_dir", "staging_dir", "publish_dir", "local_mirror", "upload_file", "check_reachable", "url_fs",
           "RemoteFSError"]

# Temporaries of other hosts (shared filesystem) cannot be checked by pid: those older than this
# are taken as abandoned.
FOREIGN_STALE_S = 24 * 3600


def _no_listing_cache() -> None:
    # gcsfs caches folder listings forever by default; checkpoint objects are written by
    # tensorstore (not through gcsfs) and, on pods, by other hosts, so a cached listing would
    # hide them. Applied to gcsfs instances created from now on unless the user configured it.
    try:
        import fsspec.config  # noqa: PLC0415
    except ImportError:
        return
    fsspec.config.conf.setdefault("gs", {}).setdefault("use_listings_cache", False)


_no_listing_cache()


class RemoteFSError(OSError):
    """An object-store URL that cannot be used (its fsspec backend, e.g. gcsfs, is missing)."""


# ----------------------------------------------------------------------------- paths

_OFF = ("0", "off", "false", "no", "none", "")


def env_off(name: str, environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether environment variable `name` (of `environ`, default os.environ) is set to off
    (0/off/false/no/none/empty)."""
    v = (os.environ if environ is None else environ).get(name)
    return v is not None and v.strip().lower() in _OFF


def cache_root() -> Optional[str]:
    """$XDG_CACHE_HOME/jax_tinybert, default ~/.cache/jax_tinybert: where the compile cache and
    the stores live. None without a home folder (HOME unset in a bare container): nothing
    cached rather than a "~" folder in the working directory."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser(os.path.join("~", ".cache"))
    return None if base.startswith("~") else os.path.join(base, "jax_tinybert")


def shared_store(env: str, name: str) -> Optional[str]:
    """A folder that runs on this machine share: $env, default cache_root()/<name>; None when
    $env is off (0/off/false/no/none/empty) or there is no cache root."""
    v = os.environ.get(env)
    if env_off(env):
        return None
    if v is None:
        root = cache_root()
        return None if root is None else os.path.join(root, name)
    return os.path.abspath(os.path.expanduser(v))


def is_remote(path) -> bool:
    """True for an object-store URL (gs://, s3://, ...); file:// and plain paths are local."""
    p = os.fspath(path)
    return "://" in p and not p.startswith("file://")


def abspath(path) -> str:
    """os.path.abspath for local paths; URLs unchanged (str)."""
    p = os.fspath(path)
    return p if is_remote(p) else os.path.abspath(p)


def join(*parts) -> str:
    """os.path.join (URLs are '/'-separated, which os.path.join keeps on POSIX)."""
    return os.path.join(*(os.fspath(p) for p in parts))


def _epath(path) -> epath.Path:
    return epath.Path(os.fspath(path))


def url_fs(path):
    """(fsspec filesystem, bucket-relative path) of a URL: the filesystem etils.epath's own
    backend uses for it (gcsfs for gs://), for what epath has no call for (server-side copy,
    listing with modification times)."""
    import fsspec  # noqa: PLC0415 - only object stores need it

    try:
        return fsspec.core.url_to_fs(os.fspath(path))
    except (ImportError, ValueError) as e:
        scheme = os.fspath(path).split("://")[0]
        pkg = {"gs": "gcsfs", "s3": "s3fs", "az": "adlfs"}.get(scheme, f"the fsspec backend of {scheme}://")
        raise RemoteFSError(f"{os.fspath(path)}: cannot open {scheme}:// URLs ({e}); install "
                            f"{pkg} (pip install {pkg})") from e


def check_reachable(url: str) -> None:
    """RemoteFSError naming the fix when the bucket of `url` cannot be used: no fsspec backend
    (gcsfs), no credentials, no such bucket, no access."""
    fsys, p = url_fs(url)
    bucket = p.split("/", 1)[0]
    try:
        fsys.info(bucket)
    except FileNotFoundError as e:
        raise RemoteFSError(f"bucket {bucket} does not exist (create it, or fix the URL)") from e
    except Exception as e:  # noqa: BLE001 - auth / network / permission errors of any client
        msg = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise RemoteFSError(f"cannot list bucket {bucket} ({type(e).__name__}: {msg}); check "
                            "the credentials (gcloud auth application-default login, or "
                            "GOOGLE_APPLICATION_CREDENTIALS) and the bucket's permissions") from e


# ----------------------------------------------------------------------------- basic calls

def exists(path) -> bool:
    return _epath(path).exists() if is_remote(path) else os.path.exists(path)


def isdir(path) -> bool:
    return _epath(path).is_dir() if is_remote(path) else os.path.isdir(path)


def isfile(path) -> bool:
    if not is_remote(path):
        return os.path.isfile(path)
    p = _epath(path)
    return p.exists() and not p.is_dir()


def listdir(path) -> List[str]:
    """Names in the folder `path` (FileNotFoundError if there is none)."""
    if not is_remote(path):
        return os.listdir(path)
    p = _epath(path)
    if not p.is_dir():
        raise FileNotFoundError(errno.ENOENT, "no such folder", os.fspath(path))
    return [c.name for c in p.iterdir()]


def getsize(path) -> int:
    return _epath(path).stat().length if is_remote(path) else os.path.getsize(path)


def existing_dir(path) -> str:
    """The local folder `path` is, or the nearest one above it that exists (for a path not
    created yet: the folder whose disk it will be written to)."""
    p = os.path.abspath(os.fspath(path))
    while not os.path.isdir(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    return p


def free_bytes(path) -> int:
    """Free bytes on the local disk that holds (or will hold) `path`."""
    return shutil.disk_usage(existing_dir(path)).free


def makedirs(path) -> None:
    """os.makedirs(exist_ok=True); a no-op on object stores (folders are key prefixes)."""
    if not is_remote(path):
        os.makedirs(path, exist_ok=True)


def remove(path) -> None:
    if is_remote(path):
        fs, p = url_fs(path)
        fs.rm_file(p)
    else:
        os.unlink(path)


def rmtree(path) -> None:
    """Delete a folder and everything under it; no error if it is missing."""
    if not is_remote(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    p = _epath(path)
    if p.exists():
        with contextlib.suppress(FileNotFoundError):
            p.rmtree()


def open_file(path, mode: str = "r", **kwargs) -> IO:
    """open() for local paths; epath.Path.open for URLs (text modes utf-8). Remote "a" is
    refused: object stores cannot append (write locally and upload, see metrics_writer)."""
    if not is_remote(path):
        return open(path, mode, **kwargs)
    if "a" in mode or "+" in mode:
        raise ValueError(f"{os.fspath(path)}: mode {mode!r} is not possible on an object store")
    fh = _epath(path).open(mode.replace("t", "").replace("b", "") + "b")
    if "b" in mode:
        return fh
    kwargs.setdefault("encoding", "utf-8")
    return io.TextIOWrapper(fh, **kwargs)


def upload_file(local: str, url: str) -> None:
    """Copy the local file `local` to the object `url` (one upload: the object appears whole)."""
    with open(local, "rb") as src, _epath(url).open("wb") as dst:
        shutil.copyfileobj(src, dst, 8 << 20)


def umask_mode(mode: int = 0o666) -> int:
    """`mode` with the process umask applied (what `open(path, "w")` would create)."""
    mask = os.umask(0)
    os.umask(mask)
    return mode & ~mask


def _host() -> str:
    return socket.gethostname().replace("-", "_") or "host"


def _prefix(name: str) -> str:
    return f".{name}.tmp-{_host()}-{os.getpid()}-"


def _local_only(path, what: str) -> None:
    if is_remote(path):
        raise ValueError(f"{what}({os.fspath(path)}): local paths only (object stores: "
                         "atomic_open / staging_dir + publish_dir)")


def mkstemp(path: str, suffix: str = ""):
    """(fd, tmp) of a new hidden temporary file beside `path`, mode per the umask (not 0600)."""
    _local_only(path, "mkstemp")
    d, name = os.path.split(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=_prefix(name), suffix=suffix, dir=d)
    os.fchmod(fd, umask_mode(0o666))
    return fd, tmp


def mkdtemp(path: str) -> str:
    """A new hidden temporary folder beside `path`, mode per the umask (not 0700)."""
    _local_only(path, "mkdtemp")
    d, name = os.path.split(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=_prefix(name), dir=d)
    os.chmod(tmp, umask_mode(0o777))
    return tmp


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "w", **open_kwargs) -> Iterator[IO]:
    """An open temporary file beside `path` (`mkstemp`), renamed onto `path` when the block
    ends without an exception and deleted otherwise. mode: "w" or "wb" (plus open() keywords,
    e.g. encoding, newline). On an object store: an in-memory buffer uploaded as one object
    when the block ends without an exception (module docstring)."""
    if is_remote(path):
        buf = io.BytesIO()
        fh = buf if "b" in mode else io.TextIOWrapper(
            buf, **{"encoding": "utf-8", **open_kwargs})
        yield fh
        if fh is not buf:
            fh.flush()
        with _epath(path).open("wb") as out:
            out.write(buf.getvalue())
        return
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
    deleted afterwards (a reader sees the old folder or the new one, never a mix). Local only:
    `publish_dir` handles both."""
    _local_only(out_dir, "swap_into_place")
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


# ----------------------------------------------------------------------------- folders

def scratch_dir(kind: str) -> str:
    """A new local working folder for the files of a bucket output (staged uploads, downloaded
    caches, metrics), under <tempdir>/jax_tinybert-scratch and named like a temporary
    (`mkdtemp`), so the ones left by a killed process are removed by the next call."""
    path = os.path.join(tempfile.gettempdir(), "jax_tinybert-scratch", kind)
    clean_stale_temps(path)
    return mkdtemp(path)


def staging_dir(out_dir: str) -> str:
    """A new empty local folder to write the future `out_dir` into with plain file I/O: a hidden
    temporary beside it (`mkdtemp`) for a local out_dir, a `scratch_dir` for a URL."""
    if not is_remote(out_dir):
        return mkdtemp(out_dir)
    return scratch_dir("stage-" + os.fspath(out_dir).rstrip("/").rsplit("/", 1)[-1])


def _local_files(root: str) -> List[str]:
    out = []
    for d, dirs, files in os.walk(root):
        dirs.sort()
        out.extend(os.path.relpath(os.path.join(d, f), root) for f in sorted(files))
    return out


def publish_dir(tmp: str, out_dir: str, last: Sequence[str] = (), keep_local: bool = False) -> None:
    """Put the complete staged folder `tmp` (from `staging_dir`) in place of `out_dir`.

    Local: `swap_into_place`. URL: uploaded under a hidden temporary prefix beside out_dir, then
    the old out_dir deleted and the objects copied into place, the relative paths in `last`
    after all others (module docstring); the local `tmp` is deleted afterwards unless
    `keep_local` (then it is deleted when the process exits).
    """
    if not is_remote(out_dir):
        swap_into_place(tmp, out_dir)
        return
    out_dir = os.fspath(out_dir).rstrip("/")
    parent, name = out_dir.rsplit("/", 1)
    remote_tmp = f"{parent}/{_prefix(name)}{uuid.uuid4().hex[:8]}"
    rels = _local_files(tmp)
    fs, _ = url_fs(out_dir)
    try:
        for r in rels:
            upload_file(os.path.join(tmp, r), f"{remote_tmp}/{r}")
        rmtree(out_dir)
        last = [r for r in last if r in rels]
        for r in [r for r in rels if r not in last] + last:
            # gcsfs copy = one server-side "rewrite" request: the object appears whole.
            fs.copy(url_fs(f"{remote_tmp}/{r}")[1], url_fs(f"{out_dir}/{r}")[1])
    finally:
        rmtree(remote_tmp)
    if keep_local:
        _delete_at_exit(tmp)
    else:
        shutil.rmtree(tmp, ignore_errors=True)


def _delete_at_exit(local: str) -> None:
    import atexit  # noqa: PLC0415

    atexit.register(shutil.rmtree, local, True)


def local_mirror(path: str) -> str:
    """A local folder with the files of folder `path`: `path` itself when local; for a URL a
    new temporary folder the files are downloaded to (deleted when the process exits)."""
    if not is_remote(path):
        return path
    local = scratch_dir("mirror")
    _delete_at_exit(local)
    root = os.fspath(path).rstrip("/")
    fsys, p = url_fs(root)
    for obj in fsys.find(p):
        rel = obj[len(p.rstrip("/")) + 1:]
        dst = os.path.join(local, *rel.split("/"))
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with _epath(f"{root}/{rel}").open("rb") as src, open(dst, "wb") as out:
            shutil.copyfileobj(src, out, 8 << 20)
    return local


# ----------------------------------------------------------------------------- stale temporaries

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


def _remote_mtime(url: str) -> Optional[float]:
    """Newest modification time of the object `url` or of the objects under it (None: gone)."""
    fs, p = url_fs(url)
    try:
        infos = fs.find(p, withdirs=False, detail=True) if fs.isdir(p) else {p: fs.info(p)}
    except FileNotFoundError:
        return None
    times = []
    for info in infos.values():
        m = info.get("mtime") or info.get("updated")
        if hasattr(m, "timestamp"):
            m = m.timestamp()
        elif isinstance(m, str):
            import datetime  # noqa: PLC0415

            m = datetime.datetime.fromisoformat(m.replace("Z", "+00:00")).timestamp()
        if m is not None:
            times.append(float(m))
    return max(times) if times else (0.0 if infos else None)


def clean_stale_temps(path: str) -> List[str]:
    """Delete the temporaries of `path` left by dead writers; returns what was removed.

    Stale: this host and the pid in the name is not running; another host's and older than
    FOREIGN_STALE_S; or an old-style name without host/pid that predates this process.
    Works on URLs too (the temporary prefixes of `publish_dir`).
    """
    remote = is_remote(path)
    if remote:
        d, name = os.fspath(path).rstrip("/").rsplit("/", 1)
    else:
        d, name = os.path.split(os.path.abspath(path))
    head = f".{name}.tmp-"
    try:
        entries = listdir(d)
    except FileNotFoundError:
        return []
    host, started, removed = _host(), None, []
    for e in entries:
        if not e.startswith(head):
            continue
        full = join(d, e)
        parts = e[len(head):].split("-")
        if remote:
            mtime = _remote_mtime(full)
            if mtime is None:
                continue
        else:
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
        if remote:
            if isdir(full):
                rmtree(full)
            else:
                with contextlib.suppress(FileNotFoundError):
                    remove(full)
        elif os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full, ignore_errors=True)
        else:
            try:
                os.unlink(full)
            except FileNotFoundError:
                pass
        removed.append(full)
    return removed
