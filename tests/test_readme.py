"""The README's own commands, run as a new user runs them.

A fresh copy of the repository (the files a `git clone` of this working tree holds: tracked and
untracked-but-not-ignored) goes into a temp folder with `shared` beside it (a link to the shared
data), so `../shared/...` in the README resolves as it does for a user. Then, in that clone and
with relative paths:

* `make demo` exactly as written (the real target, its default relative WORKDIR=runs/demo and
  default steps, ~90 s), whose student must keep the teacher's accuracy;
* every command of the README's "The command line" recipe block, in the README's order, then
  the "Export" block. The commands are parsed FROM README.md (fenced block, `\\` continuations
  joined, `export VAR=...` lines applied, `$VAR` substituted), so editing the README changes
  this test; only small-size overrides (`--config.train.num_steps=...`, subsets, a tiny
  general-distillation student) are appended.

Re-creating .venv costs minutes, so the clone's .venv is a link to the venv running pytest and
make is told not to rebuild it (`-o .venv/.installed`); PYTHONPATH and the working directory
are the clone, and the first test checks that the clone's code is what runs.

Step 3 (augmentation) needs a masked LM: it runs with the README's `--mlm` when that model is
available (local folder, Hugging Face cache or hub); offline, `--mlm` is replaced by a tiny random
BERT masked LM written by `transformers` with the packaged tokenizer (a wiring check of the
command: its augmentations are noise), and the substitution is printed.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import shutil
import socket
import subprocess
import sys

import pytest

from helpers import tiny_run

pytestmark = pytest.mark.readme

REPO = pathlib.Path(__file__).resolve().parents[1]
README = REPO / "README.md"
TIMEOUT = 600

# Appended to every `python -m jax_tinybert.main` command: a few steps on a few examples, one
# length bucket (one compile per step function).
SMALL = ["--config.train.num_steps=4", "--config.train.batch_size=8",
         "--config.train.eval_batch_size=16", "--config.train.log_every=2",
         "--config.data.train_subset=48", "--config.data.eval_subset=32",
         "--config.data.max_len=32", "--config.data.buckets=(32,)"]
# Per config file (the part of --config before ':').
SMALL_BY_CONFIG = {
    "configs/general_distill.py": ["--config.data.seq_len=32", "--config.student.hidden_size=96",
                                   "--config.student.intermediate_size=192",
                                   "--config.student.num_attention_heads=12"],
}
SMALL_AUGMENT = ["--max_rows", "4", "--N", "2", "--batch_size", "16"]

# --------------------------------------------------------------------------- README parsing

def fenced_blocks(text: str, section: str):
    """The fenced code blocks of the `## <section>` section of a markdown text."""
    m = re.search(rf"^## {re.escape(section)}\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"README.md has no '## {section}' section"
    return re.findall(r"^```[^\n]*\n(.*?)^```", m.group(1), re.M | re.S)


def parse_commands(block: str, env: dict):
    """Shell lines of a block -> [argv]: comments dropped, continuations joined, `export K=V`
    applied to env (in place) and $VARs substituted."""
    lines, cur = [], ""
    for raw in block.splitlines():
        line = raw.split(" #", 1)[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if not line.strip() and not cur:
            continue
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        lines.append((cur + line).strip())
        cur = ""
    cmds = []
    for line in filter(None, lines):
        argv = shlex.split(line)
        if argv[0] == "export":
            for kv in argv[1:]:
                k, v = kv.split("=", 1)
                env[k] = v
            continue
        cmds.append([re.sub(r"\$\{?(\w+)\}?", lambda m: env[m.group(1)], a) for a in argv])
    return cmds


def readme_recipe():
    """(env from the export lines, [argv]) of the first fenced block of "The command line" (the
    recipe; later blocks there are transcripts) and of "Export"."""
    text = README.read_text()
    env, cmds = {}, []
    for section in ("The command line", "Export"):
        block = fenced_blocks(text, section)[0]
        cmds += [c for c in parse_commands(block, env) if c[0] == "python"]
    return env, cmds


def _flag(argv, name):
    for i, a in enumerate(argv):
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
        if a == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _stage_id(argv):
    module = argv[2]
    return (_flag(argv, "config") or module).replace("configs/", "")


RECIPE_ENV, RECIPE = readme_recipe()
_STATE: dict = {}   # the README command that failed, if any (later ones depend on it)


def test_readme_recipe_is_parsed():
    """The parser sees the whole recipe, in order (a failure here means README.md changed
    shape: update the parser, not the README)."""
    ids = [_stage_id(c) for c in RECIPE]
    assert ids == ["finetune_teacher.py:sst2", "general_distill.py:small",
                   "jax_tinybert.data.augment", "task_distill.py:sst2_intermediate",
                   "task_distill.py:sst2_pred", "pkd.py:sst2", "jax_tinybert.cli.export"], ids
    assert RECIPE_ENV == {"GLUE_DIR": "../shared/data/glue"}
    gen = RECIPE[1]
    assert gen[-1] == "--config.data.corpus=../shared/data/corpus"   # continuation joined
    assert "../shared/data/glue" in RECIPE[2]                          # $GLUE_DIR substituted


# --------------------------------------------------------------------------- the clone

def _clone_files(dst: pathlib.Path) -> None:
    """What `git clone` of this working tree would hold (plus uncommitted edits)."""
    try:
        out = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"], capture_output=True, check=True).stdout
        files = [f for f in out.decode().split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the README tier needs `git ls-files` to make a clone")
    for f in files:
        src = REPO / f
        if src.is_file() and not src.is_symlink():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / f)


@pytest.fixture(scope="module")
def clone(tmp_path_factory, shared_dir):
    base = tmp_path_factory.mktemp("fresh")
    repo = base / "jax-tinybert"
    repo.mkdir()
    _clone_files(repo)
    (base / "shared").symlink_to(shared_dir, target_is_directory=True)
    if sys.prefix == sys.base_prefix:
        pytest.skip("pytest is not running in a virtualenv: the README tier links the clone's "
                    ".venv to the running one")
    (repo / ".venv").symlink_to(sys.prefix, target_is_directory=True)
    env = {k: v for k, v in os.environ.items()
           if (k in tiny_run.STORES or not k.startswith(("JTB_", "SLURM_"))) and k not in (
               "WORKDIR", "GLUE_DIR", "DEMO_ARGS", "XLA_FLAGS", "MAKEFLAGS", "MFLAGS")}
    # The commands' behaviour is checked, not their speed: XLA's cheapest backend optimisation,
    # as every tiny run of the suite (tests/helpers/tiny_run.py); compiling is most of each stage.
    env.update(PYTHONPATH=str(repo), JAX_PLATFORMS="cpu",
               XLA_FLAGS=tiny_run.FAST_COMPILE_XLA_FLAGS)
    return repo, env


def _run(argv, repo, env, timeout=TIMEOUT):
    p = subprocess.run(argv, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"`{shlex.join(argv)}` exited {p.returncode}:\n{out[-4000:]}"
    return out


def test_clone_code_runs(clone):
    repo, env = clone
    out = _run([str(repo / ".venv" / "bin" / "python"), "-c",
                "import jax_tinybert; print(jax_tinybert.__file__)"], repo, env)
    assert pathlib.Path(out.strip().splitlines()[-1]).resolve().is_relative_to(repo.resolve()), out


def test_make_demo(clone):
    """`make demo` exactly as written: default WORKDIR (relative runs/demo), default steps
    (~90 s on 2 cores). Its student must keep the teacher's accuracy, as the README shows: a
    change of the demo's random streams once left it at 0.8775 (against 0.95) unnoticed."""
    repo, env = clone
    # A real training run, checked for its accuracy: XLA's default optimisation, as a user's.
    env = {k: v for k, v in env.items() if k != "XLA_FLAGS"}
    out = _run(["make", "-o", ".venv/.installed", "demo"], repo, env)
    res = json.loads((repo / "runs" / "demo" / "results.json").read_text())
    assert res["teacher"]["main"] >= 0.95 and res["student"]["main"] >= 0.90, res
    table = [l for l in out.splitlines() if l.startswith(("teacher (", "student ("))]
    assert len(table) == 2, out[-3000:]
    for stage in ("teacher", "general", "intermediate", "pred"):
        assert (repo / "runs" / "demo" / stage / "summary.json").is_file(), stage
    assert (repo / "runs" / "demo" / "pred" / "export" / "model.safetensors").is_file()


def _mlm_unavailable(name: str) -> str:
    """'' when the masked LM `name` can be loaded here, else the reason it cannot."""
    if os.path.isdir(name):
        return ""
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return ""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0"):
        return "HF_HUB_OFFLINE is set and it is not in the Hugging Face cache"
    try:  # the hub client retries for ~25 s when offline: ask the network once, quickly
        socket.create_connection(("huggingface.co", 443), timeout=3).close()
    except OSError as e:
        return f"huggingface.co unreachable ({e})"
    return ""


def _tiny_random_mlm(out_dir: pathlib.Path, tokenizer_dir: str) -> str:
    """A 1-layer d-32 BERT with its pre-training heads (masked LM, as bert-base-uncased's
    checkpoint) saved by transformers, with the packaged tokenizer."""
    import torch
    from transformers import BertConfig, BertForPreTraining

    with open(os.path.join(tokenizer_dir, "config.json")) as fh:
        vocab = json.load(fh)["vocab_size"]
    torch.manual_seed(0)
    BertForPreTraining(BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=64)
                       ).save_pretrained(out_dir)
    for f in os.listdir(tokenizer_dir):
        if f.startswith(("tokenizer", "vocab", "special_tokens")):
            shutil.copy(os.path.join(tokenizer_dir, f), out_dir / f)
    return str(out_dir)


@pytest.mark.parametrize("index", range(len(RECIPE)), ids=[_stage_id(c) for c in RECIPE])
def test_readme_command_line(clone, index, tmp_path, teacher_dir):
    """One command of the README recipe, in order, relative paths, in the clone."""
    repo, env = clone
    state = _STATE
    failed = state.get("failed")
    if failed is not None:
        pytest.fail(f"an earlier README command failed ({failed}); this one depends on it")
    argv = list(RECIPE[index])
    argv[0] = str(repo / ".venv" / "bin" / "python")
    module = argv[2]
    env = dict(env, **RECIPE_ENV)
    if module == "jax_tinybert.data.augment":
        mlm = _flag(argv, "mlm")
        reason = _mlm_unavailable(mlm)
        if reason:
            local = _tiny_random_mlm(tmp_path / "tiny_mlm", teacher_dir)
            print(f"masked LM {mlm!r} not available here ({reason}); running the README command "
                  f"with --mlm {local} (tiny random MLM: a wiring check)")
            argv = [a.replace(mlm, local) if a in (mlm, f"--mlm={mlm}") else a for a in argv]
        argv += SMALL_AUGMENT
    elif module == "jax_tinybert.main":
        argv += SMALL + SMALL_BY_CONFIG.get(_flag(argv, "config").split(":")[0], [])
    if module != "jax_tinybert.data.augment":   # optional: nothing later reads its output
        state["failed"] = _stage_id(RECIPE[index])
    out = _run(argv, repo, env)
    state["failed"] = None
    if module == "jax_tinybert.main":
        wd = repo / _flag(argv, "workdir")
        assert not pathlib.Path(_flag(argv, "workdir")).is_absolute()
        summary = json.loads((wd / "summary.json").read_text())
        assert summary["steps"] == 4, summary
        assert (wd / "metrics.jsonl").read_text().strip(), "no metrics written"
        assert list((wd / "tb").iterdir()), "no TensorBoard events"
        for f in ("config.json", "model.safetensors", "tokenizer.json"):
            assert (wd / "export" / f).is_file(), f"{wd}/export/{f} missing"
        if summary["objective"] != "tinybert_intermediate":
            assert summary["best"] is not None and "main" in summary["best"], summary
    elif module.endswith("export"):
        out_dir = repo / _flag(argv, "out")
        for f in ("config.json", "model.safetensors"):
            assert (out_dir / f).is_file(), f"{out_dir}/{f} missing:\n{out[-2000:]}"
    elif module == "jax_tinybert.data.augment":
        aug = repo / _flag(argv, "out")
        assert aug.is_file() and len(aug.read_text().splitlines()) > 4, aug



def test_the_recipe_runs_in_the_environment_make_creates():
    """The recipe says `python -m ...`: a new shell's python lacks the dependencies (the CLI then
    says so in one line, tests/test_cli.py), so the block first activates the .venv that the
    Makefile creates; the tests above run the recipe with that venv's python."""
    block = fenced_blocks(README.read_text(), "The command line")[0]
    first = parse_commands(block, {})[0]
    assert first[0] in (".", "source") and first[1] == ".venv/bin/activate", first
    assert re.search(r"^VENV := \.venv$", (REPO / "Makefile").read_text(), re.M)
