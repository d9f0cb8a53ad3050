"""The encoder families one model implements: BERT, RoBERTa, XLM-RoBERTa, ELECTRA, DistilBERT.

They share the transformer layers; they differ in a few facts kept here, so that the model,
the loader and the export read them from one place instead of four copies of the model:

- positions: RoBERTa / XLM-R number real tokens from pad_token_id + 1 (HF
  `create_position_ids_from_input_ids`); BERT and ELECTRA from 0.
- the embedding width: ELECTRA's tables may be narrower (`embedding_size`), projected to the
  hidden size by `embeddings_project` before the first layer.
- the classification head: BERT's pooler (tanh dense on [CLS]) + `classifier`; RoBERTa's and
  ELECTRA's `classifier.dense` (tanh / gelu) + `classifier.out_proj` on the first token, no pooler;
  DistilBERT's `pre_classifier` + ReLU + `classifier` (ours: classifier/dense, out_proj).
- DistilBERT: no token types, its own names for the same post-LN layers.
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
    mlm_prefix: str          # HF name of the masked-LM head's scope ("" = none)
    token_types: bool = True         # a token-type table (DistilBERT has none)
    head_dropout_first: bool = True  # the first-token head drops its input (not DistilBERT's)
    encoder: str = "encoder"         # HF name of the layer stack's scope


FAMILIES: Dict[str, Family] = {f.model_type: f for f in (
    Family("bert", "bert", "Bert", False, True, "", "cls"),
    Family("roberta", "roberta", "Roberta", True, False, "tanh", "lm_head"),
    Family("xlm-roberta", "roberta", "XLMRoberta", True, False, "tanh", "lm_head"),
    Family("electra", "electra", "Electra", False, False, "gelu", ""),
    # pre_classifier + ReLU + classifier on [CLS]; the same post-LN layers under other names.
    Family("distilbert", "distilbert", "DistilBert", False, False, "relu", "vocab",
           token_types=False, head_dropout_first=False, encoder="transformer"),
)}

# Our names -> the family's, by path prefix. Heads (top level): the masked-LM heads are BERT's
# dense -> gelu -> LayerNorm -> tied decoder + bias under other names.
_LM_HEAD = {("cls", "predictions", "transform", "dense"): ("lm_head", "dense"),
            ("cls", "predictions", "transform", "LayerNorm"): ("lm_head", "layer_norm"),
            ("cls", "predictions", "bias"): ("lm_head", "bias")}
_TOP = {
    "roberta": _LM_HEAD, "xlm-roberta": _LM_HEAD,
    "distilbert": {("cls", "predictions", "transform", "dense"): ("vocab_transform",),
              ("cls", "predictions", "transform", "LayerNorm"): ("vocab_layer_norm",),
              ("cls", "predictions", "bias"): ("vocab_projector", "bias"),
              ("classifier", "dense"): ("pre_classifier",),
              ("classifier", "out_proj"): ("classifier",)},
}
# Inside a layer (after encoder/layer/<i>): DistilBERT's names of BERT's sub-layers.
_LAYER = {"distilbert": {
    ("attention", "self", "query"): ("attention", "q_lin"),
    ("attention", "self", "key"): ("attention", "k_lin"),
    ("attention", "self", "value"): ("attention", "v_lin"),
    ("attention", "output", "dense"): ("attention", "out_lin"),
    ("attention", "output", "LayerNorm"): ("sa_layer_norm",),
    ("intermediate", "dense"): ("ffn", "lin1"),
    ("output", "dense"): ("ffn", "lin2"),
    ("output", "LayerNorm"): ("output_layer_norm",)}}


def of(config) -> Family:
    """The family of a BertConfig (its model_type)."""
    return FAMILIES[config.model_type]


def _swap(path: Path, table: Dict[Path, Path]) -> Path:
    for a, b in table.items():
        if path[:len(a)] == a:
            return b + path[len(a):]
    return path


def _inverse(table: Dict[Path, Path]) -> Dict[Path, Path]:
    return {b: a for a, b in table.items()}


def _body(family: Family, body: Path, to: bool) -> Path:
    """Below the encoder prefix: ELECTRA's projection, the layer stack's and layers' names."""
    if to and body[:2] == ("embeddings", "embeddings_project"):   # ELECTRA: beside them
        return body[1:]
    if not to and body[:1] == ("embeddings_project",):
        return ("embeddings",) + body
    ours, theirs = ("encoder", "layer"), (family.encoder, "layer")
    src, dst = (ours, theirs) if to else (theirs, ours)
    if body[:2] == src and len(body) > 2:
        table = _LAYER.get(family.model_type, {})
        inner = _swap(body[3:], table if to else _inverse(table))
        return dst + (body[2],) + inner
    return body


def to_hf(family: Family, path: Path) -> Path:
    """Our flat parameter path -> the family's HF Flax path (same array)."""
    if family.model_type == "bert":
        return path
    path = _swap(path, _TOP.get(family.model_type, {}))
    if path[:1] == ("bert",):
        return (family.prefix,) + _body(family, path[1:], True)
    return _body(family, path, True)


def from_hf(family: Family, path: Path) -> Path:
    """The family's HF Flax path -> ours (the inverse of `to_hf`)."""
    if family.model_type == "bert":
        return path
    path = _swap(path, _inverse(_TOP.get(family.model_type, {})))
    if path[:1] == (family.prefix,):
        return ("bert",) + _body(family, path[1:], False)
    return _body(family, path, False)


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
