"""`rocmoe bench fused_gpu`'s verdicts (rocmoe/bench/fused_gpu.py: judge), which need no GPU."""

from __future__ import annotations

from rocmoe.bench.fused_gpu import judge


def timed(**ratios) -> dict:
    """A record as compare() leaves it: the ratios given, host time and syncs within goal."""
    return dict({f"ratio_{mode}": r for mode, r in ratios.items()}, rocmoe_host_us=10.0,
                syncs_per_call=0.0)


def test_each_timing_meets_the_goal_by_its_own_ratio():
    rec = judge(timed(idle=1.02, queued=0.99, graph=1.0), 1.0)
    assert rec["meets_goal"] == {"idle": True, "queued": False, "graph": True}
    assert rec["goal_ratio"] == 1.0 and rec["meets_host_goal"] and rec["meets_sync_goal"]


def test_a_call_that_could_not_be_captured_misses_the_graph_goal():
    # compare() records graph_error instead of a graph ratio when capturing the call raised:
    # the verdict must say so, not leave the graph timing out of it
    rec = timed(idle=1.2, queued=1.2)
    rec["graph_error"] = "RuntimeError: operation not permitted when stream is capturing"
    assert judge(rec, 1.0)["meets_goal"] == {"idle": True, "queued": True, "graph": False}
