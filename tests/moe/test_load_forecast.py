"""The load forecast the vExpert policy plans for (rocmoe/moe/load_forecast.py)."""

import numpy as np
import pytest

from rocmoe.moe.load_forecast import LoadForecast


def test_without_a_trend_it_is_the_exponential_average_of_the_counts():
    f = LoadForecast(level_weight=0.5, trend_weight=0.0)
    ema = None
    for counts in ([[4.0, 0.0]], [[2.0, 2.0]], [[0.0, 8.0]]):
        f.update(counts)
        c = np.asarray(counts)
        ema = c if ema is None else 0.5 * ema + 0.5 * c
        np.testing.assert_allclose(f.forecast(), ema)


def test_a_steady_ramp_is_forecast_at_the_horizon():
    f = LoadForecast(level_weight=0.5, trend_weight=0.5, horizon=2)
    for t in range(60):
        f.update([[100.0 + 3.0 * t, 500.0 - 3.0 * t]])
    # the counts of step 59 + 2
    np.testing.assert_allclose(f.forecast(), [[100.0 + 3.0 * 61, 500.0 - 3.0 * 61]], rtol=1e-6)


def test_a_falling_load_is_never_forecast_below_zero():
    f = LoadForecast(level_weight=0.9, trend_weight=0.9, horizon=5)
    for v in (100.0, 50.0, 10.0, 0.0):
        f.update([[v]])
    assert (f.forecast() >= 0).all() and f.forecast()[0, 0] == 0.0


def test_its_state_round_trips():
    f = LoadForecast()
    for v in (3.0, 5.0, 9.0):
        f.update([[v, 1.0]])
    g = LoadForecast()
    g.load_state_dict(f.state_dict())
    np.testing.assert_array_equal(g.forecast(), f.forecast())


def test_weights_out_of_range_are_refused():
    with pytest.raises(ValueError):
        LoadForecast(level_weight=0.0)
    with pytest.raises(ValueError):
        LoadForecast(trend_weight=1.5)
