"""SIGTERM or Ctrl-C -> a stop that every process takes at the same step, within a step or two.

A preempted VM gets SIGTERM and a short grace period. The handler only sets a flag (it runs
between two bytecodes of the main thread, possibly inside jax or orbax: no I/O there); the
training loop calls `poll` once per step and, when it answers True, saves that step and exits.
Ctrl-C (SIGINT) in a terminal does the same (exit 130 instead of 143), and a second Ctrl-C stops
at once (KeyboardInterrupt: the last periodic checkpoint is what a rerun resumes from). SIGINT is
taken only where Python's own handler is in place: a job started in the background or under
`nohup` ignores it, and a caller's own handler is kept.

    pre = Preemption()                    # after jax.distributed.initialize
    pre.install()                         # SIGTERM -> flag (restored by uninstall / close)
    while step < total:
        state, metrics = train_step(state, batch)       # dispatched, runs asynchronously
        step += 1
        if pre.poll(step, metrics["loss"]):             # same answer on every process
            save(step, state); raise Preempted(step)

`poll(step, marker)` first waits for the *previous* step's `marker` (any output of that step
that is not donated), so the host runs at most one step ahead of the devices: without that
bound the host queues steps until the next blocking call (the next logging step, up to
`log_every - 1` steps later) and a signal is only seen once they have all run.

Agreement across processes without a barrier per step: each process feeds its flag into a tiny
jitted max over one entry per device (`_agree`, a collective like the training step's own),
dispatched right after it waits for the previous step; the result is read one step later,
when it is ready anyway. All processes read the same value for the same step, so they stop
together. Latency: a signal that arrives while step k runs stops the loop after step k + 1
with one process, after step k + 2 with several (one step to feed the flag in, one to read it).
"""
from __future__ import annotations

import logging
import signal
import threading
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

log = logging.getLogger(__name__)

__all__ = ["Preemption", "Preempted", "EXIT_CODE"]

# 128 + SIGTERM: what a shell reports for a process killed by SIGTERM, and what schedulers
# (SLURM, Kubernetes) expect from a job that stopped because it was told to.
EXIT_CODE = 143


def exit_code(signum: int) -> int:
    """128 + the signal: 143 for SIGTERM, 130 for Ctrl-C (what a shell reports for either)."""
    return 128 + int(signum)


class Preempted(Exception):
    """The run saved its state at `step` and stopped (SIGTERM, Ctrl-C or a stop request);
    rerunning the same command resumes from there. `python -m jax_tinybert.main` exits with
    `exit_code` (EXIT_CODE after SIGTERM or a stop request, 130 after Ctrl-C)."""

    def __init__(self, step: int, workdir: str | None = None, signum: int = signal.SIGTERM):
        where = f" in {workdir}" if workdir else ""
        what = "interrupted (Ctrl-C)" if signum == signal.SIGINT else "preempted"
        super().__init__(f"{what}: saved step {step}{where}; rerun the same command to resume")
        self.step = int(step)
        self.workdir = workdir
        self.signum = int(signum)
        self.exit_code = exit_code(signum)


class Preemption:
    """SIGTERM handler + per-step stop agreement (see the module docstring).

    Every process must call `poll` once per step with the same step numbers. Single-process
    runs read the local flag only; several processes agree through `_agree`.
    """

    def __init__(self):
        self._flag = threading.Event()
        self.signum = signal.SIGTERM       # what set the flag first (SIGTERM for request_stop)
        self._prev_int = None
        self._stopping = False
        self._prev_marker = None
        self._agreed = None            # device result of the last dispatched agreement
        self._prev_handler = None
        self._installed = False
        self._multi = jax.process_count() > 1
        if self._multi:
            devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
            mesh = Mesh(np.array(devices), ("all",))
            self._in_sharding = NamedSharding(mesh, P("all"))
            self._n_local = len(jax.local_devices())
            self._n_global = len(devices)
            self._agree = jax.jit(lambda f: jnp.max(f),
                                  out_shardings=NamedSharding(mesh, P()))

    # ------------------------------------------------------------------ signal handler
    def install(self) -> "Preemption":
        """SIGTERM, and Ctrl-C where Python's default SIGINT handler is in place, set the stop
        flag; a second Ctrl-C raises KeyboardInterrupt. Call from the main thread.

        Replaces the previous SIGTERM handler (including the one JAX's preemption service
        installs in `jax.distributed.initialize`); `uninstall` puts both back.
        """
        def handler(signum, frame):
            # Only an Event.set (or the default Ctrl-C's raise): see the module docstring.
            if signum == signal.SIGINT and self._flag.is_set() and self.signum == signal.SIGINT:
                raise KeyboardInterrupt
            if not self._flag.is_set():
                self.signum = signum
            self._flag.set()

        prev = signal.signal(signal.SIGTERM, handler)
        prev_int = signal.getsignal(signal.SIGINT)
        if prev_int is signal.default_int_handler:
            signal.signal(signal.SIGINT, handler)
        if not self._installed:
            # None: a handler installed from C (JAX's); Python cannot put it back, so
            # uninstalling falls back to the default action.
            self._prev_handler = signal.SIG_DFL if prev is None else prev
            self._prev_int = prev_int if prev_int is signal.default_int_handler else None
            self._installed = True
        return self

    def uninstall(self) -> None:
        if self._installed:
            try:
                signal.signal(signal.SIGTERM, self._prev_handler)
                if self._prev_int is not None:
                    signal.signal(signal.SIGINT, self._prev_int)
            except ValueError:  # not the main thread
                pass
            self._installed = False
            self._prev_handler = self._prev_int = None

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.uninstall()

    def request_stop(self) -> None:
        """Stop as if SIGTERM had arrived (e.g. a wall-clock budget ran out)."""
        self._flag.set()

    @property
    def received(self) -> bool:
        """This process got SIGTERM, Ctrl-C or `request_stop`. Local; `poll` is the agreed
        answer."""
        return self._flag.is_set()

    # ------------------------------------------------------------------ per-step check
    def poll(self, step: int, marker=None) -> bool:
        """True when the loop should save `step` (just dispatched) and stop; the same on all
        processes. Waits for the previous step's `marker` first (one step of run-ahead)."""
        if self._stopping:
            return True
        prev, self._prev_marker = self._prev_marker, marker
        if prev is not None:
            jax.block_until_ready(prev)
        if not self._multi:
            stop = self._flag.is_set()
        else:
            # Ready (or nearly): dispatched one step ago, behind the step just waited for.
            stop = self._agreed is not None and bool(
                np.asarray(self._agreed.addressable_data(0)))
            if not stop:
                local = np.full((self._n_local,), int(self._flag.is_set()), np.int32)
                self._agreed = self._agree(jax.make_array_from_process_local_data(
                    self._in_sharding, local, (self._n_global,)))
        if stop:
            self._stopping = True
            if not self._flag.is_set():
                log.warning("stopping at step %d (a signal on another process)", step)
            elif self.signum == signal.SIGINT:
                log.warning("stopping at step %d (Ctrl-C): saving it; Ctrl-C again stops at once",
                            step)
            else:
                log.warning("stopping at step %d (SIGTERM)", step)
        return stop
