"""Metrics out of the loop: JSON lines (workdir/metrics.jsonl) + TensorBoard events (workdir/tb).

Only process 0 writes (enabled=False elsewhere). TensorBoard goes through tensorboardX because
clu's writers need TensorFlow; without tensorboardX only the JSON lines are written.

Resuming: `MetricsWriter(workdir, start_step=s)` keeps only the records of steps <= s (the
restored checkpoint; later ones were written by the killed run and are about to be replayed)
and rebuilds `tb/` from them as a single events file, so a resumed run's metrics equal an
unbroken run's: no step repeated, no second events file.

A workdir in a bucket (gs://...) cannot be appended to: both files are written to a local
folder and uploaded whole (each one object, so a reader sees a complete earlier version) at most
every `upload_every_s` seconds (JTB_METRICS_UPLOAD_S, default 30), and at `close()` (end of
the run, preemption). A run killed without warning loses at most that long of metrics; they are
rewritten when the resumed run replays those steps.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from typing import Dict, List, Optional

from jax_tinybert import fs

log = logging.getLogger(__name__)

__all__ = ["MetricsWriter", "read_jsonl"]


def read_jsonl(path: str) -> List[dict]:
    """The records of a metrics.jsonl; a torn last line (killed mid-write) is skipped."""
    out = []
    try:
        with fs.open_file(path) as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict) and "step" in rec:
                    out.append(rec)
    except FileNotFoundError:
        pass
    return out


def _summary_writer_class():
    """tensorboardX's SummaryWriter, imported without importing torch.

    tensorboardX imports torch, when it is installed, only to accept torch tensors; that was 1.06
    of its 1.25 s of import per run on a 2-core Xeon, and the values written here are floats.
    torch is kept out only while tensorboardX is imported, and only if nothing imported it yet.
    """
    block = "torch" not in sys.modules
    if block:
        sys.modules["torch"] = None   # `import torch` raises ImportError: tensorboardX skips it
    try:
        from tensorboardX import SummaryWriter
    finally:
        if block and sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    return SummaryWriter


class MetricsWriter:
    """Appends records to workdir/metrics.jsonl and workdir/tb (process 0 only).

    start_step: the step the run starts from (0 fresh, else the restored checkpoint's step):
    records of later steps are dropped and TensorBoard is rebuilt from the rest. None appends
    to whatever is there.
    """

    def __init__(self, workdir: str, enabled: bool = True, start_step: int | None = None,
                 upload_every_s: Optional[float] = None):
        self.enabled = enabled
        self._tb = None
        self._fh = None
        self._remote: Optional[str] = None   # the bucket workdir; files are staged locally
        if not enabled:
            return
        path = fs.join(workdir, "metrics.jsonl")
        kept = read_jsonl(path) if start_step is not None or fs.is_remote(workdir) else []
        if start_step is not None:
            kept = [r for r in kept if r["step"] <= start_step]
        if fs.is_remote(workdir):
            self._remote = workdir
            self._upload_every = float(os.environ.get("JTB_METRICS_UPLOAD_S", 30)
                                       if upload_every_s is None else upload_every_s)
            self._last_upload = time.monotonic()
            self._local = fs.scratch_dir("metrics")
            workdir = self._local
            path = os.path.join(workdir, "metrics.jsonl")
        else:
            os.makedirs(workdir, exist_ok=True)
        if start_step is not None or self._remote:
            tmp = path + ".tmp"
            with open(tmp, "w") as fh:
                for r in kept:
                    fh.write(json.dumps(r) + "\n")
            os.replace(tmp, path)
        self._fh = open(path, "a")
        tb_dir = os.path.join(workdir, "tb")
        try:
            SummaryWriter = _summary_writer_class()
        except ImportError:
            log.warning("tensorboardX not installed: metrics go to metrics.jsonl only")
            return
        if start_step is not None:
            # One events file holding exactly the kept records (TensorBoard would otherwise
            # show the killed run's extra steps, and the replayed ones twice, from a 2nd file).
            shutil.rmtree(tb_dir, ignore_errors=True)
            if self._remote:
                fs.rmtree(fs.join(self._remote, "tb"))
        self._tb = SummaryWriter(tb_dir)
        if start_step is not None:
            for r in kept:
                self._add_tb(r)

    def _add_tb(self, rec: dict) -> None:
        for k, v in rec.items():
            if k not in ("step", "time"):
                self._tb.add_scalar(k, v, rec["step"], walltime=rec.get("time"))

    def write(self, step: int, metrics: Dict[str, float], prefix: str = "") -> None:
        """One record {"step", "time", "<prefix>/<name>": value, ...}."""
        if not self.enabled:
            return
        rec = {"step": int(step), "time": time.time()}
        rec.update({f"{prefix}/{k}" if prefix else k: float(v) for k, v in metrics.items()})
        self._fh.write(json.dumps(rec) + "\n")
        self._fh.flush()
        if self._tb is not None:
            self._add_tb(rec)
        if self._remote and time.monotonic() - self._last_upload >= self._upload_every:
            self.upload()

    def upload(self, quiet: bool = False) -> None:
        """Bucket workdir: upload metrics.jsonl and the TensorBoard events as they are now.
        quiet: log a failure instead of raising (used while another error propagates)."""
        if not self._remote:
            return
        if quiet:
            try:
                self.upload()
            except Exception as e:  # noqa: BLE001 - the caller's error matters more
                log.warning("could not upload the metrics to %s: %s", self._remote, e)
            return
        if self._tb is not None:
            self._tb.flush()
        for d, _, files in os.walk(self._local):
            for f in files:
                if f.endswith(".tmp"):
                    continue
                rel = os.path.relpath(os.path.join(d, f), self._local)
                fs.upload_file(os.path.join(d, f), fs.join(self._remote, *rel.split(os.sep)))
        self._last_upload = time.monotonic()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._remote:
            self.upload()
            shutil.rmtree(self._local, ignore_errors=True)
            self._remote = None
