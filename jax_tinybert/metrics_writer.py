"""Metrics out of the loop: JSON lines (workdir/metrics.jsonl) + TensorBoard events (workdir/tb).

Only process 0 writes (enabled=False elsewhere). TensorBoard goes through tensorboardX because
clu's writers need TensorFlow; without tensorboardX only the JSON lines are written.
"""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Dict

log = logging.getLogger(__name__)


class MetricsWriter:
    def __init__(self, workdir: str, enabled: bool = True):
        self.enabled = enabled
        self._tb = None
        self._fh = None
        if not enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        self._fh = open(os.path.join(workdir, "metrics.jsonl"), "a")
        try:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(workdir, "tb"))
        except ImportError:
            log.warning("tensorboardX not installed: metrics go to metrics.jsonl only")

    def write(self, step: int, metrics: Dict[str, float], prefix: str = "") -> None:
        """One record {"step", "time", "<prefix>/<name>": value, ...}."""
        if not self.enabled:
            return
        rec = {"step": int(step), "time": time.time()}
        rec.update({f"{prefix}/{k}" if prefix else k: float(v) for k, v in metrics.items()})
        self._fh.write(json.dumps(rec) + "\n")
        self._fh.flush()
        if self._tb is not None:
            for k, v in rec.items():
                if k not in ("step", "time"):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
