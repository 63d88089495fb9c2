# Sourced (repo root) by the scripts that run on a GPU machine: the environment they share,
# cffi from the carried wheels where the machine lacks it, and the CUDA build.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
# Never NVLink multicast on shared machines: it can take the host's GPUs out of service.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
if ! python3 -c "import cffi, pycparser" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    $(ls .whl/cffi-2.1.1-*.whl .whl/pycparser-*.whl) || exit 3
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# Triton's compiled kernels in the checkout (gitignored), not in ~/.triton: a device machine
# starts bare, and the first GPU tests on it spent most of a 330 s part compiling (forty-
# seventh session). pack_triton_cache brings the cache back under $OUT; unpacked at the repo
# root here and named in the run's carry (".triton_cache"), it travels to the next machine,
# which then compiles only the kernels whose source changed (Triton keys an entry by the
# kernel's source, its options, the target (sm_90 on H100 and H200 alike) and its own version)
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton_cache}

# pack_triton_cache: $OUT/triton_cache.tgz, the cache as it is now (rc 0 when there is none)
pack_triton_cache() {
  [ -d "$TRITON_CACHE_DIR" ] || return 0
  tar -C "$(dirname "$TRITON_CACHE_DIR")" -czf "${OUT:-device_out}/triton_cache.tgz" \
    "$(basename "$TRITON_CACHE_DIR")"
}

# build_cuda LOG: librocmoe for CUDA in place (build/cuda); on failure the log's tail, rc 4
build_cuda() {
  (cmake -S . -B build/cuda -G Ninja -DROCMOE_GPU=cuda -DROCMOE_INPLACE=ON >/dev/null &&
   cmake --build build/cuda -j 16) > "$1" 2>&1 || { tail -40 "$1"; return 4; }
}

# stage_nvshmem LOG: librocmoe with the nvshmem facade (-DROCMOE_SHMEM=nvshmem) in
# $NVSHMEM_BUILD (default build/nvshmem), staged as a copy of the package in $NVSHMEM_PACKAGE
# (default /tmp/nvpkg); on failure the log's tail, rc 5. It changes no environment, so a
# script may run it in the background beside build_cuda (benchmarks/gpu_multi.sh does).
stage_nvshmem() {
  local pkg=${NVSHMEM_PACKAGE:-/tmp/nvpkg} dir=${NVSHMEM_BUILD:-build/nvshmem}
  (cmake -S . -B "$dir" -G Ninja -DROCMOE_GPU=cuda -DROCMOE_SHMEM=nvshmem \
     -DROCMOE_INPLACE=OFF -DPython_EXECUTABLE="$(command -v python3)" >/dev/null &&
   cmake --build "$dir" -j 16) > "$1" 2>&1 || { tail -40 "$1"; return 5; }
  rm -rf "$pkg" && mkdir -p "$pkg" && cp -r rocmoe "$pkg/" &&
    cp "$dir"/librocmoe.so "$dir"/_rocmoe_cffi*.so "$pkg/rocmoe/" || return 5
}

# use_nvshmem: after stage_nvshmem, exports the staged package's path as
# ROCMOE_NVSHMEM_PACKAGE (tests/gpu/test_nvshmem.py reads it) and puts NVSHMEM's libraries
# (the nvidia-nvshmem wheel's, on the device) on LD_LIBRARY_PATH
use_nvshmem() {
  local home
  home=$(python3 -c "import nvidia.nvshmem as m; print(list(m.__path__)[0])" 2>/dev/null)
  export ROCMOE_NVSHMEM_PACKAGE=${NVSHMEM_PACKAGE:-/tmp/nvpkg}
  export LD_LIBRARY_PATH=${home:+$home/lib:}${LD_LIBRARY_PATH:-}
}

# build_nvshmem LOG: both, in this shell (rc 5 when the build or the staging fails)
build_nvshmem() {
  stage_nvshmem "$1" && use_nvshmem
}
