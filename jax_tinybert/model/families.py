"""The encoder families one model implements: BERT, RoBERTa, XLM-RoBERTa and ELECTRA.

They share the transformer layers; they differ in a few facts kept here, so that the model,
the loader and the export read them from one place instead of four copies of the model:

- positions: RoBERTa / XLM-R number real tokens from pad_token_id + 1 (HF
  `create_position_ids_from_input_ids`); BERT and ELECTRA from 0.
- the embedding width: ELECTRA's tables may be narrower (`embedding_size`), projected to the
  hidden size by `embeddings_project` before the first layer.
- the classification head: BERT's pooler (tanh dense on [CLS]) + `classifier`; RoBERTa's and
  ELECTRA's `classifier.dense` (tanh / gelu) + `classifier.out_proj` on the first token, no pooler.
- parameter names: our trees keep BERT's layout for every family (`{"bert": ..., "cls": ...}`),
  so every objective, layer map and sharding rule reads them unchanged; `to_hf` / `from_hf`
  rename flat paths to the family's HF Flax layout on export and load.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Tuple

Path = Tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Family:
    """One family's differences from BERT (see the module docstring)."""

    model_type: str          # HF config.json's model_type
    prefix: str              # HF parameter prefix of the encoder in task models
    class_stem: str          # HF class names: <stem>Model, <stem>ForSequenceClassification
    position_offset: bool    # positions start at pad_token_id + 1
    pooler: bool             # the classifier reads a pooler (BERT) or the first token
    head_activation: str     # of the first-token head's dense layer ("" = BERT's pooler head)
    mlm_prefix: str          # HF name of the masked-LM head's scope


FAMILIES: Dict[str, Family] = {f.model_type: f for f in (
    Family("bert", "bert", "Bert", False, True, "", "cls"),
    Family("roberta", "roberta", "Roberta", True, False, "tanh", "lm_head"),
    Family("xlm-roberta", "roberta", "XLMRoberta", True, False, "tanh", "lm_head"),
    Family("electra", "electra", "Electra", False, False, "gelu", ""),
)}

# Our masked-LM head (BERT's names) <-> RoBERTa's lm_head: the same dense -> gelu -> LayerNorm
# -> tied decoder + bias.
_LM_HEAD = {("cls", "predictions", "transform", "dense"): ("lm_head", "dense"),
            ("cls", "predictions", "transform", "LayerNorm"): ("lm_head", "layer_norm"),
            ("cls", "predictions", "bias"): ("lm_head", "bias")}


def of(config) -> Family:
    """The family of a BertConfig (its model_type)."""
    return FAMILIES[config.model_type]


def _swap(path: Path, table: Dict[Path, Path]) -> Path:
    for a, b in table.items():
        if path[:len(a)] == a:
            return b + path[len(a):]
    return path


def to_hf(family: Family, path: Path) -> Path:
    """Our flat parameter path -> the family's HF Flax path (same array)."""
    if family.model_type == "bert":
        return path
    if family.mlm_prefix == "lm_head":
        path = _swap(path, _LM_HEAD)
    root = path[:1] == ("bert",)
    body = path[1:] if root else path
    if body[:2] == ("embeddings", "embeddings_project"):   # ELECTRA: beside the embeddings
        body = body[1:]
    return ((family.prefix,) + body) if root else body


def from_hf(family: Family, path: Path) -> Path:
    """The family's HF Flax path -> ours (the inverse of `to_hf`)."""
    if family.model_type == "bert":
        return path
    if family.mlm_prefix == "lm_head":
        path = _swap(path, {b: a for a, b in _LM_HEAD.items()})
    root = path[:1] == (family.prefix,)
    body = path[1:] if root else path
    if body[:1] == ("embeddings_project",):
        body = ("embeddings",) + body
    return (("bert",) + body) if root else body


def rename(tree: dict, fn, family: Family) -> dict:
    """A nested dict with every leaf path mapped by fn(family, path)."""
    out: dict = {}

    def walk(t, prefix):
        for k, v in t.items():
            if isinstance(v, dict) or hasattr(v, "items"):
                walk(v, prefix + (k,))
            else:
                d = out
                new = fn(family, prefix + (k,))
                for p in new[:-1]:
                    d = d.setdefault(p, {})
                d[new[-1]] = v
    walk(tree, ())
    return out


def head_labels(classifier: dict) -> int:
    """The label count of a classifier's params, either head kind (BERT's `kernel` [D, C],
    RoBERTa's / ELECTRA's `out_proj/kernel` [D, C])."""
    return int(classifier.get("out_proj", classifier)["kernel"].shape[-1])
