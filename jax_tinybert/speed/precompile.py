"""Jitted steps compiled ahead for the shapes a run will meet, in a background thread.

A jitted step compiles one program per length bucket when the bucket's first batch arrives,
and training waits meanwhile: six buckets of the prediction step are ~40 s of a 340 s SST-2
epoch on a 2-core Xeon. XLA's compiler keeps only ~1.35 of the 2 cores busy, and training
leaves gaps too (host work between steps), so the same programs compiled by a worker thread
while the main thread trains cost the run ~2 s less each (benchmarks/RESULTS.md#length-buckets-and-compilation).

`Compiler()` owns the worker (one thread: programs compile one at a time, in the order they
were submitted). `Compiler(workers=N)` compiles N at a time: on a GPU host with cores to spare
a second bucket's program otherwise stalls the shuffled epoch that meets it a few steps in (an
SST-2 intermediate epoch on an H200 spent 14 s of its 55 s waiting for it); speed.resolve picks
1 on a CPU backend, where the cores train. `compiler.wrap(jitted)` gives an `Ahead`, the jitted
function wrapped: `submit(*args)` queues `jitted.lower(*args).compile()` (the very function that trains, as
MaxText's train_compile does; args may be ShapeDtypeStructs with shardings), and a call runs
the executable compiled for its shapes. Programs are told apart by the last argument (the
batch); the others (state, params) must keep their shapes and shardings from call to call, as a
train or eval step's do. A call whose program is still queued moves it to the front of the
queue and waits for the worker: compiling it in the calling thread beside the worker's compile
made both ~2x slower (two XLA compiles on 2 cores with one malloc arena: MRPC's first gradient
program took 12 s instead of 5.5 s, and the fine-tuning epoch 4-5 s longer). A shape never
submitted, or whose compile failed, goes through the jitted function (so any error is raised
where it always was).
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import logging
import math
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Set

import jax

from jax_tinybert import flops as work_lib

log = logging.getLogger(__name__)


def signature(batch: Any) -> tuple:
    """The pytree structure, shapes, dtypes and shardings of `batch` (arrays or
    ShapeDtypeStructs): what picks a compiled program."""
    leaves, tree = jax.tree_util.tree_flatten(batch)
    return (tree,) + tuple((tuple(x.shape), str(x.dtype), getattr(x, "sharding", None))
                           for x in leaves)


class Compiler:
    """`workers` threads compiling programs ahead, in the order they were submitted, except
    that a program a call is waiting for goes next (`expedite`)."""

    def __init__(self, workers: int = 1):
        if workers < 1:
            raise ValueError(f"Compiler needs at least one worker thread, got {workers}")
        # The pool runs one `_next` per submitted program; each takes whichever job is first
        # in the queue when a worker gets to it, so the queue's order can change meanwhile.
        self._pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="jtb-compile")
        self._queue: collections.deque = collections.deque()   # (future, fn, args), not started
        self._lock = threading.Lock()
        self._wrapped: List[Ahead] = []
        self._pending = 0                              # submitted, not finished
        self._idle_since: Optional[float] = time.time()  # None while the worker has work

    def wrap(self, jitted: Callable, name: str = "step") -> "Ahead":
        self._wrapped.append(Ahead(jitted, name, self))
        return self._wrapped[-1]

    def submit(self, fn: Callable, *args) -> cf.Future:
        """Queues fn(*args) for the worker; -> its future."""
        fut: cf.Future = cf.Future()
        with self._lock:
            self._queue.append((fut, fn, args))
            self._pending += 1
            self._idle_since = None
        self._pool.submit(self._next)
        return fut

    def expedite(self, fut: cf.Future) -> None:
        """Moves `fut`'s job to the front of the queue (nothing if it has started or is done)."""
        with self._lock:
            for job in self._queue:
                if job[0] is fut:
                    self._queue.remove(job)
                    self._queue.appendleft(job)
                    return

    def quiet_since(self) -> float:
        """The wall time (time.time) since which the workers have had nothing to compile; inf
        while they have. Steps timed before then shared the cores with a compilation."""
        with self._lock:
            return math.inf if self._idle_since is None else self._idle_since

    def _next(self) -> None:
        try:
            with self._lock:
                if not self._queue:
                    return
                fut, fn, args = self._queue.popleft()
            if not fut.set_running_or_notify_cancel():
                return
            try:
                result = fn(*args)
            except BaseException as e:   # noqa: BLE001 - handed to the waiting call
                fut.set_exception(e)
            else:
                fut.set_result(result)
        finally:   # one `_next` runs per submitted job, whatever became of the job
            with self._lock:
                self._pending -= 1
                if self._pending == 0:
                    self._idle_since = time.time()

    def close(self) -> str:
        """Drops the programs not started (one being compiled finishes in its thread);
        -> what ran compiled ahead, e.g. "update step 1 of 1 programs (120 of 120 calls; 1.7 s;
        0.02 TFLOP), gradient step 5 of 6 programs (112 of 120 calls; 3.6 3.5 3.6 3.7 3.9 s;
        6.31 TFLOP)": of the distinct programs each step ran, those the worker compiled, the
        calls they ran, the seconds a worker spent tracing, lowering and compiling each (in
        the order finished; the ones a run never reached included), and the FLOPs of those calls
        by XLA's cost analysis; the others were compiled by the call that
        first needed them (never submitted, or their compile failed)."""
        with self._lock:
            dropped, self._queue = list(self._queue), collections.deque()
        for fut, _, _ in dropped:
            fut.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
        return ", ".join(f"{a.name} {len(a.ahead)} of {len(a.ahead | a.in_step)} programs "
                         f"({a.hits} of {a.hits + a.misses} calls"
                         + (f"; {' '.join(f'{t:.1f}' for t in a.seconds)} s" if a.seconds else "")
                         + (f"; {work_lib.fmt(a.work.flops)}" if a.work.known else "")
                         + ")" for a in self._wrapped)


    def flops(self) -> Optional[float]:
        """FLOPs of every call of the wrapped steps so far (XLA's cost analysis); None when some
        are not counted (run by the jitted function, or by a program without a count)."""
        if any(a.misses or (a.hits and not a.work.known) for a in self._wrapped):
            return None
        return sum(a.work.flops for a in self._wrapped)


class Ahead:
    """`jitted` with programs compiled ahead by a Compiler's worker (see the module docstring)."""

    def __init__(self, jitted: Callable, name: str, compiler: Compiler):
        self.jitted, self.name, self._compiler = jitted, name, compiler
        self._programs: Dict[tuple, cf.Future] = {}
        self.hits = self.misses = 0   # calls run by an executable compiled ahead / by jitted
        self.ahead: Set[tuple] = set()     # signatures run by a program compiled ahead
        self.in_step: Set[tuple] = set()   # and those the jitted function compiled
        self.seconds: List[float] = []     # each compilation a worker finished, in order
        self.work = work_lib.Work()        # FLOPs of the calls run compiled ahead

    def submit(self, *args) -> None:
        """Queues the compilation of the program for `args` (one per distinct signature)."""
        key = signature(args[-1])
        if key not in self._programs:
            self._programs[key] = self._compiler.submit(self._compile, args)

    def _compile(self, args):
        t = time.perf_counter()
        lowered = self.jitted.lower(*args)
        compiled = lowered.compile()
        self.seconds.append(time.perf_counter() - t)
        # Counted after the program is handed over, behind the programs still to compile: a
        # lowered program's count converts its module to HLO again (~0.3 s a program), and the
        # first step of each bucket waited for it (1.6 of 24 s of an MRPC prediction stage's
        # compile worker). On one CPU device the compiled program is counted (~0.03 s).
        key = signature(args[-1])
        counted = work_lib.counted_program(lowered, compiled)
        self.work.defer(key, counted)
        self._compiler.submit(self.work.analyse, key, counted)
        return compiled

    def __call__(self, *args):
        key = signature(args[-1])
        fut = self._programs.get(key)
        compiled = None
        if fut is not None:
            self._compiler.expedite(fut)
            try:
                compiled = fut.result()
            except cf.CancelledError:   # the compiler was closed before the worker got to it
                pass
            except Exception as e:   # noqa: BLE001 - the jitted call below raises it properly
                log.warning("%s: compiling ahead failed (%s); compiling in the step", self.name,
                            e)
        if compiled is None:
            self.misses += 1
            self.in_step.add(key)
            return self.jitted(*args)
        self.hits += 1
        self.ahead.add(key)
        self.work.add(key)
        return compiled(*args)
