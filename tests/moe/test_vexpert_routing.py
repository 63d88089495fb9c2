"""vExpert placement tables and the locality-first routing (FlexMoE Alg. 3), one process.

The routing is computed from every rank's counts, so several ranks are simulated here by
calling each rank's dispatcher with a stand-in transport that returns the gathered counts.
"""

import numpy as np
import pytest
import torch

from rocmoe.errors import PlacementError
from rocmoe.moe.placement import Placement, balance_ratio, copies_needed
from rocmoe.moe.vexpert_routing import (VExpertDispatcher, assignment, pair_destinations,
                                        quotas)


def _random_counts(world, experts, seed, high=50):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, high, (world, experts), generator=gen)


def _replicated(world=4, experts=8, slots=4):
    p = Placement.static(experts, world, slots)
    p = p.expanded(0, 1).expanded(0, 2).expanded(0, 3).expanded(5, 0)  # hot 0, warm 5
    return p.expanded(0, 0)  # two vExperts of expert 0 on rank 0: a double share there


# -- placement ------------------------------------------------------------------------
def test_static_placement_puts_expert_e_on_rank_e_div_local_and_leaves_extra_slots_free():
    p = Placement.static(8, 2, 6)
    assert p.to_list() == [[0, 1, 2, 3, -1, -1], [4, 5, 6, 7, -1, -1]]
    assert p.replicas().sum(axis=1).tolist() == [1] * 8


def test_same_rank_vexperts_share_the_lowest_slot_as_their_weight_copy():
    p = Placement.static(4, 2, 4).expanded(0, 0)
    assert p.to_list()[0] == [0, 1, 0, -1]
    assert p.weight_slots()[0].tolist() == [0, -1]
    assert p.replicas()[0].tolist() == [2, 0]


def test_expand_into_a_full_rank_is_refused():
    p = Placement.static(4, 2, 2)
    with pytest.raises(PlacementError, match="rank 1 has no free slot"):
        p.expanded(0, 1)


def test_shrinking_an_experts_last_vexpert_is_refused():
    p = Placement.static(4, 2, 3)
    with pytest.raises(PlacementError, match="last vExpert"):
        p.shrunk(3, 1)
    assert p.expanded(3, 0).shrunk(3, 1).holders(3) == [0]


def test_a_slot_budget_below_one_slot_per_expert_is_refused():
    with pytest.raises(PlacementError, match="slots_per_rank=1 is too small"):
        Placement.static(8, 4, 1)


def test_migrate_swaps_two_slots_and_copies_needed_lists_both_directions():
    p = Placement.static(4, 2, 3).expanded(0, 1).expanded(2, 0)  # 0 on {0,1}, 2 on {1,0}
    q = p.migrated((0, 2), (1, 2))   # rank 0's copy of 2 <-> rank 1's copy of 0
    assert q.holders(0) == [0] and q.holders(2) == [1]
    assert q.replicas()[0].tolist() == [2, 0] and q.replicas()[2].tolist() == [0, 2]
    # rank 0's slot 2 now holds expert 0, whose weights rank 0 already has (slot 0): no copy
    assert copies_needed(p, q) == []
    moved = Placement.static(4, 2, 3).migrated((0, 0), (1, 2))   # expert 0 moves to rank 1
    assert copies_needed(Placement.static(4, 2, 3), moved) == [(0, 0, 0, 1, 2)]


def test_balance_ratio_is_max_over_mean():
    assert balance_ratio([3, 1]) == 1.5
    assert balance_ratio([0, 0]) == 1.0


# -- the assignment -------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(5))
def test_assignment_routes_every_pair_and_fills_each_rank_to_its_quota(seed):
    p = _replicated()
    counts = _random_counts(4, 8, seed)
    reps = torch.from_numpy(p.replicas())
    a = assignment(counts, reps)
    assert torch.equal(a.sum(dim=2), counts)                     # dropless, per source
    assert torch.equal(a.sum(dim=0).t(), quotas(counts.sum(0), reps).t())
    assert (a >= 0).all()
    # nothing goes to a rank without a copy of the expert
    assert (a.sum(dim=0)[reps == 0] == 0).all()


def test_quotas_split_an_expert_equally_over_its_vexperts_and_sum_exactly():
    q = quotas(torch.tensor([10, 7]), torch.tensor([[1, 1, 2], [1, 0, 0]]))
    assert q.tolist() == [[2, 3, 5], [7, 0, 0]]


def test_pairs_stay_on_their_rank_when_it_holds_the_expert_with_room():
    p = _replicated()
    counts = torch.full((4, 8), 10)
    a = assignment(counts, torch.from_numpy(p.replicas()))
    # expert 0 has vExperts on every rank (two on rank 0: quotas 16, 8, 8, 8 of its 40
    # pairs) and each rank has 10 of its pairs: each keeps what its quota allows
    kept = torch.diagonal(a[:, 0, :])
    assert kept.tolist() == [10, 8, 8, 8]
    # the overflow (2 pairs each from ranks 1-3) fills rank 0's spare room
    assert a[1:, 0, 0].tolist() == [2, 2, 2]
    # expert 1 lives on rank 0 only: every rank sends it there
    assert a[:, 1, 0].tolist() == [10, 10, 10, 10]


def test_static_placement_routes_like_the_static_layer():
    p = Placement.static(8, 4, 3)
    counts = _random_counts(4, 8, 7)
    a = assignment(counts, torch.from_numpy(p.replicas()))
    owner = torch.arange(8) // 2
    expect = torch.zeros(4, 8, 4, dtype=torch.int64)
    expect[:, torch.arange(8), owner] = counts
    assert torch.equal(a, expect)


def test_replicas_bring_a_skewed_load_to_balance():
    counts = torch.zeros(4, 8, dtype=torch.int64)
    counts[:, 0] = 100                       # every token wants expert 0
    counts[:, 1:] = 1
    static = assignment(counts, torch.from_numpy(Placement.static(8, 4, 4).replicas()))
    spread = assignment(counts, torch.from_numpy(
        Placement.static(8, 4, 4).expanded(0, 1).expanded(0, 2).expanded(0, 3).replicas()))
    assert balance_ratio(static.sum(dim=(0, 1)).tolist()) > 3.5
    assert balance_ratio(spread.sum(dim=(0, 1)).tolist()) < 1.05


def test_pair_destinations_follow_the_assignment_row_in_token_order():
    p = _replicated()
    counts_all = _random_counts(4, 8, 3, high=6)
    a = assignment(counts_all, torch.from_numpy(p.replicas()))
    rank = 2
    # this rank's pairs: counts_all[rank] of each expert, shuffled into tokens of k=2
    ids = torch.cat([torch.full((int(c),), e) for e, c in enumerate(counts_all[rank])])
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(0))]
    dest = pair_destinations(ids.view(-1, 1), a[rank], rank)
    for e in range(8):
        got = torch.bincount(dest[ids == e], minlength=4)
        assert torch.equal(got, a[rank, e]), (e, got, a[rank, e])
        # the kept share comes first, in token order
        kept = int(a[rank, e, rank])
        assert (dest[ids == e][:kept] == rank).all()


class _GatherTransport:
    """Stands in for the exchange: returns every simulated rank's histogram."""

    def __init__(self, all_counts):
        self.all_counts = all_counts

    def exchange_counts(self, send_counts):
        return self.all_counts.clone()


def test_every_rank_computes_what_every_other_rank_receives():
    world, experts, slots = 4, 8, 4
    p = _replicated(world, experts, slots)
    gen = torch.Generator().manual_seed(5)
    ids = [torch.randint(0, experts, (40, 2), generator=gen) for _ in range(world)]
    from rocmoe.moe.router import expert_histogram
    counts = torch.stack([expert_histogram(i, experts).long() for i in ids])
    plans = []
    for r in range(world):
        d = VExpertDispatcher(experts, world, r, slots)
        d.set_placement(p)
        plans.append(d.plan(ids[r], _GatherTransport(counts)))
    ws = torch.from_numpy(p.weight_slots())
    for r, plan in enumerate(plans):
        assert plan.send_counts.sum() == ids[r].numel()
        # each pair's group is its expert's weight slot on its destination
        flat = ids[r].reshape(-1)
        assert torch.equal(plan.group, ws[flat, plan.rank])
        for s in range(world):
            assert torch.equal(plan.recv_counts[s], plans[s].send_counts[r])
        got = torch.zeros(world, slots, dtype=torch.int64)
        got.index_put_((plan.rank, plan.group), torch.ones_like(plan.rank), accumulate=True)
        assert torch.equal(got, plan.send_counts)


def test_a_peers_rejected_input_shows_as_negative_receive_counts():
    p = Placement.static(4, 2, 3)
    d = VExpertDispatcher(4, 2, 0, 3)
    d.set_placement(p)
    counts = torch.tensor([[1, 2, 3, 4], [-1, -1, -1, -1]])
    plan = d.plan(torch.tensor([[0, 1], [2, 3], [3, 3], [1, 2], [2, 3]]), _GatherTransport(counts))
    assert plan.recv_counts[1].tolist() == [-1, -1, -1]
    assert plan.recv_counts[0].min() >= 0


def test_the_placement_travels_in_the_layers_state_dict():
    from rocmoe.moe import DroplessMoE
    layer = DroplessMoE(8, 16, 4, 2, block_size=16, placement="vexpert", slots_per_rank=6)
    moved = layer.dispatcher.placement.expanded(1, 0)
    layer.dispatcher.set_placement(moved)
    state = layer.state_dict()
    fresh = DroplessMoE(8, 16, 4, 2, block_size=16, placement="vexpert", slots_per_rank=6)
    fresh.load_state_dict(state)
    assert fresh.dispatcher.placement == moved
    assert np.array_equal(fresh.dispatcher.replicas.numpy(), moved.replicas())


def test_a_placement_for_another_slot_budget_is_refused_on_load():
    from rocmoe.moe import DroplessMoE
    small = DroplessMoE(8, 16, 4, 2, block_size=16, placement="vexpert", slots_per_rank=5)
    big = DroplessMoE(8, 16, 4, 2, block_size=16, placement="vexpert", slots_per_rank=6)
    state = small.state_dict()
    state["w1"], state["w2"] = big.w1.detach(), big.w2.detach()
    with pytest.raises(PlacementError, match="5 slots per rank, the layer 6"):
        big.load_state_dict(state)


def test_the_schedulers_state_round_trips_through_its_state_dict():
    from rocmoe.moe import CostModel, DroplessMoE, VExpertScheduler

    def build():
        layer = DroplessMoE(8, 16, 4, 2, block_size=16, placement="vexpert")
        opt = torch.optim.SGD(layer.parameters(), lr=0.1)
        return layer, opt, VExpertScheduler(layer, opt, cost_model=CostModel(ffn_ms_per_row=2e-3))
    layer, opt, sched = build()
    layer(torch.randn(10, 8)).sum().backward()
    opt.step()
    sched.step()
    state = sched.state_dict()
    assert state["steps"] == 1 and state["layers"][0]["load"]["level"] is not None
    _, _, resumed = build()
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state


def test_a_scheduler_state_from_before_the_forecast_resumes_with_its_averaged_counts():
    from rocmoe.moe import CostModel, DroplessMoE, VExpertScheduler
    layer = DroplessMoE(8, 16, 4, 2, block_size=16, placement="vexpert")
    sched = VExpertScheduler(layer, None, cost_model=CostModel(ffn_ms_per_row=2e-3))
    old = {"version": 1, "steps": 3, "policy": "greedy", "cost_model": None,
           "layers": [{"steps": 3, "counts_ema": [[1.0, 2.0, 3.0, 4.0]], "backoff": None}]}
    sched.load_state_dict(old)
    load = sched.state_dict()["layers"][0]["load"]
    assert load == {"level": [[1.0, 2.0, 3.0, 4.0]], "trend": [[0.0, 0.0, 0.0, 0.0]]}


@pytest.mark.parametrize("bad", [dict(load_trend=1.5), dict(load_decay=1.0)])
def test_the_scheduler_refuses_a_load_forecast_out_of_range(bad):
    from rocmoe.errors import ConfigurationError
    from rocmoe.moe import DroplessMoE, VExpertScheduler
    layer = DroplessMoE(8, 16, 4, 2, block_size=16, placement="vexpert")
    with pytest.raises(ConfigurationError, match="load_decay must be in"):
        VExpertScheduler(layer, None, **bad)


def test_the_scheduler_refuses_a_static_layer():
    from rocmoe.errors import ConfigurationError
    from rocmoe.moe import DroplessMoE, VExpertScheduler
    with pytest.raises(ConfigurationError, match="placement='vexpert'"):
        VExpertScheduler([DroplessMoE(8, 16, 4, 2, block_size=16)], None)


def test_the_cost_model_charges_pairs_that_cross_nodes_at_the_inter_node_rate():
    from rocmoe.moe import CostModel
    counts = np.zeros((4, 4))
    counts[:, 0] = 100                                  # every rank's pairs want expert 0
    on_node = Placement.static(4, 4, 2).expanded(0, 1)  # expert 0 on ranks 0 and 1
    model = CostModel(ffn_ms_per_row=0.0, a2a_ms_per_byte={"intra": 1e-3, "inter": 1e-2},
                      row_bytes=1, ranks_per_node=2)
    a2a = model.rank_terms(on_node, counts)["a2a"]
    # ranks 2 and 3 (the other node) send their 100 pairs each across; rank 0 and 1 keep theirs
    assert a2a[2] == pytest.approx(4 * 100 * 1e-2) and a2a[3] == pytest.approx(4 * 100 * 1e-2)
    one_node = CostModel(ffn_ms_per_row=0.0, a2a_ms_per_byte={"intra": 1e-3, "inter": 1e-2},
                         row_bytes=1, ranks_per_node=0)
    assert one_node.rank_terms(on_node, counts)["a2a"][2] == pytest.approx(4 * 100 * 1e-3)


def test_the_cost_model_predicts_the_busiest_ranks_compute():
    from rocmoe.moe import CostModel
    counts = np.zeros((2, 4))
    counts[:, 0] = 50
    static = Placement.static(4, 2, 3)
    model = CostModel(ffn_ms_per_row=1.0)
    assert model.predict_ms(static, counts) == pytest.approx(100.0)
    assert model.predict_ms(static.expanded(0, 1), counts) == pytest.approx(50.0)


def _runs(backoff, steps, ratios=None, changed_at=()):
    """The steps (1-based, rebalance_every 1) at which the policy runs."""
    runs = []
    for step in range(1, steps + 1):
        ratio = (ratios or {}).get(step, 2.0)
        if backoff.due(step, ratio):
            runs.append(step)
            backoff.verdict(step, 1, ratio, changed=step in changed_at)
    return runs


def test_the_policy_backs_off_after_runs_that_change_nothing():
    from rocmoe.moe.scheduler import PolicyBackoff
    # waits of 2, 4, 8, 16, then 16 rebalance intervals (capped)
    assert _runs(PolicyBackoff(), 70) == [1, 3, 7, 15, 31, 47, 63]


def test_a_change_resets_the_policy_backoff():
    from rocmoe.moe.scheduler import PolicyBackoff
    assert _runs(PolicyBackoff(), 20, changed_at={7}) == [1, 3, 7, 8, 10, 14]


def test_a_worsened_balance_ends_the_policy_backoff_early():
    from rocmoe.moe.scheduler import PolicyBackoff
    # quiet at ratio 2.0 after step 3 (next run due at 7); at step 5 the ratio is 2.2
    # (> 2.0 * 1.05): it runs, changes nothing again, and the wait grows to 8 (step 13)
    assert _runs(PolicyBackoff(), 14, ratios={5: 2.2}) == [1, 3, 5, 13]


def test_the_policy_backoff_round_trips_and_old_checkpoints_load_without_it():
    from rocmoe.moe.scheduler import PolicyBackoff
    a = PolicyBackoff()
    _runs(a, 10)
    b = PolicyBackoff()
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict() and b.next_step == 15
    c = PolicyBackoff()
    c.load_state_dict(None)
    assert c.due(1, 2.0) and c.state_dict() == PolicyBackoff().state_dict()
