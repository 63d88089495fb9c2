"""`rocmoe plot RUN.jsonl`: the examples' JSON lines become PNG pictures."""

from __future__ import annotations

import json

import pytest

from rocmoe import cli
from rocmoe.plot import balance_series, by_step, plot_run, read_records

PNG = b"\x89PNG\r\n\x1a\n"


def moe_run(path, steps=6):
    lines = ["rocmoe: a line that is not JSON (a captured stderr) is skipped",
             json.dumps({"event": "config", "example": "moe_train", "ranks": 2,
                         "backend": "host", "unigram_entropy_bits": 4.7})]
    for step in range(1, steps + 1):
        lines.append(json.dumps({
            "event": "train", "example": "moe_train", "step": step, "loss": 5.0 - 0.3 * step,
            "bpb": (5.0 - 0.3 * step) / 0.693, "tokens_per_expert": [[10 + step, 20, 30, 40]],
            "tokens_per_rank": [[30 + step, 70]], "balance_ratio": [1.3],
            "time_parts": {"forward": 0.1, "backward": 0.2, "grad_sync": 0.01}}))
        if step % 3 == 0:
            lines.append(json.dumps({"event": "eval", "example": "moe_train", "step": step,
                                     "val_loss": 4.0, "val_bpb": 5.7}))
    path.write_text("\n".join(lines) + "\n")
    return path


def dlrm_run(path):
    lines = [json.dumps({"event": "config", "example": "dlrm_train"})]
    for step in (10, 20, 30):
        lines.append(json.dumps({"event": "train", "example": "dlrm_train", "step": step,
                                 "loss": 0.7 - step / 100, "ms_per_it": 3.0}))
    lines.append(json.dumps({"event": "test", "example": "dlrm_train", "step": 30,
                             "loss": 0.5, "accuracy": 0.7, "roc_auc": 0.75}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_moe_run_gives_loss_routing_and_step_time_pictures(tmp_path):
    written = plot_run(moe_run(tmp_path / "moe.jsonl"), tmp_path / "out")
    assert [p.name for p in written] == ["moe_loss.png", "moe_routing.png", "moe_step_time.png"]
    for png in written:
        data = png.read_bytes()
        assert data.startswith(PNG) and len(data) > 5000


def test_a_vexpert_run_draws_the_vexpert_placements_balance_ratio_beside_the_static_one(
        tmp_path):
    path = moe_run(tmp_path / "moe.jsonl")
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if '"train"' in line:
            record = json.loads(line)
            record["vexpert"] = {"steps": record["step"], "balance_ratio": [1.0 + record["step"]
                                                                            / 100],
                                 "changes": 0, "vexperts": [4]}
            lines[i] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")
    routed = by_step(read_records(path), "train")
    series = balance_series(routed, 0)
    assert series["balance ratio"] == [1.3] * 6
    assert series["vExpert balance ratio"] == [1.0 + s / 100 for s in range(1, 7)]
    assert [p.name for p in plot_run(path, tmp_path / "out")][1] == "moe_routing.png"


def test_a_static_run_has_one_balance_ratio_series(tmp_path):
    routed = by_step(read_records(moe_run(tmp_path / "moe.jsonl")), "train")
    assert list(balance_series(routed, 0)) == ["balance ratio"]


def test_dlrm_run_gives_loss_and_step_time_pictures(tmp_path):
    written = plot_run(dlrm_run(tmp_path / "dlrm.jsonl"))
    assert [p.name for p in written] == ["dlrm_loss.png", "dlrm_step_time.png"]
    assert all(p.parent == tmp_path and p.read_bytes().startswith(PNG) for p in written)


def test_a_resumed_runs_repeated_steps_count_once_the_last_record_winning(tmp_path):
    path = moe_run(tmp_path / "moe.jsonl", steps=4)
    with open(path, "a") as f:  # the second attempt, resumed at step 2
        f.write(json.dumps({"event": "train", "example": "moe_train", "step": 3, "loss": 1.0,
                            "bpb": 1.44}) + "\n")
    train = by_step(read_records(path), "train")
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert train[2]["loss"] == 1.0


def test_the_command_prints_the_pictures_it_wrote(tmp_path, capsys):
    run = moe_run(tmp_path / "moe.jsonl")
    assert cli.main(["plot", str(run), "--out", str(tmp_path / "pics")]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(tmp_path / "pics" / n) for n in
                       ("moe_loss.png", "moe_routing.png", "moe_step_time.png")]


@pytest.mark.parametrize("content,message", [
    (None, "is not a file"),
    ('{"event": "summary", "example": "moe_train"}\n', "has no training records"),
])
def test_the_command_explains_what_it_cannot_plot(tmp_path, capsys, content, message):
    path = tmp_path / "run.jsonl"
    if content is not None:
        path.write_text(content)
    assert cli.main(["plot", str(path)]) == 2
    assert message in capsys.readouterr().err
