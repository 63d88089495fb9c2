"""Models built from rocmoe's layers and ops: GPT-MoE (dropless MoE FFNs) and DLRM (fused
embedding all-to-all). Importing this package needs torch only."""
