"""The CPU a timing belongs to, named as the benchmarks record it (CPUs change between machines)."""
from __future__ import annotations

import os


def cpu_name() -> str:
    """'model name (family F model M, N cores)' from /proc/cpuinfo."""
    info = {}
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                k, _, v = line.partition(":")
                info.setdefault(k.strip(), v.strip())
    except OSError:
        return "unknown CPU"
    return f"{info.get('model name', '?')} (family {info.get('cpu family', '?')} " \
           f"model {info.get('model', '?')}, {os.cpu_count()} cores)"
