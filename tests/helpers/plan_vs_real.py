"""Run with N simulated CPU devices (argv[1]): the planner's numbers for a small case (abstract
shapes) vs the same step built by `build.build_step` with real arrays on the mesh and run once.
Prints JSON."""
import json
import os
import sys

N = int(sys.argv[1]) if len(sys.argv) > 1 else 2
# Planner and real step are compiled here with the same flags; XLA's cheapest backend
# optimisation (as tests/helpers/tiny_run.py) makes each compile ~3x faster.
os.environ["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count={N} "
                           "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jax_tinybert.train import build  # noqa: E402
from jax_tinybert.cli import plan  # noqa: E402
from jax_tinybert.parallel import sharding as shd  # noqa: E402
from jax_tinybert.model.modeling import BertConfig, random_params  # noqa: E402

tcfg = BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                  intermediate_size=128, max_position_embeddings=64, num_labels=2)
scfg = BertConfig(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, max_position_embeddings=64, num_labels=2)
B, T = 16, 32
out = {}
for name, spec in (("dp", {"data": -1}), ("fsdp", {"data": 1, "fsdp": -1})):
    p = plan.plan_one(tcfg, scfg, batch=B, seq_len=T, mesh_spec=spec, fsdp_min_size=1024,
                      teacher_placement="sharded")

    # The real thing: real params on the mesh, the step built by the build layer.
    mesh = shd.make_mesh(spec)
    config = plan.plan_config(fsdp_min_size=1024, teacher_placement="sharded")
    obj = build.build_objective(config, scfg, tcfg)
    student = build.student_module(config, scfg)
    teacher = build.teacher_module(config, tcfg, classifier=False)
    sparams = random_params(student, 1)
    tparams = random_params(teacher, 0)
    built = build.build_step(config, student=student, teacher=teacher, objective=obj,
                             student_params=sparams, teacher_params=tparams, mesh=mesh,
                             total_steps=10000)
    state = built.init_state(sparams, seed=2)
    tp = built.put_teacher(tparams)
    rng = np.random.default_rng(0)
    batch = {"input_ids": rng.integers(1, 512, (B, T)).astype(np.int32),
             "attention_mask": np.ones((B, T), np.int32),
             "token_type_ids": np.zeros((B, T), np.int32), "valid": np.ones(B, np.float32)}
    gbatch = shd.shard_batch(batch, mesh)
    f = built.train_step
    compiled = f.lower(state, tp, gbatch).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    mem = compiled.memory_analysis()
    dev0 = jax.devices()[0]

    def on_dev0(tree):
        return sum(s.data.nbytes for x in jax.tree_util.tree_leaves(tree)
                   for s in x.addressable_shards if s.device == dev0)

    actual_args = on_dev0(state) + on_dev0(tp) + on_dev0(gbatch)
    state, m = f(state, tp, gbatch)                     # and it runs
    stats = dev0.memory_stats()
    out[name] = {"plan": p, "real_flops": float(cost["flops"]),
                 "real_argument_bytes": int(mem.argument_size_in_bytes),
                 "real_temp_bytes": int(mem.temp_size_in_bytes),
                 "actual_arg_bytes_dev0": int(actual_args), "loss": float(m["loss"]),
                 "peak_bytes_in_use": (stats or {}).get("peak_bytes_in_use")}
print("JSON" + json.dumps(out))
