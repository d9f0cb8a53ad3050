"""`python -m jax_tinybert.main`: the command line, whose code is jax_tinybert/cli/main.py.

The name stays because launch scripts, docs and jobs call it; imported, it is that module.
"""
import sys

if __name__ == "__main__":
    from jax_tinybert.cli import run

    sys.exit(run())

from jax_tinybert.cli import main as _main  # noqa: E402

sys.modules[__name__] = _main
