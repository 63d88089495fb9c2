"""The host backend's shared-memory segments (README, "Guarantees and limits"): created
O_EXCL with mode 0600, named by job and rank, and unlinked once every rank has mapped them.

These drive librocmoe's C ABI directly (one rank, in this process), so each lifecycle step
can be observed: the segment exists after rocmoe_init, and is gone after rocmoe_seal. The
multi-rank case (no segment left after rocmoe.init on 2 and 4 ranks) is the check
`segments_unlinked_after_init` of tests/runtime/rank_checks.py."""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

import rocmoe
from rocmoe import _native
from rocmoe._native import ffi, lib

SHM = Path("/dev/shm")
HEAP = 1 << 16


def _tag() -> str:
    # unique per test: other jobs may be running on this machine at the same time
    return f"i18test-{os.getpid()}-{secrets.token_hex(4)}"


def _segment(tag: str, rank: int = 0) -> Path:
    return SHM / f"rocmoe.{tag}.{rank}"


def _native_init(tag: str):
    """rocmoe_init for one host rank; returns (rc, ctx handle or None, the C strings kept)."""
    args = ffi.new("rocmoe_init_args *")
    args.backend = _native.BACKENDS["host"]
    args.rank, args.world_size, args.local_rank, args.local_size = 0, 1, 0, 1
    args.device = -1
    args.heap_size = HEAP
    args.timeout_s = 5.0
    tag_c = ffi.new("char[]", tag.encode())
    args.job_tag = tag_c
    out = ffi.new("rocmoe_ctx **")
    rc = lib.rocmoe_init(args, out)
    return rc, (out[0] if rc == lib.ROCMOE_OK else None), tag_c


def _connect(handle) -> None:
    blob = np.zeros(lib.rocmoe_bootstrap_blob_size(), dtype=np.uint8)
    _native.check(lib.rocmoe_bootstrap_blob(handle, ffi.from_buffer(blob)), "blob")
    _native.check(lib.rocmoe_connect(handle, ffi.from_buffer(blob)), "connect")


@pytest.fixture
def no_umask():
    # with umask 0 the segment's mode is exactly what librocmoe asks for (a 0644 would
    # otherwise hide behind a umask of 077)
    old = os.umask(0)
    yield
    os.umask(old)


def test_segment_is_created_with_mode_0600_under_the_job_and_rank_name(no_umask):
    tag = _tag()
    rc, handle, _keep = _native_init(tag)
    assert rc == lib.ROCMOE_OK, _native.last_error()
    try:
        st = os.stat(_segment(tag))
        assert stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
        assert st.st_uid == os.getuid()
    finally:
        lib.rocmoe_finalize(handle)


def test_segment_is_unlinked_once_every_rank_has_mapped_it():
    tag = _tag()
    rc, handle, _keep = _native_init(tag)
    assert rc == lib.ROCMOE_OK, _native.last_error()
    try:
        _connect(handle)
        assert _segment(tag).exists()  # peers still need its name until they have mapped it
        _native.check(lib.rocmoe_seal(handle), "seal")
        assert not _segment(tag).exists(), "the segment's name outlives the bootstrap"
        # the heap itself stays usable: the mapping, not the name, keeps the memory
        base = int(ffi.cast("uintptr_t", lib.rocmoe_heap_base(handle)))
        ffi.cast("uint8_t *", base)[HEAP - 1] = 7
        assert ffi.cast("uint8_t *", base)[HEAP - 1] == 7
    finally:
        lib.rocmoe_finalize(handle)


def test_a_pre_existing_segment_of_the_jobs_name_is_refused_and_left_alone():
    tag = _tag()
    path = _segment(tag)
    path.write_bytes(b"somebody else's data")  # a leftover, or another user's segment
    try:
        rc, handle, _keep = _native_init(tag)
        if handle is not None:
            lib.rocmoe_finalize(handle)
        assert rc == lib.ROCMOE_ERR_STATE, (rc, _native.last_error())
        assert "exists" in _native.last_error() and "rocmoe doctor --clean" in \
            _native.last_error()
        # neither opened (truncated to the heap size) nor unlinked by the failed init
        assert path.read_bytes() == b"somebody else's data"
    finally:
        path.unlink(missing_ok=True)


def test_rocmoe_init_leaves_no_segment_of_its_job_in_dev_shm():
    with rocmoe.init(backend="host", heap_size=HEAP) as ctx:
        assert ctx.job_tag and "/" not in ctx.job_tag
        left = sorted(p.name for p in SHM.glob(f"rocmoe.{ctx.job_tag}.*"))
        assert left == [], left
        t = ctx.zeros((16,), torch.float32)  # and the heap works without its name
        t.fill_(3.0)
        assert float(t.sum()) == 48.0
        ctx.free(t)
