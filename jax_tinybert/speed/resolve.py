"""`resolve`: every `auto` speed knob of a config made concrete, once, for a backend and a run.

    config, notes = resolve(config, "cpu")                 # what the backend alone decides
    config, notes = resolve(config, "cpu", RunFacts(...))  # and what the run's size decides

Build, step and loop then read concrete values only. The knobs (SPEED_FIELDS) change how fast a
run goes, never its math, so the workdir check ignores them and a run resumes on another backend.
Imports no JAX.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable, Dict, Optional, Tuple

from jax_tinybert.speed.profiles import Profile, profile

SPEED_FIELDS = ("data.bucket_compile_steps", "train.checkpoint_seconds", "train.compile_ahead",
                "train.compile_workers", "train.chunk_tokens", "train.split_update",
                "teacher.cache_tokens", "teacher.cache_build", "train.attention")


@dataclasses.dataclass
class RunFacts:
    """What a run's size and data say, for the knobs that depend on them."""

    total_steps: int
    steps_per_epoch: int
    num_buckets: int
    devices: int = 1                 # devices of the mesh
    objective: str = ""
    logits_cache: bool = False       # the stage reads the teacher's logits / [CLS] from a cache
    token_cacheable: bool = False    # its per-token teacher outputs could be cached
    # () -> (fits, why): whether the per-token cache fits its disk limits.
    token_cache_fits: Callable[[], Tuple[bool, str]] = lambda: (True, "")
    # token dtype or None -> whether the cache pass forwards rows in the steps' order.
    follows_steps: Callable[[Optional[str]], bool] = lambda token_dtype: False
    host_cpus: Optional[int] = None  # None: this process's cores


def resolve(config, backend: str, facts: Optional[RunFacts] = None):
    """-> (a copy of config with the auto knobs concrete, {field: why} for the choices worth a
    log line). Without facts only the knobs the backend alone decides are resolved; a value
    already concrete is kept, so resolving twice is the same as once."""
    c = config.copy_and_resolve_references()
    p, notes = profile(backend), {}
    with c.unlocked():
        t = c.train
        if float(c.data.bucket_compile_steps) < 0:
            c.data.bucket_compile_steps = p.bucket_compile_steps
        if float(t.checkpoint_seconds) < 0:
            t.checkpoint_seconds = p.checkpoint_seconds
        if int(t.compile_workers) == 0:
            t.compile_workers = _compile_workers(p, facts.host_cpus if facts else None)
        if facts is None:
            return c, notes
        buckets = max(1, facts.num_buckets)
        if int(t.chunk_tokens) < 0:
            long_run = facts.total_steps >= p.chunk_min_steps * buckets
            # Several devices would each hold a slice of every chunk.
            t.chunk_tokens = p.chunk_tokens if facts.devices == 1 and long_run else 0
        if t.split_update == "auto":
            split = (facts.objective in p.split_objectives
                     or facts.total_steps <= p.split_steps_per_bucket * buckets)
            t.split_update = "always" if split else "never"
        if c.teacher.cache_tokens == "auto":
            c.teacher.cache_tokens, notes["teacher.cache_tokens"] = _cache_tokens(p, backend,
                                                                                 facts)
        tokens = facts.token_cacheable and c.teacher.cache_tokens == "always"
        token_dtype = c.teacher.cache_dtype if tokens else None
        if c.teacher.cache_build == "auto":
            # A pass in no step's order (packed rows) would keep the first step waiting for it.
            beside = (p.cache_beside and (facts.logits_cache or tokens)
                      and facts.follows_steps(token_dtype))
            c.teacher.cache_build = "beside" if beside else "before"
    return c, notes


def concrete(config) -> Dict[str, object]:
    """{field: value} of SPEED_FIELDS in `config` (what a run records in its config.json)."""
    out = {}
    for field in SPEED_FIELDS:
        section, name = field.split(".")
        out[field] = config[section][name]
    return out


def _compile_workers(p: Profile, cpus: Optional[int]) -> int:
    if p.compile_workers:
        return p.compile_workers
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # A run has a few programs (its buckets' steps, an eval step, an update step).
    return max(1, min(4, (cpus or 0) // 4))


def _cache_tokens(p: Profile, backend: str, facts: RunFacts) -> Tuple[str, str]:
    """auto teacher.cache_tokens -> ("always" | "never", why)."""
    if not facts.token_cacheable:
        return "never", "not cacheable"
    if not p.cache_tokens:
        return "never", (f"on {backend} the teacher's forward in the step is faster than reading "
                         "its outputs from disk (--config.teacher.cache_tokens=always to cache)")
    epochs, spe = p.cache_tokens_epochs, facts.steps_per_epoch
    if facts.total_steps <= epochs * spe:
        # The build costs about one epoch's teacher forwards: it pays from the third epoch on.
        return "never", (f"{facts.total_steps} steps are at most {epochs} epochs of {spe} "
                         "steps: building the cache would not pay back")
    fits, why = facts.token_cache_fits()
    return ("always", why) if fits else ("never", why + ": the teacher runs in every step")
