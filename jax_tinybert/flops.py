"""The FLOPs of the programs a run executes, by XLA's cost analysis: what a phase achieved.

A run reports how fast it went in examples/s; what the hardware could have given is a FLOP
rate. `program_flops(lowered)` is XLA's count for one call of a program (the unoptimised HLO:
every dot 2 M N K, so the same count on every backend; on one CPU device the compiled
program's, `counted_program`: within 0.3% of it and ~15x cheaper), and `Work` adds it up over
the calls a phase makes, from any thread, analysing each program once. The teacher's cache
pass and the compiled-ahead train and eval steps report theirs (`[teacher cache] ... (5.21
TFLOP, 137 GFLOP/s)`, `compiled ahead: ...`), and benchmarks/epoch.py turns them into each
epoch's achieved rate and the speed-up that epoch could reach at the machine's best matmul
rate.
"""
from __future__ import annotations

import math
import threading
from typing import Any, Callable, Dict, Hashable, Optional

import jax


def program_flops(program) -> float:
    """FLOPs of one call of a `jax.stages.Lowered` (its unoptimised HLO: every dot 2 M N K) or
    Compiled; of a split step's programs (`.parts`), their sum. Where the backend has no
    analysis of a Lowered (the GPU plugin: NaN or NotImplementedError), the CPU backend's
    analysis of the same HLO module (a private JAX API). NaN for None, or when neither gives one.
    """
    if program is None:
        return math.nan
    if hasattr(program, "parts"):
        return sum(program_flops(p) for p in program.parts)
    try:
        ca = program.cost_analysis()
        if isinstance(ca, (list, tuple)):
            ca = ca[0] if ca else {}
        f = float((ca or {}).get("flops", math.nan))
        if math.isfinite(f):
            return f
    except Exception:  # noqa: BLE001 - an unimplemented analysis is not the run's error
        pass
    try:
        from jax._src.lib import _jax
        from jax.extend import backend as xb

        ca = _jax.hlo_module_cost_analysis(xb.get_backend("cpu"),
                                           program.compiler_ir("hlo").as_hlo_module())
        return float((ca or {}).get("flops", math.nan))
    except Exception:  # noqa: BLE001 - a Compiled has no HLO to give, or the API moved
        return math.nan


def counted_program(lowered, compiled):
    """Which of a program's two forms `Work` should count (`program_flops`): the compiled one
    where it runs on one CPU device, else `lowered`.

    The compiled program's analysis reads the optimised module XLA already holds, ~0.03 s for a
    train step's gradient program against 0.4-0.6 s to convert its lowered module to HLO again;
    XLA's optimisations add a few elementwise ops, +0.3% (prediction and intermediate steps,
    benchmarks/RESULTS.md#length-buckets-and-compilation). A partitioned program's analysis would count one device's share,
    and an accelerator's may leave out its library calls: those count the lowered module."""
    if compiled is None:
        return lowered
    try:
        shardings = jax.tree_util.tree_leaves((compiled.input_shardings,
                                               compiled.output_shardings))
        devices = set().union(*(s.device_set for s in shardings))
    except Exception:  # noqa: BLE001 - no shardings to read: count what always works
        return lowered
    if len(devices) == 1 and next(iter(devices)).platform == "cpu":
        return compiled
    return lowered


class Work:
    """FLOPs summed over calls, each program analysed once (thread-safe).

    A program can be handed over before it is analysed (`defer`): converting its module to HLO
    for the count takes ~0.3 s, and a step waiting for the program compiled ahead should not
    wait for that too. Reading `flops`, `calls`, `unknown` or `known` analyses what is left."""

    def __init__(self):
        self._per_program: Dict[Hashable, float] = {}
        self._deferred: Dict[Hashable, Any] = {}   # key -> program, not analysed yet
        self._calls: Dict[Hashable, int] = {}
        self._lock = threading.Lock()

    def analyse(self, key: Hashable, program) -> float:
        """Counts the program `key` (a Lowered or Compiled), ahead of its calls; -> its FLOPs."""
        f = program_flops(program)
        with self._lock:
            self._per_program[key] = f
            self._deferred.pop(key, None)
        return f

    def defer(self, key: Hashable, program) -> None:
        """The program `key`, to analyse later (`analyse_deferred`, or when a total is read)."""
        with self._lock:
            if key not in self._per_program:
                self._deferred[key] = program

    def analyse_deferred(self) -> None:
        with self._lock:
            todo = list(self._deferred.items())
        for key, program in todo:
            self.analyse(key, program)

    def add(self, key: Hashable, lower: Optional[Callable[[], Any]] = None) -> None:
        """One call of the program `key`. Not analysed (nor deferred) yet: `lower()` -> its
        Lowered is (after the call has compiled it, a jitted function's `lower` and the
        Lowered's `compile` are cache hits: the form `counted_program` picks is counted);
        without `lower` the call has no count."""
        with self._lock:
            seen = key in self._per_program or key in self._deferred
        if not seen and lower is not None:
            lowered = lower()
            # Asked for on the CPU only, where it is known to be a cache hit after the call
            # (elsewhere counted_program would not pick it anyway).
            cpu = jax.default_backend() == "cpu" and hasattr(lowered, "compile")
            self.analyse(key, counted_program(lowered, lowered.compile() if cpu else None))
        with self._lock:
            self._calls[key] = self._calls.get(key, 0) + 1

    def _totals(self):
        self.analyse_deferred()
        with self._lock:
            flops, unknown = 0.0, 0
            for key, n in self._calls.items():
                f = self._per_program.get(key)
                if f is not None and math.isfinite(f):
                    flops += n * f
                else:
                    unknown += n
            return flops, sum(self._calls.values()), unknown

    @property
    def flops(self) -> float:
        return self._totals()[0]

    @property
    def calls(self) -> int:
        return self._totals()[1]

    @property
    def unknown(self) -> int:
        """Calls whose program has no count."""
        return self._totals()[2]

    @property
    def known(self) -> bool:
        """Whether every call was counted (and there was one)."""
        _, calls, unknown = self._totals()
        return calls > 0 and unknown == 0


def fmt(flops: float, seconds: float = 0.0) -> str:
    """"5.21 TFLOP" (or GFLOP below 1 TFLOP), with ", 137 GFLOP/s" over `seconds` > 0."""
    s = f"{flops / 1e12:.2f} TFLOP" if flops >= 1e12 else f"{flops / 1e9:.2f} GFLOP"
    return s + (f", {flops / seconds / 1e9:.0f} GFLOP/s" if seconds > 0 else "")
