"""The expert FFN's activation functions, by name.

A module of its own because both the layer (block-sparse FFN) and expert parallelism (the
fused combine applies the activation itself) need the table: neither imports the other.
"""

from __future__ import annotations

import torch.nn.functional as F_

ACTIVATIONS = {
    "gelu": lambda t: F_.gelu(t, approximate="tanh"),
    "gelu_exact": F_.gelu,
    "relu": F_.relu,
    "silu": F_.silu,
}

# the ones the block-sparse kernels can apply inside SDD/DSD (blocksparse.fused_expert_ffn)
FUSABLE = frozenset({"gelu", "relu", "silu"})
