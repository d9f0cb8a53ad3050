"""The CPU this process runs on, read from Linux's /proc/cpuinfo, without importing JAX (the CLI
and the benchmarks read it before they set XLA's flags). "AMD EPYC" names Zen 3, 4 and 5 alike:
family and model tell them apart, so timings record both."""
from __future__ import annotations

import os
from typing import Dict, Mapping, Optional

PROC_CPUINFO = "/proc/cpuinfo"


def cpuinfo(path: str = PROC_CPUINFO) -> Dict[str, str]:
    """The first processor's fields ('vendor_id', 'model name', 'cpu family', 'model', 'flags',
    ...), values stripped; {} where the file is missing (not Linux)."""
    info: Dict[str, str] = {}
    try:
        with open(path) as fh:
            for line in fh:
                if not line.strip():
                    if info:
                        break  # the blank line after the first processor
                    continue
                k, _, v = line.partition(":")
                info.setdefault(k.strip(), v.strip())
    except OSError:
        pass
    return info


def cpu_name(info: Optional[Mapping[str, str]] = None) -> str:
    """'model name (family F model M, N cores)', or 'unknown CPU'."""
    info = cpuinfo() if info is None else info
    if not info:
        return "unknown CPU"
    return (f"{info.get('model name', '?')} (family {info.get('cpu family', '?')} "
            f"model {info.get('model', '?')}, {os.cpu_count()} cores)")


def fast_bf16(info: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The hardware that runs bfloat16 products faster than float32 ones on this CPU, in words:
    "AMX" (any vendor with `amx_bf16`, e.g. an Intel Xeon model 143/167), "AVX512-BF16 on AMD"
    (an AMD EPYC Zen 4: XLA's bf16 x bf16 -> f32 product ran 1.7-2.8x its float32 one at the
    step's shapes; benchmarks/RESULTS.md#bfloat16-on-a-cpu), or None: an Intel CPU with AVX512-BF16
    but no AMX ran them slower than float32 (benchmarks/RESULTS.md#bfloat16-on-a-cpu), and anything unknown counts as
    slow. `info`: cpuinfo()'s fields, read from /proc/cpuinfo when None."""
    info = cpuinfo() if info is None else info
    flags = set(info.get("flags", "").split())
    if "amx_bf16" in flags:
        return "AMX"
    if info.get("vendor_id") == "AuthenticAMD" and "avx512_bf16" in flags:
        return "AVX512-BF16 on AMD"
    return None
