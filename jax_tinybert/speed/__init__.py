"""What exists only to run fast on one kind of hardware, behind one seam; imports no JAX.

The rest of the package asks here: `resolve` (every auto knob of a config made concrete for a
backend and a run), `profile` (the per-backend values), dtypes.py (how a 16-bit model computes
on a backend, and the start-up note), dots.py (the CPU's product layouts the model is given),
dropout.py + prng.py (16-bit dropout words), precompile.py (compiling ahead), malloc.py and
xla_flags.py (the process's allocator and XLA flags, set before JAX loads), cpu.py (the CPU).
"""
from jax_tinybert.speed.profiles import ACCELERATOR, CPU, Profile, backend, current, profile
from jax_tinybert.speed.resolve import SPEED_FIELDS, RunFacts, concrete, resolve

__all__ = ["ACCELERATOR", "CPU", "Profile", "RunFacts", "SPEED_FIELDS", "backend", "concrete",
           "current", "profile", "resolve"]
