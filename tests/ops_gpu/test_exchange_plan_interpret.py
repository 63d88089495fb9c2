"""exchange_plan_kernel (the task table the grouped GemmAllToAll kernel reads instead of
recomputing its plan for every tile) under Triton's CPU interpreter, against the plan the
kernel's docstring states, built here in plain Python: slices in the rank's `order`, an
empty slice one task with no rows, a slice's segments in turn, inside a segment GROUP_M row
tiles per column tile; each record names X's first row of its tile, the tile's rows, the
group, the column tile, the destination, the row in this rank's region there, the slice's
task count and the count its signal carries. Segments span several row tiles and column
tiles; counts that cannot be meant, or that ask for more tasks than the table holds, leave
one row-less task a slice that sends COUNT_BAD_INPUT."""

import os
import subprocess
import sys

import pytest

from rocmoe_testing import REPO, require_module

require_module("triton", "the Triton interpreter runs the exchange plan on CPU")

pytestmark = pytest.mark.triton_interpret

SCRIPT = r"""
import json
import math
import sys
import torch
from rocmoe.ops import triton_gemm_a2a as tk

case = sys.argv[1]
BM, N_TILES, GROUP_M, BLOCK_T = 16, 3, 2, 8
counts = torch.tensor([[37, 0, 9, 16], [0, 0, 0, 0], [7, 21, 2, 40]], dtype=torch.int64)
world, groups = counts.shape
order = torch.tensor([1, 2, 0], dtype=torch.int32)   # this rank is 0: remote slices first
capacity, rows = 100, int(counts.sum()) + 3
max_tasks = world * (math.ceil(capacity / BM) + groups) * N_TILES
if case == "negative":
    counts[2, 1] = -1
elif case == "too_many_rows":
    rows = int(counts.sum()) - 1
elif case == "over_capacity":
    capacity = 70                                     # destination 2's 70 rows fit, 71 do not
    counts[2, 0] = 8
elif case == "too_many_tasks":
    max_tasks = 20


def grouped_tile(t, m_tiles, n_tiles, gm):
    in_group = gm * n_tiles
    first = (t // in_group) * gm
    rows_in = max(min(m_tiles - first, gm), 1)
    return first + (t % in_group) % rows_in, (t % in_group) // rows_in


def reference():
    dest_rows = counts.sum(1).tolist()
    bad = (int(counts.min()) < 0 or max(dest_rows) > capacity or sum(dest_rows) > rows)
    tasks = {d: [] for d in range(world)}
    if not bad:
        for d in range(world):
            seg_row = 0
            for g in range(groups):
                c = int(counts[d, g])
                m_tiles = math.ceil(c / BM)
                for t in range(m_tiles * N_TILES):
                    m, n = grouped_tile(t, m_tiles, N_TILES, GROUP_M)
                    tasks[d].append([seg_row + m * BM, min(c - m * BM, BM), g, n, d,
                                     seg_row + m * BM])
                seg_row += c
    if not bad and sum(max(len(v), 1) for v in tasks.values()) > max_tasks:
        bad, tasks = True, {d: [] for d in range(world)}
    taken = [0 if bad else r for r in dest_rows]
    start = [sum(taken[:d]) for d in range(world)]
    records = []
    for d in order.tolist():
        mine = tasks[d] or [[0, 0, groups - 1, 0, d, 0]]   # an empty slice: one task
        for rec in mine:
            rec = list(rec)
            rec[0] += start[d]                                # X's rows: this slice's
            records.append(rec + [len(mine), -2 if bad else dest_rows[d]])
    return [len(records), int(bad), sum(taken)], records


table = torch.full((tk.TABLE_HEADER + tk.TABLE_RECORD * max_tasks,), -7, dtype=torch.int32)
grid = (math.ceil(max_tasks / BLOCK_T),)
tk.get("exchange_plan_kernel")[grid](
    counts, order, table.data_ptr(), world, rows, groups, capacity, N_TILES, max_tasks,
    WORLD_P2=4, GROUPS_P2=4, BLOCK_T=BLOCK_T, BLOCK_M=BM, GROUP_M=GROUP_M)
header, records = reference()
got_header = table[:3].tolist()
got = table[tk.TABLE_HEADER:].view(-1, tk.TABLE_RECORD)[:len(records)].tolist()
assert got_header == header, (case, got_header, header)
for i, (a, b) in enumerate(zip(got, records)):
    assert a == b, (case, i, dict(zip(tk.TABLE_FIELDS, a)), dict(zip(tk.TABLE_FIELDS, b)))
if header[1] == 0:
    assert header[0] > world, header            # several tiles a segment: a real table
print("PLAN_OK", json.dumps(header))
"""


def test_the_table_lists_every_tile_of_every_segment_in_the_kernels_task_order():
    _run("good")


@pytest.mark.parametrize("case", ["negative", "too_many_rows", "over_capacity"])
def test_counts_that_cannot_be_meant_leave_one_rowless_task_a_slice_sending_bad_input(case):
    _run(case)


def test_counts_asking_for_more_tasks_than_the_table_holds_count_as_bad():
    _run("too_many_tasks")


def _run(case):
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, case], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "PLAN_OK" in proc.stdout, proc.stdout + proc.stderr
