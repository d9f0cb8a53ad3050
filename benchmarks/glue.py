#!/usr/bin/env python
"""GLUE end to end: teacher fine-tune -> general distillation -> task distillation, with the
plain-KD and PKD baselines on the same student, and measured inference speed.

Per task (SST-2, MRPC, STS-B by default), each stage an ordinary `train_and_evaluate` call in
its own sub-workdir (finished stages are skipped on rerun: their summary.json exists):

    <workdir>/general                    general distillation of the student (shared by the tasks)
    <workdir>/<task>/teacher             fine-tune the teacher (configs/finetune_teacher.py; --teacher,
                                         default the packaged MiniLM-L6)
    <workdir>/<task>/inter, pred         TinyBERT task distillation without augmentation
    <workdir>/<task>/inter_da, pred_da   the same on augmented data (needs --mlm, see below)
    <workdir>/<task>/kd                  plain KD (objective kd) from the general student
    <workdir>/<task>/pkd                 PKD-Skip, student = the teacher's layers 1..3 (configs/pkd.py)

The student is the "small" shape of configs/general_distill.py (3 layers, d 384, d_ff 1536,
12 heads): PKD initialises the student from 3 of the teacher's 6 layers, so this is the shape
on which all three methods compare, and 3 divides the teacher's 6 layers (uniform map).
`--teacher bert-base-uncased --student tinybert4` (online) is the paper's pairing; `--teacher DIR
--student tiny` with a small random BERT checks the wiring in about a minute
(tests/test_benchmarks_e2e.py).

Data augmentation needs a masked LM (jax_tinybert/data/augment.py: MLM top-K for one-piece words,
embedding neighbours only for multi-piece words; there is no MLM-free mode). The packaged MiniLM has
no MLM head, so offline the "with DA" rows are skipped with a note. `--mlm PATH` (an HF BERT
with cls.predictions.*, e.g. bert-base-uncased when online) runs them; `--mlm random-tiny` uses
a small random MLM on the teacher's vocabulary: a wiring check only, its augmentations are noise.

    .venv/bin/python benchmarks/glue.py --budget small                 # smoke, ~2 min (3 tasks)
    .venv/bin/python benchmarks/glue.py --budget hour --out glue.md    # ~1 h on 2 CPU cores
    .venv/bin/python benchmarks/glue.py --budget full --mlm bert-base-uncased   # accelerators

Writes a markdown table to stdout and to --out (and results.json in the workdir).

`--budget cpu --tasks TASK[,TASK...] [--glue_dir DIR] --workdir W`: the FULL train and dev sets of
any of the nine GLUE tasks (DIR/<TaskFolder>/{train,dev}.tsv), sized for about an hour per task on
2 CPU cores: every stage sees ~67k examples (one SST-2 epoch; small tasks up to 5 teacher / 4
student epochs, large tasks a fraction of an epoch). Rows: teacher (packaged MiniLM-L6 fine-tuned;
--teacher another, whose size scales the time),
tinybert (intermediate + prediction distillation), tinybert+da (each stage one epoch of the
augmented set, N augmented sentences per text column sized so that epoch is about the no-DA
stage's examples, i.e. about equal compute; embedding-neighbour DA from the teacher's word
embeddings, or MLM DA with --mlm, e.g. the export of configs/mlm_head.py), pkd, kd, labels-only (the same student on gold labels) and majority. With
`--rows` (`--rows teacher,tinybert+da`: the DA stages without the plain ones) also minilm,
minilmv2 (the intermediate stage with MiniLM's / MiniLMv2's relations of the teacher's last
layer instead of TinyBERT's losses, then the same prediction stage) and
minilmv2-6heads (the same student split into 6 heads, which only MiniLMv2 can distil). Every
student is 3 layers, d 384, initialised from the fine-tuned teacher's layers 2, 4, 6 (--init_layers;
the intermediate stage maps student layer m to teacher layer 2m); of another teacher, 3 of its
layers at its width, by default those the uniform map pairs them with. W/results.json is
a list of {"task", "model", "dev", "metric", "export", "params", "wall_s"} (rewritten after each
task), W/stages.json the per-stage summaries.

    .venv/bin/python benchmarks/glue.py --budget cpu --tasks sst2 --workdir /tmp/glue_cpu

`--budget cpu --tasks squad11|squad20|conll2003 [--data_dir DIR]`: the same rows (tinybert+da only
when --rows names it: SQuAD's questions augmented, CoNLL's words tagged O; majority only on v2.0:
the null answer everywhere) on SQuAD v1.1 / v2.0 or CoNLL-2003 NER, DIR
holding train.json + dev.json or train.txt + dev.txt (default ../shared/data/squad/v1.1,
squad/v2.0, conll2003); dev = the official F1 (SQuAD v1.1 f1, v2.0 best_f1, in percent; CoNLL
entity F1 in [0, 1]).

`--budget small` is bounded by fixed per-stage costs (model load, XLA compiles, checkpoint,
export: ~8 s a stage on 2 idle-ish cores), not by its 3 steps: 16 stages for the three tasks
took 2 min 11 s here (load ~1.5); with `--tasks sst2` (tests/test_benchmarks_e2e.py) ~1 min.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import importlib.util
import json
import os
import platform
import sys
import time
from typing import Dict, List, Optional, Tuple

_HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(_HERE)
sys.path.insert(0, REPO)

TASKS = ("sst2", "mrpc", "stsb")
ALL_GLUE = ("cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte", "wnli")
STUDENT = "small"  # default --student: configs/general_distill.py's 3 layers, d 384, d_ff 1536

# Per budget: subsets (0 = all), steps per stage (0 = the config's epochs), batch sizes, lengths
# and learning rates (None = the config's own). "full" = the official recipes of configs/*.py.
BUDGETS: Dict[str, dict] = {
    "small": dict(
        train_subset=48, eval_subset=48, batch=8, eval_batch=16, max_len=32, pair_max_len=32,
        corpus_files=("gutenberg_pg1656_plato_apology_jowett.txt",), corpus_subset=64,
        general_batch=8, general_seq_len=32,
        steps=dict(teacher=3, general=3, inter=3, pred=3, kd=3, pkd=3),
        lr=dict(teacher=5e-5, general=5e-4, inter=2e-4, pred=2e-4, kd=1e-4, pkd=5e-5),
        evals_per_stage=1, repeats=2, da_N=2, da_K=4),
    "hour": dict(
        train_subset={"sst2": 3000, "mrpc": 2000, "stsb": 2000}, eval_subset={"stsb": 800},
        batch=32, eval_batch=64, max_len=64, pair_max_len=128,
        corpus_files=(), corpus_subset=0, general_batch=32, general_seq_len=64,
        steps=dict(teacher={"sst2": 200, "mrpc": 150, "stsb": 150}, general=400,
                   inter={"sst2": 150, "mrpc": 100, "stsb": 100},
                   pred={"sst2": 150, "mrpc": 120, "stsb": 120},
                   kd={"sst2": 150, "mrpc": 120, "stsb": 120},
                   pkd={"sst2": 150, "mrpc": 120, "stsb": 120}),
        lr=dict(teacher=5e-5, general=5e-4, inter=2e-4, pred=2e-4, kd=2e-4, pkd=5e-5),
        evals_per_stage=1, repeats=10, da_N=4, da_K=15),
    # "cpu": full train/dev sets, sized per task (see CPU below); its own code path.
    "cpu": dict(train_subset=0, eval_subset=0, steps={}),
    "full": dict(
        train_subset=0, eval_subset=0, batch=None, eval_batch=None, max_len=None,
        pair_max_len=None, corpus_files=(), corpus_subset=0, general_batch=None,
        general_seq_len=None, steps=dict(teacher=0, general=0, inter=0, pred=0, kd=0, pkd=0),
        lr=dict(teacher=None, general=None, inter=None, pred=None, kd=None, pkd=None),
        evals_per_stage=0, repeats=20, da_N=20, da_K=15),
}
PAIR_TASKS = {"mrpc", "stsb"}


def _per_task(v, task):
    return v.get(task, 0) if isinstance(v, dict) else v


def _load_config(name: str, arg: str):
    path = os.path.join(REPO, "configs", name + ".py")
    spec = importlib.util.spec_from_file_location(f"_jtb_cfg_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config(arg)


# The demo's stage runner (skip finished stages, apply overrides); imported lazily so JAX starts
# only after this script has set its environment.
def _set(c, overrides: Dict[str, object]):
    from jax_tinybert.cli.demo import apply_overrides

    return apply_overrides(c, overrides)


def _run(cfg, workdir: str) -> dict:
    from jax_tinybert.cli.demo import run_stage

    return run_stage(cfg, workdir)


# --------------------------------------------------------------------------- augmentation

def _write_subset_tsv(glue_dir: str, task: str, n: int, seed: int, out_path: str) -> str:
    """The training rows the un-augmented stages see (same seeded choice as build.subset),
    as a TSV, so that augmentation costs scale with the subset, not the whole train set."""
    from jax_tinybert.data import glue
    from jax_tinybert.data.tokenize import subset_indices
    from jax_tinybert.fs import atomic_open

    spec = glue.get_task(task)
    with open(glue.tsv_path(glue_dir, spec, "train"), encoding="utf-8-sig", newline="") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    header = [rows.pop(0)] if spec.has_header else []
    idx = subset_indices(len(rows), n, seed)
    if idx is not None:
        rows = [rows[i] for i in idx]
    with atomic_open(out_path, "w", encoding="utf-8", newline="") as f:
        for r in header + rows:
            f.write("\t".join(r) + "\n")
    return out_path


def _augmenter(mlm: str, tokenizer_dir: str, N: int, K: int, max_len: int):
    import jax

    from jax_tinybert.data import augment, tokenize
    from jax_tinybert.model.hf import load_pretrained
    from jax_tinybert.model.modeling import BertConfig, BertForMaskedLM, init_params

    tok = tokenize.load_tokenizer(tokenizer_dir if mlm == "random-tiny" else mlm)
    if mlm == "random-tiny":
        cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=1,
                         num_attention_heads=2, intermediate_size=64, max_position_embeddings=512)
        model = BertForMaskedLM(cfg)
        params = init_params(model, jax.random.PRNGKey(0))
    else:
        cfg, params = load_pretrained(mlm, mlm_head=True)
        model = BertForMaskedLM(cfg)
    return augment.Augmenter(tok, model, params, N=N, K=K, p=0.4, seed=42, max_seq_len=max_len,
                             batch_size=64, buckets=(32, 64, 128))


def augmented_train_file(args, task: str, b: dict, tdir: str, tokenizer_dir: str) -> dict:
    """<tdir>/data/train_aug.tsv from the (subset) train rows; returns info for the table."""
    from jax_tinybert.data import glue

    out = os.path.join(tdir, "data", "train_aug.tsv")
    info_path = out + ".json"
    if os.path.exists(info_path):
        with open(info_path) as fh:
            return json.load(fh)
    t0 = time.time()
    sub = _write_subset_tsv(args.glue_dir, task, _per_task(b["train_subset"], task), 0,
                            os.path.join(tdir, "data", "train.tsv"))
    max_len = b["pair_max_len" if task in PAIR_TASKS else "max_len"] or 128
    aug = _augmenter(args.mlm, tokenizer_dir, b["da_N"], b["da_K"], max(max_len, 32))
    stats = aug.augment_tsv(glue.get_task(task), sub, out)
    info = {"path": out, **stats, "wall_s": time.time() - t0, "mlm": args.mlm,
            "N": b["da_N"], "K": b["da_K"]}
    with open(info_path, "w") as fh:
        json.dump(info, fh)
    return info


# --------------------------------------------------------------------------- stages

def _dtype_overrides(args) -> dict:
    """Every model of every stage (teacher and student) computes in --dtype, named on every
    command line (the configs' "auto" is bfloat16 on a GPU). On a CPU, bfloat16 means bf16
    products with float32 activations (build.compute_dtypes)."""
    return {"student.dtype": args.dtype, "teacher.dtype": args.dtype}


def common_overrides(args, b: dict, task: Optional[str], kind: str) -> dict:
    o = {"data.glue_dir": args.glue_dir, "data.cache_dir": os.path.join(args.workdir, "cache"),
         "train.log_every": 25 if args.budget != "small" else 1, **_dtype_overrides(args)}
    if task is not None:
        o.update({"data.train_subset": _per_task(b["train_subset"], task),
                  "data.eval_subset": _per_task(b["eval_subset"], task),
                  "train.batch_size": b["batch"], "train.eval_batch_size": b["eval_batch"]})
        ml = b["pair_max_len" if task in PAIR_TASKS else "max_len"]
        if ml:
            o["data.max_len"] = ml
            o["data.buckets"] = tuple(x for x in (32, 64, 128) if x <= ml)
    steps = _per_task(b["steps"][kind], task)
    if steps and args.steps_scale != 1.0:
        steps = max(1, int(round(steps * args.steps_scale)))
    if steps:
        o["train.num_steps"] = steps
        if b["evals_per_stage"]:
            o["train.eval_every"] = max(1, steps // b["evals_per_stage"])
    o["optim.learning_rate"] = b["lr"][kind]
    return o


def run_general(args, b: dict) -> dict:
    c = _load_config("general_distill", args.student)
    corpus = args.corpus
    if b["corpus_files"]:
        corpus = ",".join(os.path.join(args.corpus, f) for f in b["corpus_files"])
    o = common_overrides(args, b, None, "general")
    o.update({"data.corpus": corpus, "data.train_subset": b["corpus_subset"],
              "data.seq_len": b["general_seq_len"], "train.batch_size": b["general_batch"],
              "teacher.path": args.teacher})
    return _run(_set(c, o), os.path.join(args.workdir, "general"))


def run_task(args, b: dict, task: str, general_export: str) -> dict:
    tdir = os.path.join(args.workdir, task)
    teacher_export = os.path.join(tdir, "teacher", "export")
    res: Dict[str, dict] = {}
    c = _set(_load_config("finetune_teacher", task),
             {**common_overrides(args, b, task, "teacher"), "teacher.path": args.teacher})
    res["teacher"] = _run(c, os.path.join(tdir, "teacher"))

    def tinybert(suffix: str, train_file: str = ""):
        c = _load_config("task_distill", f"{task}_intermediate")
        o = {**common_overrides(args, b, task, "inter"), "teacher.path": teacher_export,
             "student.path": general_export}
        if train_file:
            o.update({"data.train_file": train_file, "data.train_subset": 0})
        res["inter" + suffix] = _run(_set(c, o), os.path.join(tdir, "inter" + suffix))
        c = _load_config("task_distill", f"{task}_pred")
        o = {**common_overrides(args, b, task, "pred"), "teacher.path": teacher_export,
             "student.path": os.path.join(tdir, "inter" + suffix, "export")}
        if train_file:
            o.update({"data.train_file": train_file, "data.train_subset": 0})
        res["pred" + suffix] = _run(_set(c, o), os.path.join(tdir, "pred" + suffix))

    tinybert("")
    if args.mlm:
        info = augmented_train_file(args, task, b, tdir, teacher_export)
        res["da_info"] = info
        tinybert("_da", info["path"])

    # Plain KD from the same general-distilled student (configs: task_distill base + kd).
    c = _load_config("task_distill", f"{task}_pred")
    c.stage = "kd"
    c.objective.name = "kd"          # T, alpha, t2: KD's own defaults (objectives.KD)
    o = {**common_overrides(args, b, task, "kd"), "teacher.path": teacher_export,
         "student.path": general_export}
    res["kd"] = _run(_set(c, o), os.path.join(tdir, "kd"))

    # PKD-Skip, student = teacher layers (1, 2, 3) of the fine-tuned teacher.
    c = _load_config("pkd", task)
    o = {**common_overrides(args, b, task, "pkd"), "teacher.path": teacher_export}
    res["pkd"] = _run(_set(c, o), os.path.join(tdir, "pkd"))
    return res


# --------------------------------------------------------------------------- budget cpu

# One SST-2 epoch of examples per stage (67,349): SST-2 gets 1 epoch, small tasks more epochs
# (capped), large tasks (QQP, MNLI, QNLI) a fraction of an epoch of their shuffled full train set.
CPU_EXAMPLES_PER_STAGE = 67_349
CPU = dict(
    batch=32, eval_batch=64, teacher_max_epochs=5.0, student_max_epochs=4.0,
    # All students start from the fine-tuned teacher's layers 2, 4, 6 (3 layers, d 384), the
    # layers the uniform map asks them to imitate: with layers 1-3 the intermediate stage has to
    # move every layer far from its init and TinyBERT ended at 0.688 STS-B corr against 0.816
    # from (2, 4, 6) (benchmarks/RESULTS.md#the-recipes-accuracy-choices). Not general
    # distillation: 400 steps of it gave a student no better than this init, at a cost. Another
    # teacher's students start from the layers the uniform map gives (default_init_layers).
    init_layers=(2, 4, 6),
    lr=dict(teacher=5e-5, inter=5e-5, pred=5e-5, kd=5e-5, pkd=5e-5, labels=5e-5),
    # Per-task overrides of `lr` (measured: MRPC's teacher 0.836 at 1e-4 against 0.827 at 5e-5
    # and 0.791 at 2e-4, 5 epochs; benchmarks/RESULTS.md#the-recipes-accuracy-choices).
    # SQuAD: every stage at 1e-4 (measured on v1.1, 2 student epochs: TinyBERT 54.0 F1 against
    # 44.3 at 5e-5 and 1 epoch; docs/tasks.md).
    task_lr=dict(mrpc=dict(teacher=1e-4),
                 **{t: dict(teacher=1e-4, inter=1e-4, pred=1e-4, kd=1e-4, pkd=1e-4, labels=1e-4)
                    for t in ("squad11", "squad20")}),
    da_K=15, da_p=0.4,
    # The student is as wide as the teacher (384): its hidden states are matched to the
    # teacher's directly, not through a learned fit_dense, so they stay in the teacher's space
    # and the copied pooler + head still fit after the intermediate stage. With 'shared'
    # (the official fit_dense) STS-B's student ended at CLS cosine 0.23 to the teacher, its
    # head output collapsed (std 0.07), and the prediction stage reached 0.545 against 0.813
    # for labels-only (benchmarks/RESULTS.md#the-recipes-accuracy-choices).
    inter_projection="none",
    # The intermediate stage's student -> teacher layer map (a name of layer_maps.NAMES or
    # explicit pairs, --layer_map) and the teacher layers the students start from (--init_layers).
    inter_layer_map="uniform")
CPU_TEACHER_LAYERS = 6   # the packaged all-MiniLM-L6-v2
CPU_STUDENT_LAYERS = 3


def default_init_layers(teacher_layers: int) -> Tuple[int, ...]:
    """The teacher layers (1-based) a 3-layer student starts from: those the uniform map asks
    it to imitate (2, 4, 6 of a 6-layer teacher; 4, 8, 12 of BERT-base)."""
    from jax_tinybert.distill import layer_maps

    return tuple(t for _, t in layer_maps.uniform(CPU_STUDENT_LAYERS, teacher_layers).attention)
STUDENT_STAGES = tuple(s for s in CPU["lr"] if s != "teacher")   # --epochs' stages
# The intermediate stage with MiniLM's objectives instead of TinyBERT's (then the same prediction
# stage): row -> (objective, the student's heads; 0 = the teacher's 12). The 6-head student
# has the same weights split into fewer heads: only MiniLMv2's relations can distil into it.
MINILM_ROWS = {"minilm": ("minilm", 0), "minilmv2": ("minilmv2", 0),
               "minilmv2-6heads": ("minilmv2", 6)}
CPU_ROWS = ("teacher", "tinybert", "tinybert+da", "pkd", "kd", "labels-only", "majority")
CPU_OPTIONAL_ROWS = tuple(MINILM_ROWS)   # run when --rows names them
# The position tasks (docs/tasks.md): their data folder under ../shared/data by default (--data_dir
# overrides), and per stage the epochs of the budget. SQuAD: ~7.4k windows of 384 tokens an epoch
# (a row costs ~8 SST-2 rows), the teacher 2 epochs (run_qa's) and each student stage 2: one epoch
# at 5e-5 left the students undertrained (TinyBERT 72.8% of the teacher, labels-only 28.5%); two at
# 1e-4 took TinyBERT to 88.8%, its prediction stage flat after the first (docs/tasks.md). About
# 2.5 h for SQuAD v1.1 on 2 cores, ~3.5 h for v2.0, whose teacher runs 5 epochs: its split has
# half v1.1's answerable questions, and after 2 it was 2 points above the null answer. The DA
# row (the questions augmented, contexts and answers kept) adds ~50 min: only when --rows names
# it. The majority row on v2.0 only: the null answer everywhere, which scores the share of
# unanswerable dev questions (0 on v1.1, as CoNLL's all-O F1).
# CoNLL: 14k sentences of ~35 pieces, 3 teacher and 2 student epochs (~42k / 28k rows a stage).
POSITION_TASKS = {"squad11": dict(data="squad/v1.1", teacher_epochs=2.0, student_epochs=2.0),
                  "squad20": dict(data="squad/v2.0", teacher_epochs=5.0, student_epochs=2.0),
                  "conll2003": dict(data="conll2003", teacher_epochs=3.0, student_epochs=2.0)}


def _train_rows(args, task: str) -> int:
    from jax_tinybert.data import glue, position_tasks

    if task in POSITION_TASKS:
        n = len(position_tasks.read(position_tasks.get(task), "train",
                                    data_dir=_data_dir(args, task)))
    else:
        n = len(glue.load_examples(task, "train", glue_dir=args.glue_dir))
    return min(n, args.train_subset) if args.train_subset else n


def _data_dir(args, task: str) -> str:
    """A position task's data folder: --data_dir, else ../shared/data/<its folder>."""
    return os.path.abspath(args.data_dir or os.path.join(
        REPO, "..", "shared", "data", POSITION_TASKS[task]["data"]))


def _task_name(task: str) -> str:
    from jax_tinybert.data import glue

    return task if task in POSITION_TASKS else glue.get_task(task).dir_name


def _main_metric(task: str) -> str:
    from jax_tinybert.data import glue, position_tasks

    spec = position_tasks.get(task)
    return spec.main_metric if spec else glue.get_task(task).main_metric


def cpu_epochs(n_train: int, max_epochs: float) -> float:
    """Epochs so that a stage sees ~CPU_EXAMPLES_PER_STAGE examples, at most `max_epochs`."""
    return float(min(max_epochs, CPU_EXAMPLES_PER_STAGE / max(1, n_train)))


def _cpu_common(args, task: str, epochs: float, lr: float) -> dict:
    o = {"data.glue_dir": args.glue_dir, "data.cache_dir": os.path.join(args.workdir, "cache"),
         "data.train_subset": args.train_subset or 0, "data.eval_subset": args.eval_subset or 0,
         "train.batch_size": CPU["batch"], "train.eval_batch_size": CPU["eval_batch"],
         "train.num_epochs": epochs, "train.log_every": 50, "optim.learning_rate": lr,
         "train.checkpoint_every": 500, **_dtype_overrides(args)}
    if args.max_steps:
        o["train.num_steps"] = args.max_steps
    if task in POSITION_TASKS:
        o["data.data_dir"] = _data_dir(args, task)
        o["train.eval_batch_size"] = CPU["batch"]   # rows of up to 384 tokens
    return o


def _student_init(args, teacher_export: str) -> dict:
    return {"teacher.path": teacher_export, "student.init": "teacher_layers",
            "student.teacher_layers": args.init_layers}


def da_n(student_epochs: float, text_cols: int) -> int:
    """Augmented sentences per text column so that one epoch of the augmented set, n (1 + N x
    cols) rows, is about what a no-DA stage reads (student_epochs x n): DA at about equal
    compute, every augmented row read once. At least 1."""
    return max(1, int(round((student_epochs - 1.0) / max(1, text_cols))))


def cpu_augment(args, task: str, tdir: str, teacher_export: str, n_train: int,
                student_epochs: float) -> dict:
    """<tdir>/data/train_aug.tsv (SQuAD .json: the questions augmented; CoNLL .txt: the words
    tagged O): embedding-neighbour DA from the teacher's word embeddings, or MLM DA with --mlm;
    N from `da_n` (or --da_N); of the --train_subset rows the other stages see."""
    from jax_tinybert.model import hf
    from jax_tinybert.data import augment, glue, position_tasks, tokenize
    from jax_tinybert.model.modeling import BertForMaskedLM

    pos = position_tasks.get(task)   # None for GLUE
    ext = os.path.splitext(pos.files["train"])[1] if pos else ".tsv"
    out = os.path.join(tdir, "data", "train_aug" + ext)
    info_path = out + ".json"
    if os.path.exists(info_path):
        with open(info_path) as fh:
            return json.load(fh)
    if pos:
        src = position_tasks.file_path(pos, "train", _data_dir(args, task))
        cols, max_len = 1, (64 if pos.head == "span" else 128)   # run_qa's question cap
    else:
        spec = glue.get_task(task)
        src = glue.tsv_path(args.glue_dir, spec, "train")
        if args.train_subset:
            src = _write_subset_tsv(args.glue_dir, task, args.train_subset, 0,
                                    os.path.join(tdir, "data", "train.tsv"))
        cols, max_len = (2, 128) if spec.is_pair else (1, 64)
    N = args.da_N or da_n(student_epochs, cols)
    common = dict(N=N, K=CPU["da_K"], p=CPU["da_p"], seed=42, max_seq_len=max_len,
                  batch_size=64, buckets=(32, 64, 128))
    t0 = time.time()
    if args.mlm:
        tok = tokenize.load_tokenizer(args.mlm)
        cfg, params = hf.load_pretrained(args.mlm, mlm_head=True)
        aug = augment.Augmenter(tok, BertForMaskedLM(cfg), params, **common)
        source = f"mlm {args.mlm}"
    else:
        tok = tokenize.load_tokenizer(teacher_export)
        _, params = hf.load_pretrained(teacher_export, for_classification=False)
        emb = hf.bert_params(params)["embeddings"]["word_embeddings"]["embedding"]
        aug = augment.Augmenter(tok, mode="embedding", word_embeddings=emb, **common)
        source = "embedding neighbours of the teacher's word embeddings"
    if pos is None:
        stats = aug.augment_tsv(spec, src, out)
    elif pos.head == "span":
        stats = aug.augment_squad(src, out, subset=args.train_subset)   # the stages' train.seed 0
    else:
        stats = aug.augment_conll(src, out, subset=args.train_subset)
    info = {"path": out, **stats, "wall_s": time.time() - t0, "source": source, "N": N,
            "K": CPU["da_K"], "p": CPU["da_p"]}
    print(f"[augment] {task}: {stats['rows_in']} -> {stats['rows_out']} rows in "
          f"{info['wall_s']:.0f} s ({source}, N={N})", flush=True)
    with open(info_path, "w") as fh:
        json.dump(info, fh)
    return info


def run_task_cpu(args, task: str) -> Dict[str, dict]:
    """Every stage of one task on its full train set; returns {stage: summary}."""
    tdir = os.path.join(args.workdir, task)
    teacher_export = os.path.join(tdir, "teacher", "export")
    n = _train_rows(args, task)
    te = cpu_epochs(n, args.teacher_max_epochs or CPU["teacher_max_epochs"])
    se = cpu_epochs(n, args.student_max_epochs or CPU["student_max_epochs"])
    pos = POSITION_TASKS.get(task)
    if pos and pos["teacher_epochs"]:
        te = args.teacher_max_epochs or pos["teacher_epochs"]
        se = args.student_max_epochs or pos["student_epochs"]
    want = set(args.rows.split(",")) if args.rows else set(CPU_ROWS)
    if pos and not args.rows:   # the position tasks' DA row only when --rows names it
        want -= {"tinybert+da"}
    ep = {**{s: se for s in STUDENT_STAGES}, **args.epochs}   # --epochs: per student stage
    print(f"[glue cpu] {_task_name(task)}: {n} train examples; teacher {te:.2f} epochs, student "
          f"stages {se:.2f} epochs each{_stage_epochs_text(args.epochs)}", flush=True)
    lr = {**CPU["lr"], **CPU["task_lr"].get(task, {}), **args.lr}
    res: Dict[str, dict] = {"recipe": {"teacher": args.teacher,
                                       "teacher_epochs": te, "student_epochs": se, "lr": lr,
                                       "init_layers": list(args.init_layers),
                                       "layer_map": args.layer_map,
                                       "dtype": args.dtype}}
    if args.epochs:
        res["recipe"]["stage_epochs"] = dict(args.epochs)
    c = _load_config("finetune_teacher", task)
    res["teacher"] = _run(_set(c, {**_cpu_common(args, task, te, lr["teacher"]),
                                   "teacher.path": args.teacher}), os.path.join(tdir, "teacher"))
    init = _student_init(args, teacher_export)

    def tinybert(suffix: str, train_file: str = "", objective: str = "", heads: int = 0):
        c = _load_config("task_distill", f"{task}_intermediate")
        o = {**_cpu_common(args, task, ep["inter"], lr["inter"]), **init,
             "objective.projection": CPU["inter_projection"],
             "objective.layer_map": args.layer_map}
        if objective:   # MiniLM / MiniLMv2: the relations of the teacher's last layer
            o = {**o, "objective.name": objective, "student.teacher_layers_heads": heads}
            del o["objective.projection"], o["objective.layer_map"]
        # With DA: one epoch of the augmented set (sized by da_n to about the no-DA stage's
        # examples): every augmented row read once, about equal compute.
        da = {"data.train_file": train_file, "data.train_subset": 0, "train.num_epochs": 1.0}
        if train_file:
            o.update(da)
        res["inter" + suffix] = _run(_set(c, o), os.path.join(tdir, "inter" + suffix))
        c = _load_config("task_distill", f"{task}_pred")
        o = {**_cpu_common(args, task, ep["pred"], lr["pred"]), "teacher.path": teacher_export,
             "student.init": "pretrained",
             "student.path": os.path.join(tdir, "inter" + suffix, "export")}
        if train_file:
            o.update(da)
        res["pred" + suffix] = _run(_set(c, o), os.path.join(tdir, "pred" + suffix))

    if "tinybert" in want:   # --rows tinybert+da alone: the DA stages only
        tinybert("")
    for model, (objective, heads) in MINILM_ROWS.items():
        if model in want:
            tinybert("_" + model.replace("-", "_"), objective=objective, heads=heads)
    if "tinybert+da" in want and not args.no_da:
        res["da_info"] = cpu_augment(args, task, tdir, teacher_export, n, se)
        tinybert("_da", res["da_info"]["path"])

    # The same student and steps on gold labels alone: what distillation adds.
    if "labels-only" in want:
        c = _load_config("finetune_teacher", task)
        c.stage = "task_distill"
        res["labels"] = _run(_set(c, {**_cpu_common(args, task, ep["labels"], lr["labels"]), **init,
                                      "teacher.cache": False}), os.path.join(tdir, "labels"))

    if "kd" in want:
        c = _load_config("task_distill", f"{task}_pred")
        c.stage, c.objective.name = "kd", "kd"   # T, alpha, t2: KD's own defaults
        res["kd"] = _run(_set(c, {**_cpu_common(args, task, ep["kd"], lr["kd"]), **init}),
                         os.path.join(tdir, "kd"))

    if "pkd" in want:
        c = _load_config("pkd", task)
        res["pkd"] = _run(_set(c, {**_cpu_common(args, task, ep["pkd"], lr["pkd"]), **init}),
                          os.path.join(tdir, "pkd"))
    return res


def _export_dev(summary: dict) -> Optional[float]:
    """The main metric of the exported model (the stage exports its best evaluation: one per
    epoch, so for 1-epoch stages the final model)."""
    return _metric(summary)


def cpu_rows(args, task: str, res: Dict[str, dict]) -> List[dict]:
    """results.json rows: {"task", "model", "dev", "metric", "export", "params", "wall_s"}."""
    stages = {"teacher": ("teacher",), "tinybert": ("inter", "pred"),
              "tinybert+da": ("inter_da", "pred_da"), "pkd": ("pkd",), "kd": ("kd",),
              "labels-only": ("labels",),
              **{m: ("inter_" + m.replace("-", "_"), "pred_" + m.replace("-", "_"))
                 for m in MINILM_ROWS}}
    rows = []
    for model, st in stages.items():
        if st[-1] not in res:
            continue
        last = res[st[-1]]
        wall = sum(res[x]["wall_s"] for x in st)
        if model == "tinybert+da":
            wall += res["da_info"]["wall_s"]
        rows.append({"task": _task_name(task), "model": model, "dev": _export_dev(last),
                     "metric": _main_metric(task), "export": os.path.abspath(last["export"]),
                     "params": last["student_params"], "wall_s": round(wall, 1),
                     "recipe": res.get("recipe"),
                     "stages": {x: {"steps": res[x]["steps"], "wall_s": round(res[x]["wall_s"], 1)}
                                for x in st}})
    major = majority_baseline(args, task)
    if major is not None:
        rows.append({"task": _task_name(task), "model": "majority",
                     "dev": major, "metric": _main_metric(task),
                     "export": None, "params": 0, "wall_s": 0.0})
    return rows


RECORD_KEY = ("task", "dtype", "model")


def record_rows(rows: List[dict], dtype: str) -> List[dict]:
    """The rows benchmarks/results keeps of results.json rows (key RECORD_KEY): each model's dev
    score, its share of the teacher's and its stages' wall time."""
    teacher = {r["task"]: r["dev"] for r in rows if r["model"] == "teacher"}
    out = []
    for r in rows:
        t, dev = teacher.get(r["task"]), r["dev"]
        out.append({"task": r["task"], "dtype": dtype, "model": r["model"],
                    "metric": r["metric"], "dev": None if dev is None else round(dev, 4),
                    "pct_of_teacher": None if dev is None or not t else round(100 * dev / t, 1),
                    "wall_s": round(r["wall_s"]) if r["wall_s"] else None})
    return out


def cpu_rows_of(rows: List[dict], task: str) -> List[dict]:
    name = _task_name(task)
    return [r for r in rows if r["task"] == name]


def record(args, rows: List[dict]) -> str:
    """Merge one task's rows into benchmarks/results/glue-<machine>.json; returns the path."""
    import results

    return results.record("glue", results.machine_kind(results.gpu_name()),
                          record_rows(rows, args.dtype), RECORD_KEY)


def cpu_table(rows: List[dict], res_by_task: Dict[str, dict], teacher: str = "packaged") -> str:
    L = [f"GLUE dev (full dev sets), budget `cpu`: teacher = {_teacher_name(teacher)} fine-tuned; "
         "every student = 3 of its layers, its width (init: the fine-tuned teacher's layers given "
         "in the recipe line below). "
         "dev = the exported model (best of the per-epoch evaluations). "
         "% = of the teacher's dev score.", "",
         "| task | model | dev | metric | % of teacher | params | wall s | steps per stage |",
         "|---|---|---:|---|---:|---:|---:|---|"]
    teacher = {r["task"]: r["dev"] for r in rows if r["model"] == "teacher"}
    for r in rows:
        t = teacher.get(r["task"])
        dev = "n/a" if r["dev"] is None else f"{r['dev']:.4f}"
        pct = "n/a" if r["dev"] is None or not t else f"{100 * r['dev'] / t:.1f}%"
        steps = ", ".join(f"{k} {v['steps']} st {v['wall_s']:.0f} s"
                          for k, v in (r.get("stages") or {}).items())
        L.append(f"| {r['task']} | {r['model']} | {dev} | {r['metric']} | {pct} | "
                 f"{r['params']:,} | {r['wall_s']:.0f} | {steps} |")
    for task, res in res_by_task.items():
        if "recipe" in res:
            r = res["recipe"]
            L.append("")
            L.append(f"Recipe for {task}: teacher {r['teacher_epochs']:.2f} epochs, student stages "
                     f"{r['student_epochs']:.2f} epochs each"
                     f"{_stage_epochs_text(r.get('stage_epochs', {}))}, learning rates "
                     f"{json.dumps(r['lr'])}"
                     + (f", students initialised from teacher layers {r['init_layers']}, "
                        f"intermediate layer map {r['layer_map']}" if "init_layers" in r else "")
                     + f", compute dtype {r['dtype']}.")
        if "da_info" in res:
            d = res["da_info"]
            L.append("")
            L.append(f"DA for {task}: {d['rows_in']} -> {d['rows_out']} rows, N={d['N']}, "
                     f"K={d['K']}, p={d['p']}, {d['source']}, {d['wall_s']:.0f} s.")
    return "\n".join(L)


def main_cpu(args, tasks: List[str]) -> str:
    t0 = time.time()
    rows, res_by_task = [], {}
    path = os.path.join(args.workdir, "results.json")
    # Rows of tasks run by earlier invocations into the same workdir are kept (one task per
    # invocation is how a long run is split up); a task run again replaces its rows.
    kept = []
    if os.path.exists(path):
        with open(path) as fh:
            kept = json.load(fh)
    for task in tasks:
        res_by_task[task] = run_task_cpu(args, task)
        rows += cpu_rows(args, task, res_by_task[task])
        names = {r["task"] for r in rows}
        kept = [r for r in kept if r["task"] not in names]
        _write_json(path, kept + rows)  # after every task, so a long run shows what is done
        if args.record:
            print(f"recorded {os.path.relpath(record(args, cpu_rows_of(rows, task)))}", flush=True)
        _write_json(os.path.join(args.workdir, "stages.json"), res_by_task)
    table = cpu_table(rows, res_by_task, args.teacher)
    table += f"\n\nTotal wall time of this invocation: {time.time() - t0:.0f} s."
    print("\n" + table, flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(table + "\n")
    return table


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1, default=float)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- table

def _metric(summary: dict) -> Optional[float]:
    best = summary.get("best") or {}
    return best.get("main")


def measure_inference(tdir: str, task: str, b: dict, cache: dict) -> dict:
    """Teacher vs student jitted forward (batch 32 x the task's max length), median ms."""
    from jax_tinybert.cli.demo import inference_ms

    path = os.path.join(tdir, "inference.json")
    if os.path.exists(path):
        with open(path) as fh:
            return json.load(fh)
    seq = b["pair_max_len" if task in PAIR_TASKS else "max_len"] or (128 if task in PAIR_TASKS
                                                                    else 64)
    r = b["repeats"]
    out = {"seq_len": seq, "batch": 32, "repeats": r,
           "teacher_ms": inference_ms(os.path.join(tdir, "teacher", "export"), 32, seq, r),
           "student_ms": inference_ms(os.path.join(tdir, "pred", "export"), 32, seq, r)}
    with open(path, "w") as fh:
        json.dump(out, fh)
    return out


def majority_baseline(args, task: str) -> Optional[float]:
    """Main metric of predicting the most frequent dev label for every example (full dev set):
    the score a collapsed student gets. SQuAD v2.0: the null answer for every question; None
    for SQuAD v1.1 and CoNLL, where that scores 0."""
    import numpy as np

    from jax_tinybert.train import metrics
    from jax_tinybert.data import glue, position_tasks

    if task in POSITION_TASKS:
        spec = position_tasks.get(task)
        if spec.version != "2.0":
            return None
        from jax_tinybert.train import qa_metrics

        dev = position_tasks.read(spec, "dev", data_dir=_data_dir(args, task))
        # No answer anywhere (null-score differences +inf): the official best F1, the main metric.
        return float(qa_metrics.squad_v2({}, {}, dev)["best_f1"])
    spec = glue.get_task(task)
    if spec.labels is None:
        return None
    ex = glue.load_examples(task, spec.eval_splits[0], glue_dir=args.glue_dir)
    labels = np.array([spec.labels.index(e.label) if isinstance(e.label, str) else int(e.label)
                       for e in ex])
    major = np.bincount(labels).argmax()
    return float(metrics.score(task, np.full_like(labels, major), labels))


def _student_shape(variant: str):
    """(layers, d, d_ff, heads) of a configs/general_distill.py student variant."""
    c = _load_config("general_distill", variant)
    s = c.student
    return s.num_hidden_layers, s.hidden_size, s.intermediate_size, s.num_attention_heads


def _teacher_name(teacher: str, short: bool = False) -> str:
    if teacher == "packaged":
        return "MiniLM-L6" if short else "packaged all-MiniLM-L6-v2"
    return os.path.basename(teacher.rstrip("/")) or teacher


def make_table(args, b: dict, general: dict, results: Dict[str, dict],
               infer: Dict[str, dict], total_s: float) -> str:
    import jax

    from jax_tinybert.data import glue

    L = []
    layers, d, d_ff, heads = _student_shape(args.student)
    L.append(f"GLUE dev, budget `{args.budget}`; student = {layers} layers, d {d}, d_ff {d_ff}, "
             f"{heads} heads (configs/general_distill.py:{args.student}); teacher = "
             f"{_teacher_name(args.teacher)} fine-tuned per task. "
             "% = student / teacher on the task's main metric. "
             "Inference = jitted forward, batch 32 x task length, median, on "
             f"{jax.devices()[0].platform} ({os.cpu_count()} cores).")
    L.append("")
    L.append("| task (metric) | model | dev | % of teacher | params | ms/batch | speedup | "
             "steps (st) and wall time per stage |")
    L.append("|---|---|---:|---:|---:|---:|---:|---|")
    gw = general.get("wall_s", 0.0)
    for task, res in results.items():
        spec = glue.get_task(task)
        t = res["teacher"]
        tm = _metric(t)
        inf = infer.get(task, {})
        tms, sms = inf.get("teacher_ms"), inf.get("student_ms")
        name = f"{spec.dir_name} ({spec.main_metric})"
        fmt = lambda x: "n/a" if x is None else f"{x:.4f}"
        pct = lambda x: "n/a" if x is None or not tm else f"{100 * x / tm:.1f}%"
        L.append(f"| {name} | teacher {_teacher_name(args.teacher, short=True)} (fine-tuned) | "
                 f"{fmt(tm)} | 100% | "
                 f"{t['student_params']:,} | {tms:.1f} | 1.0x | finetune {t['steps']} st {t['wall_s']:.0f} s |"
                 if tms else f"| {name} | teacher | {fmt(tm)} | 100% | {t['student_params']:,} "
                 f"| n/a | n/a | finetune {t['steps']} st {t['wall_s']:.0f} s |")
        rows = [("TinyBERT (GD + inter + pred), no DA", ("inter", "pred"), True)]
        if "pred_da" in res:
            label = "TinyBERT with DA" + (" (random-tiny MLM: wiring check)"
                                          if args.mlm == "random-tiny" else f" (MLM {args.mlm})")
            rows.append((label, ("inter_da", "pred_da"), True))
        rows += [("plain KD (GD student, objective kd)", ("kd",), True),
                 ("PKD-Skip (teacher layers 1-3)", ("pkd",), False)]
        for label, stages, uses_general in rows:
            last = res[stages[-1]]
            m = _metric(last)
            walls = ([f"general {general.get('steps', 0)} st {gw:.0f} s (shared)"]
                     if uses_general else []) + [
                f"{s} {res[s]['steps']} st {res[s]['wall_s']:.0f} s" for s in stages]
            speed = f"{tms / sms:.2f}x" if tms and sms else "n/a"
            L.append(f"| {name} | {label} | {fmt(m)} | {pct(m)} | {last['student_params']:,} | "
                     f"{sms:.1f} | {speed} | {', '.join(walls)} |" if sms else
                     f"| {name} | {label} | {fmt(m)} | {pct(m)} | {last['student_params']:,} | "
                     f"n/a | n/a | {', '.join(walls)} |")
        maj = majority_baseline(args, task)
        if maj is not None:
            L.append(f"| {name} | (majority class, full dev: what a collapsed model scores) | "
                     f"{maj:.4f} | {pct(maj)} | | | | |")
        if "pred_da" not in res:
            L.append(f"| {name} | TinyBERT with DA | skipped | | | | | no masked LM offline: the "
                     "packaged MiniLM has no MLM head and augment.py needs one (pass --mlm) |")
    L.append("")
    L.append(budget_note(args, b))
    L.append(f"Total wall time of this invocation: {total_s:.0f} s (stages already done were "
             "read from their summary.json).")
    return "\n".join(L)


def budget_note(args, b: dict) -> str:
    if args.budget == "full":
        return ("Budget `full`: the official recipes of configs/*.py (full train sets and dev "
                "sets, epochs, batch sizes, lengths and learning rates as the configs state).")
    parts = [f"Budget `{args.budget}`: train subsets {b['train_subset']} (seeded), dev subsets "
             f"{b['eval_subset'] or 'none (full dev)'}; batch {b['batch']}; max length "
             f"{b['max_len']} (single) / {b['pair_max_len']} (pairs); steps per stage "
             f"{json.dumps(b['steps'])}"
             + (f" x {args.steps_scale} (rounded)" if args.steps_scale != 1.0 else "")
             + f"; learning rates {json.dumps(b['lr'])}; general "
             f"distillation on {'the corpus files ' + ', '.join(b['corpus_files']) if b['corpus_files'] else args.corpus}"
             f" (subset {b['corpus_subset'] or 'all'} packed sequences, length "
             f"{b['general_seq_len']}, batch {b['general_batch']})."]
    if args.mlm:
        parts.append(f"DA: N={b['da_N']}, K={b['da_K']}, p=0.4 on the train subset.")
    return " ".join(parts)


def _model_folder_problem(path: str) -> str:
    """What keeps the folder `path` (local or gs://) from being a model a stage can load ('' if
    nothing): the files `config_check` asks of config.teacher.path, here before any stage runs."""
    from jax_tinybert import fs
    from jax_tinybert.config.check import missing_model_files

    remote = fs.is_remote(path)
    if remote:
        try:
            fs.check_reachable(path)
        except fs.RemoteFSError as e:
            return str(e)
    q = path.rstrip("/") if remote else os.path.expanduser(path)
    if not fs.isdir(q):
        return "a file, not a model folder" if fs.exists(q) else "no model folder there"
    missing = missing_model_files(q)
    if missing and fs.isdir(fs.join(q, "export")):
        return (f"a run's workdir, not a model folder: its model is in "
                f"{fs.join(path.rstrip('/'), 'export')}")
    if missing:
        return f"the folder has no {' and no '.join(missing)}"
    try:
        with fs.open_file(fs.join(q, "config.json")) as fh:
            cfg = json.load(fh)
    except (OSError, ValueError) as e:
        return f"config.json is not readable JSON ({e})"
    if not isinstance(cfg, dict) or not isinstance(cfg.get("num_hidden_layers"), int):
        return "config.json has no num_hidden_layers: not a BERT config"
    return ""


def _teacher_layers(ap, args) -> int:
    """The teacher's depth: the packaged MiniLM's 6, else its config.json's num_hidden_layers (a
    hub name is downloaded now, as its first stage would)."""
    if args.teacher == "packaged":
        return CPU_TEACHER_LAYERS
    from jax_tinybert.errors import UserError, one_line
    from jax_tinybert.model import hf

    try:
        with open(os.path.join(hf.resolve_path(args.teacher), "config.json")) as fh:
            layers = json.load(fh).get("num_hidden_layers")
    except (UserError, OSError, ValueError) as e:
        ap.error(f"--teacher {args.teacher}: {one_line(e)}")
    if not isinstance(layers, int) or layers < 1:
        ap.error(f"--teacher {args.teacher}: config.json has no num_hidden_layers: not a BERT "
                 "config")
    return layers


def _parse_stage_values(ap, flag: str, text: str, stages, example: str,
                        what: str) -> Dict[str, float]:
    """'stage=value,...' -> {stage: value}; a stage not in `stages`, a value that is not a
    positive number: argparse's one-line error naming the item."""
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        stage, _, value = item.partition("=")
        if stage not in stages:
            ap.error(f"{flag} {item!r}: stage {stage!r} is not one of {','.join(stages)}")
        try:
            out[stage] = float(value)
        except ValueError:
            ap.error(f"{flag} {item!r}: {value!r} is not a number (e.g. {flag} {example})")
        if not out[stage] > 0:
            ap.error(f"{flag} {item!r}: {what} must be > 0")
    return out


def _stage_epochs_text(stage_epochs: Dict[str, float]) -> str:
    """--epochs' stages for the recipe lines: ', inter 4.00, pred 1.00' ('' without any)."""
    return "".join(f", {k} {v:.2f}" for k, v in stage_epochs.items())


def _parse_lr(ap, text: str) -> Dict[str, float]:
    return _parse_stage_values(ap, "--lr", text, tuple(CPU["lr"]), "teacher=1e-4",
                               "the learning rate")


def _parse_epochs(ap, text: str) -> Dict[str, float]:
    return _parse_stage_values(ap, "--epochs", text, STUDENT_STAGES, "inter=4,pred=1",
                               "the epoch count")


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", choices=sorted(BUDGETS), default="small")
    ap.add_argument("--glue_dir", default=os.path.join(REPO, "..", "shared", "data", "glue"))
    ap.add_argument("--corpus", default=os.path.join(REPO, "..", "shared", "data", "corpus"))
    ap.add_argument("--data_dir", default="",
                    help="budget cpu, squad11 / squad20 / conll2003: the folder holding train.json + "
                    "dev.json (SQuAD) or train.txt + dev.txt (CoNLL); default ../shared/data/squad/"
                    "v1.1, squad/v2.0 or conll2003")
    ap.add_argument("--tasks", default=",".join(TASKS),
                    help="comma list of GLUE task names (sst2, mrpc, stsb; with --budget cpu any "
                    "of cola, sst2, mrpc, stsb, qqp, mnli, qnli, rte, wnli)")
    ap.add_argument("--workdir", default=None,
                    help="default: /tmp/jax_tinybert_glue_<budget> (outside the repo)")
    ap.add_argument("--teacher", default="packaged",
                    help="the pre-trained model fine-tuned per task and distilled from: 'packaged' "
                    "(all-MiniLM-L6-v2, installed with the package), a Hugging Face folder, or a hub "
                    "name such as bert-base-uncased (online); budget cpu is sized for the packaged "
                    "one (a 12-layer d-768 teacher has ~8x its FLOPs a token)")
    ap.add_argument("--student", default=STUDENT,
                    help="the general-distillation student: a variant of "
                    "configs/general_distill.py (tinybert4, tinybert6, small, tiny); budgets small, "
                    "hour and full (budget cpu starts its students from the teacher's layers)")
    ap.add_argument("--mlm", default="", help="masked LM for data augmentation (HF folder / hub "
                    "name with an MLM head), or 'random-tiny' (wiring check); empty: skip DA")
    ap.add_argument("--train_subset", type=int, default=None, help="override the budget's")
    ap.add_argument("--eval_subset", type=int, default=None, help="override the budget's")
    ap.add_argument("--steps_scale", type=float, default=1.0,
                    help="multiply the budget's steps per stage (e.g. 0.5 on a busy machine); "
                    "the table states the steps run")
    ap.add_argument("--no_compile_cache", action="store_true",
                    help="do not use a persistent XLA compilation cache in <workdir>/jax_cache")
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    ap.add_argument("--record", action="store_true",
                    help="budget cpu: merge each task's rows into benchmarks/results/ as it ends")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="compute dtype of every stage's teacher and student (default float32); "
                    "bfloat16 on a CPU with AMX (or an AMD one with AVX512-BF16): bf16 products, "
                    "float32 activations, ~1.6x (1.2-1.6x) faster steps")
    ap.add_argument("--no_da", action="store_true", help="budget cpu: skip the tinybert+da row")
    ap.add_argument("--rows", default="",
                    help="budget cpu: comma list of rows to run, of "
                    + ",".join(CPU_ROWS + CPU_OPTIONAL_ROWS) + " (default all but the MiniLM rows; "
                    "the teacher always runs, the others need it; tinybert+da also runs tinybert, "
                    "its no-DA counterpart)")
    ap.add_argument("--teacher_max_epochs", type=float, default=0.0,
                    help=f"budget cpu: cap on teacher epochs (default {CPU['teacher_max_epochs']})")
    ap.add_argument("--student_max_epochs", type=float, default=0.0,
                    help=f"budget cpu: cap on student epochs (default {CPU['student_max_epochs']})")
    ap.add_argument("--max_steps", type=int, default=0,
                    help="budget cpu: cap every stage at this many steps (smoke tests)")
    ap.add_argument("--da_N", type=int, default=0,
                    help="budget cpu: augmented sentences per text column (default: sized so one "
                    "epoch of the augmented set ~ the no-DA stage's examples, see da_n)")
    ap.add_argument("--lr", default="",
                    help="budget cpu: learning rates per stage, e.g. teacher=1e-4,pred=3e-5 "
                    f"(stages {','.join(CPU['lr'])}; default {json.dumps(CPU['lr'])})")
    ap.add_argument("--epochs", default="",
                    help="budget cpu: epochs of single student stages, e.g. inter=4,pred=1 (stages "
                    f"{','.join(STUDENT_STAGES)}; the others keep --student_max_epochs' or the "
                    "budget's)")
    ap.add_argument("--init_layers", default="",
                    help="budget cpu: the fine-tuned teacher's layers (1-based) every student "
                    "starts from, e.g. 2,4,6 (default: those the uniform map pairs with 3 student "
                    f"layers, {','.join(map(str, CPU['init_layers']))} of the packaged MiniLM)")
    ap.add_argument("--layer_map", default="",
                    help="budget cpu: the intermediate stage's layer map, one of uniform, top, "
                    f"bottom, ... or explicit pairs (default {CPU['inter_layer_map']})")
    args = ap.parse_args(argv)
    if args.record and args.budget != "cpu":
        ap.error("--record: only the full-data recipe (--budget cpu) is kept in benchmarks/results")
    if args.budget == "cpu" and args.student != STUDENT:
        ap.error("--student: budget cpu starts its students from the fine-tuned teacher's layers "
                 "(--init_layers); use --student with --budget small, hour or full")
    if args.record and args.teacher != "packaged":
        ap.error("--record: benchmarks/results keeps the packaged teacher's rows; run other "
                 "teachers without --record (W/results.json has their rows)")
    try:
        _student_shape(args.student)
    except ValueError as e:
        ap.error(f"--student: {e}")
    if args.budget == "cpu" and args.mlm == "random-tiny":
        ap.error("--mlm random-tiny: a wiring check of budgets small, hour and full; budget cpu "
                 "augments with a masked LM folder or hub name, or without --mlm with the "
                 "teacher's embedding neighbours")
    from jax_tinybert.config.check import looks_local

    # Model folders are checked now, not stages later (the masked LM is first read after four
    # stages); a teacher's hub name when its layers are read (_teacher_layers), the masked LM's
    # when the DA stage loads it (a one-line error too, `cli`).
    for flag, value, other in (("--teacher", args.teacher, "'packaged'"),
                               ("--mlm", args.mlm, "'random-tiny'")):
        if value and value not in ("packaged", "random-tiny") and looks_local(value):
            problem = _model_folder_problem(value)
            if problem:
                ap.error(f"{flag} {value}: {problem}; pass {other}, a model folder (config.json, "
                         "model.safetensors and the tokenizer, as a run's <workdir>/export) or a "
                         "Hugging Face hub name such as bert-base-uncased")
    if args.teacher != "packaged" and looks_local(args.teacher):
        from jax_tinybert import fs

        if not fs.is_remote(args.teacher):   # the stages run with their own working folders
            args.teacher = os.path.abspath(os.path.expanduser(args.teacher))
    args.teacher_layers = _teacher_layers(ap, args)
    # The small budgets' PKD student is made of the teacher layers configs/pkd.py names.
    need = max(_load_config("pkd", "sst2").student.teacher_layers)
    if args.budget != "cpu" and args.teacher_layers < need:
        ap.error(f"--teacher {args.teacher}: {args.teacher_layers} layers; the PKD row's student "
                 f"takes the teacher's layers 1-{need}: pass a teacher of at least {need} layers")
    args.lr = _parse_lr(ap, args.lr)
    args.epochs = _parse_epochs(ap, args.epochs)
    from jax_tinybert.distill import layer_maps

    try:
        args.init_layers = tuple(int(x) for x in args.init_layers.split(",") if x.strip()) \
            or default_init_layers(args.teacher_layers)
    except ValueError:
        ap.error(f"--init_layers {args.init_layers!r}: expected comma-separated layer numbers, "
                 "e.g. 2,4,6")
    except layer_maps.LayerMapError as e:
        ap.error(f"--teacher {args.teacher}: {e}")
    # Checked now, not an hour in when the intermediate stage starts.
    bad = [x for x in args.init_layers if not 1 <= x <= args.teacher_layers]
    if bad:
        ap.error(f"--init_layers: layer {bad[0]} is not a teacher layer (the teacher, "
                 f"{_teacher_name(args.teacher, short=True)}, has layers 1..{args.teacher_layers})")
    args.layer_map = args.layer_map or CPU["inter_layer_map"]
    try:
        layer_maps.from_spec(args.layer_map, len(args.init_layers), args.teacher_layers)
    except layer_maps.LayerMapError as e:
        ap.error(f"--layer_map: {e}")
    args.glue_dir = os.path.abspath(args.glue_dir)
    args.corpus = os.path.abspath(args.corpus)
    args.workdir = os.path.abspath(args.workdir or f"/tmp/jax_tinybert_glue_{args.budget}")
    b = dict(BUDGETS[args.budget])
    if args.train_subset is not None:
        b["train_subset"] = args.train_subset
    if args.eval_subset is not None:
        b["eval_subset"] = args.eval_subset
    tasks = [t.strip().lower().replace("-", "") for t in args.tasks.split(",") if t.strip()]
    for r in filter(None, args.rows.split(",")):
        if r not in CPU_ROWS + CPU_OPTIONAL_ROWS:
            ap.error(f"--rows: {r!r} is not one of {','.join(CPU_ROWS + CPU_OPTIONAL_ROWS)}")
    allowed = ALL_GLUE + tuple(POSITION_TASKS) if args.budget == "cpu" else TASKS
    for t in tasks:
        if t not in allowed:
            ap.error(f"--tasks: {t!r} is not one of {allowed}"
                     + ("" if args.budget == "cpu" else " (--budget cpu takes all nine, and "
                        "squad11, squad20, conll2003)"))
    if not os.path.isdir(args.glue_dir):
        ap.error(f"--glue_dir {args.glue_dir} does not exist")
    os.makedirs(args.workdir, exist_ok=True)
    if not args.no_compile_cache:
        # Stages of different tasks compile the same programs (same shapes): XLA's persistent
        # cache makes the second task's compiles cache hits.
        import jax

        jax.config.update("jax_compilation_cache_dir", os.path.join(args.workdir, "jax_cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

    if args.budget == "cpu":
        for t in tasks:
            from jax_tinybert.data import glue, position_tasks

            if t in POSITION_TASKS:
                spec = position_tasks.get(t)
                for f in spec.files.values():
                    if not os.path.isfile(os.path.join(_data_dir(args, t), f)):
                        ap.error(f"--tasks {t}: {os.path.join(_data_dir(args, t), f)} not found "
                                 f"(--data_dir must hold {' + '.join(spec.files.values())})")
                continue
            p = glue.tsv_path(args.glue_dir, glue.get_task(t), "train")
            if not os.path.exists(p):
                ap.error(f"--tasks {t}: {p} not found (expected <glue_dir>/<TaskFolder>/train.tsv)")
        return main_cpu(args, tasks)
    t0 = time.time()
    general = run_general(args, b)
    general_export = os.path.join(args.workdir, "general", "export")
    results, infer = {}, {}
    for task in tasks:
        results[task] = run_task(args, b, task, general_export)
        infer[task] = measure_inference(os.path.join(args.workdir, task), task, b, {})
    total = time.time() - t0
    table = make_table(args, b, general, results, infer, total)
    print("\n" + table, flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(table + "\n")
    with open(os.path.join(args.workdir, "results.json"), "w") as fh:
        json.dump({"budget": args.budget, "date": datetime.datetime.now().isoformat(),
                   "machine": platform.platform(), "general": general, "tasks": results,
                   "inference": infer, "total_s": total}, fh, indent=1, default=float)
    return table


def cli(argv=None) -> int:
    """main(argv) as a command: its exit status, with a stage's refusal of its config as the
    command line's one-line error (status 2) and a stop on SIGTERM / Ctrl-C as 143 / 130."""
    try:
        main(argv)
        return 0
    except Exception as e:
        from jax_tinybert.errors import EXIT_USER_ERROR, UserError, one_line
        from jax_tinybert.train.preemption import Preempted  # JAX starts after main() set its env

        if isinstance(e, UserError):
            # A stage refused its config (a hub name that cannot be loaded, a damaged model): one
            # line, as the command line prints it; the finished stages are kept for the rerun.
            sys.stderr.write(f"error: {one_line(e)}\n")
            return EXIT_USER_ERROR
        if not isinstance(e, Preempted):
            raise
        # The stage saved its state (train.py said which step); the same command resumes it.
        print(f"benchmarks/glue.py: stopped in {e.workdir or 'a stage'} at its step {e.step}; "
              "rerun the same command: finished stages are kept, this one resumes",
              file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    from jax_tinybert.speed import malloc

    # The CLI's allocator (tcmalloc where installed), before anything loads JAX: the stages run
    # in this process, and under glibc's defaults a step re-faults its freed buffers.
    malloc.restart_unless_set()
    sys.exit(cli())
