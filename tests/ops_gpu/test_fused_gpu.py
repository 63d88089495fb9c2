"""The fused-op handles' device kernels on a real GPU (skipped on CPU-only machines): every
op and dtype at 1, 2 and 4 ranks (ranks share the GPU when there are fewer) against the
references, the split-K GEMM, and several calls of each handle captured in a CUDA graph and
replayed. Launch paths and failure cases: test_fused_launch_and_failures_gpu.py."""

import pytest

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
