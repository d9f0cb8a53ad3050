"""How a model of a config dtype computes on a backend, and the start-up note when the dtype is
the slower one there (benchmarks/RESULTS.md#bfloat16-on-a-cpu has the measurements)."""
from __future__ import annotations

from typing import Iterable, Optional

import jax.numpy as jnp

from jax_tinybert.speed import cpu, dots
from jax_tinybert.speed.profiles import profile


def is_half(dtype) -> bool:
    """True for a 16-bit float dtype (bfloat16, float16)."""
    return dtype is not None and jnp.dtype(dtype).itemsize == 2


def compute_dtypes(name: str, backend: str) -> dict:
    """A model's compute keyword arguments for config dtype `name` on `backend`: {"dtype": name},
    or where the profile says so (a CPU) for a 16-bit name {"dtype": float32, "products":
    dots.HalfProducts(name)}: float32 activations and 16-bit products' operands. No "products"
    key otherwise, so that a model class from before it (benchmarks/ab_modeling.py's baseline)
    takes these too."""
    dt = getattr(jnp, name)
    if is_half(dt) and profile(backend).half_products_only:
        return {"dtype": jnp.float32, "products": dots.HalfProducts(dt)}
    return {"dtype": dt}


def compute_label(name: str, backend: str) -> str:
    """`compute_dtypes` in words for the start-up line: 'bfloat16', or on a CPU 'bfloat16
    products, float32 activations'."""
    kw = compute_dtypes(name, backend)
    act = jnp.dtype(kw["dtype"]).name
    return f"{jnp.dtype(kw['products'].dot_dtype).name} products, {act} activations" \
        if "products" in kw else act


def dtype_hint(backend: str, dtypes: Iterable[str], bf16: Optional[str]) -> Optional[str]:
    """A one-line note when a model's compute dtype (`dtypes`: the student's, the teacher's) is
    the slower one on this backend: float32 on a GPU or on a CPU with fast bfloat16 products
    (`bf16`: cpu.fast_bf16()'s answer; None off a CPU), bfloat16 on a CPU without them,
    float16 on any CPU. None otherwise."""
    dtypes = {str(d) for d in dtypes}
    if backend == "gpu" and "float32" in dtypes:
        return ("note: float32 compute on a GPU; --config.student.dtype=bfloat16 "
                "--config.teacher.dtype=bfloat16 ran the step 1.6-2.1x faster on an H200 "
                "(params, gradients and the optimizer stay float32)")
    if backend != "cpu":
        return None
    if bf16 and "float32" in dtypes:
        measured = ("1.55-1.9x faster on an Intel Xeon with AMX" if bf16 == "AMX" else
                    "1.2-1.6x faster on an AMD EPYC Zen 4, MRPC's epochs 1.2-1.4x; each "
                    "program compiles 1.5-2.5 s longer, so `make demo` gains nothing")
        return (f"note: this CPU multiplies bfloat16 fast ({bf16}); "
                "--config.student.dtype=bfloat16 --config.teacher.dtype=bfloat16 ran the steps "
                f"{measured} (bfloat16 products; activations, params and the optimizer stay "
                "float32; MRPC dev scores within 0.8 points of float32 in benchmarks/RESULTS.md)")
    if "float16" in dtypes:
        return ("note: float16 compute on a CPU: XLA has no float16 product kernel there, so "
                "it converts the operands and multiplies in float32, slower than float32 itself; "
                "use bfloat16 (fast on a CPU with AMX, or an AMD one with AVX512-BF16) or "
                "float32, the default")
    if not bf16 and "bfloat16" in dtypes:
        return ("note: bfloat16 compute on a CPU without AMX (or an AMD CPU with AVX512-BF16) "
                "ran its products slower than float32 (an Intel Xeon with AVX512-BF16 but no "
                "AMX); --config.student.dtype=float32 --config.teacher.dtype=float32 is the "
                "default")
    return None


def startup_note(backend: str, dtypes: Iterable[str]) -> Optional[str]:
    """dtype_hint for this process's CPU (read from /proc/cpuinfo) or accelerator."""
    return dtype_hint(backend, dtypes, cpu.fast_bf16() if backend == "cpu" else None)
