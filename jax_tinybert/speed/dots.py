"""The CPU's 16-bit product layouts, given to the model as its `products` (model/modeling.py).

On a CPU a 16-bit model computes float32 activations with bfloat16 (or float16) products
(speed/dtypes.py): XLA's CPU backend has no 16-bit element-wise arithmetic, while its bfloat16 x
bfloat16 -> float32 dots run on AMX or AMD's AVX512-BF16. Its library dot (YNNPACK) takes
row-major operands only, so the products' operands are laid out as rows here.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

Array = jax.Array
Dtype = Any


def _sum32(eq: str, a: Array, b: Array) -> Array:
    return jnp.einsum(eq, a, b, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4))
def half_einsum(eq: str, a: Array, b: Array, dtype: Dtype, out_dtype: Dtype) -> Array:
    """einsum(eq, a, b) with 16-bit operands: a and b rounded to `dtype` (bfloat16 / float16),
    the products summed in float32, the result returned in `out_dtype` (`dtype`, or float32 to
    keep float32 activations). eq: two operands, plain letters, every letter of an operand also
    in the other operand or the output (true of a matmul and of attention's batched products).

    Why not a plain bfloat16 einsum: XLA's CPU backend has no bfloat16-output dot, so it upcasts
    both operands and runs a float32 one, while a bfloat16 x bfloat16 -> float32 dot runs on AMX
    (4096x384 @ 384x1536: ~1850 against ~330 GFLOP/s float32 on an Intel Xeon with AMX) or on
    AVX512-BF16 (4096x312 @ 312x1200: ~350 against ~175 on an AMD EPYC Zen 4). On a GPU
    the value is the same: its bfloat16 dots sum in float32 too. The gradients are the same two
    kinds of product, taken from the cotangent rounded to `dtype`, and come back in each
    operand's own dtype: a float32 kernel gets its gradient summed and kept in float32.
    """
    return _sum32(eq, a.astype(dtype), b.astype(dtype)).astype(out_dtype)


def _half_einsum_fwd(eq, a, b, dtype, out_dtype):
    return half_einsum(eq, a, b, dtype, out_dtype), (a, b)


def _half_einsum_bwd(eq, dtype, out_dtype, res, g):
    a, b = res
    ins, out = eq.split("->")
    ia, ib = ins.split(",")
    for own, other in ((ia, ib), (ib, ia)):
        if set(own) - set(other) - set(out):
            raise ValueError(f"half_einsum {eq!r}: a letter of {own!r} is summed within its own "
                             "operand; its gradient is not a product of the other two")
    g = g.astype(dtype)
    ga = _sum32(f"{out},{ib}->{ia}", g, b.astype(dtype)).astype(a.dtype)
    if _contracts_rows(ia, out, ib):   # a dense kernel's gradient, or k's and v's
        gb = _rows_product_of_columns(g, a.astype(dtype), out, ia, ib)
    else:
        gb = _sum32(f"{ia},{out}->{ib}", a.astype(dtype), g)
    return ga, gb.astype(b.dtype)


def _contracts_rows(x: str, y: str, out: str) -> bool:
    """Whether einsum x,y->out is a (batched) product over the rows of both operands:
    [..., Q, X] and [..., Q, Y] -> [..., X, Y] or [..., Y, X] (the second gradient of a dense
    layer, x.T @ g, and of the attention products: k from the scores', v from the context's)."""
    return (len(x) == len(y) == len(out) >= 2 and x[:-2] == y[:-2] == out[:-2]
            and x[-2] == y[-2] and x[-2] not in out and {x[-1], y[-1]} == set(out[-2:])
            and x[-1] != y[-1])


def _rows_product_of_columns(g: Array, a: Array, g_eq: str, a_eq: str, out: str) -> Array:
    """einsum(f"{g_eq},{a_eq}->{out}", g, a) in float32, for a product over the rows of both
    16-bit operands (_contracts_rows). As written, the left operand of the library dot would be
    read column by column, which XLA's CPU library dot (YNNPACK) refuses: it upcast these to a
    float32 Eigen batched dot. One operand, or the other and the result, is first transposed as
    rows (_swap_minor), whichever moves fewer elements."""
    lhs, rhs = (g, a) if g_eq[-1] == out[-2] else (a, g)   # lhs: the output's rows
    Q, X, Y = lhs.shape[-2], lhs.shape[-1], rhs.shape[-1]
    if Q * X <= Q * Y + X * Y:
        return jnp.matmul(_swap_minor(lhs), rhs, preferred_element_type=jnp.float32)
    return _swap_minor(jnp.matmul(_swap_minor(rhs), lhs, preferred_element_type=jnp.float32))


def _rows_split(n: int) -> int:
    """The factor (8, 4, 2 or 1) a transpose splits an axis of n rows by (see _swap_minor)."""
    return next(d for d in (8, 4, 2, 1) if n % d == 0)


def _swap_minor(x: Array) -> Array:
    """x [..., M, N] -> [..., N, M], as an array in row-major order.

    XLA's CPU backend gives a plain transpose a column-major layout instead of moving data, and
    its library dot (YNNPACK) takes row-major operands only, so a bfloat16 kernel gradient
    x.T @ g was upcast to a float32 Eigen dot (~270 against ~860 GFLOP/s for [4096, 384] x
    [4096, 1536] on an Intel Xeon with AMX, transpose included). Going through one more axis
    ([M/d, d, N] -> [N, M/d, d]) makes XLA write the transposed rows."""
    *lead, m, n = x.shape
    d = _rows_split(m)
    k = len(lead)
    y = x.reshape(*lead, m // d, d, n).transpose(*range(k), k + 2, k, k + 1)
    return y.reshape(*lead, n, m)


half_einsum.defvjp(_half_einsum_fwd, _half_einsum_bwd)


def _heads_first(x: Array, heads: int) -> Array:
    """x [B, T, H*d] -> [B, H, T, d] as an array in row-major order (see _swap_minor): a
    plain transpose is a layout, {3,1,2,0}, and the library dot takes no 16-bit operand in it.
    T is split in two on the way, which makes XLA write the rows."""
    B, T, D = x.shape
    e = _rows_split(T)
    y = x.reshape(B, T // e, e, heads, D // heads).transpose(0, 3, 1, 2, 4)
    return y.reshape(B, heads, T, D // heads)


def _heads_last(x: Array) -> Array:
    """x [B, H, T, d] -> [B, T, H*d] as an array in row-major order (_heads_first's inverse):
    the context's cotangent then reaches its batched gradient products as rows too."""
    B, H, T, d = x.shape
    e = _rows_split(T)
    return x.reshape(B, H, T // e, e, d).transpose(0, 2, 3, 1, 4).reshape(B, T, H * d)


def rows_product(x: Array, kernel: Array, dtype: Dtype, bias: Optional[Array],
                 dot_dtype: Dtype) -> Array:
    """x [..., in] @ kernel [in, out] (+ bias [out]) -> [..., out] in `dtype`, as one 2-D
    product on the rows through half_einsum with `dot_dtype` operands (the kernel may stay
    float32: its gradient then does too)."""
    y = half_einsum("nk,km->nm", x.reshape((-1, x.shape[-1])), kernel, dot_dtype, dtype)
    if bias is not None:
        # Added to the 2-D rows: its gradient is then a sum over one axis, which XLA's CPU
        # backend fuses; over [B, T] of a bfloat16 cotangent it became a convert and a
        # reduce-window, ~25% of a fine-tuning step.
        y = y + bias.astype(dtype)
    return y.reshape(x.shape[:-1] + (kernel.shape[1],))




@dataclasses.dataclass(frozen=True)
class HalfProducts:
    """The model's products with `dot_dtype` (16-bit) operands summed in float32, laid out as
    rows; the same interface as modeling.Products."""

    dot_dtype: Any

    def dense(self, x: Array, kernel: Array, bias: Optional[Array], dtype: Dtype) -> Array:
        return rows_product(x, kernel, dtype, bias, self.dot_dtype)

    def einsum(self, eq: str, a: Array, b: Array, dtype: Dtype) -> Array:
        return half_einsum(eq, a, b, self.dot_dtype, dtype)

    def split_heads(self, x: Array, heads: int) -> Array:
        return _heads_first(x, heads)

    def merge_heads(self, x: Array) -> Array:
        return _heads_last(x)

    def attention(self, q, k, v, mask_bias, dtype):
        return None   # the model's own products (speed/attention.py wraps these to fuse it)
