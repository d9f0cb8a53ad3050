"""The build layer's config side (defaults, variants) and the package's import graph.

No model is built here: these run in about a second.
"""
import ast
import pathlib
import re

import pytest
from absl import flags
from ml_collections import config_flags

from jax_tinybert.train import build
from jax_tinybert.distill import objectives
from jax_tinybert import optim

REPO = pathlib.Path(__file__).resolve().parents[1]
PKG = REPO / "jax_tinybert"


def _cli(argv, config="configs/task_distill.py:sst2_pred"):
    """The config main.py would get for `--config=<config> argv...` (same flag machinery), with
    the defaults a run fills in."""
    fv = flags.FlagValues()
    argv = ["prog", f"--config={REPO / config}", *argv]
    config_flags.DEFINE_config_file("config", None, "", flag_values=fv, lock_config=True,
                                    sys_argv=argv)
    fv(argv)
    return build.with_defaults(fv.config)


def test_objective_defaults_take_effect_from_the_command_line():
    kd = _cli(["--config.objective.name=kd"]).objective
    d = objectives.REGISTRY["kd"].defaults
    assert (kd.temperature, kd.alpha, kd.t2) == (d["temperature"], d["alpha"], d["t2"]) == \
        (2.0, 0.5, True)
    pkd = _cli(["--config.objective.name=pkd"]).objective
    assert (pkd.temperature, pkd.alpha, pkd.layer_map, pkd.projection) == \
        (10.0, 0.7, "pkd_skip", "none")
    assert pkd.beta is None   # PKD's default: 500 / (K * D), from the models' shapes
    # An explicit value always wins over the objective's default.
    assert _cli(["--config.objective.name=kd", "--config.objective.temperature=3"]
                ).objective.temperature == 3.0
    # configs/pkd.py repeats no PKD default: only its recipe's beta (for the packaged teacher).
    got = _cli([], "configs/pkd.py:sst2_last").objective.to_dict()
    want = {k: v for k, v in objectives.REGISTRY["pkd"].defaults.items() if k in got}
    assert got == dict(want, name="pkd", layer_map="pkd_last", beta=500.0 / (2 * 384),
                       layer_weights=())


def test_optimizer_defaults_come_from_the_optimizer():
    adamw = _cli([]).optim
    assert adamw.eps == optim.defaults("adamw")["eps"] == 1e-6
    assert adamw.clip_norm == 1.0 and adamw.grad_clip_per_tensor == 0.0   # 0 = off
    bert = _cli(["--config.optim.name=bertadam"])
    assert bert.optim.clip_norm == 0.0 and bert.optim.grad_clip_per_tensor == 1.0
    build.build_optimizer(bert, 10)   # each clipping option reached only its optimizer
    with pytest.raises(ValueError, match="clip_norm"):
        build.build_optimizer(_cli(["--config.optim.name=bertadam",
                                    "--config.optim.clip_norm=1"]), 10)
    # The recipe's own values stay (configs/task_distill.py: pred phase lr 3e-5).
    assert adamw.learning_rate == 3e-5


@pytest.mark.parametrize("config,variant,msg", [
    ("task_distill", "sst2", "'<name>_intermediate' or '<name>_pred'"),
    ("task_distill", "sst3_pred", "unknown GLUE task 'sst3' (did you mean SST-2?)"),
    ("pkd", "sst2_first", "unknown GLUE task 'sst2_first'"),
    ("general_distill", "huge", "expected one of tinybert4, tinybert6, small, tiny"),
    ("finetune_teacher", "imdb", "unknown GLUE task 'imdb'"),
    ("demo", "sst2", "configs/demo.py: takes no variant"),
])
def test_bad_variants_name_the_file_and_the_forms(config, variant, msg):
    with pytest.raises(Exception, match=re.escape(msg)):
        _cli([], f"configs/{config}.py:{variant}")


def test_every_objective_declares_every_cfg_key():
    for name, cls in objectives.REGISTRY.items():
        assert cls.name == name and set(cls.defaults) == set(objectives.CFG_KEYS), name
    with pytest.raises(ValueError, match="unknown objective 'x'; expected one of"):
        objectives.make_objective("x", {}, None)


def _imports():
    """{module: [(lineno, imported jax_tinybert module, at top level?)]} of the package."""
    mods = {}
    for p in PKG.rglob("*.py"):
        name = ".".join(p.relative_to(REPO).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = p
    out = {}
    for m, p in mods.items():
        tree = ast.parse(p.read_text())
        found = []
        for top in tree.body:
            if isinstance(top, ast.If) and "__main__" in ast.unparse(top.test):
                continue   # `python -m` entry points may import their CLI
            for node in ast.walk(top):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                        "jax_tinybert"):
                    subs = [f"{node.module}.{a.name}" for a in node.names]
                    targets = [s for s in subs if s in mods] or [node.module]
                elif isinstance(node, ast.Import):
                    targets = [a.name for a in node.names if a.name.startswith("jax_tinybert")]
                else:
                    continue
                found += [(node.lineno, t, node is top) for t in targets if t in mods and t != m]
        out[m] = found
    return out


def test_package_imports_are_a_dag_at_the_top_of_each_file():
    imports = _imports()
    # Made on demand by design: the package's and train/'s lazy attribute loaders, and the
    # console script, which restarts with the fast allocator before it imports main (and JAX).
    inner = [(m, line, t) for m, found in imports.items() for line, t, top in found
             if not top and m not in ("jax_tinybert", "jax_tinybert.cli", "jax_tinybert.train")]
    assert not inner, f"function-level imports of the package: {inner}"
    graph = {m: {t for _, t, top in found if top} for m, found in imports.items()}
    state, cycles = {}, []

    def visit(u, path):
        state[u] = 1
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                cycles.append(path[path.index(v):] + [v])
            elif v not in state:
                visit(v, path + [v])
        state[u] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, f"import cycles: {cycles}"
