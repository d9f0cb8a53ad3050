"""prng.py (JAX's threefry2x32 hash written out) against independent references: the
Random123 known-answer vector of Threefry-2x32-20, and JAX's own `jax.random.bits`, which
`threefry_bits` must equal bit for bit so that every dropout mask is JAX's."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_tinybert.speed import prng


def test_threefry_hash_known_answer():
    # Salmon et al.'s Random123 known-answer test for Threefry-2x32 with 20 rounds (also in
    # JAX's tests): key (0x13198a2e, 0x03707344), counter (0x243f6a88, 0x85a308d3).
    y0, y1 = prng.threefry_hash(0x13198A2E, 0x03707344, 0x243F6A88, 0x85A308D3)
    assert (int(y0), int(y1)) == (0xC4923A9C, 0x483DF7A0)


@pytest.mark.skipif(not jax.config.jax_threefry_partitionable,
                    reason="threefry_bits gives the words of JAX's partitionable threefry")
@pytest.mark.parametrize("shape", [(), (1,), (3, 4), (2, 12, 9, 5)])
def test_threefry_bits_are_jax_random_bits(shape):
    for seed in (0, 2**31 + 5):
        key = jax.random.fold_in(jax.random.key(seed), 3)
        want = np.asarray(jax.random.bits(key, shape, jnp.uint32))
        got = jax.jit(prng.threefry_bits, static_argnums=1)(jax.random.key_data(key), shape)
        np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.skipif(not jax.config.jax_threefry_partitionable,
                    reason="threefry_bits gives the words of JAX's partitionable threefry")
def test_a_programs_draws_of_one_shape_are_traced_once(monkeypatch):
    # A train step draws ~14 dropout masks of 2-3 shapes; each shape's hash is traced and
    # lowered once (prng._bits_of), not once per draw. Shapes no other test uses, so that no
    # earlier trace is reused.
    traced = []
    real = prng.threefry_hash
    monkeypatch.setattr(prng, "threefry_hash", lambda *a: traced.append(1) or real(*a))
    keys = [jax.random.fold_in(jax.random.key(7), i) for i in range(4)]
    shapes = [(3, 5, 11), (3, 5, 11), (3, 5, 11), (13, 2)]

    def draws(datas):
        return [prng.threefry_bits(d, s) for d, s in zip(datas, shapes)]

    got = jax.jit(draws)([jax.random.key_data(k) for k in keys])
    assert len(traced) == 2
    for g, k, s in zip(got, keys, shapes):   # the draws still differ by key, as JAX's
        np.testing.assert_array_equal(np.asarray(g),
                                      np.asarray(jax.random.bits(k, s, jnp.uint32)))
