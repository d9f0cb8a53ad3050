"""jax_tinybert: TinyBERT and Patient-KD distillation of BERT in JAX/Flax.

The functional API (docs/design.md has the map of the package):

    import jax_tinybert as jtb
    config, params = jtb.load_pretrained(path_or_name)
    out = jtb.BertModel(config).apply({"params": params}, ids, mask, types)
    jtb.losses.attention_mse(...), jtb.layer_maps.uniform(4, 12), jtb.export_hf(...)
"""
import importlib

from jax_tinybert.modeling import (BertConfig, BertForMaskedLM, BertForSequenceClassification,
                                   BertModel, BertOutput, ConfigError, count_params, init_params)
from jax_tinybert.hf import WeightsError, load_pretrained

__version__ = "0.1.0"

# Submodules written alongside (losses, layer_maps, objectives, ...) load on first use so the
# model can be imported on its own.
_LAZY = {"losses", "layer_maps", "objectives", "optim", "metrics", "data", "checkpoints",
         "sharding", "step", "train", "export", "teacher_cache", "hf", "modeling", "build",
         "fs", "config_check", "run_export", "plan", "pipeline"}


def __getattr__(name):
    if name in _LAZY:
        return importlib.import_module(f"jax_tinybert.{name}")
    if name == "export_hf":
        return importlib.import_module("jax_tinybert.export").export_hf
    raise AttributeError(f"module 'jax_tinybert' has no attribute {name!r}")
