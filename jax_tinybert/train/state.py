"""The training state: everything that changes during training and is checkpointed."""
from __future__ import annotations

from typing import Any

import flax
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class TrainState:
    """step: int32 scalar; params: {"student": student params, "proj": projection params ({} if
    none)}; opt_state: optax state over `params`; rng: PRNG key data (uint32 [2]) for dropout.

    The teacher's params are never here: they are frozen inputs of the step.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array

    @classmethod
    def create(cls, params, tx, rng) -> "TrainState":
        return cls(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                   rng=jax.random.key_data(rng) if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
                   else rng)
