"""Preemption.poll (single process): the host stays one step ahead of the device, so a SIGTERM
is acted on within a step even when nothing else blocks the loop. The 2-process agreement is
tested with the checkpoints (tests/test_checkpoints.py::test_two_processes_...)."""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import jax
import jax.numpy as jnp
import pytest

from jax_tinybert.train.preemption import EXIT_CODE, Preempted, Preemption, exit_code


@jax.jit
def _slow_step(x):
    """~0.05-0.3 s on a CPU core: matmuls whose result feeds the next step."""
    y = jax.lax.fori_loop(0, 12, lambda i, y: jnp.tanh(y @ y), x)
    return x + 1e-3 * y


def _run(poll: bool, n: int = 40, signal_after: int = 3):
    """Dispatches n steps; a watcher thread sends SIGTERM to this process once step
    `signal_after` is finished on the device. -> (steps done when signalled, stop step)."""
    x = _slow_step(jnp.full((384, 384), 1 / 384, jnp.float32))
    x.block_until_ready()
    outs, at_signal = [], []

    def watch():
        while len(outs) < signal_after or not outs[signal_after - 1].is_ready():
            time.sleep(0.002)
        at_signal.append(sum(o.is_ready() for o in list(outs)))
        os.kill(os.getpid(), signal.SIGTERM)

    pre = Preemption().install()
    try:
        t = threading.Thread(target=watch, daemon=True)
        t.start()
        stop = None
        for step in range(1, n + 1):
            x = _slow_step(x)
            outs.append(x)
            stopped = pre.poll(step, x) if poll else pre.received  # the old check: no wait
            if stopped:
                stop = step
                break
        x.block_until_ready()
        t.join(timeout=60)
    finally:
        pre.uninstall()
    return at_signal[0], stop


def test_sigterm_acted_on_within_one_step():
    done, stop = _run(poll=True)
    # The step running when the signal came (done + 1) and at most the one queued behind it.
    assert stop is not None and done <= stop <= done + 2, (done, stop)


def test_without_the_wait_the_host_runs_ahead():
    """What `poll` prevents: checking the flag after each dispatch without waiting, the host
    queues steps far ahead of the device, and sees the signal only many steps later (the old
    behaviour: the stop came at the next blocking call, e.g. the next logging step)."""
    done, stop = _run(poll=False)
    assert stop is None or stop - done > 10, (done, stop)


def test_poll_is_sticky_and_request_stop():
    pre = Preemption()
    x = jnp.zeros(3)
    assert not pre.poll(1, x)
    pre.request_stop()
    assert pre.received and pre.poll(2, x + 1) and pre.poll(3, x + 2)


def test_install_uninstall_restores_the_previous_handler():
    seen = []
    prev = signal.signal(signal.SIGTERM, lambda *a: seen.append(a[0]))
    try:
        with Preemption() as pre:
            os.kill(os.getpid(), signal.SIGTERM)
            assert pre.received and not seen
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, prev)


def test_preempted_exception_and_exit_code():
    e = Preempted(7, "runs/x")
    assert e.step == 7 and "saved step 7 in runs/x" in str(e) and EXIT_CODE == 143
    with pytest.raises(Preempted):
        raise e


def test_ctrl_c_stops_like_sigterm_and_a_second_one_at_once():
    """The first Ctrl-C sets the flag (the loop saves its step and exits 130); the second
    raises KeyboardInterrupt at once; uninstall puts Python's own handler back."""
    with _python_owns_ctrl_c():
        pre = Preemption().install()
        try:
            os.kill(os.getpid(), signal.SIGINT)
            assert pre.received and pre.signum == signal.SIGINT and pre.poll(1, jnp.zeros(2))
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)   # the handler runs at the next bytecode; never reached
        finally:
            pre.uninstall()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    e = Preempted(3, "runs/x", signal.SIGINT)
    assert "interrupted (Ctrl-C): saved step 3 in runs/x" in str(e) and e.exit_code == 130
    assert Preempted(3).exit_code == EXIT_CODE == exit_code(signal.SIGTERM)


def test_ctrl_c_left_alone_where_python_does_not_own_it():
    """Ignored (a background job, nohup) or a caller's own handler: install keeps it."""
    for mine in (signal.SIG_IGN, lambda *a: None):
        prev = signal.signal(signal.SIGINT, mine)
        try:
            with Preemption():
                assert signal.getsignal(signal.SIGINT) is mine
            assert signal.getsignal(signal.SIGINT) is mine
        finally:
            signal.signal(signal.SIGINT, prev)


def test_sigterm_after_ctrl_c_keeps_the_ctrl_c_exit():
    """The first signal names the stop; a SIGTERM after a Ctrl-C does not abort at once."""
    with _python_owns_ctrl_c(), Preemption() as pre:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert pre.received and pre.signum == signal.SIGINT


@contextlib.contextmanager
def _python_owns_ctrl_c():
    """Python's own SIGINT handler, as in a terminal: a test runner's worker (pytest-xdist)
    may run with SIGINT ignored."""
    prev = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, prev)
