"""Dropout that draws 16 random bits per element instead of 32.

The student trains with dropout on every hidden state and on the attention probabilities
([B, H, T, T] per layer); on CPU the threefry hash that makes the random bits is ~5% of a
train step at T = 128 (benchmarks/RESULTS.md#dropout-and-random-bits). Each 32-bit word
of threefry output here serves two elements: one keeps its low 16 bits, the next its high 16.
The words are JAX's own (`jax.random.bits`), computed by the hash written out as elementwise
ops (`prng.py`), which XLA fuses into the mask: JAX lowers the hash on CPU as a while loop.

The drop rate is then a multiple of 2^-16: rate r becomes t / 65536, t = round(r * 65536)
(0.1 -> 0.10000610), and kept values are scaled by 65536 / (65536 - t), the exact inverse of
the realised keep probability, so E[dropout(x)] = x as before. (`flax.linen.Dropout` draws a
float32 uniform, whose 23-bit grid quantises the rate too, only more finely.) A rate that the
16-bit grid cannot hold within 0.1% (below ~0.015, or not close to a multiple of 2^-16) takes
the 32-bit path of `jax.random.bernoulli` instead.
"""
from __future__ import annotations

import math
import sys
from typing import Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax_tinybert.speed import prng

_GRID = 1 << 16
_MAX_REL_ERR = 1e-3


def random_bits(key: jax.Array, shape: Tuple[int, ...]) -> jax.Array:
    """uint32 [shape] random words, equal to `jax.random.bits(key, shape, jnp.uint32)`; for a
    threefry2x32 key computed by `prng.threefry_bits`, which XLA fuses into the mask."""
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    impl = str(jax.random.key_impl(key)) if typed else jax.config.jax_default_prng_impl
    if (impl == "threefry2x32" and jax.config.jax_threefry_partitionable
            and math.prod(shape) < 1 << 32 and (typed or key.shape == (2,))):
        return prng.threefry_bits(jax.random.key_data(key) if typed else key, tuple(shape))
    return jax.random.bits(key, shape, jnp.uint32)


def _cpu_little_endian() -> bool:
    """Whether the default backend is the CPU on a little-endian host, where a bitcast of
    uint16 to 2 x uint8 puts the low byte first (XLA leaves the order to the machine, so the
    bitcast interleave is used only where it is known)."""
    return sys.byteorder == "little" and jax.default_backend() == "cpu"


def grid_rate(rate: float) -> Tuple[int, float]:
    """rate -> (t, t / 65536): the 16-bit drop threshold and the rate it realises."""
    t = int(round(rate * _GRID))
    return t, t / _GRID


def keep_mask(key: jax.Array, rate: float, shape: Tuple[int, ...]) -> Tuple[jax.Array, float]:
    """-> (bool[shape] mask of kept elements, scale for the kept ones = 1 / P(keep)).

    Elements are independent: each 16-bit half of a threefry word decides one element."""
    t, realised = grid_rate(rate)
    if t <= 0 or t >= _GRID or abs(realised - rate) > _MAX_REL_ERR * rate:
        keep = jax.random.bernoulli(key, 1.0 - rate, shape)
        return keep, 1.0 / (1.0 - rate)
    n = math.prod(shape)
    if shape and shape[-1] % 2 == 0:
        words = random_bits(key, tuple(shape[:-1]) + (shape[-1] // 2,))
        lo, hi = (words & 0xFFFF) >= jnp.uint32(t), (words >> 16) >= jnp.uint32(t)
        if _cpu_little_endian():
            # Both decisions of a word in one uint16, split into its two bytes by a bitcast, so
            # that the hash runs once per word. Interleaved by a stack, each element hashes its
            # own word: twice per word. `% 0xFFFF` is the identity (pair <= 0x0101), but XLA's
            # fusion counts an integer remainder as expensive and will not copy it into each
            # consumer: without it the hash was fused into both the forward's and the
            # backward's loop, four times per word (benchmarks/RESULTS.md#dropout-and-random-bits).
            pair = (lo.astype(jnp.uint16) | (hi.astype(jnp.uint16) << 8)) % jnp.uint16(0xFFFF)
            keep = jax.lax.bitcast_convert_type(pair, jnp.uint8).astype(jnp.bool_)
        else:
            # Compared before they are interleaved: XLA then keeps a 1-byte mask between the
            # forward and the backward instead of the 4-byte halves.
            keep = jnp.stack([lo, hi], axis=-1)
        return keep.reshape(shape), _GRID / (_GRID - t)
    else:
        words = random_bits(key, ((n + 1) // 2,))
        halves = jnp.concatenate([words & 0xFFFF, words >> 16])[:n].reshape(shape)
    return halves >= jnp.uint32(t), _GRID / (_GRID - t)


class Dropout(nn.Module):
    """Inverted dropout, as `flax.linen.Dropout` (rng collection "dropout"), 16 bits per element.

    x [...] -> x with each element zeroed with probability ~`rate` (see the module docstring),
    the others divided by the keep probability."""

    rate: float

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool) -> jax.Array:
        if deterministic or self.rate == 0.0:
            return x
        if self.rate >= 1.0:
            return jnp.zeros_like(x)
        keep, scale = keep_mask(self.make_rng("dropout"), self.rate, x.shape)
        return jnp.where(keep, x * jnp.asarray(scale, x.dtype), jnp.zeros((), x.dtype))
