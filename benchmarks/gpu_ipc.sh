#!/usr/bin/env bash
# ipc backend on a GPU machine: build librocmoe for the GPU in place (plain CMake: no pip
# needed), run the GPU tests, then the store+signal benchmark at 2 and 4 ranks sharing the
# node's GPUs (rank r on GPU r % count). JSON lines go to stdout and to $1.
#
#   benchmarks/gpu_ipc.sh [OUT.json]          ROCMOE_GPU=cuda (default) or hip
#   SIZES=1M,16M,256M RANKS="2 4" SKIP_TESTS=1 benchmarks/gpu_ipc.sh
set -euo pipefail
cd "$(dirname "$0")/.."

out=${1:-benchmarks/results/ipc_$(hostname -s).json}
gpu=${ROCMOE_GPU:-cuda}
sizes=${SIZES:-1M,16M,256M}
ranks=${RANKS:-"2 4"}

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
# Never use NVLink multicast on shared machines (it can take the host's GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

extra=()
[[ $gpu == hip ]] && extra+=(-DCMAKE_CXX_COMPILER=hipcc)
cmake -S . -B "build/gpu-$gpu" -G Ninja -DROCMOE_GPU="$gpu" -DROCMOE_INPLACE=ON \
    -DPython_EXECUTABLE="$(command -v python3)" "${extra[@]}" >/dev/null
cmake --build "build/gpu-$gpu"

# A failing test does not stop the benchmark (its own checks still apply); it sets the
# script's exit status.
tests_rc=0
if [[ -z ${SKIP_TESTS:-} ]]; then
    python3 -m pytest -q -rs -p no:cacheprovider tests/gpu || tests_rc=$?
fi

launcher=(mpirun)
command -v mpirun >/dev/null || launcher=(mpiexec)
# Open MPI needs --oversubscribe to put more ranks than cores/slots; MPICH has no such flag.
"${launcher[0]}" --version 2>&1 | grep -q "Open MPI" && launcher+=(--oversubscribe)
mkdir -p "$(dirname "$out")"
: > "$out"
for n in $ranks; do
    "${launcher[@]}" -n "$n" python3 -m rocmoe.bench.ipc --sizes "$sizes" --output "$out"
done
exit "$tests_rc"
