"""The cost model's online calibration (rocmoe/moe/cost_calibration.py) and what the
scheduler keeps of it (in process, world size 1)."""

import numpy as np
import torch

from rocmoe.moe.cost_calibration import RatioWindow
from rocmoe.moe.cost_model import CostModel
from rocmoe.moe.placement import Placement


def test_the_factor_is_the_median_of_the_last_window_ratios():
    w = RatioWindow(window=3)
    assert w.factor() == 1.0                       # nothing measured yet: the model as is
    for predicted, measured in ((10, 50), (10, 8), (10, 9), (10, 11)):
        w.observe(predicted, measured)
    assert w.factor() == 0.9                       # median of 0.8, 0.9, 1.1; 5.0 has left


def test_the_first_ratio_of_a_new_placement_drops_the_other_placements_ratios():
    w = RatioWindow(window=8)
    static, moved = Placement.static(8, 2, 6), Placement.static(8, 2, 6).expanded(0, 1)
    for measured in (9.4, 9.5, 9.3):
        w.observe(10, measured, tag=static)
    assert np.isclose(w.factor(), 0.94)
    w.observe(10, 10.6, tag=Placement.static(8, 2, 6))     # an equal placement: kept
    assert len(w.ratios) == 4
    w.observe(10, 10.6, tag=moved)
    assert w.factor() == 1.06 and len(w.ratios) == 1
    w.observe(10, 10.8)                                   # untagged: drops nothing
    assert np.isclose(w.factor(), 1.07)


def test_a_step_without_a_time_or_a_prediction_leaves_the_factor_as_it_was():
    w = RatioWindow()
    w.observe(10, 12)
    for predicted, measured in ((10, float("nan")), (0.0, 5.0), (10, 0.0)):
        assert not w.observe(predicted, measured)
    assert w.factor() == 1.2


def test_a_scaled_model_scales_the_layer_terms_and_the_replica_sums_apart():
    model = CostModel(ffn_fixed_ms=1.0, ffn_ms_per_row=0.01, a2a_latency_ms=0.2,
                      a2a_ms_per_byte={"intra": 1e-6, "inter": 2e-6}, fixed_ms=2.0,
                      allreduce={2: [0.3, 1e-6]}, row_bytes=1024, expert_grad_bytes=10_000)
    placement = Placement.static(8, 2, 6).expanded(0, 1)
    counts = np.random.default_rng(0).integers(0, 300, (2, 8))
    base = model.breakdown(placement, counts)
    scaled = model.scaled(compute=0.5, sync=2.0).breakdown(placement, counts)
    for term in ("fixed_ms", "comp_ms", "a2a_ms"):
        assert np.isclose(scaled[term], 0.5 * base[term])
    assert np.isclose(scaled["sync_ms"], 2.0 * base["sync_ms"]) and base["sync_ms"] > 0


def _scheduler():
    from rocmoe.moe import DroplessMoE, VExpertScheduler
    layer = DroplessMoE(8, 16, 4, 2, block_size=16, placement="vexpert")
    return layer, VExpertScheduler(layer, None, cost_model=CostModel(ffn_ms_per_row=2e-3))


def test_the_calibration_travels_in_the_schedulers_state_dict():
    layer, sched = _scheduler()
    sched._state(layer).compute.observe(10.0, 7.0)
    sched.sync.observe(2.0, 3.0)
    state = sched.state_dict()
    other, resumed = _scheduler()
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
    model = resumed.calibrated_model(other)
    assert np.isclose(model.ffn_ms_per_row, 0.7 * 2e-3)


def test_a_scheduler_state_from_before_the_calibration_resumes_with_the_profiled_model():
    layer, sched = _scheduler()
    old = {"version": 1, "steps": 3, "policy": "greedy",
           "cost_model": CostModel(ffn_ms_per_row=5e-3).to_dict(),
           "layers": [{"steps": 3, "load": {"level": None, "trend": None}, "backoff": None}]}
    sched._state(layer).compute.observe(10.0, 7.0)   # whatever it had is replaced
    sched.load_state_dict(old)
    assert sched.calibrated_model(layer).ffn_ms_per_row == 5e-3
    assert sched.state_dict()["layers"][0]["calibration"] == []


def test_a_negative_calibration_window_is_refused():
    import pytest
    from rocmoe.errors import ConfigurationError
    from rocmoe.moe import DroplessMoE, VExpertScheduler
    layer = DroplessMoE(8, 16, 4, 2, block_size=16, placement="vexpert")
    with pytest.raises(ConfigurationError, match="calibration_window must be an int >= 0"):
        VExpertScheduler(layer, None, calibration_window=-1)


def test_the_noise_floor_is_the_error_of_the_median_and_of_the_previous_step():
    from rocmoe.moe.cost_model import noise_floor
    floor = noise_floor([100.0, 110.0, 100.0, 150.0])
    # median 105 (the mean is 115): errors 5/100, 5/110, 5/100, 45/150; the step before:
    # 10/110, 10/100, 50/150 (each relative to the step predicted)
    assert np.isclose(floor["constant_at_median"], (5 / 100 + 5 / 110 + 5 / 100 + 45 / 150) / 4)
    assert np.isclose(floor["previous_step"], (10 / 110 + 10 / 100 + 50 / 150) / 3)
    assert noise_floor([5.0]) == {"constant_at_median": 0.0, "previous_step": None}
    assert noise_floor([]) == {"constant_at_median": None, "previous_step": None}
