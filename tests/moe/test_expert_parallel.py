"""Expert parallelism at 2 and 4 ranks equals the one-rank layer (launches mpiexec)."""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.mpi

SCRIPT = pathlib.Path(__file__).with_name("ep_script.py")
REPO = pathlib.Path(__file__).resolve().parents[2]


def _mpiexec():
    exe = shutil.which("mpiexec")
    if exe is None:
        if os.environ.get("ROCMOE_REQUIRE_ALL") == "1":
            pytest.fail("mpiexec not found and ROCMOE_REQUIRE_ALL=1")
        pytest.skip("mpiexec not found")
    return exe


def _run(ranks, *args, expect="EP_OK"):
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", PYTHONUNBUFFERED="1",
               # one thread per rank: CI has 2 cores for up to 4 ranks
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [_mpiexec(), "-n", str(ranks), "--oversubscribe", sys.executable, str(SCRIPT), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count(expect) == ranks, out
    return out


def _require_runtime():
    try:
        import rocmoe.runtime  # noqa: F401  (needs the native library)
    except Exception as exc:  # noqa: BLE001
        if os.environ.get("ROCMOE_REQUIRE_ALL") == "1":
            pytest.fail(f"rocmoe runtime unavailable: {exc}")
        pytest.skip(f"rocmoe runtime unavailable: {exc}")


def test_expert_parallel_at_two_ranks_over_mpi_equals_one_rank_layer():
    out = _run(2, "--block-size", "16")
    assert out.count("transport=MPITransport") == 2, out


def test_expert_parallel_at_two_ranks_over_symmetric_heap_equals_one_rank_layer():
    # float64 weights: gemm_all_to_all takes none, so "auto" combines by all-to-all
    _require_runtime()
    out = _run(2, "--ctx", "runtime")
    assert out.count("transport=HandleTransport combine=all_to_all") == 2, out


def test_expert_parallel_combines_through_gemm_all_to_all_on_a_context():
    # float32 on a rocmoe Context: each local expert's last GEMM runs fused with the trip
    # back (rocmoe.ops.gemm_all_to_all); outputs and all gradients equal the one-rank layer
    _require_runtime()
    out = _run(2, "--ctx", "runtime", "--dtype", "float32")
    assert out.count("combine=gemm_all_to_all") == 2, out


def test_gemm_all_to_all_combine_at_four_ranks_with_glu_and_top3():
    _require_runtime()
    out = _run(4, "--ctx", "runtime", "--dtype", "float32", "--glu", "--block-size", "32",
               "--top-k", "3")
    assert out.count("combine=gemm_all_to_all") == 4, out


def test_gemm_all_to_all_combine_with_experts_that_get_no_tokens():
    # 10 (token, expert) pairs over 16 experts: some experts idle, so some ranks call the
    # collective op with no rows for them (it must still be called, and agree)
    _require_runtime()
    out = _run(4, "--ctx", "runtime", "--dtype", "float32", "--experts", "16", "--tokens", "1",
               "--top-k", "1")
    assert out.count("combine=gemm_all_to_all") == 4, out
    idle = [int(part.split("=")[1]) for part in out.split() if part.startswith("idle_experts_here=")]
    assert len(idle) == 4 and sum(idle) > 0, out


def test_all_to_all_combine_can_be_chosen_on_a_context():
    _require_runtime()
    out = _run(2, "--ctx", "runtime", "--dtype", "float32", "--combine", "all_to_all")
    assert out.count("transport=HandleTransport combine=all_to_all") == 2, out


def test_grouped_mm_combine_on_a_context_equals_the_one_rank_layer():
    # the local FFN on the arrivals regrouped by expert (device counts, the handle path),
    # then the row exchange; GLU and k = 3 so that the W3 product and several slots count
    _require_runtime()
    out = _run(2, "--ctx", "runtime", "--dtype", "float32", "--combine", "grouped_mm",
               "--glu", "--top-k", "3")
    assert out.count("transport=HandleTransport combine=grouped_mm") == 2, out


def test_grouped_mm_combine_over_mpi_with_idle_experts_equals_the_one_rank_layer():
    # the host-count path (MPITransport), with experts that get no rows on some ranks
    out = _run(2, "--combine", "grouped_mm", "--experts", "16", "--tokens", "2", "--top-k", "1")
    assert out.count("transport=MPITransport combine=grouped_mm") == 2, out


def test_expert_parallel_at_four_ranks_over_symmetric_heap_with_glu_and_top3():
    # one 4-rank run covers the GLU path, k=3 and 32-row blocks (CI has 2 cores)
    _require_runtime()
    out = _run(4, "--ctx", "runtime", "--glu", "--block-size", "32", "--top-k", "3")
    assert out.count("transport=HandleTransport combine=all_to_all") == 4, out


@pytest.mark.parametrize("bad,error", [("width", "InvalidArgumentError"),
                                       ("dtype", "DTypeError"),
                                       # checked before the exchange, not inside it
                                       ("other_float", "DTypeError"),
                                       ("list", "InvalidArgumentError")])
def test_bad_input_on_one_rank_raises_on_every_rank_over_mpi(bad, error):
    # rank 1's input is rejected; rank 0 must raise too, not wait in the exchange
    out = _run(2, "--bad-rank", "1", "--bad", bad, expect="EP_REJECTED")
    assert f"EP_REJECTED rank=1 world=2 error={error}" in out, out
    assert "EP_REJECTED rank=0 world=2 error=InvalidArgumentError: expert-parallel layer: " \
           "rank(s) [1] rejected their input" in out, out


def test_bad_input_on_one_rank_raises_on_every_rank_over_symmetric_heap():
    _require_runtime()
    out = _run(2, "--ctx", "runtime", "--bad-rank", "0", expect="EP_REJECTED")
    assert "EP_REJECTED rank=0 world=2 error=InvalidArgumentError: input must have shape" in out
    assert "EP_REJECTED rank=1 world=2 error=InvalidArgumentError: expert-parallel layer: " \
           "rank(s) [0] rejected their input" in out, out


def test_a_combine_one_rank_cannot_run_raises_on_every_rank():
    # rank 1 asks for the fused combine with float64 weights: it raises ConfigurationError,
    # rank 0 (which would combine by all-to-all) raises too instead of waiting for rows
    _require_runtime()
    out = _run(2, "--ctx", "runtime", "--bad-rank", "1", "--bad", "combine",
               expect="EP_REJECTED")
    assert "EP_REJECTED rank=1 world=2 error=ConfigurationError: combine='gemm_all_to_all' " \
           "takes float32, bfloat16 or float16 weights" in out, out
    assert "EP_REJECTED rank=0 world=2 error=InvalidArgumentError: expert-parallel layer: " \
           "rank(s) [1] rejected their input" in out, out
