"""The CPU a timing belongs to, as the benchmarks record it (CPUs change between machines:
"AMD EPYC" names Zen 4 and Zen 5 alike, family and model tell them apart)."""
from __future__ import annotations

import os
from typing import Dict


def cpuinfo() -> Dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ('model name', 'cpu family', 'model',
    'flags', ...); {} where there is none (not Linux)."""
    info: Dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if not line.strip():
                    break  # the blank line after the first processor
                k, _, v = line.partition(":")
                info.setdefault(k.strip(), v.strip())
    except OSError:
        pass
    return info


def cpu_name() -> str:
    """'model name (family F model M, N cores)'."""
    info = cpuinfo()
    if not info:
        return "unknown CPU"
    return f"{info.get('model name', '?')} (family {info.get('cpu family', '?')} " \
           f"model {info.get('model', '?')}, {os.cpu_count()} cores)"
