"""The optimizer's update program alone: the project's AdamW (optim.make_optimizer +
step.make_update_step, as `train.split_update` compiles it) against the same update written with
optax's own pieces (the [PAD] row zeroed by a scatter, `optax.clip_by_global_norm`,
`optax.tree.norm` for the logged norm), on the parameter trees the CLI trains.

    python benchmarks/optimizer_update.py --trees minilm,tinybert4 --rounds 6

Both are jitted with the state donated, as in training, and run in alternating rounds (median
of each round's steps; the median of the rounds is reported), on the same gradients. Prints a
table and the largest difference of the parameters the two reach after all rounds.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jax_tinybert.speed import malloc  # noqa: E402

malloc.restart_unless_set()   # the CLI's allocator, before JAX is imported

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import step_throughput as st  # noqa: E402
from jax_tinybert import optim  # noqa: E402
from jax_tinybert.train import step as step_lib  # noqa: E402
from jax_tinybert.train.state import TrainState  # noqa: E402

OPT = dict(name="adamw", learning_rate=5e-5, schedule="warmup_linear", warmup_ratio=0.1,
           weight_decay=0.01, clip_norm=1.0, eps=1e-6, pad_token_id=0)


def optax_update(schedule):
    """The update as optax's pieces write it (the project's own before it read gradients in
    place: benchmarks/RESULTS.md#optimizer-update)."""
    def zero_pad(g):
        def fix(path, x):
            return x.at[0].set(0) if optim._is_word_embedding(path, x) else x
        return jax.tree_util.tree_map_with_path(fix, g)

    tx = optax.chain(optax.clip_by_global_norm(OPT["clip_norm"]),
                     optax.adamw(schedule, b1=0.9, b2=0.999, eps=OPT["eps"],
                                 weight_decay=OPT["weight_decay"], mask=optim.decay_mask))

    def update(state, grads):
        updates, opt_state = tx.update(zero_pad(grads), state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return (state.replace(step=state.step + 1, params=params, opt_state=opt_state),
                {"grad_norm": optax.tree.norm(grads)})
    return update, tx


def tree(name: str):
    tcfg, _ = st.load_teacher("minilm", random_teacher=True)
    cfg = tcfg if name == "minilm" else st.student_config(name, tcfg)
    return {"student": jax.tree_util.tree_map(jnp.asarray, st._random_params(cfg, 2)), "proj": {}}


def run(args) -> dict:
    out = {"machine": st.machine_info(), "rounds": args.rounds, "steps": args.steps, "trees": {}}
    for name in args.trees:
        params = tree(name)
        n = sum(x.size for x in jax.tree_util.tree_leaves(params))
        rng = np.random.default_rng(0)
        grads = jax.tree_util.tree_map(
            lambda p: jnp.asarray(rng.standard_normal(p.shape, np.float32) * 1e-2), params)
        tx, schedule = optim.make_optimizer(OPT, 1000)
        numbers = optim.schedule_numbers(OPT, 1000)
        ours = functools.partial(step_lib.make_update_step(
            functools.partial(optim.make_optimizer, OPT, 1000), OPT["pad_token_id"]),
            numbers=numbers)
        ref, ref_tx = optax_update(schedule)
        fns = {"optax pieces": (jax.jit(ref, donate_argnums=(0,)), ref_tx),
               "jax_tinybert": (jax.jit(ours, donate_argnums=(0,)), tx)}
        states = {k: TrainState.create(jax.tree_util.tree_map(jnp.copy, params), t,
                                       jax.random.PRNGKey(0))
                  for k, (_, t) in fns.items()}
        times = {k: [] for k in fns}
        norms = {}
        for r in range(args.rounds + 1):       # round 0 compiles and warms up
            for k, (f, _) in fns.items():
                ts = []
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    states[k], m = f(states[k], grads)
                    jax.block_until_ready(states[k])
                    ts.append(time.perf_counter() - t0)
                norms[k] = float(m["grad_norm"])
                if r:
                    times[k].append(statistics.median(ts))
        a, b = (jax.tree_util.tree_leaves(states[k].params) for k in fns)
        diff = max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(a, b))
        row = {"params": int(n), "diff_after": diff, "grad_norms": norms,
               **{k: {"ms_rounds": [1e3 * t for t in v], "ms": 1e3 * statistics.median(v)}
                  for k, v in times.items()}}
        out["trees"][name] = row
        print(f"| {name} | {n / 1e6:.2f}M | {row['optax pieces']['ms']:.1f} | "
              f"{row['jax_tinybert']['ms']:.1f} | {diff:.1e} |", flush=True)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", type=lambda s: s.split(","), default=["minilm", "tinybert4"])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=8, help="steps per round")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    print("| tree | params | optax pieces, ms | jax_tinybert, ms | max param diff |\n"
          "|---|---|---|---|---|", flush=True)
    out = run(args)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
