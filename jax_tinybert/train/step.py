"""The pure, jitted, sharded train and eval steps.

train step: (state, teacher_params, batch) -> (state, metrics), one jitted program, or two
(`SplitTrainStep`: the gradients, one program per batch shape, then the optimizer update). The
teacher runs once per micro-batch under stop_gradient (deterministic unless `teacher_dropout`),
the student once; the objective gives the loss and its terms; optax updates
params = {"student", "proj"}. Gradient accumulation is a `lax.scan` over micro-batches inside
the gradient program.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_tinybert import optim
from jax_tinybert.parallel import sharding as shd
from jax_tinybert.data import batching
from jax_tinybert.distill.objectives import CACHED_TOKEN_KEYS
from jax_tinybert.train.state import TrainState

Array = jax.Array
MODEL_KEYS = ("input_ids", "attention_mask", "token_type_ids")
# The eval program's inputs: example_id rides through it, sharded like the rows (see make_eval_step).
EVAL_KEYS = MODEL_KEYS + ("example_id",)
# A batch carrying any of these has its teacher outputs from the teacher cache.
CACHED_KEYS = ("teacher_logits", "teacher_cls") + CACHED_TOKEN_KEYS


def _apply(model: nn.Module, params, batch, *, deterministic: bool, attention_logits, rng,
           cls_only: bool = False, qkv_layers=()):
    # qkv_layers only where asked for: every other objective's call (and program) as before.
    extra = {"qkv_layers": tuple(qkv_layers)} if qkv_layers else {}
    return model.apply({"params": params}, batch["input_ids"], batch["attention_mask"],
                       batch["token_type_ids"], deterministic=deterministic,
                       attention_logits=attention_logits,
                       rngs=None if deterministic else {"dropout": rng}, cls_only=cls_only,
                       **extra)


def num_chunks(batch_size: int, seq_len: int, chunk_tokens: int) -> int:
    """How many equal row chunks a forward of [batch_size, seq_len] runs in: those of
    `batching.chunk_rows` (halved while over `chunk_tokens` tokens, down to 8 rows; the rule of
    the teacher cache's pass); 1 for chunk_tokens 0."""
    if chunk_tokens <= 0:
        return 1
    return batch_size // batching.chunk_rows(batch_size, seq_len, chunk_tokens)


def _apply_chunked(model: nn.Module, params, batch, chunk_tokens: int, *, deterministic: bool,
                   rng, **kw):
    """`_apply` over the batch's rows in `num_chunks` chunks, each a forward of its own in the
    same program, outputs concatenated ([B, ...] as one forward). On CPU a chunk's [rows, H,
    T, T] attention tensors and [rows * T, d_ff] activations stay in cache
    (benchmarks/RESULTS.md#row-chunks-and-layer-loops). Rows are computed as alone; with dropout
    each chunk draws from its own key (fold_in(rng, i)), so the draws differ from one whole
    forward's."""
    B, T = batch["input_ids"].shape
    n = num_chunks(B, T, chunk_tokens)
    if n == 1:
        return _apply(model, params, batch, deterministic=deterministic, rng=rng, **kw)
    c = B // n
    outs = [_apply(model, params, {k: batch[k][i * c:(i + 1) * c] for k in MODEL_KEYS},
                   deterministic=deterministic,
                   rng=None if deterministic else jax.random.fold_in(rng, i), **kw)
            for i in range(n)]
    return jax.tree_util.tree_map(lambda *xs: jnp.concatenate(xs), *outs)


def make_loss_fn(student: nn.Module, teacher: Optional[nn.Module], objective, *,
                 teacher_dropout: bool = False, student_dropout: bool = True,
                 chunk_tokens: int = 0) -> Callable:
    """-> loss_fn(params, teacher_params, batch, rng) -> (loss, terms). Pure.

    chunk_tokens: teacher and student forward the batch in row chunks of at most this many
    tokens (`num_chunks`; 0: the whole batch at once). The same loss and gradients (to float
    rounding); with dropout, other masks."""
    use_teacher = teacher is not None and objective.needs_teacher
    # A loss that reads logits and [CLS] vectors only needs the last layers' [CLS] rows: the
    # same loss and gradients for ~5/6 less of that layer's work (dropout draws differ).
    cls_only = not objective.reads_tokens

    def loss_fn(params, teacher_params, batch, rng):
        r_s, r_t = jax.random.split(rng)
        t_out = None
        if use_teacher and not any(k in batch for k in CACHED_KEYS):
            t_out = _apply_chunked(teacher, teacher_params, batch, chunk_tokens,
                                   deterministic=not teacher_dropout,
                                   attention_logits=objective.teacher_attention_layers, rng=r_t,
                                   cls_only=cls_only,
                                   qkv_layers=getattr(objective, "teacher_qkv_layers", ()))
            t_out = jax.tree_util.tree_map(
                lambda x: jax.lax.stop_gradient(x.astype(jnp.float32)), t_out)
        s_out = _apply_chunked(student, params["student"], batch, chunk_tokens,
                               deterministic=not student_dropout,
                               attention_logits=objective.student_attention_layers, rng=r_s,
                               cls_only=cls_only,
                               qkv_layers=getattr(objective, "student_qkv_layers", ()))
        return objective(params.get("proj", {}), s_out, t_out, batch)

    return loss_fn


def make_grad_step(loss_fn: Callable, *, grad_accum: int = 1,
                   mesh: Optional[Mesh] = None) -> Callable:
    """-> grads(state, teacher_params, batch) -> (grads like state.params, metrics), not jitted.

    batch leaves have a leading global batch dim B (B % grad_accum == 0); grads are averaged
    over the grad_accum micro-batches; metrics: `loss` and every objective term.
    """

    def grads_of(params, teacher_params, batch, rng):
        (loss, terms), g = jax.value_and_grad(loss_fn, has_aux=True)(params, teacher_params,
                                                                     batch, rng)
        return g, dict(terms, loss=loss)

    def grads(state: TrainState, teacher_params, batch):
        rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        if grad_accum == 1:
            return grads_of(state.params, teacher_params, batch, rng)

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
        (g, metrics, _), _ = jax.lax.scan(body, (zeros, m0, 0), micro)
        g = jax.tree_util.tree_map(lambda x: x / grad_accum, g)
        return g, jax.tree_util.tree_map(lambda m: m / grad_accum, metrics)

    return grads


def make_update_step(optimizer: Callable[[Dict[str, Array]], tuple],
                     pad_token_id: Optional[int] = None) -> Callable:
    """-> update(state, grads, numbers) -> (state, {"grad_norm", "lr"}), not jitted: the
    optimizer's step (grad_norm: global L2 of `grads`; lr: the schedule's value at this step).
    optimizer(numbers) -> (tx, schedule): the run's optimizer built from the schedule's numbers
    (optim.schedule_numbers; arguments of the program, so that one compiled update serves any
    learning rate and run length), e.g. functools.partial(optim.make_optimizer, cfg, steps).
    pad_token_id: the optimizer's (optim.resolve), so that the norm shares its sums with the
    optimizer's clip instead of reading every gradient once more."""

    def update(state: TrainState, grads, numbers):
        tx, schedule = optimizer(numbers)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"grad_norm": optim.global_norm(grads, pad_token_id),
                   "lr": jnp.asarray(schedule(state.step), jnp.float32)}
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return update


def make_train_step(loss_fn: Callable, optimizer: Callable[[Dict[str, Array]], tuple], *,
                    grad_accum: int = 1, mesh: Optional[Mesh] = None,
                    pad_token_id: Optional[int] = None) -> Callable:
    """-> step(state, teacher_params, batch, numbers) -> (state, metrics), not yet jitted: the
    gradient step and the update step (`make_update_step`'s optimizer and numbers) as one
    function (metrics: both steps' metrics)."""
    grads_fn = make_grad_step(loss_fn, grad_accum=grad_accum, mesh=mesh)
    update_fn = make_update_step(optimizer, pad_token_id)

    def step(state: TrainState, teacher_params, batch, numbers):
        grads, metrics = grads_fn(state, teacher_params, batch)
        state, more = update_fn(state, grads, numbers)
        return state, dict(metrics, **more)

    return step


def make_eval_step(student: nn.Module) -> Callable:
    """-> eval_step(student_params, batch) -> (logits [B, C] float32, example_id [B] int32).

    batch holds EVAL_KEYS, each [B, ...] sharded over the mesh's batch axes. The ids go through
    the program beside the rows, so each logit comes back next to its own example's id whatever
    the order of the mesh's devices (a TPU torus interleaves the hosts' chips; a host's rows then
    land in slices that are not one block). Pure, deterministic."""

    def eval_step(params, batch):
        out = _apply(student, params, batch, deterministic=True, attention_logits=False, rng=None,
                     cls_only=True)
        return out.logits, batch["example_id"].astype(jnp.int32)

    return eval_step


def jit_train_step(step: Callable, state_sharding, teacher_sharding, mesh: Mesh,
                   numbers) -> "Bound":
    """jax.jit with explicit in/out shardings and the state donated (updated in place), called
    as step(state, teacher_params, batch): `numbers` (replicated arrays) bound."""
    jitted = jax.jit(step, in_shardings=(state_sharding, teacher_sharding,
                                         shd.batch_sharding(mesh), shd.replicated(mesh)),
                     out_shardings=(state_sharding, shd.replicated(mesh)), donate_argnums=(0,))
    return Bound(jitted, numbers)


def jit_eval_step(eval_step: Callable, student_sharding, mesh: Mesh):
    """eval_step jitted: the batch split over the batch axes, (logits, ids) replicated."""
    return jax.jit(eval_step, in_shardings=(student_sharding, shd.batch_sharding(mesh)),
                   out_shardings=(shd.replicated(mesh), shd.replicated(mesh)))


def jit_split_train_step(grads_fn: Callable, update_fn: Callable, state_sharding,
                         teacher_sharding, mesh: Mesh, numbers) -> "SplitTrainStep":
    """The train step as two jitted programs: the gradient step (one program per batch shape;
    the state is read, not donated) and the update step (one program for the run; the state
    donated: the new params and moments take its buffers, so donating the gradients too would
    give XLA buffers it has no output for), called as update(state, grads): `numbers` bound."""
    grads = jax.jit(grads_fn,
                    in_shardings=(state_sharding, teacher_sharding, shd.batch_sharding(mesh)),
                    out_shardings=(state_sharding.params, shd.replicated(mesh)))
    update = jax.jit(update_fn, in_shardings=(state_sharding, state_sharding.params,
                                              shd.replicated(mesh)),
                     out_shardings=(state_sharding, shd.replicated(mesh)), donate_argnums=(0,))
    return SplitTrainStep(grads, Bound(update, numbers))


class Bound:
    """`fn` (jitted, lowered or compiled) with its last arguments bound: called as
    fn(*args, *bound), lowered to and compiled into Bound forms of the same; the rest of the
    interface (cost_analysis, memory_analysis, as_text, ...) is fn's.

    The schedule's numbers are arguments of the update program, not constants written into it
    (optim.py), while every caller keeps calling, lowering and compiling the step with the
    arguments it always had."""

    def __init__(self, fn: Callable, *bound):
        self.fn, self.bound = fn, bound

    def __call__(self, *args):
        return self.fn(*args, *self.bound)

    def lower(self, *args) -> "Bound":
        return Bound(self.fn.lower(*args, *self.bound), *self.bound)

    def compile(self) -> "Bound":
        return Bound(self.fn.compile(), *self.bound)

    def __getattr__(self, name):
        if name in ("fn", "bound"):   # not set yet (copy, unpickling): not fn's to answer
            raise AttributeError(name)
        return getattr(self.fn, name)


class SplitTrainStep:
    """train_step(state, teacher_params, batch) -> (state, metrics), run as two programs:
    grads(state, teacher_params, batch) -> (grads, metrics), then update(state, grads).

    Why: a fused step compiles the optimizer's update (AdamW over every parameter leaf) into the
    program of every length bucket. Compiled once on its own, each bucket's program compiles
    2.4-3.2 s faster on a 2-core Xeon, for steps ~3% slower (the update no longer overlaps the
    backward pass); the two give the same parameters up to float rounding
    (benchmarks/RESULTS.md#optimizer-update). `train.split_update` picks one (speed/profiles.py).

    `lower(...)` / `.compile()` mirror jax.jit's: the compiled pair runs as the step does, with
    the two programs' cost analyses added and their memory analyses combined (`SplitLowered`).
    """

    def __init__(self, grads: Callable, update: Callable):
        self.grads, self.update = grads, update

    def __call__(self, state, teacher_params, batch):
        return _run_pair(self.grads, self.update, state, teacher_params, batch)

    def lower(self, state, teacher_params, batch) -> "SplitLowered":
        g = self.grads.lower(state, teacher_params, batch)
        return SplitLowered(g, self.update.lower(state, g.out_info[0]))


def _run_pair(grads_fn, update_fn, state, teacher_params, batch):
    grads, metrics = grads_fn(state, teacher_params, batch)
    state, more = update_fn(state, grads)
    return state, dict(metrics, **more)


class _Programs:
    """The gradient and update programs (`parts`), lowered or compiled, with XLA's cost
    analysis of the two added key by key."""

    def __init__(self, grads, update):
        self.grads, self.update = grads, update

    @property
    def parts(self) -> tuple:
        return (self.grads, self.update)

    def cost_analysis(self) -> Dict[str, float]:
        return _add_costs(p.cost_analysis() for p in self.parts)


class SplitLowered(_Programs):
    """The lowered programs of a SplitTrainStep."""

    def compile(self) -> "SplitCompiled":
        return SplitCompiled(*(p.compile() for p in self.parts))


@dataclasses.dataclass(frozen=True)
class MemoryAnalysis:
    """The byte counts of XLA's memory analysis that this project reads."""
    argument_size_in_bytes: int
    output_size_in_bytes: int
    alias_size_in_bytes: int
    temp_size_in_bytes: int
    generated_code_size_in_bytes: int


class SplitCompiled(_Programs):
    """The compiled programs of a SplitTrainStep: callable as the step, with XLA's analyses."""

    def __call__(self, state, teacher_params, batch):
        return _run_pair(self.grads, self.update, state, teacher_params, batch)

    def memory_analysis(self) -> MemoryAnalysis:
        """As one program would report it: the arguments of both (the state with its moments,
        the teacher, the batch), the gradient program's outputs (the gradients, live until
        the update has read them; the update's outputs alias the state it is given), the
        larger of the two programs' temporaries, and both executables."""
        g, u = (p.memory_analysis() for p in self.parts)
        # The update reads the state and the gradients: the params (also read by the gradient
        # program) and the gradients (its outputs) are counted already; what is left is the
        # optimizer's moments (and a few bytes of metrics too many, under the key and step).
        moments = max(0, int(u.argument_size_in_bytes) - 2 * int(g.output_size_in_bytes))
        return MemoryAnalysis(
            int(g.argument_size_in_bytes) + moments, int(g.output_size_in_bytes),
            int(g.alias_size_in_bytes), max(int(g.temp_size_in_bytes), int(u.temp_size_in_bytes)),
            int(g.generated_code_size_in_bytes) + int(u.generated_code_size_in_bytes))


def _add_costs(costs) -> Dict[str, float]:
    """XLA cost analyses (a dict, or a list of one dict per program) added key by key."""
    out: Dict[str, float] = {}
    for c in costs:
        if isinstance(c, (list, tuple)):
            c = c[0] if c else {}
        for k, v in (c or {}).items():
            if isinstance(v, (int, float)):
                out[k] = out.get(k, 0.0) + float(v)
    return out
