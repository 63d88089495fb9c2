"""CUDA-event timing shared by the benchmarks (CPU wall time where there is no GPU).

Every helper reports a median: over rounds of ``interleaved_ms``, which time several cases
round-robin so that clock drift shifts them alike, and over repetitions of ``time_ms`` (one
case). ``captured`` replays a function from a CUDA graph, leaving out host launch work.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def interleaved_ms(cases: dict, rounds: int = 10, calls: int = 3, queued: bool = False) -> dict:
    """Median ms per call of each case, timed round-robin: every round times every case once
    (``calls`` back-to-back calls between two events), so a drift of the GPU's clocks over
    the run shifts all cases alike instead of favouring whichever ran first. ``cases`` maps a
    key to ``(setup, fn)``: ``setup()`` runs untimed before each sample (e.g. selecting a
    kernel configuration). Callers warm every case up first.

    ``queued``: one untimed call is enqueued before the start event, so the timed call finds
    the GPU busy, as a layer inside a model does: the host's launch latency of the first
    kernel (tens of microseconds for a Triton launch) is not counted, while gaps where the
    host falls behind the GPU still are. Without it each sample starts from an idle GPU."""
    samples = {key: [] for key in cases}
    for _ in range(rounds):
        for key, (setup, fn) in cases.items():
            setup()
            if not torch.cuda.is_available():
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                samples[key].append((time.perf_counter() - t0) * 1e3 / calls)
                continue
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if queued:
                fn()
            start.record()
            for _ in range(calls):
                fn()
            stop.record()
            torch.cuda.synchronize()
            samples[key].append(start.elapsed_time(stop) / calls)
    return {key: sorted(v)[len(v) // 2] for key, v in samples.items()}


def time_ms(fn: Callable[[], object], reps: int = 10, warmup: int = 2, calls: int = 1) -> float:
    """Median ms per call of ``fn`` over ``reps`` samples of ``calls`` back-to-back calls
    between two events, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return interleaved_ms({0: (lambda: None, fn)}, rounds=reps, calls=calls)[0]


def host_ms_per_call(fn: Callable[[], object], calls: int = 10) -> float:
    """Host ms per call of ``fn`` launched ``calls`` times back to back without waiting for
    the GPU, which runs behind: the Python and launch work alone, as long as the launch
    queue does not fill up. Waits for the GPU before and after."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    ms = (time.perf_counter() - t0) * 1e3 / calls
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return ms


def host_us_median(fn: Callable[[], object], calls: int = 10, samples: int = 5) -> float:
    """Median over ``samples`` of host_ms_per_call(fn, calls), in microseconds."""
    return statistics.median(host_ms_per_call(fn, calls) * 1e3 for _ in range(samples))


def captured(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` captured in a CUDA graph (after a warm-up on a side stream, where Triton
    compiles): returns the replay. Fails if ``fn`` syncs with the host. Without a GPU, ``fn``."""
    if not torch.cuda.is_available():
        return fn
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # captured on the warm-up's stream: autograd nodes the warm-up made (and that outlive
    # it) run on the stream they were made on, which must be the capturing one
    with torch.cuda.graph(graph, stream=side):
        fn()
    return graph.replay


def graph_time_ms(fn: Callable[[], object], reps: int = 10) -> float:
    """Median device time of ``fn`` replayed from a CUDA graph (no host launch work)."""
    return time_ms(captured(fn), reps)


