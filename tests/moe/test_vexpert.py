"""vExpert scheduling on host ranks (launches mpiexec on vexpert_script.py) and the policies
on counts alone (in process)."""

import pathlib

import numpy as np
import pytest

from rocmoe_testing import require_runtime, run_mpi

SCRIPT = pathlib.Path(__file__).with_name("vexpert_script.py")


def _launch(ranks, checks, *args):
    require_runtime()
    proc = run_mpi(SCRIPT, ranks, checks, *args, timeout=300)
    return proc.returncode, proc.stdout


# One launch per world size runs every check (each mpiexec start costs seconds on CI's two
# cores); each test below reads its own check's lines.
@pytest.fixture(scope="module")
def two_ranks():
    return _launch(2, "equal,primitives,train,bad,config,reducer_timeout,profile,"
                      "forecast_trigger,calibration,calibration_batched,calibration_layers")


@pytest.fixture(scope="module")
def four_ranks():
    return _launch(4, "equal,train,reducer_sums,profile", "--dtype", "float32",
                   "--replica-sync", "heap")


@pytest.fixture(scope="module")
def two_ranks_torch_distributed():
    return _launch(2, "train,profile", "--replica-sync", "torch")


def _passed(launch, check, ranks):
    rc, out = launch
    lines = [line for line in out.splitlines() if line.startswith(f"VX_OK {check} ")]
    assert len(lines) == ranks, out
    return "\n".join(lines)


@pytest.mark.mpi
def test_replicated_experts_give_the_static_layers_outputs_and_gradients(two_ranks):
    assert "holders_of_0=[0, 1]" in _passed(two_ranks, "equal", 2)


@pytest.mark.mpi
def test_after_expand_migrate_and_shrink_every_copy_is_bitwise_equal_to_its_source(two_ranks):
    out = _passed(two_ranks, "primitives", 2)
    # expand and migrate moved weights (one copy each), shrink none
    assert "('expand', True, 1," in out and "('migrate', True, 1," in out
    assert "('shrink', True, 0," in out


@pytest.mark.mpi
def test_training_under_the_scheduler_gives_the_static_losses_and_balances(two_ranks):
    assert "changes=0" not in _passed(two_ranks, "train", 2)


@pytest.mark.mpi
def test_bad_placements_raise_on_every_rank_and_the_heap_stays_usable(two_ranks):
    out = _passed(two_ranks, "bad", 2)
    assert "is rank 0: 1, rank 1: -1" in out
    assert "rank(s) [0] refused the vExpert change" in out, out


@pytest.mark.mpi
def test_a_configuration_that_differs_across_ranks_names_the_field_and_values(two_ranks):
    out = _passed(two_ranks, "config", 2)
    assert "num_experts: rank 0 = 8, rank 1 = 16" in out
    assert ("VExpertScheduler differs across ranks: replica_sync: rank 0 = 'mpi', "
            "rank 1 = 'heap'") in out
    assert "rank=1 " in out and "replica_sync must be 'auto' or one of" in out
    assert "VExpertScheduler: rank(s) [1] rejected their arguments" in out


@pytest.mark.mpi
def test_the_two_rank_run_exits_cleanly(two_ranks):
    assert two_ranks[0] == 0, two_ranks[1]


@pytest.mark.mpi
def test_four_ranks_with_fused_combine_match_the_static_layer_and_its_training(four_ranks):
    assert "holders_of_0=[0, 1, 2, 3]" in _passed(four_ranks, "equal", 4)
    _passed(four_ranks, "train", 4)
    assert four_ranks[0] == 0, four_ranks[1]


@pytest.mark.mpi
def test_auto_replica_sync_sums_cpu_layers_with_mpi(two_ranks):
    assert "replica_sync=mpi" in _passed(two_ranks, "profile", 2)


@pytest.mark.mpi
def test_four_ranks_with_heap_replica_sums_profile_one_cost_model_on_every_rank(four_ranks):
    # groups of 2, 3 and 4 ranks profiled; ranks outside a group do not dilute its mean
    assert "replica_sync=heap" in _passed(four_ranks, "profile", 4)


@pytest.mark.mpi
def test_torch_distributed_replica_sums_give_the_static_losses(two_ranks_torch_distributed):
    assert "replica_sync=torch" in _passed(two_ranks_torch_distributed, "profile", 2)
    _passed(two_ranks_torch_distributed, "train", 2)
    assert two_ranks_torch_distributed[0] == 0, two_ranks_torch_distributed[1]


@pytest.mark.mpi
def test_heap_replica_sums_are_the_member_order_sums_with_the_same_bits_on_every_member(
        four_ranks):
    # groups of all 4 ranks, of ranks 0-1 and of ranks 2-3; equal to the MPI and the
    # torch.distributed (gloo) reducers too
    assert "groups=3" in _passed(four_ranks, "reducer_sums", 4)


@pytest.mark.mpi
def test_a_replica_sum_member_that_never_joins_makes_the_others_raise_comm_timeout(two_ranks):
    out = _passed(two_ranks, "reducer_timeout", 2)
    assert "rank=0 missing_member=CommTimeoutError after" in out


@pytest.mark.mpi
def test_the_policy_runs_when_the_forecast_is_above_the_threshold_before_the_load_is(
        two_ranks):
    _passed(two_ranks, "forecast_trigger", 2)


@pytest.mark.mpi
def test_each_step_is_predicted_by_the_model_calibrated_on_the_steps_before_it(two_ranks):
    # and every rank logs the same prediction and time (the slowest rank's)
    _passed(two_ranks, "calibration", 2)


@pytest.mark.mpi
def test_the_ranks_exchange_step_times_only_where_a_policy_run_is_due(two_ranks):
    _passed(two_ranks, "calibration_batched", 2)


@pytest.mark.mpi
def test_a_scheduler_of_several_layers_exchanges_more_step_times_than_one_all_gather_carries(
        two_ranks):
    _passed(two_ranks, "calibration_layers", 2)


# -- counts only: the policies under a drifting Zipf(1.2) load -------------------------------
def _simulate(policy, experts, world, steps=60, seed=0):
    from rocmoe.bench.vexpert import simulate
    return simulate(policy, experts=experts, world=world, steps=steps, seed=seed)


def test_greedy_policy_brings_a_drifting_zipf_load_under_the_threshold_within_a_few_steps():
    run = _simulate("greedy", 16, 4)
    static = _simulate("static", 16, 4)
    assert np.mean(static["balance_ratio"]) > 1.8       # the skew is real
    ratios = run["balance_ratio"]
    first_ok = next(i for i, r in enumerate(ratios) if r <= 1.05)
    assert first_ok <= 6, ratios[:10]
    assert np.mean(ratios[first_ok:]) <= 1.05, ratios
    assert all(run["routed_every_pair"])


def test_eplb_policy_balances_the_same_load():
    run = _simulate("eplb", 16, 4)
    assert np.mean(run["balance_ratio"][3:]) <= 1.05
    assert all(run["routed_every_pair"])


def test_bench_vexpert_sim_prints_one_record_per_policy_and_config_with_its_baseline(capsys):
    import json
    from rocmoe.bench import vexpert
    assert vexpert.main(["--part", "sim", "--steps", "12", "--skip", "2"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(records) == 2 * len(vexpert.SIM_CONFIGS)
    for r in records:
        assert r["baseline"] == "static placement"
        # the ratio is the one of the two means it reports (each rounded to 4 places)
        assert abs(r["ratio"] - r["baseline_mean_balance_ratio"] / r["mean_balance_ratio"]) < 1e-3
        assert r["every_pair_routed"]


def _policy_on(placement, loads, **kw):
    from rocmoe.moe.cost_model import CostModel
    from rocmoe.moe.policy import greedy_policy
    loads = np.asarray(loads, dtype=np.float64)
    counts = np.tile(loads / placement.world_size, (placement.world_size, 1))
    return greedy_policy(placement, counts, CostModel(), **kw)


def test_greedy_policy_frees_the_slots_of_an_expert_that_cooled():
    from rocmoe.moe.placement import Placement
    # expert 5 was hot and kept three vExperts; it now carries 1 pair of 251
    start = Placement([[0, 1, -1, -1], [2, 3, 5, 5], [4, 5, -1, -1]], 6)
    result = _policy_on(start, [100, 20, 40, 40, 50, 1])
    assert (result.placement.slot_expert == 5).sum() == 1
    assert result.predicted_ms < result.baseline_ms


def test_greedy_policy_gives_an_expert_whose_holders_hold_nothing_else_a_third_vexpert():
    from rocmoe.moe.placement import Placement
    # expert 7 (240 of 400 pairs) alone on ranks 2 and 3: an Expand onto rank 0 or 1 alone
    # makes that rank the straggler; it pays once that rank hands experts on to 2 and 3
    start = Placement([[0, 1, 2, 3], [4, 5, 6, -1], [7, -1, -1, -1], [7, -1, -1, -1]], 8)
    result = _policy_on(start, [30, 25, 20, 15, 35, 20, 15, 240])
    assert len(result.placement.holders(7)) >= 3
    assert result.predicted_ms < result.baseline_ms


def test_greedy_policy_copies_at_most_max_copies_per_rank_weights_into_a_rank():
    from rocmoe.bench.vexpert import DriftingZipf
    from rocmoe.moe.cost_model import CostModel
    from rocmoe.moe.placement import Placement, copies_needed
    from rocmoe.moe.policy import greedy_policy
    rng = np.random.default_rng(3)
    load = DriftingZipf(32, 5, rng)
    placement = Placement.static(32, 4, 12)
    for step in range(40):
        counts = np.stack([rng.multinomial(2048, load.probs(step)) for _ in range(4)])
        new = greedy_policy(placement, counts, CostModel(), max_copies_per_rank=1).placement
        into = np.bincount([c[3] for c in copies_needed(placement, new) if c[1] != c[3]],
                           minlength=4)
        assert into.max() <= 1, (step, into)
        placement = new
