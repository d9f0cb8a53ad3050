"""Per-position heads: span extraction (SQuAD) and token classification (CoNLL NER).

Both read every token of the last layer, so they ignore `cls_only` (which would compute only
its [CLS] row). Parameter names: our trees keep `{"bert": ..., <head>: ...}` as for sequence
classification; the head is `qa_outputs` (HF's name in every family) or `token_classifier`
(HF's `classifier`, renamed so that it is not taken for a sequence classifier, whose
RoBERTa / DistilBERT forms have other params under that name):

    head      ours               HF                   class
    span      qa_outputs         qa_outputs           <Family>ForQuestionAnswering
    token     token_classifier   classifier           <Family>ForTokenClassification
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from jax_tinybert.data import conll

from jax_tinybert.model.modeling import BertModel, LayerSelection, _BertModule
from jax_tinybert.speed.dropout import Dropout

HEADS = ("sequence", "span", "token")
# head -> (our top-level name, HF's, HF class suffix)
NAMES: Dict[str, Tuple[str, str, str]] = {
    "sequence": ("classifier", "classifier", "ForSequenceClassification"),
    "span": ("qa_outputs", "qa_outputs", "ForQuestionAnswering"),
    "token": ("token_classifier", "classifier", "ForTokenClassification"),
}
# A masked position's logit: far below any real one, finite after division by a temperature
# (so that soft cross-entropies give 0 * (-big) = 0 there, not NaN).
MASKED_LOGIT = -1e9


def head_of(tree: dict) -> Optional[str]:
    """The head of a parameter tree ({"bert", <head params>}), or None for a bare encoder."""
    for head in ("span", "token", "sequence"):
        if NAMES[head][0] in tree:
            return head
    return None


def from_architectures(architectures) -> str:
    """An HF config's `architectures` -> the head its checkpoint holds ("sequence" by default)."""
    for head in ("span", "token"):
        if any(str(a).endswith(NAMES[head][2]) for a in architectures or ()):
            return head
    return "sequence"


def to_hf(tree: dict) -> dict:
    """Our top-level head name -> HF's (after `families.to_hf`)."""
    tree = dict(tree)
    if "token_classifier" in tree:
        tree["classifier"] = tree.pop("token_classifier")
    return tree


def from_hf(tree: dict, head: str) -> dict:
    """HF's top-level head name -> ours for a checkpoint holding `head` (before
    `families.from_hf`, which would read a token classifier as DistilBERT's sequence head)."""
    tree = dict(tree)
    if head == "token" and "classifier" in tree:
        tree["token_classifier"] = tree.pop("classifier")
    tree.pop("dropout", None)
    return tree


class BertForQuestionAnswering(_BertModule):
    """Encoder + `qa_outputs` (dense to 2) on every token: logits [B, 2, T] float32, row 0 the
    start and row 1 the end logits, so that a softmax over the last axis is one over
    positions; positions where attention_mask is 0 hold MASKED_LOGIT. num_labels must be 2.
    DistilBERT drops the hidden states before the head (its HF class does); the others do not."""

    remat: bool = False

    @nn.compact
    def __call__(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None,
                 deterministic: bool = True, attention_logits: LayerSelection = True,
                 cls_only: bool = False, cls_positions=None, qkv_layers: LayerSelection = None):
        del cls_only   # every position's logits are read
        out = BertModel(**self._shared(), add_pooling_layer=False, remat=self.remat,
                        name="bert")(input_ids, attention_mask, token_type_ids, position_ids,
                                     deterministic, attention_logits, False, cls_positions,
                                     qkv_layers)
        h = out.hidden_states[-1]
        if self.config.model_type == "distilbert":
            h = Dropout(rate=self.config.hidden_dropout_prob)(h, deterministic=deterministic)
        logits = self._dense(2, "qa_outputs")(h).astype(jnp.float32)   # [B, T, 2]
        logits = jnp.swapaxes(logits, 1, 2)
        if attention_mask is not None:
            logits = jnp.where(attention_mask[:, None, :] > 0, logits, MASKED_LOGIT)
        return out.replace(logits=logits)


class BertForTokenClassification(_BertModule):
    """Encoder + dropout + `token_classifier` (dense to num_labels) on every token: logits
    [B, T, num_labels] float32 (HF's `classifier`)."""

    remat: bool = False

    @nn.compact
    def __call__(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None,
                 deterministic: bool = True, attention_logits: LayerSelection = True,
                 cls_only: bool = False, cls_positions=None, qkv_layers: LayerSelection = None):
        del cls_only
        out = BertModel(**self._shared(), add_pooling_layer=False, remat=self.remat,
                        name="bert")(input_ids, attention_mask, token_type_ids, position_ids,
                                     deterministic, attention_logits, False, cls_positions,
                                     qkv_layers)
        h = Dropout(rate=self.config.hidden_dropout_prob)(out.hidden_states[-1],
                                                          deterministic=deterministic)
        logits = self._dense(self.config.num_labels, "token_classifier")(h)
        return out.replace(logits=logits.astype(jnp.float32))


MODELS = {"span": BertForQuestionAnswering, "token": BertForTokenClassification}


def init_head(config, head: str, rng) -> dict:
    """A new `head` ({"kernel": [D, n], "bias": [n]}, N(0, initializer_range), zero bias) for
    the span (n = 2) or token (n = num_labels) head, without building the encoder."""
    n = 2 if head == "span" else config.num_labels
    dense = nn.Dense(n, kernel_init=nn.initializers.normal(config.initializer_range))
    return dense.init(rng, jnp.zeros((1, config.hidden_size), jnp.float32))["params"]


def relabel(config, params: dict, labels, who: str = "teacher"):
    """A token head's outputs put in `labels`' order by name (a hub NER model's id2label may
    order them otherwise): the classifier's columns and bias permuted, id2label replaced.
    Unnamed labels (LABEL_i) are taken as already in order; a model that names other labels
    stops with one line (conll.remap). -> (config, params)."""
    names = config.id2label or {}
    ordered = [names.get(i) for i in range(len(names))]
    if not names or ordered == list(labels) or all(v == f"LABEL_{k}" for k, v in names.items()):
        return config, params
    ours = conll.remap(names, labels, who)   # the model's output i is our label ours[i]
    take = np.argsort(ours)                  # our label j is the model's output take[j]
    head = params["token_classifier"]
    new = {"kernel": np.asarray(head["kernel"])[:, take], "bias": np.asarray(head["bias"])[take]}
    return (config.replace(id2label=dict(enumerate(labels))),
            dict(params, token_classifier=new))
