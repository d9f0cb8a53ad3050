"""`--cpu-durations=N`: the N tests that used the most CPU time (user + sys of pytest AND of the
subprocesses it waited for: CLI runs, benchmarks, make), per phase like `--durations`.

Wall time on a shared 2-core machine says more about the other jobs than about the test; CPU
time is the steadier number. `--cpu-durations-file=PATH` also writes every phase as
`cpu_s wall_s phase nodeid` lines (sorted, most CPU first) for comparing two runs.
"""
from __future__ import annotations

import os
import resource
import time

import pytest

_ROWS: list = []


def _cpu() -> float:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def pytest_addoption(parser):
    g = parser.getgroup("cpu-durations")
    g.addoption("--cpu-durations", type=int, default=None, metavar="N",
                help="show the N phases (setup/call/teardown) that used the most CPU seconds, "
                     "children included (0: all)")
    g.addoption("--cpu-durations-file", default=None, metavar="PATH",
                help="write every phase's CPU and wall seconds to PATH")


def _active(config) -> bool:
    return (config.getoption("cpu_durations") is not None
            or bool(config.getoption("cpu_durations_file")))


def _measure(item, phase):
    if not _active(item.config):
        yield
        return
    c0, t0 = _cpu(), time.perf_counter()
    yield
    _ROWS.append((_cpu() - c0, time.perf_counter() - t0, phase, item.nodeid))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _measure(item, "setup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _measure(item, "call")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield from _measure(item, "teardown")


def _totals():
    rows = sorted(_ROWS, reverse=True)
    # session: since pytest started, collection and imports too
    return rows, sum(r[0] for r in rows), sum(r[1] for r in rows), _cpu()


def pytest_sessionfinish(session):
    """Write --cpu-durations-file; under pytest-xdist each worker writes PATH.<worker id>
    (its own tests only: the tests run in the workers, not in the controller)."""
    path = session.config.getoption("cpu_durations_file")
    if not path:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        path = f"{path}.{worker}"
    elif session.config.pluginmanager.hasplugin("dsession"):
        return   # the xdist controller: its workers wrote their files
    rows, total_cpu, total_wall, session_cpu = _totals()
    with open(path, "w") as fh:
        fh.write(f"# total {total_cpu:.1f} CPU-s, {total_wall:.1f} wall-s in test phases; "
                 f"{session_cpu:.1f} CPU-s for the whole session\n")
        for cpu, wall, phase, nodeid in rows:
            fh.write(f"{cpu:9.2f} {wall:9.2f} {phase:8s} {nodeid}\n")


def pytest_terminal_summary(terminalreporter, config):
    if not _active(config) or (not _ROWS and config.pluginmanager.hasplugin("dsession")):
        return   # nothing measured here: under xdist the workers ran the tests
    rows, total_cpu, total_wall, session_cpu = _totals()
    n = config.getoption("cpu_durations")
    if n is None:
        return
    terminalreporter.write_sep("=", f"CPU seconds (user+sys, children included): "
                                    f"tests {total_cpu:.1f} CPU-s ({total_wall:.1f} s wall), "
                                    f"session {session_cpu:.1f} CPU-s")
    for cpu, wall, phase, nodeid in rows[:n or None]:
        terminalreporter.write_line(f"{cpu:8.2f} CPU-s {wall:8.2f} s  {phase:8s} {nodeid}")
