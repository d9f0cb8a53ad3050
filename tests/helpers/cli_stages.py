"""Several command lines in one Python process, in order: `python -m jax_tinybert.main` stages
and the package's other tools (`python -m jax_tinybert.data.augment`, `...cli.export`).

The end-to-end tests of the heads and families run five or six stages each; one process per
stage paid JAX's ~4 CPU-s of imports and start-up every time. Here one process parses each
command line afresh (absl flags and config_flags' `--config.*` overrides, exactly as the CLI
does) and runs it, so a stage also proves it leaves nothing behind that breaks the next one
(a notebook's or a pipeline's use). The CLI's own process, its restarts, exits and one-line
errors are what tests/test_cli.py, tests/test_readme.py and the resume tests check.

    res = run([["--config=configs/finetune_teacher.py:sst2", "--workdir=w", ...],
               ["-m", "jax_tinybert.data.augment", "--task", "sst2", ...]])
    res.outputs[i]   # command i's stderr (its log) and stdout
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

MARK = "##### cli_stages: command {i} finished"   # then " in S s"


class Result:
    """The driver's CompletedProcess, with `outputs[i]`: what command i printed (both streams
    interleaved as they were written)."""

    def __init__(self, proc: subprocess.CompletedProcess, n: int):
        self.proc = proc
        self.outputs = []
        rest = proc.stdout
        for i in range(n):
            cut = rest.find(MARK.format(i=i))
            assert cut >= 0, f"command {i} did not finish:\n{rest[-3000:]}"
            self.outputs.append(rest[:cut])
            rest = rest[rest.index("\n", cut) + 1:]


def run(commands, timeout: int = 900, env=None) -> Result:
    """Runs `commands` (lists of arguments; ["-m", MODULE, ...] for a tool other than the
    training CLI) in one process under tiny_run's environment; fails with the output's tail
    unless every command exits 0."""
    from helpers import tiny_run

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump([list(map(str, c)) for c in commands], fh)
    try:
        proc = subprocess.run([tiny_run.PYTHON, __file__, fh.name], cwd=tiny_run.REPO,
                              env=env or tiny_run.env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout)
    finally:
        os.unlink(fh.name)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return Result(proc, len(commands))


def _training(argv) -> None:
    from jax_tinybert.cli import main as cli

    # The previous command's `--config.*` overrides are flags config_flags defined while
    # parsing it: gone before the next parse, which defines its own (from sys.argv).
    for name in [n for n in cli.FLAGS if n.startswith("config.")]:
        delattr(cli.FLAGS, name)
    cli.FLAGS.unparse_flags()
    sys.argv = ["jax-tinybert", *argv]
    cli.main(cli._parse_flags(sys.argv))


def _tool(module: str, argv) -> None:
    import runpy

    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code not in (None, 0):
            raise


def _main(path: str) -> None:
    from jax_tinybert.speed import malloc

    malloc.restart_command()   # the CLI's allocator, as `python -m jax_tinybert.main` has
    with open(path) as fh:
        commands = json.load(fh)
    for i, argv in enumerate(commands):
        t0 = time.time()
        if argv[:1] == ["-m"]:
            _tool(argv[1], argv[2:])
        else:
            _training(argv)
        sys.stderr.flush()
        print(f"{MARK.format(i=i)} in {time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
    _main(sys.argv[1])
