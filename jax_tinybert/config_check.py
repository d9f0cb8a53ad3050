"""Config checks before a run starts: known keys and values, the config fingerprint, and the
workdir rule (a workdir holds runs of one config only)."""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Dict, Tuple

import jax
import ml_collections

from jax_tinybert import config_base, objectives
from jax_tinybert.data import glue
from jax_tinybert.errors import UserError

# Fields that may change between a run and its resumption (they do not change the result).
RESUMABLE_CHANGES = {"train.log_every", "train.eval_every", "train.checkpoint_every",
                     "train.num_steps", "train.num_epochs", "train.max_to_keep",
                     "export.enabled", "data.cache_dir"}


class ConfigValueError(UserError, ValueError):
    """A config field has a value this program cannot run with."""


def _flat(cfg, prefix="") -> Dict[str, Any]:
    out = {}
    for k, v in cfg.items():
        key = f"{prefix}{k}"
        if isinstance(v, (ml_collections.ConfigDict, dict)):
            out.update(_flat(v, key + "."))
        else:
            out[key] = list(v) if isinstance(v, tuple) else v
    return out


def validate_config(config: ml_collections.ConfigDict) -> None:
    """Stops before training on unknown keys or values, with the field and the choices."""
    known = _flat(config_base.base_config())
    unknown = sorted(set(_flat(config)) - set(known) - {
        k for k in _flat(config) if k.startswith("objective.")})
    if unknown:
        raise ConfigValueError(f"unknown config keys {unknown}; see jax_tinybert/config_base.py "
                               "for every field")
    def choice(field, value, options):
        if value not in options:
            raise ConfigValueError(f"config.{field}={value!r} is not valid; expected one of "
                                   f"{tuple(options)}")
    choice("stage", config.stage, config_base.STAGES)
    choice("objective.name", config.objective.name, objectives.OBJECTIVES)
    choice("student.init", config.student.init, config_base.STUDENT_INITS)
    choice("data.kind", config.data.kind, config_base.DATA_KINDS)
    if config.data.kind != "corpus":
        try:
            glue.get_task(config.data.task)
        except Exception as e:
            raise ConfigValueError(f"config.data.task: {e}") from e
    if config.data.kind == "corpus" and config.objective.name != "tinybert_intermediate":
        raise ConfigValueError(f"config.data.kind='corpus' has no labels; objective "
                               f"{config.objective.name!r} needs labelled task data "
                               "(use tinybert_intermediate for general distillation)")
    if config.train.batch_size <= 0 or config.train.grad_accum <= 0:
        raise ConfigValueError("config.train.batch_size and config.train.grad_accum must be > 0")


def config_fingerprint(config) -> Tuple[str, Dict[str, Any]]:
    flat = {k: v for k, v in _flat(config).items() if k not in RESUMABLE_CHANGES}
    blob = json.dumps(flat, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16], flat


def check_workdir(config, workdir: str) -> None:
    """A workdir holding a run of a different config stops the program (names the fields)."""
    fp, flat = config_fingerprint(config)
    path = os.path.join(workdir, "config.json")
    if os.path.exists(path):
        with open(path) as fh:
            old = json.load(fh)
        if old.get("fingerprint") != fp:
            old_flat = old.get("config", {})
            diff = sorted(k for k in set(flat) | set(old_flat)
                          if json.dumps(flat.get(k), default=str) != json.dumps(old_flat.get(k), default=str))
            raise ConfigValueError(
                f"workdir {workdir} holds a run of a different config (fields differ: "
                f"{', '.join(diff[:10])}); use a new --workdir, or delete {path} to start over")
    elif jax.process_index() == 0:
        os.makedirs(workdir, exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"fingerprint": fp, "config": flat}, fh, indent=1, default=str)
        os.replace(tmp, path)
