"""Host-side agreement between the processes of a job, through JAX's coordination service.

Used where every process must take the same branch on a host-side fact (a checkpoint that one
process cannot verify, say) before a collective that would otherwise hang. No device
computation, so it never waits for queued device work; each call is one round trip to the
coordinator, so it is for rare decisions (restores), not per step (see preemption.py).
"""
from __future__ import annotations

import jax

__all__ = ["Coordinator"]

# Generous: a slow host may still be finishing a restore when the others arrive.
BARRIER_TIMEOUT_MS = 10 * 60 * 1000


def _client():
    from jax._src import distributed  # the coordination-service client; no public handle

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("several JAX processes but no jax.distributed client")
    return client


class Coordinator:
    """Barriers and OR-reductions under a namespace (two instances never share a key).

    Every process must make the same calls in the same order. Single-process: no-ops.
    """

    def __init__(self, namespace: str):
        self._ns = namespace
        self._counter = 0
        self._pending_delete: list[str] = []

    def barrier(self, tag: str, timeout_s: float = BARRIER_TIMEOUT_MS / 1000) -> None:
        """Waits until every process has reached this barrier (timeout_s: then raises)."""
        if jax.process_count() == 1:
            return
        self._counter += 1
        _client().wait_at_barrier(f"{self._ns}_{tag}_{self._counter}", int(timeout_s * 1000))

    def from_process_0(self, value: str, tag: str) -> str:
        """Process 0's `value`, on every process (the others' own `value` is ignored)."""
        if jax.process_count() == 1:
            return value
        client = _client()
        self._counter += 1
        key = f"{self._ns}/{tag}_{self._counter}"
        if jax.process_index() == 0:
            client.key_value_set(key, value, allow_overwrite=True)
            return value
        return client.blocking_key_value_get(key, BARRIER_TIMEOUT_MS)

    def any_process(self, flag: bool, tag: str) -> bool:
        """Logical OR of `flag` over all processes."""
        if jax.process_count() == 1:
            return bool(flag)
        client = _client()
        self._counter += 1
        key = f"{self._ns}/{tag}_{self._counter}/"
        if flag:
            client.key_value_set(key + str(jax.process_index()), "1", allow_overwrite=True)
        client.wait_at_barrier(f"{self._ns}_{tag}_{self._counter}", BARRIER_TIMEOUT_MS)
        result = bool(client.key_value_dir_get(key))
        # Everyone has read the previous round's keys before reaching this round's barrier,
        # so they can go now.
        for k in self._pending_delete:
            try:
                client.key_value_delete(k)
            except Exception:  # noqa: BLE001 - cleanup only
                pass
        self._pending_delete = [key + str(jax.process_index())] if flag else []
        return result
