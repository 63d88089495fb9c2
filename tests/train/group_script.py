"""Run on 2 ranks by test_group.py: the training loop's collectives. Prints one
'CHECK <name> <ok|FAIL ...>' line per behaviour (rank 0), then times out on purpose."""

from __future__ import annotations

import sys
import time

import torch

from rocmoe.errors import CommTimeoutError, ConfigurationError
from rocmoe.train.data_parallel import GradientSync, split_parameters
from rocmoe.train.group import ProcessGroup
from rocmoe.train.preemption import StopSignals

group = ProcessGroup.world()
rank, world = group.rank, group.world_size
assert world == 2


def report(name, ok, detail=""):
    flags = group.allgather(torch.tensor([int(bool(ok))]).numpy(), name)
    if rank == 0:
        status = "ok" if flags.all() else f"FAIL ranks {[r for r in range(world) if not flags[r, 0]]} {detail}"
        print(f"CHECK {name} {status}", flush=True)


# replicated parameters average, rank-local ones are scaled by 1/world
model = torch.nn.Linear(3, 2)
torch.manual_seed(0)
with torch.no_grad():
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
expert = torch.nn.Parameter(torch.ones(4))
model.register_parameter("expert", expert)
replicated, local = split_parameters(model, [expert])
sync = GradientSync(replicated, local, group)
sync.check_replicas_equal()
x = torch.full((1, 3), float(rank + 1))
(model(x).sum() + (expert * (rank + 1)).sum()).backward()
mean_weight_grad = torch.full((2, 3), 1.5)  # d/dW of sum(Wx) is x: ranks give 1 and 2
sync()
report("replicated_gradients_are_averaged", torch.allclose(model.weight.grad, mean_weight_grad))
report("local_gradients_are_divided_by_world", torch.allclose(expert.grad,
                                                               torch.full((4,), (rank + 1) / 2)))

# replicas that differ are refused on every rank
with torch.no_grad():
    if rank == 1:
        model.bias.add_(1e-3)
try:
    sync.check_replicas_equal()
    refused = False
except ConfigurationError as exc:
    refused = "ranks [1] differ" in str(exc)
report("differing_replicas_are_refused_everywhere", refused)

# a problem one rank has raises on every rank, naming it; none raises nothing
try:
    group.raise_together(ValueError("mine") if rank == 1 else None, "problems", "setup failed",
                         ConfigurationError)
    named = False
except ConfigurationError as exc:
    named = "setup failed (ranks [1] failed" in str(exc) and (("here: mine" in str(exc))
                                                             == (rank == 1))
report("a_problem_on_one_rank_raises_on_every_rank", named)
try:
    group.raise_together(None, "no problems", "setup failed", ConfigurationError)
    quiet = True
except ConfigurationError:
    quiet = False
report("no_problem_raises_nothing", quiet)

# values that differ across the ranks raise on every rank, listing each rank's
try:
    group.same_everywhere([7, 10 + rank], ["files", "bytes"], "sizes", "the sizes differ",
                          ConfigurationError, "read the same data")
    listed = False
except ConfigurationError as exc:
    listed = str(exc) == ("the sizes differ (rank 0: 7 files, 10 bytes; rank 1: 7 files, "
                          "11 bytes): read the same data")
report("differing_values_raise_on_every_rank", listed)
group.same_everywhere([7, 10], ["files", "bytes"], "sizes", "the sizes differ")  # equal: quiet

# a stop requested on one rank is agreed by all
stop = StopSignals()
report("no_stop_without_a_request", not stop.agreed(group))
if rank == 1:
    stop.request("test")
report("a_stop_on_one_rank_stops_every_rank", stop.agreed(group))

# a rank that never joins turns into CommTimeoutError, not a hang
if rank == 0:
    start = time.monotonic()
    try:
        group.barrier("the barrier rank 1 skips")
        print("CHECK a_missing_rank_times_out FAIL: the barrier returned", flush=True)
    except CommTimeoutError as exc:
        took = time.monotonic() - start
        ok = "the barrier rank 1 skips" in str(exc) and took < 10
        print(f"CHECK a_missing_rank_times_out {'ok' if ok else 'FAIL ' + str(exc)}", flush=True)
else:
    time.sleep(float(sys.argv[1]) + 2)  # alive but elsewhere while rank 0 waits
