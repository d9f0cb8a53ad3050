"""Progress of long phases (tokenisation, teacher cache, evaluation, corpus packing).

On a terminal: a tqdm bar. In a log (stderr not a TTY, e.g. `python ... > run.log 2>&1` or a
cluster job): a plain line every `every_s` seconds (env JTB_PROGRESS_EVERY_S, default 10) with
the count, rate and ETA, and one closing line with the total time and rate. Only process 0
writes; JTB_PROGRESS=0 turns it off.

    with Progress("teacher cache", total=n, unit="ex") as p:
        for batch in batches:
            ...
            p.update(len(batch))
    p.rate        # units per second over the whole phase (e.g. for metrics.jsonl)

Lines look like `[teacher cache] 12,288/67,349 ex (18%) 2,046 ex/s, ETA 27s`.

A phase whose units cost unequal time (a teacher pass that forwards its longest examples first,
a few to a row, then many short ones) passes `work_total` and each update's `work`: the
percentage and the ETA then follow the work done, while the count and rate stay in units:
`[teacher cache] 1,681/67,349 ex, 9% of the work, 167 ex/s, ETA 1m31s`.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Iterable, Iterator, Optional, TextIO, TypeVar

T = TypeVar("T")


def _is_main_process() -> bool:
    # Only ask JAX when the program already uses it (importing it here would cost a second).
    jax = sys.modules.get("jax")
    if jax is not None:
        try:
            return jax.process_index() == 0
        except Exception:  # backend not initialisable: a single process
            return True
    return os.environ.get("JTB_PROCESS_ID", "0") in ("", "0")


def fmt_time(s: float) -> str:
    """Seconds as "42s", "3m05s" or "1h02m"."""
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _fmt_num(x: float, unit: str) -> str:
    if unit == "B":
        for u in ("B", "kB", "MB", "GB", "TB"):
            if abs(x) < 1000 or u == "TB":
                return f"{x:.0f} {u}" if u == "B" else f"{x:.1f} {u}"
            x /= 1000
    return f"{x:,.0f}" if abs(x) >= 10 or float(x).is_integer() else f"{x:.1f}"


class Progress:
    """A counter with a rate and an ETA (see the module docstring).

    total: units expected (None: unknown, no ETA). unit: "ex", "batch", "B" (bytes, shown as
    kB/MB/...). enabled: default process 0 and JTB_PROGRESS != "0". stream: default stderr.
    work_total: the phase's work in any unit (None: each unit is equal work); `update`'s `work`
    adds to it, and the percentage and ETA follow it.
    """

    def __init__(self, desc: str, total: Optional[float] = None, unit: str = "ex", *,
                 enabled: Optional[bool] = None, stream: Optional[TextIO] = None,
                 every_s: Optional[float] = None, bar: Optional[bool] = None,
                 work_total: Optional[float] = None):
        self.desc, self.total, self.unit = desc, total, unit
        self.work_total = work_total if work_total and work_total > 0 else None
        self.n = 0
        self.work = 0.0
        self.t0 = time.perf_counter()
        self.t_end: Optional[float] = None
        if enabled is None:
            enabled = os.environ.get("JTB_PROGRESS", "1") != "0" and _is_main_process()
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.every_s = float(every_s if every_s is not None
                             else os.environ.get("JTB_PROGRESS_EVERY_S", "10"))
        self._next = self.t0 + self.every_s
        self._bar = None
        if enabled and (bar if bar is not None else _isatty(self.stream)):
            from tqdm import tqdm

            if self.work_total:   # the bar (and tqdm's ETA) follows the work; units as postfix
                self._bar = tqdm(total=self.work_total, desc=desc, file=self.stream,
                                 dynamic_ncols=True, mininterval=0.5,
                                 bar_format="{desc}: {percentage:3.0f}%|{bar}| {postfix} "
                                            "[{elapsed}<{remaining}]")
            else:
                self._bar = tqdm(total=total, desc=desc, unit=unit, file=self.stream,
                                 unit_scale=unit == "B", dynamic_ncols=True, mininterval=0.5)

    # -- counting ---------------------------------------------------------------------------
    def update(self, n: float = 1, work: float = 0.0) -> None:
        """Adds n units (and `work` to the work done, with `work_total`)."""
        self.work += work
        self.set(self.n + n)

    def set(self, n: float) -> None:
        """Sets the count to n (e.g. bytes read so far)."""
        delta, self.n = n - self.n, n
        if not self.enabled:
            return
        if self._bar is not None:
            if self.work_total:
                self._bar.set_postfix_str(self._counts(), refresh=False)
                self._bar.update(min(self.work, self.work_total) - self._bar.n)
            else:
                self._bar.update(delta)
            return
        now = time.perf_counter()
        if now >= self._next:
            self._next = now + self.every_s
            self._line(self._status(now))

    @property
    def elapsed(self) -> float:
        return (self.t_end or time.perf_counter()) - self.t0

    @property
    def rate(self) -> float:
        """Units per second since the start (0 before any time has passed)."""
        dt = self.elapsed
        return self.n / dt if dt > 0 else 0.0

    def close(self, stopped: bool = False, note: str = "") -> None:
        """Ends the phase: closes the bar, or writes the closing line (phases over 1 s);
        `stopped`: the phase ended early (an exception, Ctrl-C), and the line says so. `note`:
        added to a finished phase's line, e.g. "3,668 ex in 38s (97 ex/s; <note>)"."""
        if self.t_end is not None:
            return
        self.t_end = time.perf_counter()
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        elif stopped:
            # "64 of 256 ex", "1.0 MB of 20.0 MB", or "64 ex" without a total.
            bare = self.total and self.unit != "B"
            n = _fmt_num(self.n, self.unit) if bare else self._q(self.n)
            of = f" of {self._q(self.total)}" if self.total else ""
            self._line(f"stopped after {n}{of} in {fmt_time(self.elapsed)}")
        elif self.elapsed >= 1.0:
            self._line(f"{self._q(self.n)} in {fmt_time(self.elapsed)} ({self._q(self.rate)}/s"
                       + (f"; {note}" if note else "") + ")")

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(stopped=exc_type is not None)

    # -- output -----------------------------------------------------------------------------
    def _q(self, x: float) -> str:
        """A quantity with its unit: "1,234 ex", "2.5 MB"."""
        s = _fmt_num(x, self.unit)
        return s if self.unit == "B" else f"{s} {self.unit}"

    def _counts(self) -> str:
        """"1,681/67,349 ex", "1.0 MB/20.0 MB" ("1,681 ex" without a total)."""
        if not self.total:
            return self._q(self.n)
        n = self._q(self.n) if self.unit == "B" else _fmt_num(self.n, self.unit)
        return f"{n}/{self._q(self.total)}"

    def _status(self, now: float) -> str:
        dt = now - self.t0
        rate = self.n / dt if dt > 0 else 0.0
        if self.work_total:
            done = min(1.0, self.work / self.work_total)
            s = f"{self._counts()}, {100 * done:.0f}% of the work, {self._q(rate)}/s"
            if done > 0:
                s += f", ETA {fmt_time(dt * (1.0 - done) / done)}"
            return s
        s = self._counts()
        if self.total:
            s += f" ({100 * self.n / self.total:.0f}%)"
        s += f" {self._q(rate)}/s"
        if self.total and rate > 0:
            s += f", ETA {fmt_time(max(0.0, self.total - self.n) / rate)}"
        return s

    def _line(self, text: str) -> None:
        print(f"[{self.desc}] {text}", file=self.stream, flush=True)


def track(iterable: Iterable[T], desc: str, total: Optional[float] = None, unit: str = "ex",
          **kw) -> Iterator[T]:
    """Yields the items of `iterable`, counting one unit per item, with progress output."""
    with Progress(desc, total, unit, **kw) as p:
        for item in iterable:
            yield item
            p.update(1)


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
