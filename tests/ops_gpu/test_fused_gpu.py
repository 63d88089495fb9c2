"""The fused-op handles' device kernels on a real GPU (skipped on CPU-only machines): every
op and dtype at 1, 2 and 4 ranks (ranks share the GPU when there are fewer) against the
references, the split-K GEMM, the tuner's tiles for X of a few rows, and several calls of each handle captured in a CUDA graph and
replayed. Launch paths and failure cases: test_fused_launch_and_failures_gpu.py."""

import json

import pytest

from rocmoe.ops.gpu import tune_candidates

from gpu_testing import require_gpu_build, run_checks

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]

OPS = ["gemm", "gemm_grouped", "rows", "embedding", "gemv"]


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_handles_match_reference_on_gpu(ranks):
    require_gpu_build()
    # every op and dtype in one job per rank count: start-up is paid once
    run_checks(ranks, OPS, ["fp32", "bf16", "fp16"], timeout=500, calls=4,
               ROCMOE_TIMEOUT_S="60")


@pytest.mark.parametrize("ranks", [1, 2])
def test_split_k_gemm_matches_reference_and_replays_from_graphs_on_gpu(ranks):
    require_gpu_build()
    # the tuner's split-K tiles, forced: a skinny product, the small handles, graph replay
    split = '{"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4, "SPLIT_K": 4}'
    run_checks(ranks, ["split", "gemm", "gemm_grouped", "graph"], ["bf16", "fp32"],
               timeout=400, calls=3, ROCMOE_TIMEOUT_S="60", ROCMOE_GEMM_CONFIG=split)


# the tuner's tiles for X of at most 64 rows that no larger X gets (mma.sync under 64 rows)
_TINY_TILES = [c for c in tune_candidates("cuda", rows=16) if c not in tune_candidates("cuda", 65)]


def _tile_id(c) -> str:
    return "x".join(str(c[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))


@pytest.mark.parametrize("tile", _TINY_TILES, ids=_tile_id)
def test_every_tiny_x_tile_matches_reference_on_gpu(tile):
    require_gpu_build()
    # each tiny-X tile, forced, at 16, 64, 1 and 33 rows times 4096 x 4096: whichever the
    # tuner keeps on the GPU computes the right rows
    run_checks(1, ["tiny"], ["bf16", "fp16"], timeout=300, calls=4, ROCMOE_TIMEOUT_S="60",
               ROCMOE_GEMM_CONFIG=json.dumps(tile))


def test_split_sum_tile_replays_from_cuda_graphs_on_gpu():
    require_gpu_build()
    # the split-and-sum tile (its sum launched for PDL on Hopper): the tiny shapes, and
    # several calls of each handle captured in one graph and replayed, equal to eager
    tile = next(c for c in _TINY_TILES if c.get("SPLIT_SUM"))
    run_checks(1, ["tiny", "graph"], ["bf16"], timeout=300, calls=4, ROCMOE_TIMEOUT_S="60",
               ROCMOE_GEMM_CONFIG=json.dumps(tile))


def test_a_tiny_x_tile_carries_the_exchange_between_ranks_on_gpu():
    require_gpu_build()
    run_checks(2, ["tiny"], ["bf16"], timeout=300, calls=4, ROCMOE_TIMEOUT_S="60",
               ROCMOE_GEMM_CONFIG=json.dumps(_TINY_TILES[1]))


@pytest.mark.parametrize("ranks", [1, 2])
def test_handles_replay_from_cuda_graphs_equal_to_eager(ranks):
    require_gpu_build()
    run_checks(ranks, ["graph"], ["bf16", "fp32"], ROCMOE_TIMEOUT_S="60")


def test_gemv_balanced_split_matches_reference_and_replays_from_graphs_on_gpu():
    require_gpu_build()
    # ROCMOE_GEMV_BALANCE=1 (off by default): rows cut between waves, summed through slots
    # that every call must leave empty; 16411 rows, more than the resident grid has waves
    run_checks(1, ["gemv_tall"], ["fp32", "bf16", "fp16"], calls=3, ROCMOE_TIMEOUT_S="60",
               ROCMOE_GEMV_BALANCE="1")
