"""Multi-stage runs: the demo (teacher fine-tune -> general distil -> task distil -> table).

Each stage is an ordinary `train_and_evaluate` call with its own sub-workdir, so each stage
resumes on its own and a finished stage is skipped on rerun (its summary.json exists).
"""
from __future__ import annotations

import json
import os
import time
from typing import Dict

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jax_tinybert.config import schema as config_base
from jax_tinybert.train import loop as train, workdir_lock
from jax_tinybert.data import synthetic
from jax_tinybert.model.hf import load_pretrained
from jax_tinybert.model.modeling import BertForSequenceClassification


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


def run_stage(cfg, workdir: str) -> dict:
    """train_and_evaluate, skipped when workdir already holds a finished run (summary.json)."""
    done = os.path.join(workdir, "summary.json")
    if os.path.exists(done):
        with open(done) as fh:
            print(f"[{os.path.basename(workdir)}] already done in {workdir} (delete it to rerun)",
                  flush=True)
            return json.load(fh)
    print(f"\n##### stage {workdir}", flush=True)
    return train.train_and_evaluate(cfg, workdir)





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
    corpus = config.data.corpus
    if not corpus:
        corpus = synthetic.write_corpus(os.path.join(workdir, "corpus", "synthetic.txt"))
    d = lambda name: os.path.join(workdir, name)
    t0 = time.time()
    teacher = run_stage(_stage(config, {
        "stage": "finetune_teacher", "objective.name": "finetune", "student.init": "pretrained",
        "student.path": config.teacher.path, "teacher.path": config.teacher.path,
        "teacher.cache": False, "optim.learning_rate": lr["teacher"],
        "train.num_steps": steps["teacher"], "train.eval_every": steps["teacher"] // 2}),
        d("teacher"))
    run_stage(_stage(config, {
        "stage": "general_distill", "objective.name": "tinybert_intermediate",
        "teacher.path": config.teacher.path, "data.kind": corpus_kind, "data.corpus": corpus,
        "data.seq_len": config.data.max_len, "optim.learning_rate": lr["general"],
        "train.num_steps": steps["general"]}), d("general"))
    run_stage(_stage(config, {
        "stage": "task_distill", "objective.name": "tinybert_intermediate",
        "teacher.path": d("teacher/export"), "student.init": "pretrained",
        "student.path": d("general/export"), "optim.learning_rate": lr["intermediate"],
        "optim.schedule": "constant", "optim.warmup_ratio": 0.0,
        "train.num_steps": steps["intermediate"]}), d("intermediate"))
    pred = run_stage(_stage(config, {
        "stage": "task_distill", "objective.name": "tinybert_pred",
        "teacher.path": d("teacher/export"), "student.init": "pretrained",
        "student.path": d("intermediate/export"), "optim.learning_rate": lr["pred"],
        "train.num_steps": steps["pred"], "train.eval_every": steps["pred"] // 2}), d("pred"))
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
    with open(d("results.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
    return summary
