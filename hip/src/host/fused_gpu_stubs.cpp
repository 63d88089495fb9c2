// Builds without a GPU platform (ROCMOE_GPU=none) still export the GPU fused-op entry
// points of rocmoe.h, so the cffi module links; they report that the GPU path is absent.
#include "../internal.hpp"

#if !defined(ROCMOE_HAVE_GPU)
namespace {
int no_gpu() {
    return rocmoe::fail(ROCMOE_ERR_BACKEND,
                        "librocmoe was built without a GPU platform (ROCMOE_GPU=none): rebuild "
                        "with -DROCMOE_GPU=hip or cuda for the GPU fused ops");
}
}  // namespace

extern "C" int rocmoe_gpu_embedding_a2a(const rocmoe_gpu_embedding_args *, int) { return no_gpu(); }
extern "C" int rocmoe_gpu_gemv_allreduce(const rocmoe_gpu_gemv_args *, int) { return no_gpu(); }
extern "C" int rocmoe_gpu_embedding_inline_tables(void) { return 0; }
#endif
