"""`python -m jax_tinybert.main` as on a Cloud TPU VM, on a machine without a TPU.

With JAX_FORCE_TPU_INIT=1, JAX's start-up marks the process as running on a Cloud TPU VM; but
finding no TPU chip on the PCI bus it also sets TPU_SKIP_MDS_QUERY, which turns its metadata
server lookups off. A real TPU VM has chips, so that variable is unset there: this removes it,
and everything else is the CLI's own code path (`jax_tinybert.main.run()`).
"""
import os

import jax  # noqa: F401  (JAX's Cloud TPU start-up runs at import)

os.environ.pop("TPU_SKIP_MDS_QUERY", None)

from jax_tinybert import main  # noqa: E402  (sets XLA_FLAGS from JTB_CPU_DEVICES first)

if __name__ == "__main__":
    main.run()
