"""How a student starts: copied teacher layers or random weights of the config's shape.

Both return (BertConfig, params as float32 numpy) in `BertForSequenceClassification`'s layout
({"bert", "classifier"}), or for a span / token head {"bert", "qa_outputs" | "token_classifier"}
(model/heads.py); `build.build_models` picks one by `config.student.init`.
"""
from __future__ import annotations

from typing import Tuple

import jax

from jax_tinybert.config.check import ConfigValueError
from jax_tinybert.model import heads as task_heads
from jax_tinybert.model.hf import bert_params
from jax_tinybert.model.modeling import (BertConfig, BertForSequenceClassification,
                                         init_classifier, random_params)


def from_teacher_layers(sc, tcfg: BertConfig, tparams: dict, num_labels: int,
                        rng: jax.Array, head: str = "sequence") -> Tuple[BertConfig, dict]:
    """A student of the teacher's layers `sc.teacher_layers` (1-based), its embeddings and
    pooler, and its classifier where the label count matches (else a new one from `rng`).
    `sc.teacher_layers_heads` (0 = the teacher's) splits the same weights into other heads."""
    layers = tuple(int(i) for i in sc.teacher_layers)
    if not layers or any(not 1 <= i <= tcfg.num_hidden_layers for i in layers):
        raise ConfigValueError(f"config.student.teacher_layers={layers}: need 1-based teacher "
                               f"layers in 1..{tcfg.num_hidden_layers}")
    heads = int(sc.get("teacher_layers_heads", 0)) or tcfg.num_attention_heads
    if tcfg.hidden_size % heads:
        raise ConfigValueError(f"config.student.teacher_layers_heads={heads} does not divide the "
                               f"teacher's hidden_size {tcfg.hidden_size}; pick a divisor")
    scfg = tcfg.replace(num_hidden_layers=len(layers), num_labels=num_labels, id2label=None,
                        num_attention_heads=heads)
    tb = bert_params(tparams)
    enc = {str(i): tb["encoder"]["layer"][str(t - 1)] for i, t in enumerate(layers)}
    bert = {**{k: v for k, v in tb.items() if k != "encoder"}, "encoder": {"layer": enc}}
    if head != "sequence":
        return scfg, _with_head(scfg, {k: v for k, v in bert.items() if k != "pooler"}, head,
                                tparams if tcfg.num_labels == num_labels else {}, rng)
    same_head = tcfg.num_labels == num_labels and "classifier" in tparams
    classifier = tparams["classifier"] if same_head else init_classifier(scfg, rng)
    return scfg, {"bert": bert, "classifier": classifier}


def _with_head(scfg: BertConfig, bert: dict, head: str, tparams: dict, rng) -> dict:
    """{"bert", <head>}: the teacher's head where it has this one, else a new one."""
    name = task_heads.NAMES[head][0]
    params = tparams.get(name)
    return {"bert": bert, name: params if params is not None else
            task_heads.init_head(scfg, head, rng)}


def random_student(sc, tcfg: BertConfig, num_labels: int, seed: int,
                   head: str = "sequence") -> Tuple[BertConfig, dict]:
    """A student of `sc`'s shape (layers, width, heads, FFN) of the teacher's family, on its
    vocabulary and positions (padding index, activation, LayerNorm epsilon), with HF's initial
    distribution (`modeling.random_params`). An ELECTRA student's tables are as wide as it is."""
    scfg = BertConfig(vocab_size=tcfg.vocab_size, hidden_size=sc.hidden_size,
                      num_hidden_layers=sc.num_hidden_layers,
                      num_attention_heads=sc.num_attention_heads,
                      intermediate_size=sc.intermediate_size,
                      max_position_embeddings=tcfg.max_position_embeddings,
                      type_vocab_size=tcfg.type_vocab_size, num_labels=num_labels,
                      model_type=tcfg.model_type, pad_token_id=tcfg.pad_token_id,
                      hidden_act=tcfg.hidden_act, layer_norm_eps=tcfg.layer_norm_eps)
    if head != "sequence":
        return scfg, random_params(task_heads.MODELS[head](scfg), seed)
    return scfg, random_params(BertForSequenceClassification(scfg), seed)
