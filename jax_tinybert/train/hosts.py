"""Per-host views of the train steps: a jax.profiler trace of chosen steps on every host, and
the straggler line (each host's step time and input wait, the slowest one named).

    prof = StepProfiler(config, workdir, start_step)     # config.train.profile_start / _steps
    prof.before(step + 1)
    with prof.annotate(step + 1): state, m = train_step(...)
    step += 1; prof.after(step, m["loss"])
    prof.close()                                         # a run stopped inside the window

    times = HostTimes()
    times.waited(seconds)                 # each step: the wait for its batch (read + feed)
    times.record(step, writer)            # at the log steps, on every process (a collective)

The trace goes to a local folder (jax.profiler writes plain files) and is then put in place
as `<workdir>/profile/host<i>` with fs.publish_dir, so a gs:// workdir gets it too.

Under synchronous data parallelism every host's step takes as long as the slowest host's: the
step times agree, and a host that holds the others back shows in its own time outside the
step, the wait for its next batch. The line names a host whose input wait is over
STRAGGLER_RATIO x the median of all hosts (and a visible share of a step); a device slower
than the others shows in the traces instead.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Optional, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from jax_tinybert import fs

log = logging.getLogger(__name__)

__all__ = ["StepProfiler", "HostTimes", "straggler_line", "STRAGGLER_RATIO"]

STRAGGLER_RATIO = 1.2
# An input wait under this share of the median step is noise, whatever its ratio.
MIN_WAIT_SHARE = 0.05
# Hosts listed one by one in the line; more are summed up as median and max.
LIST_HOSTS = 8


class StepProfiler:
    """A jax.profiler trace of train steps first .. first + count - 1 (1-based, as the step
    lines number them; config.train.profile_start / profile_steps, first 0 = off) on every
    host. A run resumed inside the window traces what is left of it; one resumed after it,
    nothing."""

    def __init__(self, config, workdir: str, start_step: int):
        tc = config.train
        self.first = int(tc.profile_start)
        self.last = self.first + int(tc.profile_steps) - 1
        self.out = fs.join(workdir, "profile", f"host{jax.process_index()}")
        self.begin = max(self.first, start_step + 1)
        self.on = self.first > 0 and self.begin <= self.last
        self.tmp: Optional[str] = None
        self.traced = (0, 0)

    def before(self, step: int) -> None:
        """Called before train step `step` (1-based) is dispatched: starts the trace there."""
        if self.on and self.tmp is None and step == self.begin:
            if not fs.is_remote(self.out):
                fs.makedirs(self.out.rsplit("/", 1)[0])
            self.tmp = fs.staging_dir(self.out)
            jax.profiler.start_trace(self.tmp)
            self.traced = (step, step)

    def annotate(self, step: int):
        """The context of train step `step`'s batch and dispatch: a step marker in the trace
        while one runs (TensorBoard's step view reads it), else nothing."""
        if self.tmp is None:
            return contextlib.nullcontext()
        return jax.profiler.StepTraceAnnotation("train", step_num=step)

    def after(self, step: int, marker) -> None:
        """Called after train step `step` is dispatched (`marker`: one of its outputs): the
        trace stops, once the step has run, at the window's last step."""
        if self.tmp is not None:
            self.traced = (self.traced[0], step)
            if step >= self.last:
                jax.block_until_ready(marker)
                self._stop()

    def close(self) -> None:
        """A trace still running (the run stopped inside the window) is stopped and kept."""
        if self.tmp is not None:
            self._stop()

    def _stop(self) -> None:
        jax.profiler.stop_trace()
        tmp, self.tmp, self.on = self.tmp, None, False
        fs.publish_dir(tmp, self.out)
        log.info("profile of train steps %d-%d (jax.profiler) -> %s", *self.traced, self.out)


class HostTimes:
    """Each host's seconds a step and seconds a step waiting for its batch since the previous
    record; gathered from every host at the log steps (one tiny collective there) into
    metrics `hosts/step_s/<i>` and `hosts/input_wait_s/<i>` and the line process 0 prints.
    Several processes only: one host has no one to straggle behind."""

    def __init__(self, clock=time.perf_counter):
        self._clock = clock
        self._t, self._wait, self._steps = clock(), 0.0, 0

    def waited(self, seconds: float) -> None:
        self._wait += seconds
        self._steps += 1

    def record(self, step: int, writer) -> Optional[np.ndarray]:
        """At a log step, on every process: -> [processes, 2] (step s, input wait s), or None
        with one process."""
        now = self._clock()
        n = max(self._steps, 1)
        mine = np.asarray([(now - self._t) / n, self._wait / n], np.float64)
        self._t, self._wait, self._steps = now, 0.0, 0
        if jax.process_count() == 1:
            return None
        rows = np.asarray(multihost_utils.process_allgather(mine), np.float64).reshape(-1, 2)
        metrics = {f"step_s/{i}": float(r[0]) for i, r in enumerate(rows)}
        metrics.update({f"input_wait_s/{i}": float(r[1]) for i, r in enumerate(rows)})
        writer.write(step, metrics, prefix="hosts")
        if jax.process_index() == 0:
            print(straggler_line(step, rows), flush=True)
        return rows


def _values(xs: Sequence[float]) -> str:
    if len(xs) <= LIST_HOSTS:
        return " ".join(f"{x:.3f}" for x in xs)
    return f"median {np.median(xs):.3f}, max {max(xs):.3f} on host {int(np.argmax(xs))}"


def straggler_line(step: int, rows: np.ndarray, ratio: float = STRAGGLER_RATIO) -> str:
    """The hosts line of `step` from rows [hosts, 2] (seconds a step, input wait a step),
    naming the host with the longest input wait when it is over `ratio` x the median (and
    over MIN_WAIT_SHARE of the median step)."""
    step_s, wait_s = rows[:, 0], rows[:, 1]
    med_step, med_wait = float(np.median(step_s)), float(np.median(wait_s))
    line = (f"[hosts] step {step}: s/step by host {_values(step_s)}; input wait s/step "
            f"{_values(wait_s)}")
    worst = int(np.argmax(wait_s))
    if wait_s[worst] > ratio * med_wait and wait_s[worst] > MIN_WAIT_SHARE * med_step:
        times = f"{wait_s[worst] / med_wait:.1f}x" if med_wait > 0 else "far over"
        line += (f"; straggler: host {worst} waits {wait_s[worst]:.3f} s a step for its input, "
                 f"{times} the median ({med_wait:.3f} s)")
    return line
