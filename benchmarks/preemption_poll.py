#!/usr/bin/env python
"""Cost of `Preemption.poll` per step, single process and 2 processes (CPU, gloo).

A jitted data-parallel MLP step (about the size of a tiny-BERT step) runs `--steps` times:
(a) dispatched back to back with nothing between steps (host unbounded ahead), (b) with
`Preemption.poll` after each step (host one step ahead; several processes: the jitted flag
agreement), (c) several processes only: the previous protocol, one coordination-service
barrier per step. Reported: ms per step, median of `--repeats`.

    .venv/bin/python benchmarks/preemption_poll.py                # 1 and 2 processes
    .venv/bin/python benchmarks/preemption_poll.py --width 1024 --steps 200
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(a):
    import jax

    if a.nproc > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{a.port}", num_processes=a.nproc,
                                   process_id=a.pid)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jax_tinybert.train.preemption import Preemption

    mesh = Mesh(np.array(jax.devices()), ("data",))
    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    w = jax.device_put(jnp.ones((a.width, a.width), jnp.float32) / a.width, rep)
    x = jax.make_array_from_process_local_data(
        rows, np.ones((a.batch // jax.process_count(), a.width), np.float32),
        (a.batch, a.width))

    @jax.jit
    def step(w, x):
        def loss(w):
            h = jnp.tanh(x @ w)
            return jnp.mean(jnp.tanh(h @ w) ** 2)
        l, g = jax.value_and_grad(loss)(w)
        return w - 1e-3 * g, l

    w, l = step(w, x)
    jax.block_until_ready(l)

    def run(mode):
        nonlocal w
        pre = Preemption()
        client = None
        if mode == "barrier":
            from jax._src import distributed
            client = distributed.global_state.client
        t = time.perf_counter()
        for i in range(1, a.steps + 1):
            w, l = step(w, x)
            if mode == "poll":
                pre.poll(i, l)
            elif mode == "barrier":
                client.wait_at_barrier(f"bench_{mode}_{run.n}_{i}", 60_000)
        jax.block_until_ready(w)
        run.n += 1
        return 1000 * (time.perf_counter() - t) / a.steps

    run.n = 0
    modes = ["none", "poll"] + (["barrier"] if a.nproc > 1 else [])
    res = {m: [] for m in modes}
    for _ in range(a.repeats):
        for m in modes:
            res[m].append(run(m))
    out = {m: float(np.median(v)) for m, v in res.items()}
    if a.pid == 0:
        print("RESULT " + json.dumps(out), flush=True)
    if a.nproc > 1:
        jax.distributed.shutdown()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(a, nproc):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO,
               XLA_FLAGS="--xla_force_host_platform_device_count=1")
    port = _free_port()
    args = [sys.executable, os.path.abspath(__file__), "--worker", f"--nproc={nproc}",
            f"--port={port}", f"--steps={a.steps}", f"--repeats={a.repeats}",
            f"--width={a.width}", f"--batch={a.batch}"]
    procs = [subprocess.Popen(args + [f"--pid={i}"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(nproc)]
    outs = [p.communicate(timeout=1800) for p in procs]
    for p, (out, err) in zip(procs, outs):
        if p.returncode:
            raise SystemExit(err[-3000:])
    line = [l for l in outs[0][0].splitlines() if l.startswith("RESULT ")][0]
    return json.loads(line[len("RESULT "):])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--nproc", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--pid", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    print("| processes | step ms, nothing between steps | with poll | overhead | "
          "barrier per step (old) |\n|---|---|---|---|---|")
    for n in (1, 2):
        r = launch(a, n)
        extra = f"{r['barrier']:.3f}" if "barrier" in r else "-"
        print(f"| {n} | {r['none']:.3f} | {r['poll']:.3f} | "
              f"{100 * (r['poll'] / r['none'] - 1):+.1f}% | {extra} |", flush=True)


if __name__ == "__main__":
    main()
