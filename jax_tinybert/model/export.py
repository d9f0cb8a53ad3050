"""Export a student as a Hugging Face BERT folder (Flax, PyTorch and tokenizer files).

    export_hf(config, params, out_dir, tokenizer_dir=None, id2label=None)

A training run's checkpoint is exported by `jax_tinybert.cli.export` (which calls this).

The folder loads with `FlaxBertForSequenceClassification` / `BertForSequenceClassification`
(or `*ForQuestionAnswering` / `*ForTokenClassification` for a span or token head, `*BertModel`
for an encoder-only export, each family its own classes) from transformers 4.x and with
`jax_tinybert.load_pretrained`. The PyTorch weights are written by us, not converted by
transformers (its `from_flax=True` path leaves weights on the meta device in 4.57).
Writes are atomic: everything goes to a temporary folder beside `out_dir`, which is renamed
into place only when complete. Call it from one process (process 0).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any, Dict, Optional

import jax
import numpy as np

from jax_tinybert import fs
from jax_tinybert.model import families, heads, hf
from jax_tinybert.model.modeling import (BertConfig, BertForMaskedLM, BertForSequenceClassification,
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

def student_tree(params: Any) -> dict:
    """Host float32 numpy tree in HF Flax layout; accepts TrainState-style {"student", "proj"}."""
    params = dict(params)
    if "student" in params:
        params = dict(params["student"])
    dropped = [k for k in ("proj",) if params.pop(k, None) is not None]
    if dropped:
        log.info("export: projection params are not part of the model; not exported")
    return jax.tree_util.tree_map(lambda x: np.asarray(jax.device_get(x), np.float32), params)


def _check_shapes(config: BertConfig, tree: dict, head: Optional[str]) -> None:
    expected = jax.eval_shape(lambda: init_params(BertForSequenceClassification(config),
                                                  jax.random.PRNGKey(0)))
    if head is None:
        hf._check_against(expected["bert"], tree, "export params", "encoder")
        return
    bert = expected["bert"]
    if head != "sequence":   # HF's span and token models have no pooler (export_hf drops it)
        bert = {k: v for k, v in bert.items() if k != "pooler"}
    hf._check_against(bert, tree["bert"], "export params", "encoder")
    name = heads.NAMES[head][0]
    want = expected["classifier"] if head == "sequence" else jax.eval_shape(
        lambda: heads.init_head(config, head, jax.random.PRNGKey(0)))
    hf._check_against(want, tree[name], "export params", f"{name} (num_labels = config.num_labels)")


def export_hf(config: BertConfig, params: Any, out_dir: str, tokenizer_dir: Optional[str] = None,
              id2label: Optional[dict] = None) -> str:
    """Write an HF BERT folder at `out_dir`; returns out_dir.

    params: `BertModel` params (embeddings/encoder/pooler) -> architectures ["BertModel"], or
    `{"bert", "classifier"}` -> ["BertForSequenceClassification"] with num_labels =
    classifier width (1 = regression), `{"bert", "qa_outputs"}` -> ["BertForQuestionAnswering"],
    `{"bert", "token_classifier"}` -> ["BertForTokenClassification"] (HF's `classifier`), or `{"bert", "cls"}` (a masked-LM head, HF names
    cls.predictions.*) -> ["BertForMaskedLM"]. A `{"student", "proj"}` dict is accepted; "proj" is
    dropped. id2label: {int: str}, overrides config.id2label.
    Files: config.json, flax_model.msgpack (bare HF Flax dict), model.safetensors (PyTorch
    names, Linear kernels transposed) and the tokenizer files found in tokenizer_dir.
    """
    tree = student_tree(params)
    if "cls" in tree:
        return _export_mlm(config, tree, out_dir, tokenizer_dir)
    head = heads.head_of(tree)
    if head is not None and "bert" not in tree:
        raise ValueError(f"export_hf: a {heads.NAMES[head][0]} head without 'bert' params; pass "
                         f"{{'bert': ..., '{heads.NAMES[head][0]}': ...}} or the bare BertModel "
                         "params")
    allowed = {"bert", heads.NAMES[head][0]} if head else {"embeddings", "encoder", "pooler"}
    unknown = set(tree) - allowed
    if unknown:
        raise ValueError(f"export_hf: unexpected top-level params {sorted(unknown)}; expected "
                         "BertModel params or {'bert', <one head>} (classifier, qa_outputs, "
                         "token_classifier)")
    if head in ("span", "token"):
        tree["bert"] = {k: v for k, v in tree["bert"].items() if k != "pooler"}
    if head is not None:
        top = tree[heads.NAMES[head][0]]
        n = families.head_labels(top) if head == "sequence" else int(top["kernel"].shape[-1])
        if n != config.num_labels:
            config = config.replace(num_labels=n, id2label=None)
    if id2label is not None and head != "span":
        id2label = {int(k): str(v) for k, v in dict(id2label).items()}
        if len(id2label) != config.num_labels:
            raise ValueError(f"export_hf: id2label has {len(id2label)} labels, the model "
                             f"{config.num_labels}")
        config = config.replace(id2label=id2label)
    _check_shapes(config, tree, head)

    cfg = config.to_dict()
    stem = families.of(config).class_stem
    cfg["architectures"] = [stem + (heads.NAMES[head][2] if head else "Model")]
    if head == "sequence" and config.num_labels == 1:
        cfg.setdefault("problem_type", "regression")
    return _write_hf(config, out_dir, cfg, tree, tokenizer_dir)


def _write_hf(config: BertConfig, out_dir: str, cfg: dict, tree: dict,
              tokenizer_dir: Optional[str]) -> str:
    """Our tree renamed to the family's HF layout (families.to_hf), written as both weights."""
    tree = heads.to_hf(families.rename(tree, families.to_hf, families.of(config)))
    return _write_folder(out_dir, cfg, tree, hf.params_to_torch_state_dict(tree), tokenizer_dir)


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
    fam = families.of(config)
    if not fam.mlm_prefix:
        raise ValueError(f"export_hf: {config.model_type} models have no masked-LM head class "
                         "to export to")
    cfg = config.replace(id2label=None).to_dict()
    cfg["architectures"] = [f"{fam.class_stem}ForMaskedLM"]
    cfg["tie_word_embeddings"] = True
    return _write_hf(config, out_dir, cfg, tree, tokenizer_dir)


def _write_folder(out_dir: str, cfg: dict, tree: dict, torch_state: dict,
                  tokenizer_dir: Optional[str]) -> str:
    """Writes config.json, the weights and the tokenizer into a temp folder renamed to out_dir."""
    out_dir = fs.abspath(out_dir)
    if fs.exists(out_dir) and not fs.isdir(out_dir):
        raise FileExistsError(f"export_hf: {out_dir} exists and is not a folder")
    # Hidden and beside out_dir, so a crashed export never looks like a model folder (for a
    # bucket: staged locally, uploaded beside it, copied into place with config.json last).
    fs.clean_stale_temps(out_dir)
    tmp = fs.staging_dir(out_dir)
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
        fs.publish_dir(tmp, out_dir, last=[CONFIG_FILE])
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
