"""Hugging Face BERT checkpoints <-> our Flax parameter trees.

Reads `model.safetensors`, `pytorch_model.bin` (torch.load with weights_only=True, never plain
pickle) or `flax_model.msgpack` from an HF folder; a hub name goes through `huggingface_hub`.
PyTorch -> Flax is a rename plus a transpose of Linear weights (see params_to_torch_state_dict).
"""
from __future__ import annotations

import logging
import os
from typing import Dict, Optional, Tuple

import jax
import numpy as np

from jax_tinybert import fs
from jax_tinybert.errors import PathError, UserError
from jax_tinybert.model import families, heads
from jax_tinybert.model.modeling import (BertConfig, BertForSequenceClassification, init_classifier,
                                   init_params, random_params)

log = logging.getLogger(__name__)

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "flax_model.msgpack")
# Files besides the weights that make a folder loadable by HF (copied on export).
TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "added_tokens.json",
                   # RoBERTa's BPE and XLM-R's SentencePiece files, for folders without tokenizer.json
                   "vocab.json", "merges.txt", "sentencepiece.bpe.model")


class WeightsError(UserError, ValueError):
    """A checkpoint's weights do not fit the config (missing, unexpected or mis-shaped)."""


def _flatten(tree, prefix=()) -> Dict[Tuple[str, ...], np.ndarray]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) or hasattr(v, "items"):
            out.update(_flatten(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


def _unflatten(flat: Dict[Tuple[str, ...], np.ndarray]) -> dict:
    tree: dict = {}
    for path, v in flat.items():
        d = tree
        for k in path[:-1]:
            d = d.setdefault(k, {})
        d[path[-1]] = v
    return tree


# --- PyTorch names <-> Flax paths -----------------------------------------------------------

def _torch_key_to_path(key: str) -> Optional[Tuple[Tuple[str, ...], bool]]:
    """'bert.encoder.layer.0.attention.self.query.weight' -> (path, transpose) or None if ignored."""
    if key.endswith(("position_ids", "token_type_ids")) or key.startswith("cls.seq_relationship") \
            or key in ("lm_head.decoder.weight", "lm_head.decoder.bias",   # tied / = lm_head.bias
                       "vocab_projector.weight"):
        return None
    parts = key.split(".")
    leaf = parts[-1]
    mods = parts[:-1]
    last_mod = mods[-1] if mods else ""
    if last_mod.endswith("_embeddings") and leaf == "weight":
        return tuple(mods) + ("embedding",), False
    if last_mod == "LayerNorm" or last_mod.endswith("layer_norm") or leaf in ("gamma", "beta"):
        name = {"weight": "scale", "gamma": "scale", "bias": "bias", "beta": "bias"}[leaf]
        return tuple(mods) + (name,), False
    if key == "cls.predictions.bias" or key == "cls.predictions.decoder.bias":
        return ("cls", "predictions", "bias"), False
    if key == "cls.predictions.decoder.weight":
        return None  # tied to the word embeddings
    if leaf == "weight":
        return tuple(mods) + ("kernel",), True
    if leaf == "bias":
        return tuple(mods) + ("bias",), False
    raise WeightsError(f"unrecognised weight name {key!r}")


def torch_state_dict_to_params(state: Dict[str, np.ndarray]) -> dict:
    """PyTorch `BertModel`/`BertFor*` state dict (numpy values) -> Flax params with HF Flax layout.

    Keys keep their top-level prefix (`bert.`, `classifier.`, `cls.`); use `_normalise_layout`
    to get the layout a given module expects.
    """
    flat = {}
    for key, value in state.items():
        mapped = _torch_key_to_path(key)
        if mapped is None:
            continue
        path, transpose = mapped
        v = np.asarray(value)
        flat[path] = v.T if transpose else v
    return _unflatten(flat)


def params_to_torch_state_dict(params: dict) -> Dict[str, np.ndarray]:
    """Flax params (HF Flax layout, any prefix) -> PyTorch names, Linear kernels transposed.

    Shapes: kernel [in, out] -> weight [out, in]; embeddings unchanged; LayerNorm scale -> weight.
    """
    out = {}
    for path, v in _flatten(params).items():
        v = np.asarray(jax.device_get(v))
        leaf = path[-1]
        mods = ".".join(path[:-1])
        if leaf == "embedding":
            out[f"{mods}.weight"] = v
        elif leaf == "kernel":
            out[f"{mods}.weight"] = np.ascontiguousarray(v.T)
        elif leaf == "scale":
            out[f"{mods}.weight"] = v
        elif path in (("cls", "predictions", "bias"), ("lm_head", "bias")):   # not DistilBERT's
            out[f"{mods}.bias"] = v
            out[f"{mods}.decoder.bias"] = v   # PyTorch's tied decoder holds the bias too
        else:
            out[f"{mods}.{leaf}"] = v
    return out


# --- reading files ---------------------------------------------------------------------------

def _unreadable(path: str, e: Exception) -> WeightsError:
    size = os.path.getsize(path) if os.path.exists(path) else 0
    return WeightsError(f"{path}: cannot read the weights ({type(e).__name__}: {e}; the file has "
                        f"{size:,} bytes, it is probably truncated or damaged); re-export or "
                        "re-download the model folder")


def _read_safetensors(path: str) -> Dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    try:
        return load_file(path)
    except Exception as e:  # SafetensorError never names the file
        raise _unreadable(path, e) from e


def _read_torch_bin(path: str) -> Dict[str, np.ndarray]:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - torch is a test extra
        raise ImportError(f"{path}: reading pytorch_model.bin needs torch (pip install torch), "
                          "or convert the folder to model.safetensors") from e
    try:
        sd = torch.load(path, map_location=lambda storage, _: storage, weights_only=True)
    except Exception as e:
        raise _unreadable(path, e) from e
    return {k: v.float().numpy() if v.is_floating_point() else v.numpy() for k, v in sd.items()}


def _read_msgpack(path: str) -> dict:
    from flax import serialization

    with open(path, "rb") as fh:
        raw = fh.read()
    try:
        return serialization.msgpack_restore(raw)
    except Exception as e:
        raise _unreadable(path, e) from e


# URL -> its local copy, so that a process downloads a model folder in a bucket once, however
# many loaders (config check, teacher, student, tokenizer) ask for it.
_MIRRORS: Dict[str, str] = {}


def _remote_folder(url: str) -> str:
    """A local copy of the model folder at `url` (gs://...), downloaded once per process."""
    key = url.rstrip("/")
    if key not in _MIRRORS:
        try:
            fs.check_reachable(key)
            there = fs.isdir(key)
        except fs.RemoteFSError as e:
            raise PathError(f"{url!r}: {e}") from e
        if not there:
            raise PathError(f"{url!r}: no such folder in the bucket; pass a folder holding "
                            f"config.json and one of {', '.join(WEIGHT_FILES)} (e.g. a run's "
                            "<workdir>/export)")
        _MIRRORS[key] = fs.local_mirror(key)
    return _MIRRORS[key]


def resolve_path(path_or_name: str) -> str:
    """A local HF folder, a folder in a bucket (gs://..., copied to a local folder once per
    process), or a hub name downloaded through huggingface_hub (online only).

    Raises PathError naming the path: a local path (starts with '.', '/', '~' or has more
    than one '/') that is not a folder is never looked up on the hub.
    """
    if fs.is_remote(str(path_or_name)):
        return _remote_folder(str(path_or_name))
    path_or_name = os.path.expanduser(str(path_or_name))
    if os.path.isdir(path_or_name):
        return path_or_name
    if os.path.exists(path_or_name):
        raise PathError(f"{path_or_name} is a file, not a model folder; pass the FOLDER holding "
                        "config.json and the weights")
    where = f"no such folder (relative to {os.getcwd()})"
    fix = (f"pass a folder holding config.json and one of {', '.join(WEIGHT_FILES)} (e.g. a "
           "run's <workdir>/export), 'packaged' for the packaged MiniLM teacher, or a Hugging "
           "Face hub name when online")
    if path_or_name.startswith((".", "/", "~")) or path_or_name.count("/") > 1 or \
            not path_or_name:
        raise PathError(f"{path_or_name!r}: {where}; {fix}")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path_or_name, allow_patterns=[
            "config.json", *WEIGHT_FILES, *TOKENIZER_FILES])
    except Exception as e:  # offline, unknown repo, no hub package
        reason = " ".join(str(e).split()).split(". ")[0][:160]
        raise PathError(f"{path_or_name!r}: {where}, and not downloadable from the Hugging Face "
                        f"hub ({type(e).__name__}: {reason}); {fix}") from e


def _raw_weights(folder: str) -> Tuple[dict, str]:
    for name in WEIGHT_FILES:
        p = os.path.join(folder, name)
        if os.path.exists(p):
            if name == "flax_model.msgpack":
                return _read_msgpack(p), p
            reader = _read_safetensors if name.endswith("safetensors") else _read_torch_bin
            return torch_state_dict_to_params(reader(p)), p
    raise PathError(f"{folder}: no weights file; expected one of {', '.join(WEIGHT_FILES)}")


def _split_layout(tree: dict) -> Tuple[dict, Dict[str, dict], Optional[dict]]:
    """-> (bert params, {head name: params} of the task heads found, MLM head or None) from
    any HF layout (the heads' names ours: `heads.from_hf` first)."""
    tree = dict(tree)
    if "params" in tree and len(tree) == 1:  # a msgpack saved with the linen wrapper
        tree = dict(tree["params"])
    found = {n: tree.pop(n) for n in (v[0] for v in heads.NAMES.values()) if n in tree}
    mlm = tree.pop("cls", None)
    if "bert" in tree:
        bert = tree.pop("bert")
        tree.pop("dropout", None)
    else:
        bert = {k: tree.pop(k) for k in ("embeddings", "encoder", "pooler") if k in tree}
    if tree:
        log.warning("ignoring unexpected top-level weights: %s", sorted(tree))
    return bert, found, mlm


def _check_against(expected: dict, got: dict, source: str, what: str) -> dict:
    """Every expected leaf present with the expected shape; returns `got` cast to float32."""
    exp_flat, got_flat = _flatten(expected), _flatten(got)
    missing = sorted("/".join(k) for k in exp_flat if k not in got_flat)
    unexpected = sorted("/".join(k) for k in got_flat if k not in exp_flat)
    bad = [f"{'/'.join(k)}: checkpoint {tuple(np.shape(got_flat[k]))}, config expects "
           f"{tuple(exp_flat[k].shape)}" for k in exp_flat
           if k in got_flat and tuple(np.shape(got_flat[k])) != tuple(exp_flat[k].shape)]
    if missing or bad:
        msg = [f"{source}: the {what} weights do not fit its config.json"]
        if missing:
            msg.append(f"missing ({len(missing)}): {', '.join(missing[:12])}"
                       + (" ..." if len(missing) > 12 else ""))
        if bad:
            msg.append("wrong shape: " + "; ".join(bad[:8]))
        raise WeightsError("\n  ".join(msg))
    if unexpected:
        log.warning("%s: ignoring unexpected weights: %s", source, ", ".join(unexpected[:20]))
    return _unflatten({k: np.asarray(got_flat[k], dtype=np.float32) for k in exp_flat})


def load_pretrained(path_or_name: str, *, for_classification: Optional[bool] = None,
                    num_labels: Optional[int] = None, mlm_head: bool = False,
                    seed: int = 0, head: str = "sequence") -> Tuple[BertConfig, dict]:
    """Load an HF BERT-family folder or hub name -> (BertConfig, params).

    Layout of `params`: `BertModel` params (embeddings/encoder/pooler) by default; with a
    classifier in the checkpoint or `for_classification=True`: `{"bert": ..., "classifier": ...}`
    for `BertForSequenceClassification` (a missing classifier is initialised from `seed`, with a
    warning); with `mlm_head=True`: `{"bert": ..., "cls": ...}` for `BertForMaskedLM`.
    `num_labels` overrides the config (a new head is then initialised). `head` "span" / "token"
    with `for_classification=True`: `{"bert", "qa_outputs" | "token_classifier"}` for
    `heads.BertForQuestionAnswering` / `BertForTokenClassification` (an *ForQuestionAnswering /
    *ForTokenClassification checkpoint's head, else a new one; span heads have num_labels 2).
    """
    folder = resolve_path(path_or_name)
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.exists(cfg_path):
        raise PathError(f"{folder}: no config.json; an HF model folder needs config.json "
                                f"and one of {', '.join(WEIGHT_FILES)}")
    config = BertConfig.from_json_file(cfg_path)
    raw, weights_path = _raw_weights(folder)
    if "params" in raw and len(raw) == 1:  # a msgpack saved with the linen wrapper
        raw = dict(raw["params"])
    ckpt_head = heads.from_architectures(config.extra.get("architectures"))
    raw = heads.from_hf(raw, ckpt_head)
    bert, found, mlm = _split_layout(families.rename(raw, families.from_hf, families.of(config)))
    name = heads.NAMES[head][0]
    if head == "span":
        num_labels = 2
    if num_labels is not None and num_labels != config.num_labels:
        config = config.replace(num_labels=num_labels, id2label=None)
        found.pop(name, None)
    model = BertForSequenceClassification(config)
    expected = jax.eval_shape(lambda: init_params(model, jax.random.PRNGKey(0)))
    if head != "sequence":   # HF's span and token models have no pooler
        bert = {k: v for k, v in bert.items() if k != "pooler"}
        expected["bert"] = {k: v for k, v in expected["bert"].items() if k != "pooler"}
    elif ckpt_head != "sequence" and "pooler" not in bert and "pooler" in expected["bert"]:
        # a QA / NER checkpoint read as an encoder: a new pooler, as HF's BertModel does
        log.warning("%s: a %s checkpoint has no pooler; initialising one (seed %d)",
                    weights_path, ckpt_head, seed)
        bert = dict(bert, pooler=jax.tree_util.tree_map(np.asarray, random_params(
            BertForSequenceClassification(config), seed)["bert"]["pooler"]))
    bert = _check_against(expected["bert"], bert, weights_path, "encoder")
    if mlm_head:
        if mlm is None:
            raise WeightsError(f"{weights_path}: no masked-LM head (cls.predictions.*) in this "
                               "checkpoint; pick a BERT checkpoint trained with MLM")
        return config, {"bert": bert, "cls": jax.tree_util.tree_map(
            lambda x: np.asarray(x, np.float32), mlm)}
    if for_classification is None:
        for_classification = name in found
    if not for_classification:
        return config, bert
    got = found.get(name)
    if got is None:
        log.warning("%s: no %s weights for %d labels; initialising a new head (seed %d): "
                    "fine-tune before use", weights_path, name, config.num_labels, seed)
        rng = jax.random.PRNGKey(seed)
        new = init_classifier(config, rng) if head == "sequence" else \
            heads.init_head(config, head, rng)
        return config, {"bert": bert, name: jax.tree_util.tree_map(np.asarray, new)}
    if head == "sequence":
        want = expected["classifier"]
    else:
        want = jax.eval_shape(lambda: heads.init_head(config, head, jax.random.PRNGKey(0)))
    return config, {"bert": bert, name: _check_against(want, got, weights_path, name)}


def bert_params(params: dict) -> dict:
    """The encoder part of either layout."""
    return params["bert"] if "bert" in params else params
