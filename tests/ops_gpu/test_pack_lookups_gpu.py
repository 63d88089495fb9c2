"""rocmoe.ops.pack_lookups on a real GPU (skipped on CPU-only machines): listed lookups pack
to what they pack to on the CPU, with no host sync, also on a later call that finds its
tables' starts already on the device. Its layout, on CPU: tests/ops/test_pack_tables.py."""

import pytest
import torch

from gpu_testing import require_gpu

from rocmoe.ops import pack_lookups

pytestmark = pytest.mark.gpu


def _listed(tables: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    indices = [torch.randint(0, 100, (int(n),), generator=g)
               for n in torch.randint(0, 40, (tables,), generator=g)]
    offsets = [torch.sort(torch.randint(0, i.numel() + 1, (8,), generator=g)).values
               for i in indices]
    for o in offsets:
        o[0] = 0
    return indices, offsets


@pytest.mark.parametrize("tables", [1, 26])
def test_listed_lookups_pack_on_the_gpu_as_on_the_cpu_without_a_host_sync(tables):
    require_gpu()
    for seed in (0, 1, 0):  # the third call's starts are the first's, kept on the device
        indices, offsets = _listed(tables, seed)
        want = pack_lookups(indices, offsets)
        on_gpu = ([i.cuda() for i in indices], [o.cuda() for o in offsets])
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = pack_lookups(*on_gpu)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
