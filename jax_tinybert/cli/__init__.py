"""The command line: `jax-tinybert` (pyproject's console script) and `python -m jax_tinybert.main`.

main.py parses flags and runs a stage; help.py and diagnose.py are its --help and its one-line
errors; demo.py chains the demo's stages; export.py and plan.py are the export and planner tools.
Nothing here imports a dependency: a Python without them gets one line naming the fix.
"""
import importlib.util
import sys


def check_installed(names=("etils", "jax", "flax", "optax", "orbax", "ml_collections", "absl",
                           "numpy")) -> None:
    """A dependency missing from this interpreter (a shell without the project's .venv): one line
    naming it and the fix, exit 2. find_spec imports nothing: JAX must load after the restart."""
    missing = [n for n in names if importlib.util.find_spec(n) is None]
    if missing:
        sys.stderr.write(f"error: the Python package {missing[0]!r} is not installed for "
                         f"{sys.executable}; run the command in the project's environment: "
                         "`make install` creates .venv, then `. .venv/bin/activate` (or call "
                         ".venv/bin/python -m jax_tinybert.main ...)\n")
        sys.exit(2)


def run():
    """The console script's entry point: restarts with the fast allocator
    (speed/malloc.restart_command) before anything imports JAX, then runs cli/main.py."""
    check_installed()
    from jax_tinybert.speed import malloc

    malloc.restart_command()
    from jax_tinybert.cli import main   # JAX loads here, in the process that keeps running

    return main.run()
