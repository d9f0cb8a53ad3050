"""Optimizers: AdamW (optax) and BertAdam, the official TinyBERT/PKD optimizer, for parity.

`make_optimizer(cfg, total_steps) -> (tx, schedule)`. Both share the schedules below, written in
the official "progress" form (progress = step / total_steps, warmup = a fraction of training), so
`warmup_linear` peaks at step warmup * total_steps and reaches 0 at total_steps; step 0 has lr 0
whenever there is a warmup (the official code evaluates the schedule before counting the step).

The update program takes the schedule's numbers (`schedule_numbers`: peak lr, total steps,
warmup ratio) as arguments, `make_optimizer(..., numbers=)` building the same optimizer from
them inside the trace: written into the program as constants, a new learning rate, run length
or batch size made a new program, so a rerun, a sweep or the next task compiled its update
again (~1.6 s on the first step's path, benchmarks/RESULTS.md#optimizer-update) instead of finding it in the
persistent compile cache.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

SCHEDULES = ("warmup_linear", "constant", "warmup_constant")
OPTIMIZERS = ("adamw", "bertadam")

# Per-optimizer defaults, the one place they live (config fields left at None take these).
# BertAdam's are the official TinyBERT/PKD ones; AdamW uses the same eps 1e-6 (BERT's).
_DEFAULTS = {
    "adamw": dict(learning_rate=5e-5, schedule="warmup_linear", warmup_ratio=0.1,
                  weight_decay=0.01, b1=0.9, b2=0.999, eps=1e-6, clip_norm=1.0,
                  grad_clip_per_tensor=0.0, pad_token_id=0),
    "bertadam": dict(learning_rate=5e-5, schedule="warmup_linear", warmup_ratio=0.1,
                     weight_decay=0.01, b1=0.9, b2=0.999, eps=1e-6, clip_norm=0.0,
                     grad_clip_per_tensor=1.0, pad_token_id=0),
}


def defaults(name: str) -> dict:
    """The defaults of optimizer `name` (one of OPTIMIZERS)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer name {name!r} unknown; expected one of {OPTIMIZERS}")
    return dict(_DEFAULTS[name])


def shared_defaults() -> dict:
    """The defaults every optimizer has in common (the config schema states these values)."""
    first, *rest = _DEFAULTS.values()
    return {k: v for k, v in first.items() if all(d.get(k) == v for d in rest)}


# ----------------------------------------------------------------------------- schedules

def schedule_factor(name: str, progress, warmup):
    """Multiplier of the peak lr at `progress` = step / total_steps (scalar, jnp or float;
    `warmup` too: a traced number in the update program).

    warmup_linear: progress / warmup during warmup, then (progress - 1) / (warmup - 1) clipped at
    0 (the official BertAdam `warmup_linear`); warmup_constant: progress / warmup, then 1;
    constant: 1 (the official schedule 'none', used by the intermediate stage).
    """
    if name == "constant":
        return jnp.ones_like(jnp.asarray(progress, jnp.float32))
    progress = jnp.asarray(progress, jnp.float32)
    warmup = jnp.maximum(jnp.asarray(warmup, jnp.float32), 0.0)
    has_warmup = warmup > 0
    up = jnp.where(has_warmup, progress / jnp.where(has_warmup, warmup, 1.0), 1.0)
    if name == "warmup_constant":
        after = jnp.ones_like(progress)
    elif name == "warmup_linear":
        after = jnp.maximum((progress - 1.0) / (warmup - 1.0), 0.0)
    else:
        raise ValueError(f"optimizer schedule {name!r} unknown; expected one of {SCHEDULES}")
    return jnp.where(progress < warmup, up, after)


def _check_schedule(name: str, total_steps: Optional[int], warmup_ratio: float) -> None:
    if name not in SCHEDULES:
        raise ValueError(f"optimizer schedule {name!r} unknown; expected one of {SCHEDULES}")
    if not 0.0 <= warmup_ratio < 1.0:
        raise ValueError(f"optimizer warmup_ratio must be in [0, 1), got {warmup_ratio!r}")
    if name != "constant" and (total_steps is None or total_steps <= 0):
        raise ValueError(f"optimizer schedule {name!r} needs total_steps > 0, got {total_steps!r}"
                         " (or use schedule='constant')")


def _schedule(name: str, learning_rate, total_steps, warmup_ratio) -> Callable[[Any], jax.Array]:
    # The numbers may be Python floats or traced float32 scalars: the same expression either way.
    def schedule(step):
        if name == "constant":
            return (jnp.asarray(learning_rate, jnp.float32)
                    + 0.0 * jnp.asarray(step, jnp.float32))
        progress = jnp.asarray(step, jnp.float32) / jnp.asarray(total_steps, jnp.float32)
        return learning_rate * schedule_factor(name, progress, warmup_ratio)

    return schedule


def make_schedule(name: str, learning_rate: float, total_steps: Optional[int],
                  warmup_ratio: float = 0.0) -> Callable[[Any], jax.Array]:
    """step (int, 0-based count of updates already applied) -> learning rate (float32 scalar)."""
    _check_schedule(name, total_steps, warmup_ratio)
    return _schedule(name, float(learning_rate), float(total_steps or 1), float(warmup_ratio))


def schedule_numbers(cfg, total_steps: Optional[int]) -> Dict[str, np.ndarray]:
    """cfg's schedule as the update program takes it: {"learning_rate", "total_steps",
    "warmup_ratio"}, float32 scalars (total_steps 1 for the constant schedule, which reads
    none); `make_optimizer(cfg, total_steps, numbers=)` builds the optimizer from them."""
    opt = resolve(cfg)
    _check_schedule(opt["schedule"], total_steps, opt["warmup_ratio"] or 0.0)
    return {"learning_rate": np.float32(opt["learning_rate"]),
            "total_steps": np.float32(total_steps or 1),
            "warmup_ratio": np.float32(opt["warmup_ratio"] or 0.0)}


# ----------------------------------------------------------------------------- weight-decay mask

def _key_name(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def decay_mask(params) -> Any:
    """Same-structure pytree of bools: True where weight decay applies.

    Off for biases and LayerNorm (leaf `bias`, `scale`, or any path through a `LayerNorm`
    module), as the official `no_decay = ['bias', 'LayerNorm.bias', 'LayerNorm.weight']`.
    """
    def keep(path, _):
        names = [_key_name(k) for k in path]
        leaf = names[-1] if names else ""
        return not (leaf in ("bias", "scale") or any("LayerNorm" in n for n in names))

    return jax.tree_util.tree_map_with_path(keep, params)


# ----------------------------------------------------------------------------- pad embedding

def _is_word_embedding(path, g) -> bool:
    names = [_key_name(k) for k in path]
    return names[-2:] == ["word_embeddings", "embedding"] and g.ndim == 2


def zero_pad_embedding_grad(pad_token_id: int = 0) -> optax.GradientTransformation:
    """Zero the gradient of row `pad_token_id` of every `word_embeddings/embedding` [V, D].

    PyTorch BERT builds its word embeddings with `nn.Embedding(padding_idx=pad_token_id)`, so
    that row never gets a gradient (weight decay still applies). Without this, losses that count
    padded positions (tinybert mode) move the [PAD] vector and the run drifts from the official
    one (0.04% of the loss after one BertAdam step on the oracle batch).
    """
    def update(grads, state, params=None):
        def fix(path, g):
            if _is_word_embedding(path, g):
                # A select against the row index, not `g.at[pad].set(0)`: XLA fuses the select
                # into the optimizer's passes, where the scatter first copied the whole [V, D]
                # gradient (the update program's input) to write one row.
                row = jax.lax.broadcasted_iota(jnp.int32, g.shape, 0)
                return jnp.where(row == pad_token_id, jnp.zeros((), g.dtype), g)
            return g

        return jax.tree_util.tree_map_with_path(fix, grads), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


# ----------------------------------------------------------------------------- global norm

def global_sumsq(grads, pad_token_id: Optional[int] = None) -> Tuple[jax.Array, jax.Array]:
    """-> (sum of squares of every gradient element except row `pad_token_id` of each word
    embedding, sum of squares of those rows); float32 scalars. Without a pad id: (all, 0).

    A word embedding's [V, D] gradient is read once, into per-row sums [V], and the pad row is
    left out of those: a slice `g[pad + 1:]` was copied out whole before its reduction, and a
    select zeroing the row written out too. `clip_by_global_norm` and `global_norm` build the
    same expressions, so in one program XLA computes them once."""
    free, rows = [], []
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        if (pad_token_id is not None and _is_word_embedding(path, g)
                and 0 <= int(pad_token_id) < g.shape[0]):
            per_row = jnp.sum(jnp.square(g), axis=1)
            pad = jnp.arange(g.shape[0]) == int(pad_token_id)
            free.append(jnp.sum(jnp.where(pad, jnp.zeros((), per_row.dtype), per_row)))
            rows.append(per_row[int(pad_token_id)])
        else:
            free.append(jnp.sum(jnp.square(g)))
    total = lambda xs: sum(xs[1:], xs[0]) if xs else jnp.zeros((), jnp.float32)
    return total(free), total(rows)


def global_norm(grads, pad_token_id: Optional[int] = None) -> jax.Array:
    """Global L2 norm of `grads` (every element; as `optax.tree.norm`, up to rounding), from the
    sums `global_sumsq` makes (pass the optimizer's pad id so XLA shares them with the clip)."""
    free, rows = global_sumsq(grads, pad_token_id)
    return jnp.sqrt(free + rows)


def clip_by_global_norm(max_norm: float,
                        pad_token_id: Optional[int] = None) -> optax.GradientTransformation:
    """`optax.clip_by_global_norm`, with the word embeddings' row `pad_token_id` left out of the
    norm: chained before `zero_pad_embedding_grad`, it clips what that row-zeroing leaves, as the
    two in the other order would (and as torch's `clip_grad_norm_` sees a padding_idx row).

    Scales by one factor, max_norm / norm, where optax divides each element by the norm then
    multiplies by max_norm (results within one rounding of each other): a per-element divide is
    costly enough that XLA writes the clipped gradients out once for the two moments to read,
    while a product by a scalar it recomputes inside each. With the pad row left out of per-row
    sums (`global_sumsq`), AdamW's update over a MiniLM-L6-sized tree takes ~28 ms instead of
    ~40 on 2 Xeon cores (benchmarks/optimizer_update.py; benchmarks/RESULTS.md#optimizer-update)."""
    def update(grads, state, params=None):
        del params
        free, _ = global_sumsq(grads, pad_token_id)
        norm = jnp.sqrt(free)
        factor = jnp.where(norm < max_norm, jnp.ones((), norm.dtype), max_norm / norm)
        return jax.tree_util.tree_map(lambda t: t * factor.astype(t.dtype), grads), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


# ----------------------------------------------------------------------------- BertAdam

class BertAdamState(NamedTuple):
    """count: int32 per tensor (updates applied to it; tensors without gradient do not count);
    mu, nu: first/second moments, like params."""

    count: Any
    mu: Any
    nu: Any


def bertadam(schedule: Callable[[Any], jax.Array], b1: float = 0.9, b2: float = 0.999,
             eps: float = 1e-6, weight_decay: float = 0.01, mask: Any = decay_mask,
             max_grad_norm: Optional[float] = 1.0) -> optax.GradientTransformation:
    """The official BertAdam as an optax transformation (needs `params` in `update`).

    Per tensor: g clipped to norm <= max_grad_norm (torch `clip_grad_norm_(p)`, factor
    min(1, max / (||g|| + 1e-6))); m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2 (no bias
    correction); update = -lr(count) * (m / (sqrt(v) + eps) + wd * p), wd only where `mask`.
    A tensor whose gradient is exactly zero everywhere gets no update and keeps its state: in
    PyTorch such parameters have grad None and BertAdam skips them (e.g. the pooler in the
    intermediate stage); here they arrive as zeros.
    """
    def init(params):
        zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
        count = jax.tree_util.tree_map(lambda _: jnp.zeros((), jnp.int32), params)
        return BertAdamState(count=count, mu=zeros,
                             nu=jax.tree_util.tree_map(jnp.zeros_like, params))

    def update(grads, state, params=None):
        if params is None:
            raise ValueError("bertadam needs params in update() for its weight decay")
        wd_mask = mask(params) if callable(mask) else mask

        def one(g, count, m, v, p, decay):
            g = g.astype(m.dtype)
            has_grad = jnp.any(g != 0)
            if max_grad_norm is not None and max_grad_norm > 0:
                norm = jnp.sqrt(jnp.sum(jnp.square(g)))
                g = g * jnp.minimum(max_grad_norm / (norm + 1e-6), 1.0)
            m_new = b1 * m + (1.0 - b1) * g
            v_new = b2 * v + (1.0 - b2) * g * g
            u = m_new / (jnp.sqrt(v_new) + eps)
            if decay and weight_decay > 0:
                u = u + weight_decay * p.astype(u.dtype)
            u = -schedule(count) * u
            return (jnp.where(has_grad, u, 0.0).astype(p.dtype),
                    jnp.where(has_grad, count + 1, count),
                    jnp.where(has_grad, m_new, m), jnp.where(has_grad, v_new, v))

        treedef = jax.tree_util.tree_structure(params)
        out = [one(*xs) for xs in zip(*(treedef.flatten_up_to(t) for t in (
            grads, state.count, state.mu, state.nu, params, wd_mask)))]
        updates, count, mu, nu = (treedef.unflatten(list(col)) for col in zip(*out))
        return updates, BertAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(init, update)


# ----------------------------------------------------------------------------- factory

def _get(cfg, key, default):
    if cfg is None:
        return default
    try:
        v = cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)
    except (KeyError, AttributeError):
        v = default
    return v


def resolve(cfg) -> dict:
    """cfg's optimizer fields with the optimizer's defaults filled in ("name" included)."""
    name = _get(cfg, "name", "adamw")
    return {"name": name, **{k: _get(cfg, k, v) for k, v in defaults(name).items()}}


def make_optimizer(cfg, total_steps: Optional[int], numbers: Optional[Dict[str, Any]] = None
                   ) -> Tuple[optax.GradientTransformation, Callable[[Any], jax.Array]]:
    """cfg (dict/ConfigDict): name ("adamw" | "bertadam"), learning_rate, schedule
    ("warmup_linear" | "constant" | "warmup_constant"), warmup_ratio, weight_decay, b1, b2, eps,
    clip_norm (adamw global-norm clip; None/0 = off), grad_clip_per_tensor (bertadam),
    pad_token_id (default 0: that word-embedding row gets no gradient, as in PyTorch; None = off).
    A key that is absent takes the optimizer's default (`defaults(name)`); None turns clipping /
    pad_token_id off. total_steps: number of optimizer updates of the run (the official t_total).
    numbers: `schedule_numbers(cfg, total_steps)`, or those traced in a program, for the
    schedule's peak lr, length and warmup (default: schedule_numbers(cfg, total_steps)).
    Returns (tx, schedule: step -> lr). Weight decay skips biases and LayerNorm.
    """
    opt = resolve(cfg)
    name = opt["name"]
    n = schedule_numbers(opt, total_steps) if numbers is None else numbers   # checked there
    schedule = _schedule(opt["schedule"], n["learning_rate"], n["total_steps"], n["warmup_ratio"])
    wd = float(opt["weight_decay"] or 0.0)
    parts = []
    if opt["pad_token_id"] is not None:
        parts.append(zero_pad_embedding_grad(int(opt["pad_token_id"])))
    if name == "bertadam":
        if opt["clip_norm"]:
            raise ValueError("bertadam clips each tensor (grad_clip_per_tensor); clip_norm "
                             "(global) is for adamw; set clip_norm=0")
        parts.append(bertadam(schedule, b1=opt["b1"], b2=opt["b2"], eps=opt["eps"],
                              weight_decay=wd, max_grad_norm=opt["grad_clip_per_tensor"]))
        return optax.chain(*parts), schedule
    if opt["grad_clip_per_tensor"]:
        raise ValueError("grad_clip_per_tensor is a bertadam option; adamw uses clip_norm "
                         "(set grad_clip_per_tensor=0)")
    if opt["clip_norm"]:
        # Before the [PAD] row is zeroed: its state is empty as that transform's, so the chain's
        # state keeps its structure (checkpoints of earlier versions restore).
        parts.insert(0, clip_by_global_norm(float(opt["clip_norm"]), opt["pad_token_id"]))
    parts.append(optax.adamw(schedule, b1=opt["b1"], b2=opt["b2"], eps=opt["eps"],
                             weight_decay=wd, mask=decay_mask))
    return optax.chain(*parts), schedule
