"""Expert parallelism on a GPU: the expert-parallel DroplessMoE on GPU contexts (ipc heap, the
fused-op handles' transport, Triton kernels, the grouped GemmAllToAll combine) equals the
one-rank layer, at 2 and 4 ranks sharing the GPU (tests/moe/ep_script.py --device cuda), and
a whole step makes no host synchronisation (--sync-debug). Skipped without a GPU."""

import pytest
import torch

from rocmoe_testing import TESTS, mpi_env, run_mpi

pytestmark = [pytest.mark.gpu, pytest.mark.mpi,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")]

SCRIPT = TESTS / "moe" / "ep_script.py"


def _run(ranks, *args):
    from rocmoe import _native
    if _native.gpu_platform() == "none":
        pytest.skip("librocmoe was built without a GPU platform (benchmarks/device_env.sh: "
                    "build_cuda)")
    proc = run_mpi(SCRIPT, ranks, "--ctx", "runtime", "--device", "cuda", *args, timeout=500,
                   env=mpi_env(ROCMOE_TIMEOUT_S="60"))
    out = proc.stdout
    assert proc.returncode == 0, out
    for rank in range(ranks):
        assert f"EP_OK rank={rank} world={ranks} ctx=runtime transport=HandleTransport" in out, out
    return out


def test_two_ranks_on_gpu_with_the_fused_combine_equal_the_one_rank_layer():
    out = _run(2, "--dtype", "float32")
    assert out.count("combine=gemm_all_to_all") == 2, out


def test_two_ranks_on_gpu_with_the_all_to_all_combine_equal_the_one_rank_layer():
    out = _run(2, "--dtype", "float32", "--combine", "all_to_all")
    assert out.count("combine=all_to_all") == 2, out


def test_four_ranks_on_gpu_with_glu_top3_and_32_row_blocks_equal_the_one_rank_layer():
    out = _run(4, "--dtype", "float32", "--glu", "--top-k", "3", "--block-size", "32")
    assert out.count("combine=gemm_all_to_all") == 4, out


def test_four_ranks_on_gpu_with_idle_experts_equal_the_one_rank_layer():
    out = _run(4, "--dtype", "float32", "--experts", "16", "--tokens", "1", "--top-k", "1")
    assert out.count("combine=gemm_all_to_all") == 4, out
    idle = [int(p.split("=")[1]) for p in out.split() if p.startswith("idle_experts_here=")]
    assert len(idle) == 4 and sum(idle) > 0, out


@pytest.mark.parametrize("ranks,extra", [(2, []), (4, ["--glu", "--top-k", "3"])])
def test_a_whole_step_on_gpu_makes_no_host_sync(ranks, extra):
    # after a warm-up step, forward and backward under sync-debug "error"
    out = _run(ranks, "--dtype", "float32", "--sync-debug", *extra)
    assert out.count("EP_NO_SYNC") == ranks, out
    assert out.count("combine=gemm_all_to_all") == ranks, out
