"""The package's shape, checked from its source: sub-packages that show the flow (their imports
form a DAG: tests/test_build.py), no module or function too long to read, hardware branches kept in speed/, every
module named in the README's layout, the functional API's paths from before the sub-packages,
and a repository that speaks of the product (no work-log labels)."""
import ast
import importlib
import pathlib
import re
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PKG = REPO / "jax_tinybert"
MODULES = sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 600, 80


def _name(path: pathlib.Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_sub_packages_and_top_level_modules():
    packages = [p for p in PKG.iterdir() if (p / "__init__.py").is_file()]
    top = [p for p in PKG.glob("*.py")]
    assert len(packages) >= 5, packages
    assert len(top) <= 8, sorted(p.name for p in top)


def test_no_module_or_function_too_long():
    long_modules, long_functions = [], []
    for path in MODULES:
        src = path.read_text()
        if len(src.splitlines()) > MAX_MODULE_LINES:
            long_modules.append(f"{path.relative_to(REPO)}: {len(src.splitlines())} lines")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long_functions.append(f"{path.relative_to(REPO)}:{node.name}: {n} lines")
    assert not long_modules and not long_functions, long_modules + long_functions


def test_backend_branches_live_in_speed():
    """Outside speed/, at most three files ask which backend runs (the CLI's start-up, the
    planner's --platform, the FLOP counter's CPU fallback)."""
    asks = re.compile(r"default_backend\(\)|[=!]= *[\"'](cpu|gpu|tpu)[\"']|[\"'](cpu|gpu|tpu)[\"']")
    files = sorted(str(p.relative_to(PKG)) for p in MODULES
                   if "speed" not in p.relative_to(PKG).parts and asks.search(p.read_text()))
    assert len(files) <= 3, files


def _layout_names(readme: str) -> set:
    """'folder/name' for every name on the Layout block's lines (a line names its folder first,
    or continues the one above)."""
    block = readme[readme.index("## Layout"):].split("```")[1]
    names, folder = set(), ""
    for line in block.splitlines():
        words = line.split()
        if not words:
            continue
        if not line.startswith(" " * 8) and words[0].endswith("/"):
            folder, words = words[0].strip(), words[1:]
            folder = folder if folder.startswith("jax_tinybert/") or line.startswith(
                ("jax", "configs", "launch", "benchmarks", "tests")) else "jax_tinybert/" + folder
        names |= {folder + w for w in words}
    return names


def test_the_readme_layout_names_every_module():
    named = _layout_names((REPO / "README.md").read_text())
    files = [p.relative_to(REPO) for p in MODULES if p.name != "__init__.py"]
    files += [p.relative_to(REPO) for d in ("configs", "launch", "benchmarks")
              for p in sorted((REPO / d).glob("*")) if p.suffix in (".py", ".sh", ".sbatch")]
    missing = [str(f) for f in files if str(f) not in named]
    assert not missing, f"README.md's Layout section does not name {missing}"


@pytest.mark.parametrize("old,new", [
    ("losses", "distill.losses"), ("layer_maps", "distill.layer_maps"),
    ("objectives", "distill.objectives"), ("modeling", "model.modeling"), ("hf", "model.hf"),
    ("export", "model.export"), ("sharding", "parallel.sharding"), ("step", "train.step"),
    ("checkpoints", "train.checkpoints"), ("teacher_cache", "teacher.cache"),
    ("config_check", "config.check"), ("malloc", "speed.malloc"),
])
def test_the_functional_api_paths_from_before_still_import(old, new):
    import jax_tinybert as jtb

    real = importlib.import_module(f"jax_tinybert.{new}")
    assert importlib.import_module(f"jax_tinybert.{old}") is real
    assert getattr(jtb, old) is real and real.__spec__.name == f"jax_tinybert.{new}"


def test_the_functional_api_names():
    import jax_tinybert as jtb
    from jax_tinybert.losses import attention_mse   # the old form of the path
    from jax_tinybert.distill import losses

    assert attention_mse is losses.attention_mse
    for name in ("BertConfig", "BertModel", "BertForSequenceClassification", "load_pretrained",
                 "export_hf", "train_and_evaluate"):
        assert callable(getattr(jtb, name)), name


def test_the_repository_speaks_of_the_product():
    try:
        files = subprocess.run(["git", "-C", str(REPO), "ls-files"], capture_output=True,
                               text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    # Built from pieces, so that this file does not match itself.
    label = re.compile(r"\b(" + "sess" + r"ions?|" + "iss" + r"ues?) #?[0-9]+", re.I)
    named = [f for f in files if label.search(f.replace("_", " ").replace("-", " "))
             or re.search("sess" + r"ion[0-9]", f)]
    said = [f"{f}:{i}" for f in files if (REPO / f).is_file() and not f.endswith(".png")
            for i, line in enumerate((REPO / f).read_text(errors="replace").splitlines(), 1)
            if label.search(line)]
    assert not named and not said, (named + said)[:20]
