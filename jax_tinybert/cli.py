"""The `jax-tinybert` command (pyproject's console script): restarts with the fast allocator
(malloc.restart_command) before anything imports JAX, then runs `jax_tinybert.main`, as
`python -m jax_tinybert.main` does."""
from jax_tinybert import malloc


def run():
    """The console script's entry point."""
    malloc.restart_command()
    from jax_tinybert import main   # JAX loads here, in the process that keeps running

    return main.run()
