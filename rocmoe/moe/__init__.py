"""Dropless block-sparse Mixture-of-Experts (router, permutation, topology, kernels, layer).

Importing this package needs torch only: Triton is loaded when a GPU tensor first reaches
a block-sparse op, and the rocmoe runtime (native library) only for expert parallelism.
"""

from .blocksparse import (ddst, dsd, dstd, fused_expert_ffn, get_backend, sdd, set_backend,
                          set_kernel_config, to_dense)
from .layer import DroplessMoE, expert_ffn
from .permute import (RoutingPlan, padded_rows_bound, permute_pad, plan_routing,
                      unpermute_combine)
from .routing import route_and_permute
from .router import Router, expert_histogram, load_balancing_loss, z_loss
from .topology import Topology, build_topology
from .placement import Placement
from .cost_model import CostModel
from .scheduler import VExpertScheduler

__all__ = [
    "DroplessMoE", "Router", "Topology", "RoutingPlan", "build_topology", "plan_routing",
    "permute_pad", "unpermute_combine", "padded_rows_bound", "sdd", "dsd", "dstd", "ddst",
    "to_dense", "expert_ffn", "fused_expert_ffn", "set_kernel_config", "expert_histogram",
    "load_balancing_loss", "z_loss",
    "set_backend", "get_backend", "route_and_permute",
    "Placement", "CostModel", "VExpertScheduler",
]
