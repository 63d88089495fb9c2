"""The Triton kernels of the GemmAllToAll / AllToAllRows handles and their protocol, run by
the Triton interpreter on CPU processes whose "peers" are the host backend's shared-memory
heap: the same kernel source, the same schedule, stores through peer base pointers, epochs
in the workspace, counts with the data, acks, status words and bounded waits as on a GPU
(no GPU needed, runs in CI)."""

import json

import pytest

from rocmoe.ops.gpu import tune_candidates

from gpu_testing import SCRIPT
from rocmoe_testing import mpi_env, require_module, run_mpi

require_module("triton", "the Triton interpreter runs the GEMM+All-to-All kernel on CPU")

pytestmark = [pytest.mark.triton_interpret, pytest.mark.mpi]


def _env(**extra):
    return mpi_env(TRITON_INTERPRET="1", **extra)


@pytest.mark.parametrize("ranks", [1, 3])
def test_gemm_all_to_all_matches_reference_over_repeated_calls(ranks):
    # fp32 and fp16 only: Triton 3.9's interpreter computes tl.dot of bfloat16 operands
    # wrongly (reinterprets the bits; a 16x16 product is off by 1e10), compiled code is fine
    proc = run_mpi(SCRIPT, ranks, "gemm,rows", "--calls", "3", "--dtype", "fp32,fp16",
                   timeout=300, env=_env(ROCMOE_TIMEOUT_S="30"))
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.count("OK gemm ") == 2 * ranks, proc.stdout
    assert proc.stdout.count("OK rows ") == 2 * ranks, proc.stdout


# the tuner's tiles for X of at most 64 rows that no larger X gets
_TINY_TILES = [c for c in tune_candidates("cuda", rows=16) if c not in tune_candidates("cuda", 65)]


def _tile_id(c) -> str:
    return "x".join(str(c[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))


@pytest.mark.parametrize("tile", _TINY_TILES, ids=_tile_id)
def test_every_tiny_x_tuning_tile_matches_reference(tile):
    # the tiles the tuner times for X of at most 64 rows (16 to 64 rows, 32 or 64 columns, a
    # K step of 128 over K 32: a masked step) at world size 1, where the tuner keeps one
    # for the handle's calls
    proc = run_mpi(SCRIPT, 1, "gemm", "--calls", "3", "--dtype", "fp32,fp16", timeout=300,
                   env=_env(ROCMOE_TIMEOUT_S="30", ROCMOE_GEMM_CONFIG=json.dumps(tile)))
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.count("OK gemm ") == 2, proc.stdout


def test_a_tiny_x_tile_carries_the_exchange_between_ranks():
    # at world size > 1 the tuned tile of a product's first call runs the protocol
    proc = run_mpi(SCRIPT, 3, "gemm", "--calls", "2", "--dtype", "fp16", timeout=300,
                   env=_env(ROCMOE_TIMEOUT_S="30", ROCMOE_GEMM_CONFIG=json.dumps(_TINY_TILES[1])))
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.count("OK gemm ") == 3, proc.stdout


@pytest.mark.parametrize("ranks", [1, 3])
def test_grouped_gemm_all_to_all_matches_reference(ranks):
    # W [G, K, N]: each destination's rows are G segments, each through its own W[g]
    proc = run_mpi(SCRIPT, ranks, "gemm_grouped", "--calls", "2", "--dtype",
                   "fp32,fp16", timeout=300, env=_env(ROCMOE_TIMEOUT_S="30"))
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.count("OK gemm_grouped") == 2 * ranks, proc.stdout


def test_grouped_segments_of_several_tiles_reach_every_rank():
    # segments of up to 21 rows (two 16-row tiles) times three 16-wide column tiles: every
    # task finds its segment, row tile and column tile in the kernel's own plan
    proc = run_mpi(SCRIPT, 3, "gemm_grouped", "--calls", "2", "--dtype", "fp32",
                   timeout=300, env=_env(ROCMOE_TIMEOUT_S="30", GEMM_COUNT_MAX="21"))
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.count("OK gemm_grouped") == 3, proc.stdout


@pytest.mark.parametrize("ranks", [1, 3])
def test_split_k_gemm_all_to_all_matches_reference(ranks):
    # SPLIT_K 3 over K's two steps (one range empty): each tile's partials meet at its
    # semaphore and the last task in stores the sum, in local mode and to every peer
    proc = run_mpi(SCRIPT, ranks, "gemm,gemm_grouped", "--calls", "2", "--dtype", "fp32",
                   timeout=300, env=_env(ROCMOE_TIMEOUT_S="30",
                                         ROCMOE_GEMM_CONFIG='{"SPLIT_K": 3}'))
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.count("OK gemm fp32") == ranks, proc.stdout
    assert proc.stdout.count("OK gemm_grouped fp32") == ranks, proc.stdout


def test_missing_peer_signal_times_out_with_comm_timeout_error():
    proc = run_mpi(SCRIPT, 2, "gemm_timeout", timeout=240, env=_env(ROCMOE_TIMEOUT_S="2"))
    assert "RANK 0 TIMEOUT" in proc.stdout and "rank(s) [1]" in proc.stdout, proc.stdout


@pytest.mark.parametrize("ranks", [1, 2])
def test_bad_device_counts_are_reported_by_every_rank_and_the_handle_stays_usable(ranks):
    # at 1 rank the kernel's DIRECT path (no plan) must see the bad count too
    proc = run_mpi(SCRIPT, ranks, "bad_counts", timeout=240, env=_env())
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.count("REJECTED") == ranks, proc.stdout


_SPLIT_TILE = '{"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "SPLIT_K": 3}'
_SPLIT_SUM_TILE = _SPLIT_TILE[:-1] + ', "SPLIT_SUM": true}'


@pytest.mark.parametrize("config", [_SPLIT_TILE, _SPLIT_SUM_TILE], ids=["joined", "summed"])
def test_bad_device_counts_on_the_direct_split_k_path_leave_the_next_call_right(config):
    # world size 1 with K split in 3, the partials joined at each tile's semaphore or summed
    # by a second launch (SPLIT_SUM): a bad count stores nothing, is reported (by the
    # product), and the next call is right
    proc = run_mpi(SCRIPT, 1, "bad_counts", timeout=240, env=_env(ROCMOE_GEMM_CONFIG=config))
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.count("REJECTED") == 1, proc.stdout


def test_split_sum_adds_the_split_partials_in_a_second_launch():
    # world size 1, K's two steps split in 3 (one range empty) with SPLIT_SUM: each task
    # stores its partial and split_sum_kernel, launched after the product, sums them into
    # the output (on Hopper launched for PDL; here in stream order)
    proc = run_mpi(SCRIPT, 1, "gemm", "--calls", "3", "--dtype", "fp32,fp16", timeout=300,
                   env=_env(ROCMOE_TIMEOUT_S="30", ROCMOE_GEMM_CONFIG=_SPLIT_SUM_TILE))
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.count("OK gemm ") == 2, proc.stdout


def test_split_sum_is_a_join_in_the_kernel_between_ranks():
    # at world size > 1 there is no DIRECT path: a SPLIT_SUM config's split tiles join at
    # their semaphores and go to the peers as before
    proc = run_mpi(SCRIPT, 3, "gemm", "--calls", "2", "--dtype", "fp32", timeout=300,
                   env=_env(ROCMOE_TIMEOUT_S="30", ROCMOE_GEMM_CONFIG=_SPLIT_SUM_TILE))
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.count("OK gemm fp32") == 3, proc.stdout


def test_a_rejected_input_aborts_the_call_on_every_rank_without_a_hang():
    proc = run_mpi(SCRIPT, 2, "abort", timeout=240, env=_env())
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.count("REJECTED") == 2, proc.stdout


def test_gemv_with_different_n_rejected_on_every_rank():
    # handle creation agrees on N before anything is allocated or launched
    proc = run_mpi(SCRIPT, 2, "gemv_mismatch", timeout=240, env=_env())
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.count("REJECTED") == 2, proc.stdout
