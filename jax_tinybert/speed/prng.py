"""JAX's threefry2x32 random words with the hash written out, so that XLA's CPU backend fuses
them into their consumer.

JAX lowers the threefry2x32 hash on CPU as a while loop of 5 steps (`use_rolled_loops`), each
step a few kernels over the whole array. The dropout masks of a train step are ~14 such draws:
on 2 CPU cores they took ~5-9% of a prediction step at T = 32-128 and ~1 s of each bucket's
compilation (benchmarks/RESULTS.md#dropout-and-random-bits). `threefry_bits` gives the same words, bit for
bit, as 20 rounds of elementwise ops. (The keys' own hashes, flax's per-module `fold_in`, stay
JAX's: done the same way they gained nothing, benchmarks/RESULTS.md#dropout-and-random-bits.)
"""
from __future__ import annotations

import functools
import math
from typing import Tuple

import jax
import jax.numpy as jnp

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def _rotl(x: jax.Array, d: int) -> jax.Array:
    return (x << jnp.uint32(d)) | (x >> jnp.uint32(32 - d))


def threefry_hash(k1, k2, x0, x1) -> Tuple[jax.Array, jax.Array]:
    """Threefry-2x32 (20 rounds) of counter words (x0, x1) under key words (k1, k2), as JAX's
    `threefry2x32_p`; uint32 arrays, broadcast together. -> (y0, y1)."""
    k1, k2, x0, x1 = (jnp.asarray(v, jnp.uint32) for v in (k1, k2, x0, x1))
    ks = (k1, k2, k1 ^ k2 ^ jnp.uint32(0x1BD11BDA))
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = _rotl(x1, r) ^ x0
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + jnp.uint32(i + 1)
    return x0, x1


def _index(shape: Tuple[int, ...]) -> jax.Array:
    """uint32 [shape]: each element's row-major index (the low word of JAX's 64-bit counter)."""
    if not shape:
        return jnp.zeros((), jnp.uint32)
    lo = jax.lax.broadcasted_iota(jnp.uint32, shape, 0)
    for d in range(1, len(shape)):
        lo = lo * jnp.uint32(shape[d]) + jax.lax.broadcasted_iota(jnp.uint32, shape, d)
    return lo


def threefry_bits(key: jax.Array, shape: Tuple[int, ...]) -> jax.Array:
    """`jax.random.bits(k, shape, jnp.uint32)` of the threefry key with data `key` (uint32 [2])."""
    shape = tuple(shape)
    if math.prod(shape) >= 1 << 32:
        raise NotImplementedError(f"threefry words of {shape}: 2^32 or more elements")
    return _bits_of(key, shape)


# A jit of its own so that a program's draws of one shape (a train step's ~9 hidden-state and 4
# attention draws are 2 shapes) are traced and lowered once: XLA inlines the call, so the
# compiled program is the same, and a gradient program's tracing and lowering took 0.3 s less
# (1.4 -> 1.1 s, prediction step at T = 64; benchmarks/RESULTS.md#dropout-and-random-bits).
@functools.partial(jax.jit, static_argnums=1)
def _bits_of(key: jax.Array, shape: Tuple[int, ...]) -> jax.Array:
    # Were the key's words computed by elementwise ops too (a key hashed without JAX's while
    # loop), XLA would fuse that scalar chain into every element of the draw: a 1.4x slower
    # prediction step at T = 64 when tried. The barrier makes the key one value, computed once.
    key = jax.lax.optimization_barrier(key)
    y0, y1 = threefry_hash(key[0], key[1], jnp.zeros((), jnp.uint32), _index(shape))
    return y0 ^ y1
