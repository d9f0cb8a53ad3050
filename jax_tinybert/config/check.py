"""Config checks before a run starts: known fields and values in range, the config
fingerprint, and the workdir rule (a workdir that holds a run's checkpoints accepts only that
run's config, up to fields that do not change the result)."""
from __future__ import annotations

import difflib
import hashlib
import json
import logging
import math
import os
from typing import Any, Dict, List, Optional, Tuple

import jax
import ml_collections
import numpy as np

from jax_tinybert.config import schema as config_base
from jax_tinybert import fs, optim, speed
from jax_tinybert.distill import layer_maps, losses, objectives
from jax_tinybert.data import glue, position_tasks, vocab_match
from jax_tinybert.errors import PathError, UserError
from jax_tinybert.model import heads
from jax_tinybert.model.hf import WEIGHT_FILES, resolve_path

# Fields that do not change the trained model (SPEED_FIELDS: how fast, not what, so a workdir
# made on one backend resumes on another): a run may resume with other values.
NO_RESULT_CHANGE = {"train.log_every", "train.eval_every", "train.checkpoint_every",
                    "train.max_to_keep", "train.eval_batch_size", "export.enabled",
                    "data.cache_dir", "mesh.teacher", "data.corpus_memory_tokens", "data.prefetch",
                    "data.read_threads", "data.read_workers", "teacher.cache_split",
                    "train.profile_start", "train.profile_steps", *speed.SPEED_FIELDS}
# Fields that fix the number of steps, and so the learning-rate schedule: a resumed run may
# change them (to extend a run), with a warning naming the schedule change.
SCHEDULE_FIELDS = ("train.num_steps", "train.num_epochs")
DTYPES = ("float32", "bfloat16", "float16")
MODEL_DTYPES = ("auto",) + DTYPES   # auto: the backend's (speed/profiles.py; build.with_defaults)
CONFIG_RECORD = "config.json"

log = logging.getLogger(__name__)


class ConfigValueError(UserError, ValueError):
    """A config field has a value this program cannot run with."""


def _flat(cfg, prefix="") -> Dict[str, Any]:
    out = {}
    for k, v in cfg.items():
        key = f"{prefix}{k}"
        if isinstance(v, (ml_collections.ConfigDict, dict)):
            out.update(_flat(v, key + "."))
        else:
            out[key] = list(v) if isinstance(v, tuple) else v
    return out


# --------------------------------------------------------------------------- field names

def unknown_field(config: ml_collections.ConfigDict, path: str) -> Optional[str]:
    """None if `path` ("train.batch_size") names a field of config; else a message naming
    the closest fields (same section first, then the same name in another section)."""
    fields = {}
    for k, v in _flat(config).items():
        fields[k] = v
    sections = [k for k, v in config.items() if isinstance(v, ml_collections.ConfigDict)]
    if path in fields or path in sections:
        return None
    parent, _, leaf = path.rpartition(".")
    if parent in sections:
        own = list(config[parent].keys())
        close = [f"{parent}.{k}" for k in difflib.get_close_matches(leaf, own, n=2, cutoff=0.7)]
        close += [p for p in fields if p.rpartition(".")[2] == leaf and p not in close]
        if not close:
            near = difflib.get_close_matches(leaf, [q.rpartition(".")[2] for q in fields], n=1,
                                             cutoff=0.85)
            close = [p for p in fields if "." in p and p.rpartition(".")[2] in near]
        where = f"config.{parent} has: {', '.join(own)}"
    else:
        near = difflib.get_close_matches(parent, sections, n=1, cutoff=0.6)
        close = [p for p in fields if p.rpartition(".")[2] == leaf and
                 p.rpartition(".")[0] in near]
        close += [p for p in fields if p.rpartition(".")[2] == leaf and p not in close]
        where = f"the sections are: {', '.join(sections)}"
    msg = f"unknown field config.{path}; "
    msg += ("did you mean " + " or ".join(f"config.{c}" for c in close[:2]) + "?") if close \
        else where
    return msg + " (every field: jax-tinybert --help)"


# --------------------------------------------------------------------------- values

def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (_is_int(v) or isinstance(v, (float, np.floating))) and math.isfinite(float(v))


# field -> (requirement, test, why). Integers where the default is an int, finite numbers else.
_POS = ("> 0", lambda v: v > 0)
_NONNEG = (">= 0", lambda v: v >= 0)
_GE1 = (">= 1", lambda v: v >= 1)
_UNIT_OPEN = ("in [0, 1)", lambda v: 0 <= v < 1)
_UNIT = ("in [0, 1]", lambda v: 0 <= v <= 1)
NUMERIC_RULES = {
    "optim.learning_rate": (_POS, "a negative rate trains by gradient ascent"),
    "optim.warmup_ratio": (_UNIT_OPEN, "the fraction of the steps spent warming up"),
    "optim.weight_decay": (_NONNEG, ""),
    "optim.b1": (_UNIT_OPEN, "Adam's first-moment decay"),
    "optim.b2": (_UNIT_OPEN, "Adam's second-moment decay"),
    "optim.eps": (_POS, "Adam's denominator epsilon"),
    "optim.clip_norm": (_NONNEG, "0 = no clipping"),
    "optim.grad_clip_per_tensor": (_NONNEG, "0 = no clipping"),
    "train.batch_size": (_GE1, ""), "train.grad_accum": (_GE1, ""),
    "train.per_device_batch": (_NONNEG, "0 = use train.batch_size as the global batch"),
    "train.eval_batch_size": (_GE1, ""),
    "train.num_steps": (_NONNEG, "0 = train for config.train.num_epochs epochs"),
    "train.num_epochs": (_POS, ""),
    "train.log_every": (_GE1, "steps between log lines"),
    "train.checkpoint_every": (_GE1, "steps between checkpoints"),
    "train.checkpoint_seconds": (("-1 (auto) or >= 0", lambda v: v == -1 or v >= 0),
                                 "the least seconds between periodic checkpoints"),
    "train.eval_every": (_NONNEG, "0 = at the end of each epoch"),
    "train.max_to_keep": (_GE1, "periodic checkpoints kept"),
    "train.seed": (_NONNEG, ""),
    "train.compile_workers": (_NONNEG, "0 = auto: 1 on CPU, one per 4 host cores on a GPU/TPU"),
    "train.profile_start": (_NONNEG, "the first train step traced by jax.profiler, 0 = none"),
    "train.profile_steps": (_GE1, "how many train steps the trace covers"),
    "train.chunk_tokens": (("-1 (auto) or >= 0", lambda v: v == -1 or v >= 0),
                           "tokens per forward chunk of the train step, 0 = whole batches"),
    "objective.temperature": (_POS, "the softmax temperature of the soft labels"),
    "objective.alpha": (_UNIT, "the weight of the KD term; the hard-label term gets 1 - alpha"),
    "objective.beta": (_NONNEG, "the weight of the patience term"),
    "objective.w_embd": (_NONNEG, ""),
    "objective.w_attn": (_NONNEG, ""),
    "objective.w_hidn": (_NONNEG, ""),
    "objective.w_pred": (_NONNEG, ""),
    "data.max_len": (("in [4, 8192]", lambda v: 4 <= v <= 8192), "tokens per example, with "
                     "[CLS] and [SEP]"),
    "data.seq_len": (("in [4, 8192]", lambda v: 4 <= v <= 8192), "tokens per corpus sequence"),
    "data.max_buckets": (_GE1, "bucket budget when data.buckets=() (chosen from the data)"),
    "data.bucket_compile_steps": (("-1 (auto) or >= 0", lambda v: v == -1 or v >= 0),
                                  "a bucket's compilations in train steps at length 64"),
    "data.doc_stride": (_NONNEG, "tokens shared by consecutive windows of a SQuAD context"),
    "data.max_query_len": (_GE1, "a SQuAD question's tokens at most"),
    "data.train_subset": (_NONNEG, "0 = all"),
    "data.eval_subset": (_NONNEG, "0 = all"),
    "data.synthetic_train": (_GE1, ""), "data.synthetic_eval": (_GE1, ""),
    "student.num_hidden_layers": (_GE1, ""), "student.hidden_size": (_GE1, ""),
    "student.intermediate_size": (_GE1, ""),
    "student.num_attention_heads": (_GE1, ""),
    "student.teacher_layers_heads": (_NONNEG, "0 = the teacher's head count"),
    "mesh.data": (("-1 (all devices) or >= 1", lambda v: v == -1 or v >= 1), ""),
    "mesh.fsdp": (_GE1, ""), "mesh.model": (_GE1, ""), "mesh.fsdp_min_size": (_NONNEG, ""),
    "teacher.cache_max_gb": (("> 0", lambda v: v > 0), "GB the per-token teacher cache may use"),
}


def _choices() -> Dict[str, Tuple[str, ...]]:
    return {
        "stage": config_base.STAGES, "objective.name": objectives.OBJECTIVES,
        "objective.mode": losses.MODES, "objective.projection": objectives.PROJECTIONS,
        "objective.regression_target": ("teacher", "gold"),
        "objective.attn_loss": tuple(objectives.ATTN_LOSSES),
        "objective.hidn_loss": tuple(objectives.HIDN_LOSSES),
        "objective.kd_loss": objectives.KD_LOSSES,
        "student.init": config_base.STUDENT_INITS, "data.kind": config_base.DATA_KINDS,
        "data.source": ("tsv", "hf", "tfds"), "data.corpus_mode": ("sentences", "documents"),
        "optim.name": optim.OPTIMIZERS, "optim.schedule": optim.SCHEDULES,
        "teacher.dtype": MODEL_DTYPES, "student.dtype": MODEL_DTYPES,
        "teacher.cache_tokens": ("auto", "always", "never"),
        "train.split_update": ("auto", "always", "never"),
        "train.attention": ("auto", "off", "xla", "cudnn"),
        "teacher.cache_dtype": ("float16", "float32"),
        "teacher.cache_build": ("auto", "beside", "before"), "teacher.cache_split": ("auto", "never"),
        "mesh.teacher": ("auto", "replicated", "sharded"),
    }


def _bad(field: str, value, requirement: str, why: str = "", example=None) -> ConfigValueError:
    default = _flat(config_base.base_config()).get(field) if example is None else example
    fix = f"pass e.g. --config.{field}={_cli(default)}" if default is not None else \
        f"fix config.{field}"
    return ConfigValueError(f"config.{field}={value!r} {requirement}"
                            + (f" ({why})" if why else "") + f"; {fix}")


def _cli(v) -> str:
    if isinstance(v, (list, tuple)):
        return "'(" + ", ".join(str(x) for x in v) + ("," if len(v) == 1 else "") + ")'"
    return str(v)


def validate_config(config: ml_collections.ConfigDict, paths: bool = True) -> None:
    """Stops before anything is written on an unknown field or a value out of its range,
    naming the field, what it must be and a value that works (ConfigValueError); with
    paths=True also on a path that does not hold what the stage reads (`check_paths`)."""
    base = config_base.base_config()
    flat = _flat(config)
    extra = {k for k in flat if config.stage == "demo" and k.startswith("demo_")}
    for key in sorted(set(flat) - set(_flat(base)) - extra):
        raise ConfigValueError(unknown_field(base, key))
    defaults = _flat(base)
    for field, options in _choices().items():
        if flat.get(field) not in options:
            raise _bad(field, flat.get(field), f"is not valid; expected one of {tuple(options)}")
    for field, ((req, test), why) in NUMERIC_RULES.items():
        v = flat[field]
        if _is_int(defaults[field]) and not _is_int(v):
            raise _bad(field, v, "must be an integer " + req, why)
        if not _is_num(v):
            raise _bad(field, v, "must be a finite number " + req, why)
        if not test(v):
            raise _bad(field, v, "must be " + req, why)
    for field, d in defaults.items():
        if isinstance(d, bool) and not isinstance(flat[field], (bool, np.bool_)):
            raise _bad(field, flat[field], "must be True or False")
    _check_sequences(config)
    if config.data.kind != "corpus" and not position_tasks.get(config.data.task):
        try:
            glue.get_task(config.data.task)
        except KeyError as e:
            raise ConfigValueError(f"config.data.task: {e}; or one of {', '.join(position_tasks.TASKS)}"
                                   ) from e
    if config.data.kind == "synthetic" and position_tasks.get(config.data.task):
        raise ConfigValueError("config.data.kind='synthetic' makes a GLUE-like set; for "
                               f"{config.data.task} pass --config.data.kind=glue")
    if config.data.kind == "corpus" and config.objective.name not in objectives.INTERMEDIATE:
        raise ConfigValueError(f"config.data.kind='corpus' has no labels; objective "
                               f"{config.objective.name!r} needs labelled task data (use one of "
                               f"{objectives.INTERMEDIATE} for general distillation)")
    if config.objective.name == "tinybert_intermediate" and objectives.kl_without_masking(
            config.objective.to_dict()):
        raise ConfigValueError(
            "config.objective.attn_loss='kl' runs in config.objective.mode='masked' only (the "
            "official TinyBERT code has no attention KL to reproduce); pass "
            "--config.objective.mode=masked or --config.objective.attn_loss=mse")
    sc = config.student
    if sc.init == "random" and sc.hidden_size % sc.num_attention_heads:
        raise ConfigValueError(
            f"config.student.hidden_size={sc.hidden_size} is not a multiple of "
            f"config.student.num_attention_heads={sc.num_attention_heads}; pick sizes with "
            "hidden_size = heads x head size, e.g. 312 and 12")
    if paths:
        check_paths(config)


def _check_sequences(config) -> None:
    b = tuple(config.data.buckets)
    if not all(_is_int(x) and x >= 1 for x in b):
        raise _bad("data.buckets", b, "must be a tuple of positive integers",
                   "sequence lengths to pad to; longer examples use data.max_len; () = chosen "
                   "from the data's lengths (at most data.max_buckets)")
    tl = tuple(config.student.teacher_layers)
    if not all(_is_int(x) and x >= 1 for x in tl) or \
            (config.student.init == "teacher_layers" and not tl):
        raise _bad("student.teacher_layers", tl, "must be 1-based teacher layer numbers",
                   "the teacher layers the student starts from", example=(1, 2, 3))
    lw = tuple(config.objective.layer_weights)
    if not all(_is_num(x) and x >= 0 for x in lw):
        raise _bad("objective.layer_weights", lw, "must be numbers >= 0",
                   "lambda_m per student layer 0..M; () = all 1", example=())
    spec = config.objective.layer_map
    if isinstance(spec, str) and ":" in spec and spec.strip()[:1] not in "([{":
        layer_maps.parse_pairs(spec)   # syntax only: the layer counts are checked with the models
    elif isinstance(spec, str) and spec.strip()[:1] not in "([{" and spec not in layer_maps.NAMES:
        raise _bad("objective.layer_map", spec, f"is not a known map; expected one of "
                   f"{layer_maps.NAMES} or student:teacher pairs such as 0:0,1:2,2:3,3:5,4:6")


# --------------------------------------------------------------------------- paths

# Objectives that distil the teacher's logits: the teacher needs a fine-tuned classifier.
_LOGIT_OBJECTIVES = ("tinybert_pred", "kd", "pkd")


def looks_local(p: str) -> bool:
    """A path or a URL (gs://..., whose '//' counts), not a Hugging Face hub name ('org/name'
    or 'name')."""
    return p.startswith((".", "/", "~")) or p.count("/") > 1 or os.path.exists(p)


def _run_without_export(export_dir: str, makes: str) -> Optional[str]:
    """Why `export_dir`, a missing `<workdir>/export`, is not there yet, and what to run: the
    recipe run out of order, or a stage stopped before it finished. None if the path is not a
    run's export folder. makes: what to run, with `{run}` for the workdir."""
    path = (export_dir.rstrip("/") if fs.is_remote(export_dir)
            else os.path.normpath(os.path.expanduser(export_dir)))
    if os.path.basename(path) != "export":
        return None
    run = os.path.dirname(export_dir.rstrip("/")) or "."
    if not fs.isdir(os.path.dirname(path)):
        return (f"nothing has run in {run} yet, and a stage writes its model to <workdir>/export "
                f"when it finishes: run {makes.format(run=run)} first")
    if fs.exists(fs.join(os.path.dirname(path), "summary.json")):
        return (f"the run in {run} finished without an export (export.enabled=False): rerun its "
                f"command with --config.export.enabled=True to write it")
    ckpts = fs.join(os.path.dirname(path), "checkpoints")
    steps = sorted(int(d) for d in (fs.listdir(ckpts) if fs.isdir(ckpts) else [])
                   if d.isdigit())
    if fs.is_remote(ckpts):   # orbax writes a step in place there, committed by this marker
        steps = [s for s in steps if fs.exists(fs.join(ckpts, str(s), "commit_success.txt"))]
    saved = f" (last checkpoint: step {steps[-1]})" if steps else ""
    return (f"the run in {run} has not finished{saved}, and a stage writes its model to "
            f"<workdir>/export when it finishes: rerun that run's command to resume and finish it")


def missing_model_files(folder: str, tokenizer: bool = True) -> List[str]:
    """What the model folder `folder` lacks for a stage to load it, as words for a message:
    config.json, the weights (any of hf.WEIGHT_FILES) and, if `tokenizer`, vocab.txt or
    tokenizer.json. Empty when nothing is missing. `folder` may be a URL (gs://...)."""
    missing = [] if fs.exists(fs.join(folder, "config.json")) else ["config.json"]
    if not any(fs.exists(fs.join(folder, w)) for w in WEIGHT_FILES):
        missing.append(" or ".join(WEIGHT_FILES))
    if tokenizer and not any(fs.exists(fs.join(folder, t))
                             for t in ("vocab.txt", "tokenizer.json")):
        missing.append("tokenizer (vocab.txt or tokenizer.json)")
    return missing


def _model_folder(field: str, p: str, example: str,
                  makes: str = "the stage with --workdir={run}") -> Optional[str]:
    """The local folder `p` after checking it holds a model (a hub name is downloaded, a
    folder in a bucket copied to a local folder).
    makes: the command whose export a missing `<workdir>/export` is, `{run}` its workdir."""
    remote = fs.is_remote(p)
    if not looks_local(p):
        try:
            return resolve_path(p)
        except PathError as e:
            raise PathError(f"config.{field}={e}") from e
    if remote:
        try:
            fs.check_reachable(p)
        except fs.RemoteFSError as e:
            raise PathError(f"config.{field}={p!r}: {e}") from e
    q = p.rstrip("/") if remote else os.path.expanduser(p)
    if not fs.isdir(q):
        what = "is a file, not a folder" if fs.exists(q) else \
            ("no such folder in the bucket" if remote
             else f"no such folder (relative to {os.getcwd()})")
        why = None if fs.exists(q) else _run_without_export(p, makes)
        if why:
            raise PathError(f"config.{field}={p!r}: {what}: {why}")
        raise PathError(f"config.{field}={p!r}: {what}; pass a model folder holding config.json "
                        f"and model.safetensors, e.g. --config.{field}={example}")
    missing = missing_model_files(q, tokenizer=field == "teacher.path")
    if missing and fs.isdir(fs.join(q, "export")):
        export = os.path.join(p.rstrip("/"), "export")
        raise PathError(f"config.{field}={p!r} is a run's workdir, not a model folder: its model "
                        f"is in {export}; pass --config.{field}={export}")
    if missing and fs.isdir(fs.join(q, "checkpoints")):
        why = _run_without_export(os.path.join(p.rstrip("/"), "export"), makes)
        raise PathError(f"config.{field}={p!r} is a run's workdir, not a model folder: {why}; "
                        f"then pass --config.{field}={os.path.join(p.rstrip('/'), 'export')}")
    if missing:
        raise PathError(f"config.{field}={p!r}: the folder has no {' and no '.join(missing)}; "
                        f"pass a model folder (a run's <workdir>/export), e.g. "
                        f"--config.{field}={example}")
    if remote:   # the checks below and the stage read the local copy (fetched once)
        try:
            return resolve_path(p)
        except PathError as e:
            raise PathError(f"config.{field}={e}") from e
    return q


def _has_classifier(folder: str, head: str = "sequence") -> Optional[bool]:
    """Whether the weights in `folder` hold a trained head of this kind (sequence, span,
    token: model/heads.py; None: cannot tell cheaply)."""
    try:
        with open(os.path.join(folder, "config.json")) as fh:
            arch = json.load(fh).get("architectures") or []
    except (OSError, ValueError):
        arch = []
    if arch and heads.from_architectures(arch) != head:
        return False
    st = os.path.join(folder, "model.safetensors")
    if os.path.exists(st):
        try:
            from safetensors import safe_open

            with safe_open(st, "np") as f:
                return any(k.startswith(heads.NAMES[head][1] + ".") for k in f.keys())
        except Exception:   # damaged: load_pretrained names the file
            return None
    return any(head != "sequence" or "SequenceClassification" in a for a in arch) if arch else None


def _max_positions(folder: str) -> Optional[int]:
    try:
        with open(os.path.join(folder, "config.json")) as fh:
            d = json.load(fh)
        roberta = d.get("model_type") in ("roberta", "xlm-roberta")   # positions past the pad
        return int(d.get("max_position_embeddings")) - (int(d.get("pad_token_id", 1)) + 1) * roberta
    except (OSError, ValueError, TypeError):
        return None


def check_paths(config) -> None:
    """Every path the config names exists and holds what the stage reads (PathError naming
    the field and a value that works), and the teacher of a logit-distilling stage has a
    fine-tuned classifier. Hub names are left to the download."""
    task = config.data.task if config.data.kind != "corpus" else "sst2"
    tdir = None
    if config.teacher.path != config_base.PACKAGED_TEACHER:
        tdir = _model_folder("teacher.path", str(config.teacher.path),
                             f"runs/{task}/teacher/export",
                             f"jax-tinybert --config=configs/finetune_teacher.py:{task} "
                             "--workdir={run}")
    if tdir is not None and config.objective.name in _LOGIT_OBJECTIVES and not (
            config.objective.name == "tinybert_pred"
            and config.objective.regression_target == "gold"):
        position = position_tasks.get(task)
        if _has_classifier(tdir, position.head if position else "sequence") is False:
            raise UserError(
                f"config.teacher.path={config.teacher.path!r} has no fine-tuned classifier head, "
                f"and objective {config.objective.name!r} distils the teacher's predictions; "
                f"fine-tune it first (jax-tinybert --config=configs/finetune_teacher.py:{task} "
                f"--workdir=runs/{task}/teacher) and pass its export: "
                f"--config.teacher.path=runs/{task}/teacher/export")
    if config.teacher.path == config_base.PACKAGED_TEACHER and \
            config.objective.name in _LOGIT_OBJECTIVES:
        raise UserError(
            f"config.teacher.path='packaged' is the pre-trained MiniLM with no fine-tuned "
            f"classifier head, and objective {config.objective.name!r} distils the teacher's "
            f"predictions; fine-tune it first (jax-tinybert --config=configs/finetune_teacher.py:"
            f"{task} --workdir=runs/{task}/teacher) and pass its export: "
            f"--config.teacher.path=runs/{task}/teacher/export")
    sdir = None
    if config.student.init == "pretrained" and config.student.path and \
            config.student.path != config_base.PACKAGED_TEACHER:
        sdir = _model_folder("student.path", str(config.student.path), "runs/general/export",
                             "the stage that trains the student with --workdir={run} "
                             "(configs/general_distill.py, or configs/task_distill.py:"
                             f"{task}_intermediate before the prediction stage)")
        vocab_match.check_student(tdir or vocab_match.packaged_dir(config.teacher.path), sdir)
    for folder in (tdir, sdir):
        n = _max_positions(folder) if folder else None
        length = config.data.seq_len if config.data.kind == "corpus" else config.data.max_len
        field = "data.seq_len" if config.data.kind == "corpus" else "data.max_len"
        if n is not None and length > n:
            raise _bad(field, length, f"is longer than the model's {n} positions (max_position_"
                       f"embeddings, {os.path.join(folder, 'config.json')})", example=min(n, 512))
    dc = config.data
    position = position_tasks.get(dc.task) if dc.kind == "glue" else None
    if position and dc.source == "tsv":
        position_tasks.check_files(position, dc.data_dir, dc.train_file)
    elif dc.kind == "glue" and dc.source == "tsv":
        glue.check_files(glue.get_task(dc.task), dc.glue_dir, dc.train_file)
    if dc.kind == "corpus":
        files = [p for p in str(dc.corpus).split(",") if p]
        if not files:
            raise PathError("config.data.kind='corpus' needs config.data.corpus: text files or "
                            "folders, e.g. --config.data.corpus=../shared/data/corpus")
        for p in files:
            if "://" not in p and not os.path.exists(os.path.expanduser(p)):
                raise PathError(f"config.data.corpus: {p!r}: no such file or folder (relative to "
                                f"{os.getcwd()}); pass text files, folders of .txt files or a "
                                "folder written by python -m jax_tinybert.data.prepare")


# --------------------------------------------------------------------------- workdir ownership

def _real(p: str) -> str:
    return os.path.realpath(os.path.expanduser(p)) if p and "://" not in p else p


def resolved_fields(config) -> Dict[str, Any]:
    """The fields that decide the trained model, with paths resolved to the folders they name
    (relative paths, $GLUE_DIR and symlinks give the same value for the same data) and the
    fields that the data kind does not read left out."""
    flat = _flat(config)
    out = {k: v for k, v in flat.items()
           if k not in NO_RESULT_CHANGE and k not in SCHEDULE_FIELDS}
    kind = flat.get("data.kind")
    if kind == "glue":
        out["data.glue_dir"] = _real(flat.get("data.glue_dir") or os.environ.get("GLUE_DIR", ""))
    else:
        for k in ("data.glue_dir", "data.train_file", "data.source", "data.skip_bad_rows"):
            out.pop(k, None)
    if kind != "corpus":
        for k in ("data.corpus", "data.corpus_mode", "data.seq_len"):
            out.pop(k, None)
    else:
        out["data.corpus"] = ",".join(_real(p) for p in str(flat["data.corpus"]).split(",") if p)
        out.pop("data.task", None)
    if kind != "synthetic":
        for k in ("data.synthetic_train", "data.synthetic_eval"):
            out.pop(k, None)
    for k in ("teacher.path", "student.path", "data.train_file"):
        v = out.get(k)
        if v and v != config_base.PACKAGED_TEACHER and os.path.exists(os.path.expanduser(v)):
            out[k] = _real(v)
    return out


def config_fingerprint(config) -> Tuple[str, Dict[str, Any]]:
    """(16-hex-digit hash, fields) of what decides the trained model (`resolved_fields`)."""
    flat = resolved_fields(config)
    blob = json.dumps(flat, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16], flat


def owned_by_a_run(workdir: str) -> bool:
    """A workdir is owned once a run in it has saved a checkpoint (or finished)."""
    for sub in ("checkpoints", "best"):
        d = fs.join(workdir, sub)
        if fs.isdir(d) and any(n.isdigit() for n in fs.listdir(d)):
            return True
    return fs.exists(fs.join(workdir, "summary.json"))


def _latest_step(workdir: str) -> Optional[int]:
    d = fs.join(workdir, "checkpoints")
    steps = [int(n) for n in fs.listdir(d) if n.isdigit()] if fs.isdir(d) else []
    return max(steps) if steps else None


def _show(v) -> str:
    return json.dumps(v, default=str)


def _schedule_warning(config, old_flat: Dict[str, Any], workdir: str) -> Optional[str]:
    changed = [(k, old_flat[k], _flat(config)[k]) for k in SCHEDULE_FIELDS
               if k in old_flat and _show(old_flat[k]) != _show(_flat(config)[k])]
    if not changed:
        return None
    what = ", ".join(f"{k.split('.')[1]} {_show(a)} -> {_show(b)}" for k, a, b in changed)
    last = _latest_step(workdir)
    at = f"step {last + 1}" if last is not None else "the next step"
    if config.optim.schedule == "constant":
        return (f"{what}: extends the run from {at} on; the learning rate is constant, so the "
                "steps already run are unchanged")
    back = " ".join(f"--config.{k}={_show(a)}" for k, a, _ in changed)
    return (f"{what} changes the learning-rate schedule ({config.optim.schedule}, warmup_ratio "
            f"{config.optim.warmup_ratio}) from {at} on: the steps already run followed the old "
            f"schedule, so this run will not equal an unbroken run of the new length; to keep "
            f"the old schedule, rerun with {back}")


def check_workdir(config, workdir: str) -> None:
    """The workdir rule: a workdir owned by a run (one that saved a checkpoint) accepts only
    the same config, up to fields that do not change the result (NO_RESULT_CHANGE, paths
    resolving to the same data); num_steps / num_epochs may change with a warning naming the
    schedule change. A workdir where no run saved a checkpoint (e.g. a start that failed on
    missing data) is free. Records the config in workdir/config.json (process 0)."""
    fp, resolved = config_fingerprint(config)
    path = fs.join(workdir, CONFIG_RECORD)
    if fs.exists(path) and owned_by_a_run(workdir):
        with fs.open_file(path) as fh:
            old = json.load(fh)
        old_resolved = old.get("resolved") or old.get("config", {})
        # A record of an older version may hold fields that no longer decide the result.
        old_resolved = {k: v for k, v in old_resolved.items() if k not in NO_RESULT_CHANGE
                        and k not in SCHEDULE_FIELDS}
        if old.get("fingerprint") != fp:
            # A field the record lacks (added since it was written) had its default then; an
            # objective field's default is the named objective's own (base_config says None).
            defaults = {**resolved_fields(config_base.base_config()),
                        **{f"objective.{k}": v for k, v in
                           objectives.DEFAULTS.get(config.objective.name, {}).items()}}
            diff = sorted(
                k for k in set(resolved) | set(old_resolved)
                if _show(resolved.get(k, defaults.get(k))) !=
                _show(old_resolved.get(k, defaults.get(k))))
            if diff:
                shown = "; ".join(f"{k}: {_show(old_resolved.get(k, defaults.get(k)))} -> "
                                  f"{_show(resolved.get(k, defaults.get(k)))}" for k in diff[:6])
                raise ConfigValueError(
                    f"workdir {workdir} holds a run of a different config ({shown}"
                    + (f"; {len(diff) - 6} more" if len(diff) > 6 else "") + "); rerun with the "
                    f"run's values (recorded in {path}), use a new --workdir, or delete {workdir} "
                    "to start over")
        warning = _schedule_warning(config, old.get("config", {}), workdir)
        if warning and jax.process_index() == 0:
            log.warning("%s", warning)
    if jax.process_index() == 0:
        fs.makedirs(workdir)
        fs.write_json_atomic(path, {"version": 2, "fingerprint": fp, "config": _flat(config),
                                    "resolved": resolved}, indent=1, default=str)


def record_speed(workdir: str, values: Dict[str, Any]) -> None:
    """Adds the run's concrete speed settings (speed.resolve) to workdir/config.json, which
    `check_workdir` wrote: what auto became on this backend, for the reader of a run."""
    path = fs.join(workdir, CONFIG_RECORD)
    if jax.process_index() != 0 or not fs.exists(path):
        return
    with fs.open_file(path) as fh:
        record = json.load(fh)
    if record.get("speed") != values:
        fs.write_json_atomic(path, dict(record, speed=values), indent=1, default=str)
