"""Turns a failed command-line parse into a UserError that names the problem and the fix.

absl / ml_collections fail on a mistyped `--config.train.batch_sise=64` deep inside flag parsing
(an AttributeError with no field path), on a missing config file only when the config is first
read, and on a bad value with the parser's own wording. `diagnose(argv, exc)` re-reads the
command line and says which argument is wrong, what the closest valid fields are, and what
the field expects. Anything it cannot explain is returned unchanged (a bug keeps its traceback).
"""
from __future__ import annotations

import importlib.util
import os
import re
from typing import Any, Dict, List, Optional, Tuple

import ml_collections
from absl import flags

from jax_tinybert.cli import help as cli_help
from jax_tinybert.config import check as config_check
from jax_tinybert.errors import PathError, UserError, one_line

_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
               tuple: "a tuple such as '(32, 64)'"}


def config_arg(argv: List[str]) -> Optional[str]:
    """The value of --config (either --config=X or --config X), or None."""
    for i, a in enumerate(argv[1:], start=1):
        name, eq, value = a.lstrip("-").partition("=")
        if a.startswith("-") and name == "config":
            if eq:
                return value
            if i + 1 < len(argv):
                return argv[i + 1]
    return None


def override_args(argv: List[str]) -> List[Tuple[str, str]]:
    """[(argument as typed, dotted field path)] for each --config.X / --noconfig.X argument."""
    out = []
    for a in argv[1:]:
        if not a.startswith("-"):
            continue
        name = a.lstrip("-").split("=", 1)[0]
        for prefix in ("config.", "noconfig."):
            if name.startswith(prefix):
                out.append((a, name[len(prefix):]))
    return out


def _available_configs() -> str:
    files = [p for p, _, _ in cli_help.config_files()]
    return ", ".join(files) if files else "configs/*.py (run from the repository root)"


def load_config(spec: str) -> ml_collections.ConfigDict:
    """Runs get_config of `path[:variant]` as absl would; a missing file or a bad variant
    raises a UserError naming the --config argument."""
    path, sep, variant = spec.partition(":")
    if not os.path.isfile(path):
        raise PathError(f"--config={spec}: no such config file {path!r} (relative to "
                        f"{os.getcwd()}); use one of {_available_configs()}")
    try:
        mod_spec = importlib.util.spec_from_file_location("jtb_config_check", path)
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
        config = module.get_config(*([variant] if sep else []))
    except Exception as e:
        raise UserError(f"--config={spec}: {one_line(e)}; see the variants of {path} in "
                        "`jax-tinybert --help`") from e
    if not isinstance(config, ml_collections.ConfigDict):
        raise UserError(f"--config={spec}: get_config() returned {type(config).__name__}, not a "
                        "ConfigDict; return the config built from base_config()")
    return config


def _leaves(cfg, prefix: str = "") -> Dict[str, Any]:
    out = {}
    for k, v in cfg.items():
        out[f"{prefix}{k}"] = v
        if isinstance(v, ml_collections.ConfigDict):
            out.update(_leaves(v, f"{prefix}{k}."))
    return out


def _field_type_hint(config, path: str) -> str:
    fields = _leaves(config)
    if path not in fields:
        return ""
    v = fields[path]
    kind, default = type(v), repr(v)
    if v is None:
        # config_base's typed None: "the named objective's / optimizer's own default".
        parent, _, leaf = path.rpartition(".")
        try:
            kind = (fields[parent] if parent else config).get_ref(leaf).get_type()
        except (AttributeError, KeyError, ValueError):
            pass
        default = "None: the named objective's or optimizer's own"
    word = _TYPE_WORDS.get(kind, kind.__name__)
    return f"config.{path} expects {word} (default {default})"


def diagnose(argv: List[str], exc: BaseException) -> BaseException:
    """A UserError explaining why parsing `argv` raised `exc`, or `exc` itself."""
    spec = config_arg(argv)
    config = None
    if spec is not None:
        try:
            config = load_config(spec)
        except UserError as e:
            return e
        for arg, path in override_args(argv):
            msg = config_check.unknown_field(config, path)
            if msg:
                return UserError(f"{arg}: {msg}")
    if isinstance(exc, UserError):
        return exc
    if isinstance(exc, flags.Error):
        text = " ".join(str(exc).split())
        m = re.match(r"flag --(\S+?)=(.*?): (.*)", text)
        if m and "must have a value other than None" in text:
            name = m.group(1)
            return UserError(f"--{name} is required; " + {
                "config": "pass --config=configs/<stage>.py[:variant], e.g. "
                          "--config=configs/finetune_teacher.py:sst2 (list: jax-tinybert --help)",
                "workdir": "pass --workdir=DIR, the folder for checkpoints, metrics and the "
                           "export, e.g. --workdir=runs/sst2/teacher",
            }.get(name, f"pass --{name}=VALUE"))
        if m:
            name, value, detail = m.groups()
            hint = _field_type_hint(config, name[len("config."):]) if config is not None and \
                name.startswith("config.") else ""
            if hint:
                return UserError(f"--{name}={value}: bad value; {hint}")
            return UserError(f"--{name}={value}: bad value ({detail}); see jax-tinybert --help")
        return UserError(f"{text.rstrip('.')}; see jax-tinybert --help")
    return exc


__all__ = ["diagnose", "load_config", "config_arg", "override_args"]
