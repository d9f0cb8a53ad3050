"""What a stage prints and records as it trains: the step lines with their ETA, the evals, and
the stop on a non-finite loss."""
from __future__ import annotations

import collections
import math
import time
from typing import Dict, Optional

import jax

from jax_tinybert.errors import UserError
from jax_tinybert.progress import fmt_time
from jax_tinybert.train.hosts import HostTimes
from jax_tinybert.train.metrics_writer import MetricsWriter

_PRINTED = set()


def print_once(line: str) -> None:
    """Prints `line` the first time this process asks: a note that holds for the whole process
    (the CPU's faster dtype) is said once, not once per stage of a pipeline such as the demo."""
    if line not in _PRINTED:
        _PRINTED.add(line)
        print(line, flush=True)


class NonFiniteLoss(UserError, FloatingPointError):
    """The loss or the gradient norm became inf / NaN: the run stops, saving nothing more."""


def check_finite(config, step: int, metrics: Dict[str, float]) -> None:
    """Raises NonFiniteLoss when a metric of `step` (host floats) is inf or NaN."""
    bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
    if bad:
        raise NonFiniteLoss(
            f"non-finite {', '.join(f'{k}={v}' for k, v in bad.items())} at step {step}; nothing "
            "from this step on is saved (the checkpoints so far are finite); rerun with a lower "
            f"config.optim.learning_rate (now {config.optim.learning_rate:g}) in a new --workdir, "
            "or check the data")


class TrainLog:
    """Train metrics every config.train.log_every steps (and at the first and last step):
    to metrics.jsonl and stdout, with examples/s and tokens/s since the previous record, and
    the steps' ETA. Non-finite metrics stop the run. `compiler`: the compile-ahead worker
    (speed/precompile.py), whose compiles the ETA leaves out, or None."""

    def __init__(self, run, writer: MetricsWriter, start_step: int, compiler=None):
        self.run, self.writer, self.start_step = run, writer, start_step
        self.compiler = compiler
        self.t_last, self.examples, self.tokens = time.time(), 0, 0
        self.last: Dict[str, float] = {}
        self.eta = StepEta(run.total_steps)
        self.hosts = HostTimes()   # fed the input waits by the loop; gathered at the records

    def step(self, step: int, batch, metrics) -> None:
        tc, total = self.run.config.train, self.run.total_steps
        self.examples += tc.batch_size
        self.tokens += int(batch["attention_mask"].sum()) * jax.process_count()
        record = step % tc.log_every == 0 or step == total or step == 1
        if not (record or step == self.start_step + 1):
            return
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.time()
        eta = self.eta.at(step, now, -math.inf if self.compiler is None
                          else self.compiler.quiet_since())
        dt = now - self.t_last
        m["examples_per_s"] = self.examples / dt
        m["tokens_per_s"] = self.tokens / dt
        self.t_last, self.examples, self.tokens = now, 0, 0
        check_finite(self.run.config, step, m)
        if record:
            self.writer.write(step, m, prefix="train")
            self.last = m
        if jax.process_index() == 0:
            terms = " ".join(f"{k}={v:.4g}" for k, v in m.items()
                             if k not in ("examples_per_s", "tokens_per_s", "lr", "grad_norm"))
            print(f"step {step:>6}/{total} [{100 * step / total:5.1f}%] {terms} "
                  f"lr={m['lr']:.2e} {m['examples_per_s']:.1f} ex/s"
                  + (f", ETA {fmt_time(eta)}" if eta is not None and step < total else ""),
                  flush=True)
        if record:   # the same steps on every process: it gathers from all of them
            self.hosts.record(step, self.writer)


class StepEta:
    """Seconds left for the steps, from the mean step time over the last few logged intervals
    (up to WINDOW). Left out: intervals that shared the cores with the programs compiling ahead
    (the ETA waits for an interval after the worker's last compile), and the interval that
    starts at the first step this process ran once a later one exists (that step paid for its
    own compilation)."""

    WINDOW = 5

    def __init__(self, total_steps: int):
        self.total = total_steps
        self.points = collections.deque(maxlen=self.WINDOW + 1)   # (step, time), oldest first
        self.logged = 0

    def at(self, step: int, now: float, quiet_since: float = -math.inf) -> Optional[float]:
        """-> seconds left, or None while no clean interval is known. `quiet_since`: the time
        since which nothing compiled beside the steps (inf: something compiles now)."""
        self.logged += 1
        if self.logged == 3:   # a later interval exists: drop the one from the first step
            self.points.popleft()
        self.points.append((step, now))
        clean = [p for p in self.points if p[1] >= quiet_since]
        if len(clean) < 2:
            return None
        (s0, t0), (s1, t1) = clean[0], clean[-1]
        if s1 <= s0 or t1 <= t0:
            return None
        return (t1 - t0) / (s1 - s0) * max(0, self.total - s1)


def record_eval(step: int, ev: Dict[str, float], best: Optional[dict], improved: bool,
                writer: MetricsWriter, history: list) -> Optional[dict]:
    """Writes and prints an eval; -> the best eval so far ({"step", metrics...})."""
    writer.write(step, ev, prefix="eval")
    history.append({"step": step, **ev})
    if improved:
        best = {"step": step, **ev}
    if jax.process_index() == 0:
        note = "  (best)" if improved else (
            f"  (best {best['main']:.4f} @ {best['step']})" if best else "")
        print(f"eval step {step}: " + " ".join(f"{k}={v:.4f}" for k, v in ev.items()) + note,
              flush=True)
    return best
