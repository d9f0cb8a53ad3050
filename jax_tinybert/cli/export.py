"""Export a training run's best (or latest) checkpoint as a Hugging Face BERT folder.

    python -m jax_tinybert.cli.export --workdir=RUN --out=DIR [--which=best|latest]
    export_from_workdir(workdir, out, which="best")

The student's architecture is rebuilt from the run's `workdir/config.json` by the build layer
(`build.build_models`), as the trainer built it; the folder is written by `export.export_hf`.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import jax
import ml_collections
import orbax.checkpoint as ocp

from jax_tinybert.train import build
from jax_tinybert.config import schema as config_base
from jax_tinybert import fs
from jax_tinybert.train.checkpoints import Checkpointer
from jax_tinybert.data import conll, glue, position_tasks
from jax_tinybert.errors import PathError, tool_exit
from jax_tinybert.model.export import export_hf, student_tree
from jax_tinybert.model import families, heads

log = logging.getLogger(__name__)


def read_run_config(workdir: str) -> ml_collections.ConfigDict:
    """The config a run was started with, from its workdir/config.json (config_check writes it)."""
    path = fs.join(workdir, "config.json")
    if not fs.exists(path):
        raise FileNotFoundError(f"{workdir}: no config.json; is this a training workdir "
                                "(python -m jax_tinybert.main --workdir=...)?")
    with fs.open_file(path) as fh:
        flat = json.load(fh)["config"]
    config = config_base.base_config()
    for key, value in flat.items():
        parts = key.split(".")
        node = config
        for p in parts[:-1]:
            if p not in node:
                node[p] = ml_collections.ConfigDict()
            node = node[p]
        if parts[-1] in node and isinstance(node[parts[-1]], tuple) and isinstance(value, list):
            value = tuple(value)
        with node.ignore_type():
            node[parts[-1]] = value
    return config


def _abstract_from_checkpoint(step_dir: str):
    """ShapeDtypeStruct tree of the saved `state` item, read from orbax's metadata."""
    # The item folder has no checkpoint-level metadata file (the manager keeps it one level
    # up); orbax warns about that, harmlessly.
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        meta = ocp.StandardCheckpointer().metadata(fs.abspath(fs.join(step_dir, "state")))
    finally:
        absl.setLevel(level)
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    dev = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree_util.tree_map(
        lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=dev), tree,
        is_leaf=lambda m: hasattr(m, "shape") and hasattr(m, "dtype"))


def _student_config(workdir: str, num_labels: int, head: str = "sequence") -> tuple:
    """(BertConfig, id2label, tokenizer_dir, encoder_only) of the run's student, rebuilt from
    the run's config.json the way the trainer built it."""
    config = read_run_config(workdir)
    id2label = None
    position = position_tasks.get(config.data.task) if config.data.kind == "glue" else None
    if head == "token" and position:   # the train file's labels, in the run's order
        dc = config.data
        labels = conll.label_order(position_tasks.read(
            position, "train", data_dir=dc.data_dir, source=dc.source, ner_column=dc.ner_column,
            train_file=dc.train_file))
        id2label = dict(enumerate(labels)) if len(labels) == num_labels else None
    elif config.data.kind == "glue" and not position:
        spec = glue.get_task(config.data.task)
        if spec.labels is not None and len(spec.labels) == num_labels:
            id2label = dict(enumerate(spec.labels))
    models = build.build_models(config, num_labels, id2label, head)
    return (models.student_config, id2label, models.tokenizer_dir,
            config.data.kind == "corpus")


def export_from_workdir(workdir: str, out: str, which: str = "best") -> str:
    """Restore the best (or latest) checkpoint of a training run and export its student.

    which: "best" (falls back to the latest when the run kept no best checkpoint) or "latest".
    Uses `jax_tinybert.train.checkpoints.Checkpointer` (corrupt newest checkpoints are skipped).
    """
    if which not in ("best", "latest"):
        raise ValueError(f"which must be 'best' or 'latest', got {which!r}")
    if not any(fs.isdir(fs.join(workdir, d)) for d in ("checkpoints", "best")):
        # Before the Checkpointer, which would create the folders of a mistyped --workdir.
        where = "" if fs.is_remote(workdir) else f" (relative to {os.getcwd()})"
        what = "holds no checkpoint" if fs.isdir(workdir) else f"no such folder{where}"
        raise PathError(f"{workdir}: {what}, so there is nothing to export; pass the --workdir "
                        "of a training run")
    # Same best-metric name as the trainer (train.py saves the dev metric as "main").
    ckpt = Checkpointer(workdir, async_save=False, keep_best=True, best_metric="main",
                        best_mode="max")
    try:
        use_best = which == "best" and ckpt.best_step() is not None
        if which == "best" and not use_best:
            log.warning("%s: no best checkpoint; exporting the latest", workdir)
        step = ckpt.best_step() if use_best else ckpt.latest_step()
        if step is None:
            raise PathError(f"{workdir}: no checkpoint to export (no run saved one there); pass "
                            "the --workdir of a training run")
        base = ckpt.best_directory if use_best else ckpt.directory
        abstract = _abstract_from_checkpoint(os.fspath(base / str(step)))
        got = ckpt.restore_best(abstract) if use_best else ckpt.restore_latest(abstract)
    finally:
        ckpt.close()
    if got is None:  # every candidate failed its digests and was moved aside (logged)
        raise PathError(
            f"{workdir}: the {'best' if use_best else 'latest'} checkpoint (step {step}) is "
            f"damaged and was moved to {os.fspath(base)}/corrupt_{step}; "
            + ("export --which=latest instead" if use_best else "nothing intact to export"))
    step, state, _ = got
    params = state["params"] if isinstance(state, dict) else state.params
    student = student_tree(params)
    head = heads.head_of(student) or "sequence"
    num_labels = (families.head_labels(student["classifier"]) if head == "sequence" and
                  "classifier" in student else 2 if head != "token" else
                  int(student["token_classifier"]["kernel"].shape[-1]))
    config, id2label, tokenizer_dir, encoder_only = _student_config(workdir, num_labels, head)
    if encoder_only:  # general distillation: the head was never trained (as train.py exports)
        student = student["bert"]
    log.info("exporting step %d of %s to %s", step, workdir, out)
    return export_hf(config, student, out, tokenizer_dir=tokenizer_dir, id2label=id2label)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jax_tinybert.cli.export",
                                 description="Export a run's student as an HF BERT folder.")
    ap.add_argument("--workdir", required=True, help="the training run's --workdir")
    ap.add_argument("--out", required=True, help="folder to write (replaced atomically)")
    ap.add_argument("--which", default="best", choices=("best", "latest"))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    log.setLevel(logging.INFO)
    out = export_from_workdir(args.workdir, args.out, args.which)
    print(f"exported {args.which} checkpoint of {args.workdir} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(tool_exit(main))
