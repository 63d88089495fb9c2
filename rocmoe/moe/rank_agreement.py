"""Check that every rank built a layer the same way, and fail on every rank when not.

A rank whose own arguments were rejected, or ranks whose layers differ (``num_experts``,
``top_k``, sizes, placement), would otherwise meet again only deep inside the first
exchange, as a heap-allocation mismatch or a wait that times out. One timed all-gather of
a few ints at construction turns that into a ConfigurationError on every rank that names
the field and each rank's value.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..errors import ConfigurationError, RocmoeError


def allgather_ints(ctx, values, what: str) -> np.ndarray:
    """[world, n] of up to 13 ints per rank, bounded by the rocmoe timeout. A rocmoe Context
    has its control channel; a communicator-only context gets a fresh one (every rank
    creates it here at the same point, so its sequence numbers agree)."""
    if hasattr(ctx, "allgather_ints"):
        return np.asarray(ctx.allgather_ints(list(values)))
    if getattr(ctx, "comm", None) is None:
        raise ConfigurationError(
            "expert parallelism needs a context with an mpi4py communicator (ctx.comm); "
            "create it with rocmoe.init()")
    from ..collective import KIND_USER, ControlChannel
    from ..env import timeout_from_env
    channel = ControlChannel(ctx.comm, timeout_from_env())
    return channel.exchange(KIND_USER, list(values), what)


def _as_int(value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return -(1 << 62)  # the rank rejects it anyway; any value that shows up as differing


def agree_on_fields(ctx, fields: dict, what: str,
                    problem: Optional[RocmoeError] = None,
                    labels: Optional[dict] = None) -> None:
    """Collective over ctx's ranks: raise `problem` on the rank that had it and a
    ConfigurationError on the others; otherwise raise ConfigurationError on every rank if
    any field differs across ranks (naming each differing field with every rank's value;
    labels[name], where given, is the list of names the field's ints index)."""
    names = list(fields)
    try:
        table = allgather_ints(ctx, [int(problem is not None)]
                               + [_as_int(fields[n]) for n in names], what)
    except ConfigurationError:
        if problem is not None:   # no way to tell the peers: this rank's own error is news
            raise problem
        raise
    if problem is not None:
        raise problem
    failed = [r for r in range(table.shape[0]) if table[r, 0]]
    if failed:
        raise ConfigurationError(f"{what}: rank(s) {failed} rejected their arguments (see the "
                                 f"error there); this rank stops too")
    differs = []
    for i, name in enumerate(names, start=1):
        column = table[:, i]
        if (column != column[0]).any():
            names_of = (labels or {}).get(name)
            values = ", ".join(
                f"rank {r} = {names_of[int(v)]!r}" if names_of and 0 <= v < len(names_of)
                else f"rank {r} = {int(v)}" for r, v in enumerate(column))
            differs.append(f"{name}: {values}")
    if differs:
        raise ConfigurationError(
            f"{what} differs across ranks: " + "; ".join(differs)
            + ". Every rank must build it with the same arguments")


__all__ = ["agree_on_fields", "allgather_ints"]
