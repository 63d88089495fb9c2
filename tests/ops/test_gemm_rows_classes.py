"""A GemmAllToAll keeps one plan (tile config, grid) per rows class of X
(rocmoe/ops/gpu/gemm_plans.py: rows_class), tuned on the class's first call, so that a handle or a function's cached
handle called with fewer rows than its first call does not run the first call's tile."""

import subprocess
import sys
import textwrap

from rocmoe_testing import REPO, mpi_env, require_module

from rocmoe.ops.gpu import class_rows, direct_tasks, rows_class, tune_candidates


def test_rows_classes_are_the_power_of_two_ranges():
    assert [rows_class(r) for r in (0, 1, 2, 3, 4, 7, 8)] == [1, 1, 2, 2, 3, 3, 4]
    assert rows_class(512) == rows_class(1023) == 10 and rows_class(1024) == 11


def test_every_rows_count_fits_its_class_and_not_the_one_below():
    for rows in range(1, 5000):
        cls = rows_class(rows)
        assert class_rows(cls) >= rows > class_rows(cls - 1), rows


def test_the_direct_grid_fits_the_classes_fewest_rows_but_fills_the_sms():
    # (max_rows, most rows of the class, BLOCK_M, column tiles, SMs) -> tiles to size for
    # 512-1023 rows on a handle of 4096, 128 x 128 tiles of N 4096: 512 rows make 128
    # tiles, fewer than an H100's 132 SMs, so 132 (not the 256 that 1023 rows make)
    assert direct_tasks(4096, 1023, 128, 32, 132) == 132
    # 128-255 rows, 64 column tiles: 128 rows make 64 tiles; 255 make 128, all at once
    assert direct_tasks(4096, 255, 128, 64, 132) == 128
    # a handle of 512 rows: never more than its own rows make
    assert direct_tasks(512, 1023, 128, 32, 132) == 128
    # the class of a power of two is sized as the handle made for exactly those rows was
    assert direct_tasks(4096, 8191, 128, 16, 132) == direct_tasks(4096, None, 128, 16, 132)


def _tiles_under_64_rows(candidates) -> list:
    return [c for c in candidates if c.get("BLOCK_M", 128) < 64]


def test_the_tuner_times_tiny_tiles_for_at_most_64_rows_in_16_bit_on_cuda():
    # 16 x 4096 times 4096 x 4096 in 64 x 64 tiles is 64 programs for 132 SMs: tiles of
    # 16 and 32 rows and narrow N are timed too, where X has at most 64 rows
    for rows in (1, 16, 64):
        tiny = _tiles_under_64_rows(tune_candidates("cuda", rows))
        assert {c["BLOCK_M"] for c in tiny} == {16, 32}, rows
    assert not _tiles_under_64_rows(tune_candidates("cuda", 65))
    assert not _tiles_under_64_rows(tune_candidates("cuda", 512))


def test_the_tuner_times_no_tiny_tiles_in_float32():
    # (float32 products on Hopper have no TMA loads and were never timed with them)
    assert not _tiles_under_64_rows(tune_candidates("cuda", 16, fp32=True))


def _interpreted(body: str):
    """What `body` prints last (a Python literal), run after `ctx` is a host-backend context
    and with the handles' Triton kernels interpreted on CPU. A subprocess: Triton's
    interpreter is chosen when the kernels are defined."""
    require_module("triton", "the Triton interpreter runs the GEMM kernel on CPU")
    script = ("import torch, rocmoe\nfrom rocmoe import ops\nfrom rocmoe.ops import gpu\n"
              "from rocmoe.ops.gpu import gemm_plans\n"
              "ctx = rocmoe.init(backend='host', heap_size=64 << 20)\n"
              + textwrap.dedent(body) + "\nctx.finalize()\n")
    proc = subprocess.run([sys.executable, "-c", script], env=mpi_env(TRITON_INTERPRET="1"),
                          cwd=str(REPO), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return eval(proc.stdout.strip().splitlines()[-1])  # noqa: S307 - the script's own print


_SCRIPT = """
    h = ops.GemmAllToAll(ctx, max_rows=64, K=16, N=16, dtype=torch.float32)
    h._engine = "triton"  # the Triton kernel, interpreted, as on a GPU
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 16, generator=g)
    for rows in (8, 12, 40, 9, 63, 1):
        x = torch.randn(rows, 16, generator=g)
        with torch.no_grad():
            out, recv = h(x, w, [rows])
        assert int(recv[0]) == rows
        assert torch.allclose(out[:rows], x @ w, atol=1e-4), rows
    print({key[-1]: (plan.direct, plan.nprog) for key, plan in h._launches.items()})
    h.close()
"""


def test_a_handle_runs_a_plan_per_rows_class_with_a_grid_for_that_class():
    plans = _interpreted(_SCRIPT)
    # rows 8, 12, 9: class 4 (8-15 rows); 40, 63: class 6 (32-63); 1 row: class 1. Every
    # one runs the kernel's DIRECT path (world size 1, one W); its grid covers the class's
    # most rows (16-row tiles on the interpreter, at most 4 programs on a CPU), not the
    # handle's 64: one program for classes 1 and 4, four for class 6
    assert plans == {1: (True, 1), 4: (True, 1), 6: (True, 4)}, plans


_CAPTURE_SCRIPT = """
    h = ops.GemmAllToAll(ctx, max_rows=64, K=16, N=16, dtype=torch.float32)
    h._engine = "triton"
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 16, generator=g)

    def call(rows):
        x = torch.randn(rows, 16, generator=g)
        with torch.no_grad():
            out, recv = h(x, w, [rows])
        assert torch.allclose(out[:rows], x @ w, atol=1e-4), rows
        return {key[-1]: plan for key, plan in h._launches.items()}

    first = call(40)[6]
    first.cfg = dict(first.cfg, GROUP_M=1)  # a config the default does not have
    gemm_plans.capturing = lambda: True     # as under CUDA graph capture
    captured = call(8)[4]
    gemm_plans.capturing = lambda: False
    after = call(8)[4]
    print(dict(captured_untuned=captured.untuned, captured_cfg=captured.cfg == first.cfg,
               replaced=after is not captured, after_untuned=after.untuned))
    h.close()
"""


def test_a_new_rows_class_under_graph_capture_borrows_a_config_and_is_tuned_after():
    # the tuner times with events and waits for them, which a CUDA graph capture forbids:
    # a class first met under capture runs the nearest class's config, untuned, and the
    # next call outside a capture makes (tunes) its own plan
    got = _interpreted(_CAPTURE_SCRIPT)
    assert got == dict(captured_untuned=True, captured_cfg=True, replaced=True,
                       after_untuned=False), got


_FIRST_CALL_CAPTURED_SCRIPT = """
    h = ops.GemmAllToAll(ctx, max_rows=64, K=16, N=24, dtype=torch.float32)
    h._engine = "triton"
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(20, 16, generator=g), torch.randn(16, 24, generator=g)
    gemm_plans.capturing = lambda: True  # as under CUDA graph capture
    with torch.no_grad():
        out, _ = h(x, w, [20])
    (plan,) = h._launches.values()
    print(dict(untuned=plan.untuned,
               default=plan.cfg == gpu.gemm_config(torch.device("cpu"), torch.float32),
               result=bool(torch.allclose(out[:20], x @ w, atol=1e-4))))
    h.close()
"""


def test_a_handles_first_call_under_graph_capture_runs_the_default_config_untuned():
    got = _interpreted(_FIRST_CALL_CAPTURED_SCRIPT)
    assert got == dict(untuned=True, default=True, result=True), got


_BENCH_PLAN_SCRIPT = """
    from rocmoe.bench.fused_gpu import _gemm_plan
    h = ops.GemmAllToAll(ctx, max_rows=64, K=16, N=16, dtype=torch.float32)
    h._engine = "triton"
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 16, generator=g)
    with torch.no_grad():
        for rows in (40, 9):
            h(torch.randn(rows, 16, generator=g), w, [rows])
    print([_gemm_plan(h, 9), _gemm_plan(h, 63), _gemm_plan(h, 2)])
    h.close()
"""


def test_the_gemm_bench_records_the_plan_of_the_calls_rows_class():
    # rocmoe.bench.fused_gpu names the plan a case's calls ran (class, tile, programs), so a
    # function's cached handle and a handle made for the rows can be told apart; None for a
    # class the handle has not run
    small, large, unrun = _interpreted(_BENCH_PLAN_SCRIPT)
    assert (small["rows_class"], small["programs"], small["direct"]) == (4, 1, True), small
    assert (large["rows_class"], large["programs"], large["max_rows"]) == (6, 4, 64), large
    assert set(large["config"]) >= {"BLOCK_M", "BLOCK_N", "BLOCK_K"}, large
    assert unrun is None


def _plans_made(monkeypatch, world, rows_seq):
    """rows_exchange's plan decisions for calls of `rows_seq` rows on a handle at `world`
    ranks, with the plan and the tuner recorded instead of run: (rows of the calls whose
    class was tuned, {rows class: (borrowed, untuned, config)})."""
    import torch
    from types import SimpleNamespace

    from rocmoe.ops.gpu import gemm_plans

    tuned = []

    class Plan:
        def __init__(self, handle, team, x, w, groups, cfg, scratch_status=None,
                     most_rows=None):
            self.cfg, self.borrowed, self.untuned = cfg, False, False

        def launch(self, *args):
            pass

    def tune(handle, team, x, w, groups, counts, out, most_rows=None):
        tuned.append(x.shape[0])
        return Plan(handle, team, x, w, groups, {"tuned_at": x.shape[0]})

    monkeypatch.setattr(gemm_plans, "_GemmLaunch", Plan)
    monkeypatch.setattr(gemm_plans, "_tuned_launch", tune)
    monkeypatch.setattr(gemm_plans, "team_for", lambda ctx: SimpleNamespace(world=world))
    monkeypatch.setattr(gemm_plans, "capturing", lambda: False)
    handle = SimpleNamespace(ctx=None, N=8, K=16)
    w = torch.zeros(16, 8)
    for rows in rows_seq:
        gemm_plans.rows_exchange(handle, torch.zeros(rows, 16), w, None,
                          torch.zeros(world, dtype=torch.int64), 0, torch.empty(64, 8))
    return tuned, {key[-1]: (p.borrowed, p.untuned, p.cfg)
                   for key, p in handle._launches.items()}


def test_at_world_size_one_every_rows_class_is_tuned(monkeypatch):
    tuned, plans = _plans_made(monkeypatch, 1, (40, 9, 40, 9))
    assert tuned == [40, 9]
    assert plans == {6: (False, False, {"tuned_at": 40}), 4: (False, False, {"tuned_at": 9})}


def test_at_world_size_two_only_the_products_first_plan_is_tuned(monkeypatch):
    # a rank meeting a new rows class mid-run would make its peers wait out the candidates'
    # compilation inside their call budget: it borrows the nearest class's tuned config,
    # for good (not marked for tuning later)
    tuned, plans = _plans_made(monkeypatch, 2, (40, 9, 40, 9, 200))
    assert tuned == [40]
    assert plans == {6: (False, False, {"tuned_at": 40}), 4: (True, False, {"tuned_at": 40}),
                     8: (True, False, {"tuned_at": 40})}


_SPLIT_SCRIPT = """
    import os
    os.environ["ROCMOE_GEMM_CONFIG"] = '{"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "SPLIT_K": 2}'
    h = ops.GemmAllToAll(ctx, max_rows=1024, K=32, N=32, dtype=torch.float32)
    h._engine = "triton"
    g = torch.Generator().manual_seed(3)
    w = torch.randn(32, 32, generator=g)
    for rows in (12, 5):
        x = torch.randn(rows, 32, generator=g)
        with torch.no_grad():
            out, recv = h(x, w, [rows])
        assert torch.allclose(out[:rows], x @ w, atol=1e-4), rows
    print({key[-1]: (plan.direct, plan.constexprs["SPLIT_K"], plan.split_tiles,
                     plan.split_scratch.numel()) for key, plan in h._launches.items()})
    h.close()
"""


_SPLIT_SUM_SCRIPT = _SPLIT_SCRIPT.replace(
    '"SPLIT_K": 2}', '"SPLIT_K": 2, "SPLIT_SUM": true}').replace(
    "plan.split_scratch.numel())", "plan.split_scratch.numel(), plan.split_sum.grid)")


def test_a_split_sum_plan_has_room_for_its_sums_last_block():
    plans = _interpreted(_SPLIT_SUM_SCRIPT)
    # the same scratch plus one block of split_sum_kernel (512 fp32: its last program loads
    # a whole block unmasked), and a sum grid over the scratch's 16 rows x 32 columns
    want = (True, 2, 2, 256 + 2 * 2 * 16 * 16 * 4 + 512 * 4, 1)
    assert plans == {4: want, 3: want}, plans


def test_the_direct_path_splits_k_with_scratch_for_its_rows_class_alone():
    plans = _interpreted(_SPLIT_SCRIPT)
    # 12 rows: class 4 (8-15 rows), one 16-row tile times two 16-wide column tiles; 5 rows:
    # class 3. Both run the DIRECT path with K split in 2, and their scratch holds those 2
    # tiles (a semaphore word each, 256-byte aligned, then 2 partials of 16 x 16 fp32 a
    # tile), not the 130 tiles the handle's 1024 rows would make
    want = (True, 2, 2, 256 + 2 * 2 * 16 * 16 * 4)
    assert plans == {4: want, 3: want}, plans
