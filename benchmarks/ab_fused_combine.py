"""A/B of the expert-parallel fused combine in one checkout: this tree's (one grouped
gemm_all_to_all per layer) against another version of rocmoe/moe/parallel.py loaded beside
it, e.g. the one-call-per-local-expert combine of commit d4194c7:

    git show d4194c7:rocmoe/moe/parallel.py > /tmp/parallel_old.py
    for v in old new old new; do VARIANT=$v OLD_PARALLEL=/tmp/parallel_old.py \\
      mpiexec -n 2 --oversubscribe -x VARIANT -x OLD_PARALLEL python3 \\
      benchmarks/ab_fused_combine.py --device cpu --ops moe_combine --reps 7 --warmup 1 \\
      --moe-shapes "256,64,128,8;2048,256,512,8;2048,256,512,32" --output /tmp/$v.json; done

VARIANT=old swaps in OLD_PARALLEL's expert_parallel_forward (the layer imports it at call
time); the remaining arguments go to rocmoe.bench.multi_gpu (run under mpiexec)."""
import importlib.util
import os
import sys

import rocmoe.moe.parallel as parallel

if os.environ.get("VARIANT", "new") == "old":
    spec = importlib.util.spec_from_file_location("rocmoe.moe._parallel_old",
                                                  os.environ["OLD_PARALLEL"])
    old = importlib.util.module_from_spec(spec)
    old.__package__ = "rocmoe.moe"
    spec.loader.exec_module(old)
    parallel.expert_parallel_forward = old.expert_parallel_forward

from rocmoe.bench import multi_gpu  # noqa: E402

sys.exit(multi_gpu.main(sys.argv[1:]))
