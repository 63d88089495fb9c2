"""Expert parallelism on the fused-op handles on a GPU (ranks share it): equal to the
one-rank layer, and a whole forward + backward step with zero host synchronisations
(torch.cuda.set_sync_debug_mode("error")), at 2 and 4 ranks."""

import pathlib

import pytest
import torch

from rocmoe_testing import mpi_env, run_mpi

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]

SCRIPT = pathlib.Path(__file__).with_name("ep_script.py")


def _require_gpu():
    if not torch.cuda.is_available():
        pytest.skip("no GPU: expert parallelism on GPU runs on the device machine")


@pytest.mark.parametrize("ranks,extra", [(2, []), (4, ["--glu", "--top-k", "3"])])
def test_expert_parallel_step_on_gpu_has_no_host_sync_and_equals_one_rank(ranks, extra):
    _require_gpu()
    proc = run_mpi(SCRIPT, ranks, "--ctx", "runtime", "--device", "cuda", "--dtype",
                   "float32", "--sync-debug", *extra, timeout=400,
                   env=mpi_env(ROCMOE_TIMEOUT_S="60"))
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.count("EP_NO_SYNC") == ranks, proc.stdout
    assert proc.stdout.count("transport=HandleTransport combine=gemm_all_to_all") == ranks, \
        proc.stdout
