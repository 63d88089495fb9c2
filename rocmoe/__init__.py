"""rocmoe: a ROCm-first runtime for Mixture-of-Experts and DLRM training.

    import rocmoe
    with rocmoe.init() as ctx:          # mpi4py COMM_WORLD, backend="auto"
        x = ctx.zeros((1024,), torch.float32)
        ...

See README.md for the backends and ../shared/DESIGN.md for the contracts.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .errors import *  # noqa: F401,F403  (the hierarchy is part of the API)
from .errors import RocmoeError  # noqa: F401


def __getattr__(name):
    # The runtime pulls in torch, mpi4py and the native library; import it lazily so that
    # `import rocmoe` (e.g. for its errors or the MoE layer on one process) stays cheap.
    if name in ("init", "Context", "current_context"):
        from . import runtime
        return getattr(runtime, name)
    raise AttributeError(f"module 'rocmoe' has no attribute {name!r}")
