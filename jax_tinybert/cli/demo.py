"""Multi-stage runs: the demo (teacher fine-tune -> general distil -> task distil -> table).

Each stage is an ordinary `train_and_evaluate` call with its own sub-workdir, so each stage
resumes on its own and a finished stage is skipped on rerun (its summary.json exists). The
workdir may be local or in a bucket (gs://): every path goes through jax_tinybert.fs, a later
stage reads an earlier one's export from there (hf.resolve_path copies a folder in a bucket to
a local one once per process), and on several processes process 0 decides which stages are
done, so that all of them skip the same ones.
"""
from __future__ import annotations

import json
import time
from typing import Dict, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jax_tinybert import fs
from jax_tinybert.config import schema as config_base
from jax_tinybert.parallel.coordination import Coordinator
from jax_tinybert.train import loop as train, workdir_lock
from jax_tinybert.data import synthetic
from jax_tinybert.model.hf import load_pretrained
from jax_tinybert.model.modeling import BertForSequenceClassification


# One for the module: keys are numbered per instance, so a second instance under the same name
# would reuse the first one's keys (and could read its stale values).
_COORD = Coordinator("demo")


def apply_overrides(c: ml_collections.ConfigDict, overrides: Dict[str, object]):
    """Sets {"section.field": value} (and "stage") on c in place; None values are skipped."""
    for key, v in overrides.items():
        if v is None:
            continue
        if key == "stage":
            c.stage = v
            continue
        sec, field = key.split(".", 1)
        c[sec][field] = v
    return c


def _stage(base: ml_collections.ConfigDict, overrides: Dict[str, object]) -> ml_collections.ConfigDict:
    c = config_base.base_config()
    for sec in ("data", "train", "mesh", "student", "teacher"):
        c[sec].update(base[sec].to_dict())
    return apply_overrides(c, overrides)


def run_stage(cfg, workdir: str, coord: Optional[Coordinator] = None) -> dict:
    """train_and_evaluate, skipped when workdir (local or gs://) already holds a finished run
    (summary.json). Process 0 looks, and every process takes its answer (`coord`), so that
    all of them train the same stages (a process that skipped one alone would wait forever at
    the other processes' first collective)."""
    coord = coord or _COORD
    done = fs.join(workdir, "summary.json")
    text = ""
    if jax.process_index() == 0 and fs.exists(done):
        with fs.open_file(done) as fh:
            text = fh.read()
    text = coord.from_process_0(text, "summary")
    name = workdir.rstrip("/").rsplit("/", 1)[-1]
    if text:
        if jax.process_index() == 0:
            print(f"[{name}] already done in {workdir} (delete it to rerun)", flush=True)
        return json.loads(text)
    if jax.process_index() == 0:
        print(f"\n##### stage {workdir}", flush=True)
    return train.train_and_evaluate(cfg, workdir)


def synthetic_corpus(workdir: str, coord: Coordinator) -> str:
    """<workdir>/corpus/synthetic.txt (local or gs://), written once: the unlabelled text of
    general distillation when config.data.corpus is empty. Rewritten by no rerun (its
    modification time is part of the prepared cache's stat hints). In a bucket process 0
    writes it and the others wait; a local workdir may be a different disk on each host, so
    there each process writes its own where it is missing (same seed, same text)."""
    path = fs.join(workdir, "corpus", "synthetic.txt")
    writer = jax.process_index() == 0 or not fs.is_remote(workdir)
    if writer and not fs.exists(path):
        synthetic.write_corpus(path)
    coord.barrier("corpus")
    return path


def inference_ms(model_dir: str, batch: int = 32, seq_len: int = 64, repeats: int = 10) -> float:
    """Median ms of a jitted forward of an exported classifier at [batch, seq_len]."""
    cfg, params = load_pretrained(model_dir, for_classification=True)
    # Host numpy params would be copied to the device on every call: time the forward only.
    params = jax.device_put(params)
    model = BertForSequenceClassification(cfg)
    # The forward the dev evaluation runs: logits only, so the last layer's [CLS] row only.
    f = jax.jit(lambda p, x: model.apply({"params": p}, x, attention_logits=False,
                                         cls_only=True).logits)
    x = jnp.ones((batch, seq_len), jnp.int32)
    f(params, x).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f(params, x).block_until_ready()
        times.append(time.perf_counter() - t)
    return 1000 * float(np.median(times))


def run_demo(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Runs the four stages of configs/demo.py and prints the results table. A second demo in
    the same workdir while one runs stops at once (workdir_lock.WorkdirBusy)."""
    with workdir_lock.hold(workdir):
        return _run_demo(config, workdir)


def _run_demo(config: ml_collections.ConfigDict, workdir: str) -> dict:
    steps, lr = config.demo_steps, config.demo_lr
    corpus_kind = "corpus"
    coord = _COORD
    corpus = config.data.corpus or synthetic_corpus(workdir, coord)
    d = lambda name: fs.join(workdir, name)
    t0 = time.time()
    teacher = run_stage(_stage(config, {
        "stage": "finetune_teacher", "objective.name": "finetune", "student.init": "pretrained",
        "student.path": config.teacher.path, "teacher.path": config.teacher.path,
        "teacher.cache": False, "optim.learning_rate": lr["teacher"],
        "train.num_steps": steps["teacher"], "train.eval_every": steps["teacher"] // 2}),
        d("teacher"), coord)
    run_stage(_stage(config, {
        "stage": "general_distill", "objective.name": "tinybert_intermediate",
        "teacher.path": config.teacher.path, "data.kind": corpus_kind, "data.corpus": corpus,
        "data.seq_len": config.data.max_len, "optim.learning_rate": lr["general"],
        "train.num_steps": steps["general"]}), d("general"), coord)
    run_stage(_stage(config, {
        "stage": "task_distill", "objective.name": "tinybert_intermediate",
        "teacher.path": d("teacher/export"), "student.init": "pretrained",
        "student.path": d("general/export"), "optim.learning_rate": lr["intermediate"],
        "optim.schedule": "constant", "optim.warmup_ratio": 0.0,
        "train.num_steps": steps["intermediate"]}), d("intermediate"), coord)
    pred = run_stage(_stage(config, {
        "stage": "task_distill", "objective.name": "tinybert_pred",
        "teacher.path": d("teacher/export"), "student.init": "pretrained",
        "student.path": d("intermediate/export"), "optim.learning_rate": lr["pred"],
        "train.num_steps": steps["pred"], "train.eval_every": steps["pred"] // 2}),
        d("pred"), coord)
    if jax.process_index() != 0:
        return {}
    t_ms = inference_ms(d("teacher/export"), seq_len=config.data.max_len)
    s_ms = inference_ms(d("pred/export"), seq_len=config.data.max_len)
    tm, sm = teacher["best"], pred["best"]
    metric = [k for k in tm if k not in ("step", "main")][0]
    rows = [("teacher (MiniLM-L6-H384, fine-tuned)", tm[metric], teacher["student_params"], t_ms),
            (f"student ({config.student.num_hidden_layers}L-H{config.student.hidden_size}, "
             "TinyBERT KD)", sm[metric], pred["student_params"], s_ms)]
    data_name = ("synthetic SST-2-style sentiment (generated)" if config.data.kind == "synthetic"
                 else "GLUE SST-2")
    print(f"\n=== jax-tinybert demo: {data_name}, dev {metric}; inference = jitted forward, "
          f"batch 32 x {config.data.max_len} tokens on {jax.devices()[0].platform} ===")
    print(f"{'model':<42}{metric:>10}{'params':>14}{'inference ms':>15}")
    for name, m, n, ms in rows:
        print(f"{name:<42}{m:>10.4f}{n:>14,}{ms:>15.1f}")
    print(f"student keeps {100 * sm[metric] / tm[metric]:.1f}% of the teacher's {metric} with "
          f"{teacher['student_params'] / pred['student_params']:.1f}x fewer parameters and runs "
          f"{t_ms / s_ms:.1f}x faster; total wall time {time.time() - t0:.0f}s")
    print(f"exports: {d('teacher/export')}  {d('pred/export')}")
    summary = {"teacher": tm, "student": sm, "teacher_params": teacher["student_params"],
               "student_params": pred["student_params"], "teacher_ms": t_ms, "student_ms": s_ms}
    fs.write_json_atomic(d("results.json"), summary, indent=1, default=float)
    return summary
