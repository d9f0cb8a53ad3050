"""The FLOPs of the programs a run executes, by XLA's cost analysis: what a phase achieved.

A run reports how fast it went in examples/s; what the hardware could have given is a FLOP
rate. `program_flops(lowered)` is XLA's count for one call of a program (the unoptimised HLO:
every dot 2 M N K, so the same count on every backend), and `Work` adds it up over the calls a
phase makes, from any thread. The teacher's cache pass and the compiled-ahead train and eval
steps report theirs (`[teacher cache] ... (5.21 TFLOP, 137 GFLOP/s)`, `compiled ahead: ...`), and
benchmarks/epoch.py turns them into each epoch's achieved rate and the speed-up that epoch could
reach at the machine's best matmul rate.
"""
from __future__ import annotations

import math
import threading
from typing import Any, Callable, Dict, Hashable


def program_flops(lowered) -> float:
    """FLOPs of one call of a `jax.stages.Lowered` (or Compiled); NaN for None or where the
    backend's cost analysis gives none (the GPU plugin does not implement it for Lowered)."""
    try:
        ca = lowered.cost_analysis() if lowered is not None else None
    except Exception:  # noqa: BLE001 - an unimplemented analysis is not the run's error
        return math.nan
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else {}
    return float((ca or {}).get("flops", math.nan))


class Work:
    """FLOPs summed over calls, each program analysed once (thread-safe)."""

    def __init__(self):
        self._per_program: Dict[Hashable, float] = {}
        self._lock = threading.Lock()
        self.flops = 0.0
        self.calls = 0
        self.unknown = 0   # calls whose program has no count

    def add(self, key: Hashable, lower: Callable[[], Any]) -> None:
        """One call of the program `key`; `lower()` -> its Lowered, called the first time only
        (after the call has compiled it, a jitted function's `lower` is a cache hit)."""
        with self._lock:
            f = self._per_program.get(key)
        if f is None:
            f = program_flops(lower())
            with self._lock:
                self._per_program[key] = f
        self.add_flops(f)

    def add_flops(self, flops: float) -> None:
        with self._lock:
            self.calls += 1
            if math.isfinite(flops):
                self.flops += flops
            else:
                self.unknown += 1

    @property
    def known(self) -> bool:
        """Whether every call was counted (and there was one)."""
        return self.calls > 0 and self.unknown == 0


def fmt(flops: float, seconds: float = 0.0) -> str:
    """"5.21 TFLOP" (or GFLOP below 1 TFLOP), with ", 137 GFLOP/s" over `seconds` > 0."""
    s = f"{flops / 1e12:.2f} TFLOP" if flops >= 1e12 else f"{flops / 1e9:.2f} GFLOP"
    return s + (f", {flops / seconds / 1e9:.0f} GFLOP/s" if seconds > 0 else "")
