"""Export a student as a Hugging Face BERT folder (Flax, PyTorch and tokenizer files).

    export_hf(config, params, out_dir, tokenizer_dir=None, id2label=None)
    python -m jax_tinybert.export --workdir=RUN --out=DIR [--which=best|latest]

The folder loads with `FlaxBertForSequenceClassification` / `BertForSequenceClassification`
(or `*BertModel` for an encoder-only export) from transformers 4.x and with
`jax_tinybert.load_pretrained`. The PyTorch weights are written by us, not converted by
transformers (its `from_flax=True` path leaves weights on the meta device in 4.57).
Writes are atomic: everything goes to a temporary folder beside `out_dir`, which is renamed
into place only when complete. Call it from one process (process 0).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import uuid
from typing import Any, Dict, Optional

import jax
import numpy as np

from jax_tinybert import fsutil, hf
from jax_tinybert.modeling import (BertConfig, BertForMaskedLM, BertForSequenceClassification,
                                   init_params)

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
FLAX_FILE = "flax_model.msgpack"
TORCH_FILE = "model.safetensors"


# ----------------------------------------------------------------------------- writers
# Module-level so tests can make one fail half-way.

def _write_config(path: str, d: dict) -> None:
    with open(path, "w") as fh:
        json.dump(d, fh, indent=2, sort_keys=True)


def _write_flax(path: str, tree: dict) -> None:
    from flax import serialization

    with open(path, "wb") as fh:
        fh.write(serialization.to_bytes(tree))


def _write_torch(path: str, state: Dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    # transformers refuses safetensors files without format metadata.
    save_file({k: np.ascontiguousarray(v) for k, v in state.items()}, path,
              metadata={"format": "pt"})


def _copy_tokenizer(tokenizer_dir: str, dst: str) -> list:
    copied = []
    for name in hf.TOKENIZER_FILES:
        src = os.path.join(tokenizer_dir, name)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(dst, name))
            copied.append(name)
    if not copied:
        raise FileNotFoundError(f"tokenizer_dir {tokenizer_dir} holds none of "
                                f"{', '.join(hf.TOKENIZER_FILES)}")
    return copied


# ----------------------------------------------------------------------------- export_hf

def _student_tree(params: Any) -> dict:
    """Host float32 numpy tree in HF Flax layout; accepts TrainState-style {"student", "proj"}."""
    params = dict(params)
    if "student" in params:
        params = dict(params["student"])
    dropped = [k for k in ("proj",) if params.pop(k, None) is not None]
    if dropped:
        log.info("export: projection params are not part of the model; not exported")
    return jax.tree_util.tree_map(lambda x: np.asarray(jax.device_get(x), np.float32), params)


def _check_shapes(config: BertConfig, tree: dict, classification: bool) -> None:
    expected = jax.eval_shape(lambda: init_params(BertForSequenceClassification(config),
                                                  jax.random.PRNGKey(0)))
    if classification:
        hf._check_against(expected["bert"], tree["bert"], "export params", "encoder")
        hf._check_against(expected["classifier"], tree["classifier"], "export params",
                          "classifier (num_labels = config.num_labels)")
    else:
        hf._check_against(expected["bert"], tree, "export params", "encoder")


def export_hf(config: BertConfig, params: Any, out_dir: str, tokenizer_dir: Optional[str] = None,
              id2label: Optional[dict] = None) -> str:
    """Write an HF BERT folder at `out_dir`; returns out_dir.

    params: `BertModel` params (embeddings/encoder/pooler) -> architectures ["BertModel"], or
    `{"bert", "classifier"}` -> ["BertForSequenceClassification"] with num_labels =
    classifier width (1 = regression), or `{"bert", "cls"}` (a masked-LM head, HF names
    cls.predictions.*) -> ["BertForMaskedLM"]. A `{"student", "proj"}` dict is accepted; "proj" is
    dropped. id2label: {int: str}, overrides config.id2label.
    Files: config.json, flax_model.msgpack (bare HF Flax dict), model.safetensors (PyTorch
    names, Linear kernels transposed) and the tokenizer files found in tokenizer_dir.
    """
    tree = _student_tree(params)
    if "cls" in tree:
        return _export_mlm(config, tree, out_dir, tokenizer_dir)
    classification = "classifier" in tree
    if classification and "bert" not in tree:
        raise ValueError("export_hf: a classifier without 'bert' params; pass "
                         "{'bert': ..., 'classifier': ...} or the bare BertModel params")
    unknown = set(tree) - ({"bert", "classifier"} if classification
                           else {"embeddings", "encoder", "pooler"})
    if unknown:
        raise ValueError(f"export_hf: unexpected top-level params {sorted(unknown)}; expected "
                         "BertModel params or {'bert', 'classifier'}")
    if classification:
        n = int(tree["classifier"]["kernel"].shape[-1])
        if n != config.num_labels:
            config = config.replace(num_labels=n, id2label=None)
    if id2label is not None:
        id2label = {int(k): str(v) for k, v in dict(id2label).items()}
        if len(id2label) != config.num_labels:
            raise ValueError(f"export_hf: id2label has {len(id2label)} labels, the model "
                             f"{config.num_labels}")
        config = config.replace(id2label=id2label)
    _check_shapes(config, tree, classification)

    cfg = config.to_dict()
    cfg["architectures"] = ["BertForSequenceClassification" if classification else "BertModel"]
    cfg["model_type"] = "bert"
    if classification and config.num_labels == 1:
        cfg.setdefault("problem_type", "regression")
    torch_state = hf.params_to_torch_state_dict(tree)
    return _write_folder(out_dir, cfg, tree, torch_state, tokenizer_dir)


def _export_mlm(config: BertConfig, tree: dict, out_dir: str, tokenizer_dir: Optional[str]) -> str:
    """{"bert", "cls"} -> an HF BertForMaskedLM folder (decoder tied to the word embeddings)."""
    unknown = set(tree) - {"bert", "cls"}
    if unknown or "bert" not in tree:
        raise ValueError(f"export_hf: a masked-LM export takes {{'bert', 'cls'}}, got {sorted(tree)}")
    hf._check_against(jax.eval_shape(lambda: init_params(
        BertForSequenceClassification(config), jax.random.PRNGKey(0)))["bert"], tree["bert"],
        "export params", "encoder")
    hf._check_against(jax.eval_shape(lambda: init_params(
        BertForMaskedLM(config), jax.random.PRNGKey(0)))["cls"], tree["cls"], "export params",
        "masked-LM head")
    cfg = config.replace(id2label=None).to_dict()
    cfg["architectures"] = ["BertForMaskedLM"]
    cfg["model_type"] = "bert"
    cfg["tie_word_embeddings"] = True
    return _write_folder(out_dir, cfg, tree, hf.params_to_torch_state_dict(tree), tokenizer_dir)


def _write_folder(out_dir: str, cfg: dict, tree: dict, torch_state: dict,
                  tokenizer_dir: Optional[str]) -> str:
    """Writes config.json, the weights and the tokenizer into a temp folder renamed to out_dir."""
    out_dir = os.path.abspath(out_dir)
    parent, name = os.path.split(out_dir.rstrip(os.sep))
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise FileExistsError(f"export_hf: {out_dir} exists and is not a folder")
    os.makedirs(parent, exist_ok=True)
    # Beside out_dir (same filesystem, so the final rename is atomic) and hidden, so a crashed
    # export never looks like a model folder.
    fsutil.clean_stale_temps(out_dir)
    tmp = fsutil.mkdtemp(out_dir)
    try:
        _write_config(os.path.join(tmp, CONFIG_FILE), cfg)
        _write_flax(os.path.join(tmp, FLAX_FILE), tree)
        _write_torch(os.path.join(tmp, TORCH_FILE), torch_state)
        if tokenizer_dir:
            _copy_tokenizer(tokenizer_dir, tmp)
        # mkdtemp (and safetensors) create owner-only entries; an export is meant to be shared.
        os.chmod(tmp, 0o755)
        for f in os.listdir(tmp):
            os.chmod(os.path.join(tmp, f), 0o644)
        _swap_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _swap_into_place(tmp: str, out_dir: str) -> None:
    """Rename tmp -> out_dir; an existing out_dir is moved aside first and deleted afterwards."""
    old = None
    if os.path.exists(out_dir):
        parent, name = os.path.split(out_dir)
        old = os.path.join(parent, f".{name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(out_dir, old)
    try:
        os.rename(tmp, out_dir)
    except BaseException:
        if old is not None:
            os.rename(old, out_dir)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------------- from a run

def _read_run_config(workdir: str):
    import ml_collections

    from jax_tinybert import config_base

    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{workdir}: no config.json; is this a training workdir "
                                "(python -m jax_tinybert.main --workdir=...)?")
    with open(path) as fh:
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
    import orbax.checkpoint as ocp

    # The item folder has no checkpoint-level metadata file (the manager keeps it one level
    # up); orbax warns about that, harmlessly.
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        meta = ocp.StandardCheckpointer().metadata(os.path.abspath(os.path.join(step_dir, "state")))
    finally:
        absl.setLevel(level)
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    dev = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree_util.tree_map(
        lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=dev), tree,
        is_leaf=lambda m: hasattr(m, "shape") and hasattr(m, "dtype"))


def _student_config(workdir: str, num_labels: int) -> tuple:
    """(BertConfig, id2label, tokenizer_dir, encoder_only) of the run's student, rebuilt from
    the run's config.json the way the trainer built it."""
    from jax_tinybert import train

    config = _read_run_config(workdir)
    id2label = None
    if config.data.kind == "glue":
        from jax_tinybert.data import glue

        spec = glue.get_task(config.data.task)
        if spec.labels is not None and len(spec.labels) == num_labels:
            id2label = dict(enumerate(spec.labels))
    models = train.build_models(config, num_labels, id2label)
    return (models.student_config, id2label, models.tokenizer_dir,
            config.data.kind == "corpus")


def export_from_workdir(workdir: str, out: str, which: str = "best") -> str:
    """Restore the best (or latest) checkpoint of a training run and export its student.

    which: "best" (falls back to the latest when the run kept no best checkpoint) or "latest".
    Uses `jax_tinybert.checkpoints.Checkpointer` (corrupt newest checkpoints are skipped).
    """
    from jax_tinybert.checkpoints import Checkpointer

    if which not in ("best", "latest"):
        raise ValueError(f"which must be 'best' or 'latest', got {which!r}")
    # Same best-metric name as the trainer (train.py saves the dev metric as "main").
    ckpt = Checkpointer(workdir, async_save=False, keep_best=True, best_metric="main",
                        best_mode="max")
    try:
        use_best = which == "best" and ckpt.best_step() is not None
        if which == "best" and not use_best:
            log.warning("%s: no best checkpoint; exporting the latest", workdir)
        step = ckpt.best_step() if use_best else ckpt.latest_step()
        if step is None:
            raise FileNotFoundError(f"{workdir}: no checkpoint to export")
        base = ckpt.best_directory if use_best else ckpt.directory
        abstract = _abstract_from_checkpoint(os.fspath(base / str(step)))
        got = ckpt.restore_best(abstract) if use_best else ckpt.restore_latest(abstract)
    finally:
        ckpt.close()
    step, state, _ = got
    params = state["params"] if isinstance(state, dict) else state.params
    student = _student_tree(params)
    num_labels = int(student["classifier"]["kernel"].shape[-1]) if "classifier" in student else 2
    config, id2label, tokenizer_dir, encoder_only = _student_config(workdir, num_labels)
    if encoder_only:  # general distillation: the head was never trained (as train.py exports)
        student = student["bert"]
    log.info("exporting step %d of %s to %s", step, workdir, out)
    return export_hf(config, student, out, tokenizer_dir=tokenizer_dir, id2label=id2label)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jax_tinybert.export",
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
    sys.exit(main())
