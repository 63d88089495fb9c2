"""What the fused ops share: context lookup, input checks, and the functional path's
per-call agreement.

The functional ops (rocmoe.ops.embedding_all_to_all etc.) first validate on every rank
without touching any peer, then run one bounded control all-gather (`agree`) that carries
each rank's verdict and the sizes the others need (batch, table counts, send counts). If any
rank is bad, every rank raises (the bad one its own error, the others an
InvalidArgumentError naming it) and nothing was written anywhere. Then the call goes to a
cached handle (rocmoe/ops/handles/), whose own protocol (epochs, acks, counts with the
data) needs no host collective.
"""

from __future__ import annotations

import threading
import weakref
from typing import Optional

import numpy as np
import torch

from .. import errors
from .._native import lib
from ..collective import RECORD_WORDS
from ..runtime import current_context

# the tensor types the fast paths take (the functions' direct calls, the handles' lean
# calls): a model's weights are Parameters, a subclass that changes nothing there; any other
# subclass may override what an op does with it, so it takes the general path
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)

# dtype codes of the C ABI (ROCMOE_DTYPE_*)
DTYPE_CODES = {torch.float32: lib.ROCMOE_DTYPE_F32, torch.bfloat16: lib.ROCMOE_DTYPE_BF16,
               torch.float16: lib.ROCMOE_DTYPE_F16}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
# embedding bag pooling modes of the C ABI (ROCMOE_BAG_*)
MODES = {"sum": lib.ROCMOE_BAG_SUM, "mean": lib.ROCMOE_BAG_MEAN}

_MAGIC = 0x524F434D4F45  # "ROCMOE": tags the agreement records of the fused ops
OP_CODES = {"embedding_all_to_all": 1, "gemv_all_reduce": 2, "gemm_all_to_all": 3,
            "all_to_all_rows": 4}

# ---- contexts by id: custom ops take ints, not Python objects ---------------------------
_contexts: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_contexts_lock = threading.Lock()


def resolve_context(ctx=None):
    # (current_context imported once, at the top: an import statement here cost about 1 us
    # of every functional call's host time, benchmarks/probe_function_layers.py)
    if ctx is None:
        ctx = current_context()
    if ctx.finalized:
        raise errors.ContextError("the rocmoe context passed to a fused op was finalized")
    return ctx


def context_id(ctx) -> int:
    with _contexts_lock:
        _contexts[id(ctx)] = ctx
    return id(ctx)


def context_by_id(ctx_id: int):
    ctx = _contexts.get(ctx_id)
    if ctx is None or ctx.finalized:
        raise errors.ContextError(
            f"fused op called with context id {ctx_id}, which is not a live rocmoe context")
    return ctx


# ---- checks --------------------------------------------------------------------------
def check_float_dtype(t: torch.Tensor, what: str) -> None:
    if t.dtype not in DTYPE_CODES:
        raise errors.DTypeError(
            f"{what} has dtype {t.dtype}; fused ops take float32, bfloat16 or float16")


def check_device(ctx, t: torch.Tensor, what: str) -> None:
    if t.device != ctx.device:
        raise errors.DeviceMismatchError(
            f"{what} is on {t.device}, but the {ctx.backend} backend of this context computes on "
            f"{ctx.device}; move it there first")


# what the fused ops take as indices, offsets and counts
INDEX_DTYPES = (torch.int32, torch.int64)


def check_index_dtype(t: torch.Tensor, what: str) -> None:
    if t.dtype not in INDEX_DTYPES:
        raise errors.DTypeError(f"{what} has dtype {t.dtype}; indices are int32 or int64")


# ---- the agreement -------------------------------------------------------------------
def agree(ctx, op: str, epoch: int, problem: Optional[Exception], payload) -> np.ndarray:
    """Bounded all-gather of [magic, op, epoch, ok, *payload] (payload: fixed length for a
    given op and world size). Raises on every rank if any rank had a problem or the ranks are
    in different calls. Returns the [world, len(payload)] payload table."""
    payload = np.asarray(payload, dtype=np.int64).reshape(-1)
    if ctx.world_size == 1:
        # one rank: no other rank to hear from or to be in another call; its own problem is
        # the only one (the record and its checks cost ~10 us of numpy a call)
        if problem is not None:
            raise problem
        return payload.reshape(1, -1)
    # One record length for every fused op of a context (and the runtime's own control
    # records when the world is small): ranks that diverged into different calls then meet
    # in an all-gather of equal sizes and get CollectiveMismatchError, not an MPI truncation.
    length = max(RECORD_WORDS, 4 + 8, 4 + 2 + ctx.world_size)
    record = np.zeros(length, dtype=np.int64)
    record[:4] = [_MAGIC, OP_CODES[op], epoch, int(problem is None)]
    record[4:4 + payload.size] = payload
    table = ctx.channel.allgather(record, f"{op} (agreeing on inputs)")
    heads = table[:, :3]
    if (heads[:, 0] != _MAGIC).any() or (heads[:, 1] != heads[0, 1]).any() or \
            (heads[:, 2] != heads[0, 2]).any():
        names = {v: k for k, v in OP_CODES.items()}
        calls = ", ".join(f"rank {r}: {names.get(int(o), '?')} call {int(e)}"
                          for r, (_, o, e) in enumerate(heads))
        raise errors.CollectiveMismatchError(
            f"{op}: ranks are in different fused-op calls ({calls}); every rank must call the "
            "same fused ops in the same order")
    if problem is not None:
        raise problem
    bad = [r for r in range(table.shape[0]) if not table[r, 3]]
    if bad:
        raise errors.InvalidArgumentError(
            f"{op}: rank(s) {bad} rejected their inputs (see their errors); no rank sent "
            "anything")
    return table[:, 4:4 + payload.size]
