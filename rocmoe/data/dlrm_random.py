"""dlrm's ``--data-generation random`` batches, reproducible per batch index.

The distributions are facebookresearch/dlrm's: dense features uniform in [0, 1); for each
table and sample a bag of ``--num-indices-per-lookup`` indices when
``--num-indices-per-lookup-fixed``, else of ``round(max(1, u * min(rows, n)))`` indices
(u uniform in [0, 1)), drawn as ``round(u * (rows - 1))`` and made unique (a bag can come out
smaller); targets uniform in [0, 1), rounded to 0/1 with ``--round-targets``.

dlrm draws the batches one after another from one numpy stream (reset at the start of every
epoch). Here batch j comes from a generator seeded by (seed, j), so each epoch sees the same
batches as in dlrm and a resumed run regenerates batch j without replaying 0..j-1.
"""

from __future__ import annotations

import numpy as np
import torch


def random_batch(index: int, batch_size: int, dense_features: int, table_sizes,
                 num_indices_per_lookup: int, fixed: bool, round_targets: bool, seed: int):
    """(dense [B, F] float32, indices [per table], offsets [per table], targets [B]) of the
    global batch number `index`."""
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), int(index)]))
    dense = torch.from_numpy(rng.random((batch_size, dense_features), dtype=np.float32))
    indices, offsets = [], []
    for rows in table_sizes:
        bags, starts, start = [], [], 0
        for _ in range(batch_size):
            if fixed:
                size = num_indices_per_lookup
            else:
                size = int(np.round(max(1.0, rng.random() * min(rows, num_indices_per_lookup))))
            bag = np.unique(np.round(rng.random(size) * (rows - 1)).astype(np.int64))
            starts.append(start)
            bags.append(bag)
            start += bag.size
        indices.append(torch.from_numpy(np.concatenate(bags) if bags else np.zeros(0, np.int64)))
        offsets.append(torch.tensor(starts, dtype=torch.int64))
    targets = rng.random(batch_size, dtype=np.float32)
    if round_targets:
        targets = np.round(targets)
    return dense, indices, offsets, torch.from_numpy(targets.astype(np.float32))
