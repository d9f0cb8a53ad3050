"""jax_tinybert: TinyBERT and Patient-KD distillation of BERT in JAX/Flax.

The functional API (docs/design.md has the map of the package):

    import jax_tinybert as jtb
    config, params = jtb.load_pretrained(path_or_name)
    out = jtb.BertModel(config).apply({"params": params}, ids, mask, types)
    jtb.losses.attention_mse(...), jtb.layer_maps.uniform(4, 12), jtb.export_hf(...)

Sub-packages, in the order data flows: config/ (the schema and its checks), data/ (text to
batches), model/ (BERT, Hugging Face import/export), distill/ (layer maps, losses, objectives),
teacher/ (teacher outputs cached per dataset), parallel/ (mesh, multi-process agreement),
train/ (build, step, loop, checkpoints), cli/ (the command line); speed/ holds what exists only
to run fast on one kind of hardware.
"""
import importlib
import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"

# Modules by their short names, `jtb.losses` and `import jax_tinybert.losses` alike: the
# functional API's paths from before the sub-packages keep working. Everything loads on first
# use, so the model imports on its own and speed.malloc and fs without JAX (the CLI restarts
# with the allocator and sets XLA's flags before JAX loads).
MODULES = {
    "losses": "distill.losses", "layer_maps": "distill.layer_maps",
    "objectives": "distill.objectives", "modeling": "model.modeling", "hf": "model.hf",
    "export": "model.export", "optim": "optim", "metrics": "train.metrics",
    "checkpoints": "train.checkpoints", "step": "train.step", "build": "train.build",
    "train_state": "train.state", "sharding": "parallel.sharding",
    "teacher_cache": "teacher.cache", "teacher_store": "teacher.store",
    "teacher_stream": "teacher.stream",
    "config_base": "config.schema", "config_check": "config.check", "run_export": "cli.export",
    "plan": "cli.plan", "pipeline": "cli.demo", "malloc": "speed.malloc",
    "fs": "fs", "data": "data",
}
_NAMES = {**{n: "model.modeling" for n in ("BertConfig", "BertForMaskedLM",
                                            "BertForSequenceClassification", "BertModel",
                                            "BertOutput", "ConfigError", "count_params",
                                            "init_params")},
          "WeightsError": "model.hf", "load_pretrained": "model.hf", "export_hf": "model.export",
          "train_and_evaluate": "train.loop"}
__all__ = sorted(_NAMES)


def __getattr__(name):
    if name in MODULES:
        return importlib.import_module(f"{__name__}.{MODULES[name]}")
    if name in _NAMES:
        return getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(MODULES) | set(_NAMES))


class _ShortNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import jax_tinybert.losses` -> the module jax_tinybert.distill.losses itself (one module
    object under both names, so a patch through either reaches the same code)."""

    def find_spec(self, fullname, path=None, target=None):
        short = fullname[len(__name__) + 1:] if fullname.startswith(__name__ + ".") else ""
        if MODULES.get(short, short) != short:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    _specs = {}   # alias -> the real module's spec, kept per alias (imports may nest)

    def create_module(self, spec):
        module = importlib.import_module(f"{__name__}.{MODULES[spec.name[len(__name__) + 1:]]}")
        self._specs[spec.name] = module.__spec__   # importlib overwrites it on what this returns
        return module

    def exec_module(self, module):
        module.__spec__ = self._specs.pop(module.__spec__.name)


if not any(isinstance(f, _ShortNames) for f in sys.meta_path):
    sys.meta_path.append(_ShortNames())
