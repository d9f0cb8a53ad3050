"""`jax-tinybert --help`: the stages, the config files and their variants, how to override a
field, and an example. Built from the config files' own docstrings and `base_config()`, so the
help cannot drift from them. Imports no JAX (help must be instant).
"""
from __future__ import annotations

import ast
import os
import pathlib
import textwrap
from typing import List, Optional, Tuple

from jax_tinybert.config import schema as config_base

# What each `config.stage` value is for (the stage names are validated against STAGES).
STAGE_HELP = {
    "finetune_teacher": "fine-tune the teacher on a GLUE task (the task teacher)",
    "general_distill": "TinyBERT stage 1: a random student learns the pre-trained teacher's "
                       "attention and hidden states on unlabelled text",
    "task_distill": "TinyBERT stage 2: intermediate layers, then the prediction layer, on a task",
    "pkd": "Patient KD: a student cut from the teacher's layers, CE + KD + patience",
    "kd": "Hinton KD on the teacher's logits",
    "demo": "the whole recipe in minutes on a CPU (teacher, general, task distillation, table) "
            "as one command; each stage in its own <workdir>/<stage> (local or gs://), a "
            "finished one skipped on rerun",
    "mlm_head": "fit a masked-LM head on an encoder that has none (for data augmentation)",
}

EXAMPLE = """\
  export GLUE_DIR=../shared/data/glue
  jax-tinybert --config=configs/finetune_teacher.py:sst2 --workdir=runs/sst2/teacher
  jax-tinybert --config=configs/task_distill.py:sst2_intermediate --workdir=runs/sst2/inter \\
      --config.teacher.path=runs/sst2/teacher/export --config.train.batch_size=64 \\
      --config.objective.layer_map=0:0,1:2,2:3,3:5,4:6"""


def configs_dir() -> Optional[pathlib.Path]:
    """configs/ under the current directory, else the one beside the installed package."""
    for d in (pathlib.Path("configs"), pathlib.Path(__file__).resolve().parents[2] / "configs"):
        if d.is_dir():
            return d
    return None


def config_files(directory: Optional[pathlib.Path] = None) -> List[Tuple[str, str, str]]:
    """[(path, one-line summary, variants paragraph)] of every configs/*.py, from docstrings."""
    d = directory or configs_dir()
    if d is None:
        return []
    out = []
    for f in sorted(d.glob("*.py")):
        try:
            doc = ast.get_docstring(ast.parse(f.read_text())) or ""
        except (OSError, SyntaxError):
            doc = ""
        paras = [" ".join(p.split()) for p in doc.split("\n\n")]
        summary = paras[0] if paras else ""
        variants = next((p[len("Variants:"):].strip() for p in paras if p.startswith("Variants:")),
                        "none")
        path = f.as_posix()
        if f.is_absolute() and not os.path.relpath(f).startswith(".."):
            path = os.path.relpath(f)
        out.append((path, summary, variants))
    return out


def _fields() -> List[str]:
    lines = []
    for section, sub in config_base.base_config().items():
        if not hasattr(sub, "items"):
            continue
        # None = the named objective's / optimizer's own default (objectives.py, optim.py).
        items = " ".join(f"{k}={v!r}" if isinstance(v, str) else
                         f"{k}=(its default)" if v is None else f"{k}={v}"
                         for k, v in sub.items())
        lines += textwrap.wrap(f"{section}: {items}", 96, initial_indent="  ",
                               subsequent_indent="      ", break_on_hyphens=False,
                               break_long_words=False)
    return lines


def text(prog: str = "jax-tinybert") -> str:
    """The full help text."""
    w = lambda s, ind="  ", sub="      ": textwrap.fill(  # noqa: E731
        s, 98, initial_indent=ind, subsequent_indent=sub, break_on_hyphens=False,
        break_long_words=False)
    out = [
        f"{prog}: TinyBERT and Patient-KD distillation of BERT in JAX/Flax.",
        "",
        f"usage: {prog} --config=CONFIG.py[:VARIANT] --workdir=DIR [--config.SECTION.FIELD=VALUE ...]",
        "       (the same as: " + ("jax-tinybert" if prog.startswith("python") else
                                  "python -m jax_tinybert.main") + " ...)",
        "",
        "A run is one stage; the stage is a config file (and its variant). Rerunning the same",
        "command in the same --workdir resumes it; a finished stage exports <workdir>/export.",
        "",
        "stages (config.stage):",
    ]
    out += [w(f"{name:<17} {STAGE_HELP.get(name, '')}", sub=" " * 20)
            for name in config_base.STAGES]
    out += ["", "config files and their variants (--config=FILE:VARIANT):"]
    files = config_files()
    if not files:
        out.append("  (no configs/ folder here: run from the repository root)")
    for path, summary, variants in files:
        out.append(w(f"{path}  {summary}", sub="      "))
        out.append(w(f"variants: {variants}", ind="      ", sub="        "))
    out += [
        "",
        "override any field with --config.SECTION.FIELD=VALUE, e.g.",
        "  --config.train.batch_size=64 --config.data.task=mrpc --config.train.num_steps=500",
        "  --config.data.buckets='(32, 64)'  (tuples)   --config.student.dropout=False  (booleans)",
        "  --config.objective.layer_map=0:0,1:2,2:3,3:5,4:6  (student:teacher layer pairs)",
        "every field and its default (docs: jax_tinybert/config/schema.py):",
    ]
    out += _fields()
    out += [
        "",
        "other flags:",
        "  --workdir=DIR       checkpoints, metrics, TensorBoard, summary.json and the export:",
        "                      a local folder or a bucket (gs://bucket/run, every stage)",
        "  --verbose           full tracebacks for every error (user mistakes print one line)",
        "  --coordinator=HOST:PORT --num_processes=N --process_id=I   multi-process runs",
        "  --cluster=auto|none|gcetpu|gketpu|slurm|ompi|...   without --coordinator: how the",
        "                      job is found (auto: the first cluster JAX detects)",
        "  --check             pre-flight: the config on a few batches on every host (train,",
        "                      checkpoint save/restore, eval), one line per host, then exit",
        "  --helpfull          every flag, including absl's",
        "",
        "example (the TinyBERT recipe on SST-2; README.md has all of it):",
        EXAMPLE,
        "",
        "exit status: 0 done, 2 a mistake in the command, config, paths or data (one line",
        "`error: <problem>; <fix>` on stderr), 143 preempted by SIGTERM (rerun to resume),",
        "1 anything else (a bug: please report the traceback).",
    ]
    return "\n".join(out) + "\n"


__all__ = ["text", "config_files", "configs_dir", "STAGE_HELP"]
