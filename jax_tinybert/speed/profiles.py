"""What each `auto` speed setting becomes on one kind of hardware: one profile per backend.

The math of a run never depends on these (docs/design.md, "Speed"); only how fast it goes. Each
value's measurement is in benchmarks/RESULTS.md#what-we-tried. Imports no JAX.
"""
from __future__ import annotations

import dataclasses
from typing import Tuple


@dataclasses.dataclass(frozen=True)
class Profile:
    """Speed settings of one backend (values of `speed.resolve` for the config's auto knobs)."""

    # data.bucket_compile_steps: one length bucket's compilations, in train steps at length 64.
    bucket_compile_steps: float
    # train.checkpoint_seconds: periodic checkpoints at least this far apart.
    checkpoint_seconds: float
    # train.compile_workers: threads compiling ahead; 0 = one per 4 host cores, at most 4.
    compile_workers: int
    # train.chunk_tokens: the step's forwards in row chunks of this many tokens, on one device,
    # in runs of at least chunk_min_steps steps per length bucket (0 = whole batches).
    chunk_tokens: int
    chunk_min_steps: int
    # train.split_update: the update as a program of its own in runs of at most this many steps
    # per length bucket, and always for these objectives.
    split_steps_per_bucket: int
    split_objectives: Tuple[str, ...]
    # teacher.cache_tokens: whether the intermediate stage's per-token teacher cache can pay
    # back here (in runs of more than cache_tokens_epochs epochs).
    cache_tokens: bool
    cache_tokens_epochs: int
    # teacher.cache_build: the teacher cache written beside the first epoch's steps.
    cache_beside: bool
    # The teacher cache pass: forwards in flight at once, rows per forward in tokens (0 = whole
    # batches).
    forwards_in_flight: int
    forward_tokens: int
    # The pass's forwards split over all of a host's devices (CPU devices share its cores: a
    # split forward only adds work there).
    forward_all_devices: bool
    # A 16-bit model dtype computes float32 activations with 16-bit products (no 16-bit
    # element-wise arithmetic on a CPU; bfloat16 products run on AMX / AVX512-BF16).
    half_products_only: bool
    # student.dtype / teacher.dtype "auto": the compute dtype here (params, gradients and the
    # optimizer stay float32). Unlike the knobs above it changes the math: a run records the
    # concrete value, and resuming it where auto means another is a config difference.
    dtype: str


# Two cores that train: one compile thread, compilations dear (7-14 steps each at length 64),
# saves cheap next to minutes of steps, a teacher forward dearer than reading its outputs back.
CPU = Profile(bucket_compile_steps=8.0, checkpoint_seconds=0.0, compile_workers=1,
              chunk_tokens=1024, chunk_min_steps=100, split_steps_per_bucket=500,
              split_objectives=("tinybert_intermediate", "minilm", "minilmv2"), cache_tokens=True,
              cache_tokens_epochs=2, cache_beside=True, forwards_in_flight=2,
              forward_tokens=1024, forward_all_devices=False,
              half_products_only=True, dtype="float32")
# A GPU or TPU: a program compiles in ~2,000 steps' time, 200 steps take ~1.5 s against a
# ~0.4 s save, and the teacher's forward in the step beats reading it from disk (H200); bfloat16
# compute ran the step 1.6-2.1x faster there than float32 (TF32 products).
ACCELERATOR = Profile(bucket_compile_steps=2000.0, checkpoint_seconds=30.0, compile_workers=0,
                      chunk_tokens=0, chunk_min_steps=100, split_steps_per_bucket=0,
                      split_objectives=(), cache_tokens=False, cache_tokens_epochs=2,
                      cache_beside=False, forwards_in_flight=1, forward_tokens=0,
                      forward_all_devices=True, half_products_only=False, dtype="bfloat16")


def profile(backend: str) -> Profile:
    """The profile of a JAX backend name ("cpu", "gpu", "tpu", ...)."""
    return CPU if backend == "cpu" else ACCELERATOR


def current() -> Profile:
    """The profile of JAX's default backend (starts the backend if it is not yet)."""
    return profile(backend())


def backend() -> str:
    """JAX's default backend name (starts the backend if it is not yet)."""
    import jax

    return jax.default_backend()
