"""BERT in flax.linen with the outputs distillation needs.

Module and parameter names follow Hugging Face's `modeling_flax_bert.py`, so HF weights load by
renaming only (see `jax_tinybert.model.hf`). Every model returns a `BertOutput` holding all hidden
states (index 0 = embedding output) and the raw attention scores Q K^T / sqrt(d_head) before the
mask, softmax and dropout, which HF's `output_attentions` (post-softmax) cannot give.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Iterable, Optional, Tuple, Union

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from jax_tinybert.speed.dropout import Dropout
from jax_tinybert.model import families
from jax_tinybert.model.config import ACTIVATIONS, BertConfig, ConfigError  # noqa: F401
from jax_tinybert.model.params import count_params, init_params, random_params  # noqa: F401

Array = jax.Array
Dtype = Any


def gelu(x: Array) -> Array:
    """The exact GELU in the form of HF's and the official code's PyTorch: x/2 (1 + erf(x/sqrt 2)).

    Not `jax.nn.gelu(approximate=False)`: that goes through `erfc`, whose XLA expansion has
    three polynomial branches and an `exp`; `erf` is one rational polynomial. Train steps at
    T 128 run 2-5.5% faster (benchmarks/RESULTS.md#products-and-attention). Against float64 the values are within
    1.1e-6 (PyTorch's own float32 GELU: 1.2e-6), a 6-layer encoder's hidden states within
    PyTorch float32's own distance from float64 (tests/test_modeling.py)."""
    return 0.5 * x * (1.0 + jax.lax.erf(x * 0.7071067811865476))


# config.ACTIVATIONS, computed.
_ACTIVATIONS = {
    "gelu": gelu,
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "tanh": jnp.tanh,
}
assert set(_ACTIVATIONS) == set(ACTIVATIONS)


@flax.struct.dataclass
class BertOutput:
    """What every model returns.

    hidden_states: tuple of N+1 arrays [B, T, D]; index 0 is the embedding output (after LayerNorm).
    attention_logits: tuple of N entries, [B, H, T, T] raw scores Q K^T / sqrt(d_head) before the
      additive mask, softmax and dropout, or None for layers not asked for.
    With `cls_only=True` the last layer computes its [CLS] row only: hidden_states[-1] is
    [B, 1, D] (pooled and logits are the same as without).
    pooled: [B, D] tanh(dense(h_last[:, 0])), or None without a pooler.
    qkv: with `qkv_layers`, a tuple of N entries: (q, k, v) each [B, H, T, d_head] (q before the
      1/sqrt(d_head) scale) for the layers asked for, None for the others; else None.
    logits: [B, C] for classification models (C = 1: regression), else None.
    Packed rows (`cls_positions` [B, S] given): pooled is [B, S, D] and logits [B, S, C], one
    per segment; with `cls_only` hidden_states[-1] is [B, S, D] (the segments' [CLS] rows).
    """

    hidden_states: Tuple[Array, ...]
    attention_logits: Tuple[Optional[Array], ...]
    pooled: Optional[Array] = None
    logits: Optional[Array] = None
    qkv: Optional[Tuple[Optional[Tuple[Array, Array, Array]], ...]] = None

    @property
    def last_hidden_state(self) -> Array:
        return self.hidden_states[-1]


def _dense_init(config: BertConfig):
    return nn.initializers.normal(stddev=config.initializer_range)


def matmul_rows(x: Array, kernel: Array) -> Array:
    """x [..., in] @ kernel [in, out] -> [..., out], computed as one 2-D product on the rows
    [N, in] (see Products.dense for why)."""
    y = x.reshape((-1, x.shape[-1])) @ kernel
    return y.reshape(x.shape[:-1] + (kernel.shape[1],))


def query_rows(x: Array, cls_positions: Optional[Array]) -> Array:
    """The rows a `cls_only` last layer computes: x [B, T, ...] -> [B, 1, ...] (row 0), or
    [B, S, ...] at cls_positions int [B, S] (each packed segment's [CLS] row)."""
    if cls_positions is None:
        return x[:, :1]
    idx = cls_positions.reshape(cls_positions.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=1)


@dataclasses.dataclass(frozen=True)
class Products:
    """How the model's products are computed: dense layers x [..., in] @ kernel [in, out] +
    bias -> [..., out], attention's two batched products, and the heads' layout. Plain JAX
    here, in the compute dtype; speed/dots.py gives a CPU's 16-bit ones (speed.dtypes)."""

    def dense(self, x: Array, kernel: Array, bias: Optional[Array], dtype: Dtype) -> Array:
        # One 2-D product on the rows [N, in], the bias added to it: XLA's CPU backend turned
        # the weight gradient of a 3-D dot_general into transposed copies and a one-core dot
        # (FFN 1.6-2x slower), and a bias gradient summed over [B, T] into a slower reduction.
        y = x.reshape((-1, x.shape[-1])).astype(dtype) @ kernel.astype(dtype)
        if bias is not None:
            y = y + bias.astype(dtype)
        return y.reshape(x.shape[:-1] + (kernel.shape[1],))

    def einsum(self, eq: str, a: Array, b: Array, dtype: Dtype) -> Array:
        return jnp.einsum(eq, a, b)

    def split_heads(self, x: Array, heads: int) -> Array:
        """[B, T, H*d] -> [B, H, T, d]."""
        B, T, D = x.shape
        return x.reshape(B, T, heads, D // heads).transpose(0, 2, 1, 3)

    def merge_heads(self, x: Array) -> Array:
        """[B, H, T, d] -> [B, T, H*d]."""
        B, H, T, d = x.shape
        return x.transpose(0, 2, 1, 3).reshape(B, T, H * d)

    def attention(self, q: Array, k: Array, v: Array, mask_bias: Array, dtype: Dtype
                  ) -> Optional[Array]:
        """softmax(q k^T + mask_bias) v in one fused op where a backend has one, for the layers
        whose scores nothing reads: q [B, H, Q, d] (scaled), k, v [B, H, T, d] -> [B, H, Q, d],
        or None (here: the model's own products; speed/attention.py's fused ones)."""
        return None


PLAIN = Products()


class _BertModule(nn.Module):
    """What every BERT sub-module shares: its config, compute dtype, parameter dtype and
    products (None: `PLAIN`; a CPU's 16-bit ones come from speed/dots.py), and the Dense /
    LayerNorm layers built from them (HF's parameter names, init and epsilon)."""

    config: BertConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    products: Optional[Any] = None

    @property
    def _ops(self):
        return PLAIN if self.products is None else self.products

    def _shared(self) -> dict:
        """The fields a sub-module inherits from its parent."""
        return dict(config=self.config, dtype=self.dtype, param_dtype=self.param_dtype,
                    products=self.products)

    def _dense(self, features: int, name: str):
        """x [..., in] -> [..., features], with the params of an `nn.Dense` named `name`."""
        params = _DenseParams(**self._shared(), features=features, name=name)

        def dense(x):
            kernel, bias = params(x.shape[-1])
            return self._ops.dense(x, kernel, bias, self.dtype)
        return dense

    def _layer_norm(self, name: str = "LayerNorm") -> nn.LayerNorm:
        return nn.LayerNorm(epsilon=self.config.layer_norm_eps, dtype=self.dtype,
                            param_dtype=self.param_dtype, name=name)


class BertEmbeddings(_BertModule):
    """Word + position + token-type embeddings, LayerNorm, dropout -> [B, T, D]."""

    @nn.compact
    def __call__(self, input_ids, token_type_ids, position_ids, deterministic: bool = True):
        c = self.config
        init = _dense_init(c)
        # The tables are read in their own dtype and the sum enters the LayerNorm, which returns
        # `dtype`. A table cast to bfloat16 first makes its gradient a bfloat16 scatter-add: on a
        # GPU that serialises on every repeated id (padding, [CLS]; 119 of a 137 ms step on an
        # H200, benchmarks/RESULTS.md#on-a-gpu) and its sums stop growing past 256 equal terms.
        E = c.embedding_size or c.hidden_size
        embed = functools.partial(nn.Embed, features=E, embedding_init=init, dtype=self.param_dtype,
                                  param_dtype=self.param_dtype)
        word = embed(c.vocab_size, name="word_embeddings")(input_ids)
        # position_ids are 0-based; RoBERTa's table starts past its padding index.
        if families.of(c).position_offset:
            position_ids = position_ids + (c.pad_token_id + 1)
        pos = embed(c.max_position_embeddings, name="position_embeddings")(position_ids)
        if families.of(c).token_types:
            word = word + embed(c.type_vocab_size, name="token_type_embeddings")(token_type_ids)
        h = self._layer_norm()(word + pos)
        h = Dropout(rate=c.hidden_dropout_prob)(h, deterministic=deterministic)
        # ELECTRA's narrower tables: hidden_states[0] is the projection, as HF's.
        return h if E == c.hidden_size else self._dense(c.hidden_size, "embeddings_project")(h)


class _DenseParams(_BertModule):
    """The kernel [in, features] and bias [features] of an `nn.Dense` of the same name (same
    initialisers, so the same initial values), for a caller that fuses several products."""

    features: int = 0

    @nn.compact
    def __call__(self, in_features: int):
        kernel = self.param("kernel", _dense_init(self.config), (in_features, self.features),
                            self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros_init(), (self.features,),
                          self.param_dtype)
        return kernel, bias


def _softmax_product(scores: Array, v: Array, product, dtype: Dtype) -> Array:
    """softmax(scores, -1) @ v with the normalisation after the product: scores [B, H, Q, T]
    float32, v [B, H, T, d] -> [B, H, Q, d] in `dtype`. The same sums as normalising first, one
    division per output instead of per score. On CPU XLA otherwise fuses the whole softmax into
    the product's YNNPACK fusion, which ran the teacher's attention 2-4x slower than the two
    products and the softmax apart (benchmarks/RESULTS.md#products-and-attention). Not used under attention
    dropout: there the mask falls on the normalised probabilities, and the training step measured
    slower in this form."""
    e = jnp.exp(scores - jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True)))
    ctx = product("bhqk,bhkd->bhqd", e.astype(dtype), v)
    return (ctx.astype(jnp.float32) / jnp.sum(e, axis=-1, keepdims=True)).astype(dtype)


class BertSelfAttention(_BertModule):
    """Multi-head self-attention (query/key/value); also returns the pre-softmax logits."""

    @nn.compact
    def __call__(self, h, mask_bias, deterministic: bool = True, cls_only: bool = False,
                 cls_positions: Optional[Array] = None, return_qkv: bool = False,
                 logits_wanted: bool = True):
        """h [B, T, D], mask_bias [B, 1, 1, T] or [B, 1, T, T] additive -> (context [B, Q, D],
        logits [B, H, Q, T], qkv); Q = T, or with `cls_only` 1 (queries from the [CLS] row only)
        or S (from the rows at cls_positions [B, S]). qkv: (q, k, v) [B, H, Q|T, d_head], q
        unscaled, with `return_qkv`, else None. Without `logits_wanted` the products' fused
        attention may compute the context (logits None then)."""
        c = self.config
        B, T, D = h.shape
        # One [B*T, D] x [D, 3*D] product instead of three [D, D] ones: the same sums (each
        # output still contracts over D), run ~1.5-2x faster on CPU for BERT-small widths, and
        # the backward's input gradient is one product too. The params stay HF's three Dense
        # layers (query/key/value kernel [D, D] + bias); stacking them on a middle axis keeps a
        # "model"-axis sharding of their output dim (sharding.py) a sharding of the stack.
        kernels, biases = zip(*(_DenseParams(**self._shared(), features=c.hidden_size, name=n)(D)
                                for n in ("query", "key", "value")))
        ops, dtype, heads = self._ops, self.dtype, c.num_attention_heads
        # cls_only: keys and values still come from every row, the query from [CLS] only, so
        # the stacked product is of the key and value kernels alone.
        every_row = slice(1 if cls_only else 0, 3)
        # The kernels stay in their dtype: the products cast them.
        h, bias = nn.dtypes.promote_dtype(h, jnp.stack(biases[every_row]), dtype=dtype)
        kernel = jnp.stack(kernels[every_row], axis=1)
        n = kernel.shape[1]
        # As one 2-D product [B*T, D] x [D, n*D]. Keeping the kernel's middle axis was 1-6%
        # slower on CPU; under a "model" mesh axis the reshape reshards this layer's kernel.
        proj = ops.dense(h, kernel.reshape(D, n * D), bias.reshape(n * D), dtype)
        proj = proj.reshape(B, T, n, D)
        # Heads before tokens ([B, H, T, d]): the batched products run 1.5-2x faster on CPU.
        qkv = [ops.split_heads(proj[:, :, i], heads) for i in range(n)]
        if cls_only:
            q = ops.dense(query_rows(h, cls_positions), kernels[0], biases[0], dtype)
            q, (k, v) = ops.split_heads(q, heads), qkv
            if mask_bias.shape[2] > 1:   # a per-query mask: the queries' rows of it
                mask_bias = jnp.swapaxes(query_rows(jnp.swapaxes(mask_bias, 1, 2),
                                                    cls_positions), 1, 2)
        else:
            q, k, v = qkv
        # MiniLM's relations read q, k, v; taken before the scale, as the papers define them.
        heads_out = (q, k, v) if return_qkv else None
        # Scale q before the product: same math as scaling the scores, fewer multiplies.
        q = q / jnp.sqrt(jnp.asarray(c.head_dim, dtype=q.dtype))

        if not (logits_wanted or return_qkv or (not deterministic
                                                and c.attention_probs_dropout_prob > 0)):
            fused = ops.attention(q, k, v, mask_bias, dtype)
            if fused is not None:
                return ops.merge_heads(fused), None, heads_out

        def product(eq, a, b):
            return ops.einsum(eq, a, b, dtype)

        logits = product("bhqd,bhkd->bhqk", q, k)
        # Softmax in float32 even under bf16 compute: the -1e9 style mask and exp need the range.
        scores = logits.astype(jnp.float32) + mask_bias
        if not deterministic and c.attention_probs_dropout_prob > 0:
            probs = jax.nn.softmax(scores, axis=-1)
            probs = Dropout(rate=c.attention_probs_dropout_prob)(probs, deterministic=False)
            ctx = product("bhqk,bhkd->bhqd", probs.astype(dtype), v)
        else:
            ctx = _softmax_product(scores, v, product, dtype)
        return ops.merge_heads(ctx), logits, heads_out


class _ResidualOutput(_BertModule):
    """dense -> dropout -> LayerNorm(x + residual): the output block after attention and FFN."""

    @nn.compact
    def __call__(self, x, residual, deterministic: bool = True):
        x = self._dense(self.config.hidden_size, "dense")(x)
        x = Dropout(rate=self.config.hidden_dropout_prob)(x, deterministic=deterministic)
        return self._layer_norm()(x + residual)


class BertSelfOutput(_ResidualOutput):
    """attention/output: projects the attention context [B, T, D], adds the layer input."""


class BertFFNOutput(_ResidualOutput):
    """output (HF's BertOutput, named apart from our model output): projects the intermediate
    activations [B, T, d_ff] back to D and adds the attention output."""


class BertAttention(_BertModule):
    """Self-attention + its output block -> (h [B, T, D], attention logits [B, H, T, T])."""

    @nn.compact
    def __call__(self, h, mask_bias, deterministic: bool = True, cls_only: bool = False,
                 cls_positions: Optional[Array] = None, return_qkv: bool = False,
                 logits_wanted: bool = True):
        ctx, logits, qkv = BertSelfAttention(**self._shared(), name="self")(
            h, mask_bias, deterministic, cls_only, cls_positions, return_qkv, logits_wanted)
        out = BertSelfOutput(**self._shared(), name="output")(
            ctx, query_rows(h, cls_positions) if cls_only else h, deterministic)
        return out, logits, qkv


class BertLayer(_BertModule):
    """One transformer layer: attention, then the feed-forward block."""

    @nn.compact
    def __call__(self, h, mask_bias, deterministic: bool = True, cls_only: bool = False,
                 cls_positions: Optional[Array] = None, return_qkv: bool = False,
                 logits_wanted: bool = True):
        """h [B, T, D] -> (h' [B, Q, D], attention logits [B, H, Q, T] or None, qkv or None);
        Q = T, or with `cls_only` 1 (the [CLS] row's output, which needs every row's keys and
        values only) or S (the rows at cls_positions [B, S]: each packed segment's [CLS])."""
        a, logits, qkv = BertAttention(**self._shared(), name="attention")(
            h, mask_bias, deterministic, cls_only, cls_positions, return_qkv, logits_wanted)
        # Names as HF: intermediate/dense, then output/dense + output/LayerNorm.
        inter = _Intermediate(**self._shared(), name="intermediate")(a)
        out = BertFFNOutput(**self._shared(), name="output")(
            inter, a, deterministic)
        return out, logits, qkv


class _Intermediate(_BertModule):
    """The FFN's up-projection and activation: [B, T, D] -> [B, T, d_ff]."""

    @nn.compact
    def __call__(self, x):
        x = self._dense(self.config.intermediate_size, "dense")(x)
        return _ACTIVATIONS[self.config.hidden_act](x)


LayerSelection = Union[bool, Iterable[int], None]


def _selected_layers(select: LayerSelection, n: int, what: str = "attention logits") -> frozenset:
    """Normalise a request for attention logits (or q, k, v) to a set of 1-based layer indices."""
    if select is True:
        return frozenset(range(1, n + 1))
    if select is None or select is False:
        return frozenset()
    sel = frozenset(int(i) for i in select)
    bad = sorted(i for i in sel if not 1 <= i <= n)
    if bad:
        raise ValueError(f"{what} asked for layers {bad}, but the model has layers "
                         f"1..{n} (1-based; layer 0 is the embedding output and has none)")
    return sel


class BertLayerCollection(_BertModule):
    """The layers 0..L-1 (optionally rematerialised) -> all hidden states and asked-for logits."""

    remat: bool = False

    @nn.compact
    def __call__(self, h, mask_bias, deterministic: bool = True,
                 attention_layers: frozenset = frozenset(), cls_only: bool = False,
                 cls_positions: Optional[Array] = None, qkv_layers: frozenset = frozenset()):
        cls = nn.remat(BertLayer, static_argnums=(3, 4, 6, 7)) if self.remat else BertLayer
        hidden, logits, qkv = [h], [], []
        n = self.config.num_hidden_layers
        for i in range(n):
            h, lg, heads = cls(**self._shared(), name=str(i))(
                h, mask_bias, deterministic, cls_only and i == n - 1, cls_positions,
                (i + 1) in qkv_layers, (i + 1) in attention_layers)
            hidden.append(h)
            # Unrequested logits are dropped here; under jit XLA never materialises them.
            logits.append(lg if (i + 1) in attention_layers else None)
            qkv.append(heads)
        return tuple(hidden), tuple(logits), (tuple(qkv) if qkv_layers else None)


class BertEncoder(_BertModule):
    """HF's `encoder` scope around the layer collection."""

    remat: bool = False

    @nn.compact
    def __call__(self, h, mask_bias, deterministic=True, attention_layers=frozenset(),
                 cls_only=False, cls_positions=None, qkv_layers=frozenset()):
        return BertLayerCollection(**self._shared(), remat=self.remat,
                                   name="layer")(h, mask_bias, deterministic, attention_layers,
                                                 cls_only, cls_positions, qkv_layers)


class BertPooler(_BertModule):
    """tanh(dense(x)): x the [CLS] rows, [B, D] (or [B, S, D] for packed rows) -> same shape."""

    @nn.compact
    def __call__(self, x):
        return jnp.tanh(self._dense(self.config.hidden_size, "dense")(x))


def _default_inputs(input_ids, attention_mask, token_type_ids):
    if attention_mask is None:
        attention_mask = jnp.ones_like(input_ids)
    if token_type_ids is None:
        token_type_ids = jnp.zeros_like(input_ids)
    return attention_mask, token_type_ids


class BertModel(_BertModule):
    """The BERT encoder (+ pooler). Params match HF `FlaxBertModel` (no prefix).

    Call: (input_ids [B, T] int, attention_mask [B, T] {0,1}, token_type_ids [B, T]) -> BertOutput.
    `attention_logits`: True (all layers), False/None, or an iterable of 1-based layer indices.
    `qkv_layers`: the same kind of selection (default none): those layers' q, k, v in `qkv`.
    `remat` recomputes each layer in the backward pass (less memory, ~1/3 more compute).
    `cls_only`: the last layer computes its [CLS] row only (its output is [B, 1, D]), for a
    caller that reads the pooled output, logits or [CLS] vectors and nothing else per token:
    the same values for those, for ~5/6 less of the last layer's work.

    Packed rows (several examples per row, `jax_tinybert.packing`): attention_mask [B, T, T]
    (query x key, 1 = may attend), position_ids restarting at each segment, and cls_positions
    int [B, S], each segment's [CLS] row: pooled and logits come per segment ([B, S, ...]).
    """

    add_pooling_layer: bool = True
    remat: bool = False

    @nn.compact
    def __call__(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None,
                 deterministic: bool = True, attention_logits: LayerSelection = True,
                 cls_only: bool = False, cls_positions=None, qkv_layers: LayerSelection = None):
        attention_mask, token_type_ids = _default_inputs(input_ids, attention_mask, token_type_ids)
        if position_ids is None and families.of(self.config).position_offset:
            # HF RoBERTa's numbering of real tokens (0-based here; pads get -1 -> pad_token_id).
            real = (input_ids != self.config.pad_token_id).astype(jnp.int32)
            position_ids = jnp.cumsum(real, axis=-1) * real - 1
        elif position_ids is None:
            position_ids = jnp.broadcast_to(jnp.arange(input_ids.shape[-1]), input_ids.shape)
        h = BertEmbeddings(**self._shared(), name="embeddings")(
            input_ids, token_type_ids, position_ids, deterministic)
        # Same additive mask value as HF Flax (finfo.min); logits are returned before it.
        # [B, T] keys -> [B, 1, 1, T]; [B, T, T] query x key (packed rows) -> [B, 1, T, T].
        mask = attention_mask[:, None] if attention_mask.ndim == 3 else \
            attention_mask[:, None, None, :]
        mask_bias = jnp.where(mask > 0, 0.0, jnp.finfo(jnp.float32).min).astype(jnp.float32)
        n = self.config.num_hidden_layers
        sel = _selected_layers(attention_logits, n)
        qkv_sel = _selected_layers(qkv_layers, n, "q, k, v")
        if cls_only and n in sel | qkv_sel:
            raise ValueError(f"cls_only=True computes layer {n}'s [CLS] row only, so it has no "
                             f"[T, T] attention logits: ask for layers 1..{n - 1} only "
                             "(attention_logits=False or a list), or drop cls_only")
        hidden, logits, qkv = BertEncoder(**self._shared(), remat=self.remat,
                                          name="encoder")(h, mask_bias, deterministic, sel,
                                                          cls_only, cls_positions, qkv_sel)
        pooled = None
        if self.add_pooling_layer and families.of(self.config).pooler:
            last = hidden[-1]
            if cls_positions is None:
                rows = last[:, 0]
            else:   # a cls_only last layer computed the [CLS] rows alone
                rows = last if cls_only else query_rows(last, cls_positions)
            pooled = BertPooler(**self._shared(), name="pooler")(rows)
        return BertOutput(hidden_states=hidden, attention_logits=logits, pooled=pooled, qkv=qkv)


class BertForSequenceClassification(_BertModule):
    """BERT + dropout + linear classifier on the pooled output. Params: `bert/...`, `classifier`.

    num_labels = 1 is regression (logits [B, 1]). `head_relu=True` applies ReLU to the pooled
    output before the classifier, as the official TinyBERT `TinyBertForSequenceClassification` does.
    """

    remat: bool = False
    head_relu: bool = False

    @nn.compact
    def __call__(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None,
                 deterministic: bool = True, attention_logits: LayerSelection = True,
                 cls_only: bool = False, cls_positions=None, qkv_layers: LayerSelection = None):
        out = BertModel(**self._shared(), add_pooling_layer=True, remat=self.remat, name="bert")(
            input_ids, attention_mask, token_type_ids, position_ids, deterministic,
            attention_logits, cls_only, cls_positions, qkv_layers)
        if not families.of(self.config).pooler:   # RoBERTa / ELECTRA: the first token's row
            last = out.hidden_states[-1]
            rows = last[:, 0] if cls_positions is None else \
                (last if cls_only else query_rows(last, cls_positions))
            logits = _FirstTokenHead(**self._shared(), name="classifier")(rows, deterministic)
            return out.replace(logits=logits.astype(jnp.float32))
        x = out.pooled
        if self.head_relu:
            x = jax.nn.relu(x)
        x = Dropout(rate=self.config.hidden_dropout_prob)(x, deterministic=deterministic)
        logits = self._dense(self.config.num_labels, "classifier")(x)
        return out.replace(logits=logits.astype(jnp.float32))


class _FirstTokenHead(_BertModule):
    """RoBERTa's / ELECTRA's classifier: dropout, dense (tanh / gelu), dropout, out_proj;
    DistilBERT's: pre_classifier, ReLU, dropout, classifier: rows [..., D] -> logits [..., C]."""

    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        c, drop = self.config, Dropout(rate=self.config.hidden_dropout_prob)
        if families.of(c).head_dropout_first:
            x = drop(x, deterministic=deterministic)
        x = self._dense(c.hidden_size, "dense")(x)
        x = _ACTIVATIONS[families.of(c).head_activation](x)
        return self._dense(c.num_labels, "out_proj")(drop(x, deterministic=deterministic))


class BertForMaskedLM(_BertModule):
    """BERT + MLM head (decoder tied to the word embeddings). Params match HF `FlaxBertForMaskedLM`.

    `logits` is [B, T, vocab]. Used by TinyBERT data augmentation."""

    @nn.compact
    def __call__(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None,
                 deterministic: bool = True, attention_logits: LayerSelection = False):
        out = BertModel(**self._shared(), add_pooling_layer=False, name="bert")(
            input_ids, attention_mask, token_type_ids, position_ids, deterministic,
            attention_logits)
        logits = _MLMHead(**self._shared(), name="cls")(
            out.hidden_states[-1],
            self.variables["params"]["bert"]["embeddings"]["word_embeddings"]["embedding"])
        return out.replace(logits=logits)


class _MLMHead(_BertModule):
    """HF's `cls` scope of the masked-LM head."""

    @nn.compact
    def __call__(self, h, embedding):
        return _MLMPredictions(**self._shared(), name="predictions")(
            h, embedding)


class _MLMPredictions(_BertModule):
    """Transform, then logits over the vocabulary with the tied word embeddings + a bias."""

    @nn.compact
    def __call__(self, h, embedding):
        c = self.config
        t = _MLMTransform(**self._shared(), name="transform")(h)
        bias = self.param("bias", nn.initializers.zeros, (c.vocab_size,), self.param_dtype)
        return (t @ embedding.T.astype(t.dtype) + bias).astype(jnp.float32)


class _MLMTransform(_BertModule):
    """dense -> activation -> LayerNorm."""

    @nn.compact
    def __call__(self, h):
        h = self._dense(self.config.hidden_size, "dense")(h)
        return self._layer_norm()(_ACTIVATIONS[self.config.hidden_act](h))


def init_classifier(config: BertConfig, rng: Array) -> dict:
    """A new classification head {"kernel": [D, num_labels], "bias": [num_labels]} with the
    distribution `init_params` gives it (N(0, initializer_range), zero bias), without building
    the encoder (a full random init of a 30k-row vocabulary costs seconds on a CPU)."""
    if not families.of(config).pooler:
        return _FirstTokenHead(config).init(rng, jnp.zeros((1, config.hidden_size)))["params"]
    head = nn.Dense(config.num_labels, kernel_init=_dense_init(config), name="classifier")
    return head.init(rng, jnp.zeros((1, config.hidden_size), jnp.float32))["params"]
