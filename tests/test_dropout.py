"""Dropout from 16-bit draws (jax_tinybert/speed/dropout.py) against the distribution it must have:
drop rate t / 65536 (hand-computed), kept values scaled by the inverse keep probability,
elements independent (also the two that share one 32-bit word), and flax's semantics for
deterministic / rate 0 / rate 1 / the "dropout" rng collection."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tinybert.speed.dropout as dropout_mod
from jax_tinybert.speed.dropout import Dropout, grid_rate, keep_mask, random_bits


@pytest.mark.parametrize("shape", [(1,), (7,), (3, 4), (32, 16, 156), (2, 12, 9, 5)])
def test_random_bits_are_jax_random_bits(shape):
    # The written-out threefry must give JAX's words exactly (JAX's own implementation is the
    # reference): then every dropout mask, and so every run, is what it was with
    # jax.random.bits. Typed keys (what flax's make_rng gives), raw keys, under jit.
    for seed in (0, 12345):
        typed = jax.random.fold_in(jax.random.key(seed), 7)
        raw = jax.random.PRNGKey(seed)
        for key in (typed, raw):
            want = np.asarray(jax.random.bits(key, shape, jnp.uint32))
            np.testing.assert_array_equal(np.asarray(random_bits(key, shape)), want)
            np.testing.assert_array_equal(
                np.asarray(jax.jit(random_bits, static_argnums=1)(key, shape)), want)


def test_random_bits_of_other_generators_are_theirs():
    key = jax.random.key(3, impl="rbg")
    np.testing.assert_array_equal(np.asarray(random_bits(key, (5, 6))),
                                  np.asarray(jax.random.bits(key, (5, 6), jnp.uint32)))


def test_grid_rate_hand_computed():
    # 0.1 * 65536 = 6553.6 -> 6554; 0.25 * 65536 = 16384 exactly.
    assert grid_rate(0.1) == (6554, 6554 / 65536)
    assert grid_rate(0.25) == (16384, 0.25)


@pytest.mark.parametrize("shape", [(64, 12, 32, 32), (257, 311)])  # even / odd last dim
def test_drop_rate_and_scale(shape):
    key = jax.random.PRNGKey(0)
    keep, scale = keep_mask(key, 0.1, shape)
    keep = np.asarray(keep)
    assert keep.shape == shape and keep.dtype == bool
    p = 6554 / 65536
    n = keep.size
    dropped = n - keep.sum()
    # Binomial(n, p): 5 standard deviations.
    assert abs(dropped - n * p) < 5 * math.sqrt(n * p * (1 - p))
    assert scale == pytest.approx(65536 / (65536 - 6554), rel=1e-12)


def test_elements_sharing_a_word_are_independent():
    # Even last dim: elements 2i and 2i+1 come from the low and high half of one word.
    keep = np.asarray(keep_mask(jax.random.PRNGKey(1), 0.5, (1024, 1024))[0])
    lo, hi = ~keep[:, 0::2], ~keep[:, 1::2]
    n, p = lo.size, 0.5
    both = (lo & hi).sum()
    assert abs(both - n * p * p) < 5 * math.sqrt(n * p * p * (1 - p * p))
    # And neighbours across words, for good measure.
    across = (hi[:, :-1] & lo[:, 1:]).sum()
    m = hi[:, :-1].size
    assert abs(across - m * p * p) < 5 * math.sqrt(m * p * p * (1 - p * p))


@pytest.mark.parametrize("bitcast", [True, False], ids=["bytes_of_uint16", "stacked"])
def test_even_masks_are_the_halves_of_jax_words_in_order(bitcast, monkeypatch):
    """The mask, element by element, against NumPy on JAX's own words: element 2i is kept when
    the low 16 bits of word i reach the threshold, element 2i+1 when its high 16 bits do (so a
    seed gives the masks it gave before the comparison moved ahead of the interleave). Both
    interleaves: the CPU's bitcast of a uint16's bytes, and the stack other backends take."""
    assert dropout_mod._cpu_little_endian()  # the CPU these tests run on
    monkeypatch.setattr(dropout_mod, "_cpu_little_endian", lambda: bitcast)
    key, shape = jax.random.PRNGKey(7), (3, 5, 8)
    t, _ = grid_rate(0.1)
    words = np.asarray(jax.random.bits(key, (3, 5, 4), jnp.uint32)).astype(np.int64)
    want = np.empty(shape, bool)
    want[..., 0::2] = (words & 0xFFFF) >= t
    want[..., 1::2] = (words >> 16) >= t
    np.testing.assert_array_equal(np.asarray(keep_mask(key, 0.1, shape)[0]), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(
        lambda k: keep_mask(k, 0.1, shape)[0])(key)), want)


def test_each_word_is_hashed_once_for_the_forward_and_the_backward():
    """A dropout's forward and backward compile so that the key feeds one loop, whose output has
    one element per threefry word: the hash runs once per word and both passes read its result.
    (A stack interleave's loop had one element per mask element, hashing each word twice;
    without the remainder, the key fed the forward's and the backward's loops, four times.)"""
    import re
    shape = (2, 3, 16, 16)

    def grad(key, x):
        def loss(x):
            keep, scale = keep_mask(key, 0.1, x.shape)
            return jnp.sum(jnp.tanh(jnp.where(keep, x * scale, 0.0)))
        return jax.grad(loss)(x)

    key, x = jax.random.PRNGKey(0), jnp.ones(shape, jnp.float32)
    hlo = jax.jit(grad).lower(key, x).compile().as_text()
    entry = hlo[hlo.index("\nENTRY"):].splitlines()
    name = next(re.match(r"\s*(%\S+) = u32\[2\]", line).group(1) for line in entry
                if "parameter(0)" in line)
    users = [line for line in entry
             if "parameter(" not in line and re.search(re.escape(name) + r"\b", line)]
    assert len(users) == 1, users
    dims = re.match(r"\s*(?:ROOT )?\S+ = \w+\[([\d,]*)\]", users[0]).group(1)
    assert math.prod(int(d) for d in dims.split(",")) == math.prod(shape) // 2, users[0]


def test_rates_the_grid_cannot_hold_take_the_32_bit_path():
    # 0.001 * 65536 = 65.5 -> 66 -> 0.001007: 0.7% off, beyond the 0.1% allowed.
    keep, scale = keep_mask(jax.random.PRNGKey(2), 0.001, (2000, 1000))
    dropped = keep.size - int(np.asarray(keep).sum())
    n, p = keep.size, 0.001
    assert abs(dropped - n * p) < 5 * math.sqrt(n * p * (1 - p))
    assert scale == pytest.approx(1 / 0.999, rel=1e-12)


def test_module_is_inverted_dropout():
    x = jnp.asarray(np.random.RandomState(0).uniform(1, 2, (8, 16, 64)), jnp.float32)
    rngs = {"dropout": jax.random.PRNGKey(3)}
    y = np.asarray(Dropout(rate=0.1).apply({}, x, deterministic=False, rngs=rngs))
    kept = y != 0
    np.testing.assert_allclose(y[kept], np.asarray(x)[kept] * 65536 / (65536 - 6554), rtol=1e-6)
    # The same key gives the same mask; another key another.
    y2 = np.asarray(Dropout(rate=0.1).apply({}, x, deterministic=False, rngs=rngs))
    np.testing.assert_array_equal(y, y2)
    y3 = np.asarray(Dropout(rate=0.1).apply({}, x, deterministic=False,
                                            rngs={"dropout": jax.random.PRNGKey(4)}))
    assert (kept != (y3 != 0)).any()
    # Expectation preserved: mean over many elements within sampling error.
    big = jnp.ones((512, 1024), jnp.float32)
    m = float(Dropout(rate=0.1).apply({}, big, deterministic=False, rngs=rngs).mean())
    assert abs(m - 1.0) < 5 * math.sqrt(0.1 / 0.9 / big.size)


def test_module_edge_cases():
    x = jnp.ones((4, 6), jnp.bfloat16)
    np.testing.assert_array_equal(Dropout(rate=0.1).apply({}, x, deterministic=True), x)
    np.testing.assert_array_equal(
        Dropout(rate=0.0).apply({}, x, deterministic=False, rngs={"dropout": jax.random.PRNGKey(0)}), x)
    z = Dropout(rate=1.0).apply({}, x, deterministic=False, rngs={"dropout": jax.random.PRNGKey(0)})
    assert z.dtype == jnp.bfloat16 and not np.asarray(z, np.float32).any()
    y = Dropout(rate=0.1).apply({}, x, deterministic=False, rngs={"dropout": jax.random.PRNGKey(0)})
    assert y.dtype == jnp.bfloat16
    with pytest.raises(Exception, match="dropout"):   # no "dropout" rng given
        Dropout(rate=0.1).apply({}, x, deterministic=False)


_SHARDED = r'''
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax_tinybert.speed.dropout import Dropout
x = jnp.asarray(np.random.RandomState(0).uniform(1, 2, (16, 12, 8, 8)), jnp.float32)
f = jax.jit(lambda x, k: Dropout(rate=0.1).apply({}, x, deterministic=False, rngs={"dropout": k}))
key = jax.random.fold_in(jax.random.key(5), 3)
one = np.asarray(f(x, key))
mesh = Mesh(np.asarray(jax.devices()).reshape(8), ("data",))
xs = jax.device_put(x, NamedSharding(mesh, P("data")))
eight = f(xs, key)
assert len(eight.sharding.device_set) == 8
np.testing.assert_array_equal(np.asarray(eight), one)
print("same")
'''


def test_masks_do_not_depend_on_the_batch_sharding():
    # The words come from each element's global index, as JAX's partitionable threefry: a
    # batch split over 8 devices gets the masks one device gets.
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _SHARDED], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "same" in out.stdout, out.stderr[-2000:]
