"""jax_tinybert: TinyBERT and Patient-KD distillation of BERT in JAX/Flax.

The functional API (docs/design.md has the map of the package):

    import jax_tinybert as jtb
    config, params = jtb.load_pretrained(path_or_name)
    out = jtb.BertModel(config).apply({"params": params}, ids, mask, types)
    jtb.losses.attention_mse(...), jtb.layer_maps.uniform(4, 12), jtb.export_hf(...)
"""
import importlib

__version__ = "0.1.0"

# Everything loads on first use: the model can be imported on its own, and `jax_tinybert.malloc`
# (and `fs`) without JAX, so the CLI and the benchmarks can restart with the malloc settings and
# set XLA's flags before JAX is loaded.
_LAZY = {"losses", "layer_maps", "objectives", "optim", "metrics", "data", "checkpoints",
         "sharding", "step", "train", "export", "teacher_cache", "hf", "modeling", "build",
         "fs", "cpu", "config_check", "run_export", "plan", "pipeline", "malloc"}
_NAMES = {**{n: "modeling" for n in ("BertConfig", "BertForMaskedLM",
                                      "BertForSequenceClassification", "BertModel", "BertOutput",
                                      "ConfigError", "count_params", "init_params")},
          "WeightsError": "hf", "load_pretrained": "hf", "export_hf": "export"}
__all__ = sorted(_NAMES)


def __getattr__(name):
    if name in _LAZY:
        return importlib.import_module(f"jax_tinybert.{name}")
    if name in _NAMES:
        return getattr(importlib.import_module(f"jax_tinybert.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'jax_tinybert' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | _LAZY | set(_NAMES))
