"""Fused attention for the layers whose scores no loss reads: the teacher's unmapped layers,
every layer of an evaluation, of the teacher cache's pass and of the prediction stage's teacher
(`train.attention`; docs/design.md, "Speed").

A layer whose [B, H, T, T] scores a loss reads (TinyBERT's mapped layers, MiniLM's last) keeps
the model's own products: the scores must exist in memory then. Elsewhere the context
softmax(q k^T / sqrt(d) + mask) v is `jax.nn.dot_product_attention`: with
implementation "cudnn" (cuDNN's flash attention, 16-bit q/k/v on an NVIDIA GPU) the scores never
reach memory; "xla" is the same op written by XLA (any backend). `auto` keeps the model's own
products on a CPU, whose form was tuned for XLA's CPU backend
(benchmarks/RESULTS.md#products-and-attention), and on a TPU until one is measured. The same math: the masked softmax summed in
float32 (tests/test_attention.py: the model with and without it within 1e-5 in float32).
Layers under attention dropout keep the model's products (the fused op has no dropout).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp

Array = jax.Array
Dtype = Any

KINDS = ("auto", "off", "xla", "cudnn")


@dataclasses.dataclass(frozen=True)
class FusedAttention:
    """A model's products (`base`: modeling.Products or speed/dots.HalfProducts) with their
    `attention` computed by jax.nn.dot_product_attention(implementation=`implementation`)."""

    base: Any
    implementation: str = "xla"

    def dense(self, x, kernel, bias, dtype):
        return self.base.dense(x, kernel, bias, dtype)

    def einsum(self, eq, a, b, dtype):
        return self.base.einsum(eq, a, b, dtype)

    def split_heads(self, x, heads):
        return self.base.split_heads(x, heads)

    def merge_heads(self, x):
        return self.base.merge_heads(x)

    def attention(self, q: Array, k: Array, v: Array, mask_bias: Array, dtype: Dtype
                  ) -> Optional[Array]:
        """q [B, H, Q, d] (already scaled by 1/sqrt(d)), k, v [B, H, T, d], mask_bias
        [B, 1, 1|Q, T] float32 additive -> context [B, H, Q, d] in `dtype`; None (the model's
        own products) for shapes cuDNN's kernel does not take."""
        (B, H, Q, d), T = q.shape, k.shape[2]
        bias = mask_bias
        if self.implementation == "cudnn":
            # Its head size: a multiple of 8 up to 128 (TinyBERT4's 312 / 12 = 26 is not);
            # with a bias, even lengths; the bias as [B, 1, Q, T] in the inputs' dtype.
            if d % 8 or d > 128 or Q % 2 or T % 2:
                return None
            bias = jnp.broadcast_to(mask_bias, (B, 1, Q, T)).astype(dtype)
        # The op's layout is [B, T, H, d].
        q, k, v = (jnp.swapaxes(x.astype(dtype), 1, 2) for x in (q, k, v))
        out = jax.nn.dot_product_attention(q, k, v, bias=bias, scale=1.0,
                                           implementation=self.implementation)
        return jnp.swapaxes(out, 1, 2).astype(dtype)


def implementation(kind: str, backend: str, dtype) -> Optional[str]:
    """A config's `train.attention` for one model of compute `dtype` on `backend` -> the fused
    op's implementation, or None for the model's own products. `auto`: cuDNN's flash attention
    on a GPU for a 16-bit model (it takes no float32), the model's products elsewhere."""
    if kind not in KINDS:
        raise ValueError(f"train.attention={kind!r}: one of {', '.join(KINDS)}")
    half = jnp.dtype(dtype).itemsize == 2
    if kind == "auto":
        return "cudnn" if backend == "gpu" and half else None
    if kind == "off":
        return None
    if kind == "cudnn" and (backend != "gpu" or not half):
        return None   # config/check.py refuses this before a run; a model built aside stays plain
    return kind


def with_attention(kw: dict, kind: str, backend: str, plain: Any) -> dict:
    """A model's compute keyword arguments (speed.dtypes.compute_dtypes) with its products
    wrapped in FusedAttention where `kind` (train.attention) applies; `plain`: the model's own
    products (modeling.PLAIN), for kw without a "products" key."""
    impl = implementation(kind, backend, kw["dtype"])
    if not impl:
        return kw
    return dict(kw, products=FusedAttention(kw.get("products", plain), impl))


def refusal(kind: str, backend: str, dtype, field: str) -> Optional[str]:
    """Why `kind` cannot run for a model of compute `dtype` (the config's `field`) on
    `backend`, as one line with the fix; None when it can."""
    if kind != "cudnn" or (backend == "gpu" and jnp.dtype(dtype).itemsize == 2):
        return None
    fix = ("--config.train.attention=auto (or xla)" if backend != "gpu" else
           f"--config.{field}=bfloat16, or --config.train.attention=auto")
    return (f"config.train.attention='cudnn' is cuDNN's flash attention, for a 16-bit model on "
            f"an NVIDIA GPU; this run has {field}={jnp.dtype(dtype).name!r} on {backend}: pass "
            f"{fix}")

