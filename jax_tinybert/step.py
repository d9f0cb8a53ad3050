"""The pure, jitted, sharded train and eval steps.

train step: (state, teacher_params, batch) -> (state, metrics). The teacher runs once per
micro-batch under stop_gradient (deterministic unless `teacher_dropout`), the student once;
the objective gives the loss and its terms; optax updates params = {"student", "proj"}.
Gradient accumulation is a `lax.scan` over micro-batches inside the same jitted function.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_tinybert import sharding as shd
from jax_tinybert.objectives import CACHED_TOKEN_KEYS
from jax_tinybert.train_state import TrainState

Array = jax.Array
MODEL_KEYS = ("input_ids", "attention_mask", "token_type_ids")
# A batch carrying any of these has its teacher outputs from the teacher cache.
CACHED_KEYS = ("teacher_logits", "teacher_cls") + CACHED_TOKEN_KEYS


def _apply(model: nn.Module, params, batch, *, deterministic: bool, attention_logits, rng):
    return model.apply({"params": params}, batch["input_ids"], batch["attention_mask"],
                       batch["token_type_ids"], deterministic=deterministic,
                       attention_logits=attention_logits,
                       rngs=None if deterministic else {"dropout": rng})


def make_loss_fn(student: nn.Module, teacher: Optional[nn.Module], objective, *,
                 teacher_dropout: bool = False, student_dropout: bool = True) -> Callable:
    """-> loss_fn(params, teacher_params, batch, rng) -> (loss, terms). Pure."""
    use_teacher = teacher is not None and objective.needs_teacher

    def loss_fn(params, teacher_params, batch, rng):
        r_s, r_t = jax.random.split(rng)
        t_out = None
        if use_teacher and not any(k in batch for k in CACHED_KEYS):
            t_out = _apply(teacher, teacher_params, batch, deterministic=not teacher_dropout,
                           attention_logits=objective.teacher_attention_layers, rng=r_t)
            t_out = jax.tree_util.tree_map(
                lambda x: jax.lax.stop_gradient(x.astype(jnp.float32)), t_out)
        s_out = _apply(student, params["student"], batch, deterministic=not student_dropout,
                       attention_logits=objective.student_attention_layers, rng=r_s)
        return objective(params.get("proj", {}), s_out, t_out, batch)

    return loss_fn


def make_train_step(loss_fn: Callable, tx: optax.GradientTransformation,
                    schedule: Callable[[Array], Array], *, grad_accum: int = 1,
                    mesh: Optional[Mesh] = None) -> Callable:
    """-> step(state, teacher_params, batch) -> (state, metrics), not yet jitted.

    batch leaves have a leading global batch dim B (B % grad_accum == 0); metrics: `loss`,
    every objective term, `grad_norm` (global L2 of the accumulated gradient) and `lr`.
    """

    def grads_of(params, teacher_params, batch, rng):
        (loss, terms), g = jax.value_and_grad(loss_fn, has_aux=True)(params, teacher_params,
                                                                     batch, rng)
        return g, dict(terms, loss=loss)

    def step(state: TrainState, teacher_params, batch):
        rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        if grad_accum == 1:
            grads, metrics = grads_of(state.params, teacher_params, batch, rng)
        else:
            def split(x):
                x = x.reshape((grad_accum, x.shape[0] // grad_accum) + x.shape[1:])
                if mesh is not None:
                    x = jax.lax.with_sharding_constraint(
                        x, NamedSharding(mesh, P(None, shd.BATCH_AXES)))
                return x

            micro = jax.tree_util.tree_map(split, batch)
            zeros = jax.tree_util.tree_map(jnp.zeros_like, state.params)

            def body(carry, xs):
                acc_g, acc_m, i = carry
                g, m = grads_of(state.params, teacher_params, xs, jax.random.fold_in(rng, i))
                acc_g = jax.tree_util.tree_map(jnp.add, acc_g, g)
                acc_m = jax.tree_util.tree_map(jnp.add, acc_m, m)
                return (acc_g, acc_m, i + 1), None

            m_shape = jax.eval_shape(lambda: grads_of(
                state.params, teacher_params, jax.tree_util.tree_map(lambda x: x[0], micro),
                rng)[1])
            m0 = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), m_shape)
            (grads, metrics, _), _ = jax.lax.scan(body, (zeros, m0, 0), micro)
            grads = jax.tree_util.tree_map(lambda g: g / grad_accum, grads)
            metrics = jax.tree_util.tree_map(lambda m: m / grad_accum, metrics)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(metrics, grad_norm=optax.tree.norm(grads),
                       lr=jnp.asarray(schedule(state.step), jnp.float32))
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new_state, metrics

    return step


def make_eval_step(student: nn.Module) -> Callable:
    """-> eval_step(student_params, batch) -> logits [B, C] (float32). Pure, deterministic."""

    def eval_step(params, batch):
        out = _apply(student, params, batch, deterministic=True, attention_logits=False, rng=None)
        return out.logits

    return eval_step


def jit_train_step(step: Callable, state_sharding, teacher_sharding, mesh: Mesh):
    """jax.jit with explicit in/out shardings and the state donated (updated in place)."""
    return jax.jit(step, in_shardings=(state_sharding, teacher_sharding, shd.batch_sharding(mesh)),
                   out_shardings=(state_sharding, shd.replicated(mesh)), donate_argnums=(0,))


def jit_eval_step(eval_step: Callable, student_sharding, mesh: Mesh):
    return jax.jit(eval_step, in_shardings=(student_sharding, shd.batch_sharding(mesh)),
                   out_shardings=shd.replicated(mesh))
