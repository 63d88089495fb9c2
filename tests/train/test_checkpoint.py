"""Checkpoints: per-rank shards, atomic files, the manifest last, and all-or-nothing loads
that refuse incomplete, damaged or mismatched checkpoints on every rank.

Ranks are threads here (ThreadGroup: the collectives rocmoe.train.checkpoint uses, over
shared memory), so multi-rank behaviour is tested without mpiexec; the examples' tests run
the same code under MPI."""

from __future__ import annotations

import json
import random
import threading

import numpy as np
import pytest
import torch

from rocmoe.errors import CheckpointError
from rocmoe.train import checkpoint as ckpt
from rocmoe.train.group import ProcessGroup

CONFIG = {"model": {"layers": 2}, "lr": 0.1}


class ThreadGroup:
    """`world` ranks as threads: barrier and allgather as rocmoe.train.group has them."""

    def __init__(self, world):
        self.world_size = world
        self._barrier = threading.Barrier(world, timeout=20)
        self._slots = [None] * world

    def member(self, rank):
        group = self

        class Member:
            world_size = group.world_size
            raise_together = ProcessGroup.raise_together  # (over the allgather below)

            def __init__(self):
                self.rank = rank

            def barrier(self, what="barrier"):
                group._barrier.wait()

            def allgather(self, array, what):
                group._barrier.wait()
                group._slots[rank] = np.asarray(array).copy()
                group._barrier.wait()
                out = np.stack(group._slots)
                group._barrier.wait()
                return out
        return Member()


def on_ranks(world, fn):
    """Run fn(group_member) on `world` thread-ranks; returns each rank's result or error."""
    group = ThreadGroup(world)
    results = [None] * world

    def body(rank):
        try:
            results[rank] = fn(group.member(rank))
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            results[rank] = exc
    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def shard_of(rank):
    return {"model": {"w": torch.full((3,), float(rank))}, "data": {"step": 7}}


def save_two_ranks(directory, step=7, keep=2):
    return on_ranks(2, lambda g: ckpt.save_checkpoint(directory, step, shard_of(g.rank), g,
                                                      CONFIG, keep=keep))


def test_every_rank_loads_back_its_own_shard(tmp_path):
    save_two_ranks(tmp_path)
    path = ckpt.latest_checkpoint(tmp_path)
    assert path == tmp_path / "step-00000007"
    loaded = on_ranks(2, lambda g: ckpt.load_checkpoint(path, g, CONFIG))
    for rank, shard in enumerate(loaded):
        assert torch.equal(shard["model"]["w"], torch.full((3,), float(rank)))
        assert (shard["step"], shard["rank"], shard["world_size"]) == (7, rank, 2)


def test_the_manifest_records_every_shards_size_and_sha256(tmp_path):
    import hashlib
    save_two_ranks(tmp_path)
    step = tmp_path / "step-00000007"
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["config"] == CONFIG
    for entry in manifest["shards"]:
        data = (step / entry["file"]).read_bytes()
        assert entry["bytes"] == len(data)
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert not [p for p in step.iterdir() if ".tmp-" in p.name]


def test_a_rank_that_cannot_write_fails_the_save_everywhere_and_no_manifest_is_written(tmp_path):
    step = tmp_path / "step-00000007"
    step.mkdir()
    (step / "rank-00001.pt").mkdir()  # rank 1's shard cannot replace a directory
    results = save_two_ranks(tmp_path)
    assert all(isinstance(r, CheckpointError) for r in results), results
    assert "ranks [1] could not write" in str(results[0])
    assert not (step / "manifest.json").exists()
    assert ckpt.latest_checkpoint(tmp_path) is None


def save_with_one_rank_adding(directory, rank, key, value):
    """Two ranks save step 3; rank `rank`'s shard carries `key: value` in its data too."""
    def save(g):
        shard = shard_of(g.rank)
        if g.rank == rank:
            shard["data"][key] = value
        return ckpt.save_checkpoint(directory, 3, shard, g, CONFIG)
    return on_ranks(2, save)


def test_a_shard_that_could_not_be_loaded_safely_is_refused_at_save_time(tmp_path):
    # a numpy scalar: not weights_only-safe
    results = save_with_one_rank_adding(tmp_path, 0, "loss", np.float64(0.5))
    assert all(isinstance(r, CheckpointError) for r in results), results
    assert "ranks [0] could not write" in str(results[1])
    assert "other than tensors and plain Python values" in str(results[0])
    assert ckpt.latest_checkpoint(tmp_path) is None


def test_a_step_directory_rank_0_cannot_create_fails_the_save_on_every_rank(tmp_path):
    (tmp_path / "step-00000007").write_text("a file where the step directory goes")
    results = save_two_ranks(tmp_path)
    assert all(isinstance(r, CheckpointError) for r in results), results
    assert all("rank 0 could not create the directory (ranks [0] failed" in str(r)
               for r in results), results
    assert "here: " in str(results[0]) and "here: " not in str(results[1])


def test_a_shard_one_rank_cannot_pickle_fails_the_save_on_every_rank(tmp_path):
    # no pickler takes a lambda
    results = save_with_one_rank_adding(tmp_path, 1, "schedule", lambda step: 0.1)
    assert all(isinstance(r, CheckpointError) for r in results), results
    assert "ranks [1] could not write" in str(results[0])
    assert "rank 1's shard cannot be saved" in str(results[1])
    assert ckpt.latest_checkpoint(tmp_path) is None


def test_a_manifest_rank_0_cannot_write_fails_the_save_on_every_rank(tmp_path):
    config = dict(CONFIG, schedule=object())  # JSON takes no object
    results = on_ranks(2, lambda g: ckpt.save_checkpoint(tmp_path, 5, shard_of(g.rank), g,
                                                         config))
    assert all(isinstance(r, CheckpointError) for r in results), results
    assert all("rank 0 could not write the manifest" in str(r) for r in results), results
    assert "not JSON serializable" in str(results[0])
    assert ckpt.latest_checkpoint(tmp_path) is None


def test_a_manifest_with_entries_a_save_does_not_write_is_refused_on_every_rank(tmp_path):
    save_two_ranks(tmp_path)
    manifest = tmp_path / "step-00000007" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["shards"] = [0, 1]  # numbers, not the shards' records
    manifest.write_text(json.dumps(data))
    results = on_ranks(2, lambda g: ckpt.load_checkpoint(tmp_path / "step-00000007", g, CONFIG))
    assert all(isinstance(r, CheckpointError) and "unreadable manifest" in str(r)
               for r in results), results
    assert "has entries a save does not write" in str(results[0])


def test_a_shard_one_ranks_model_cannot_take_fails_the_resume_on_every_rank(tmp_path):
    def shard(g):
        model = torch.nn.Linear(2, 2)
        return ckpt.training_shard(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   {"epoch": 1})
    on_ranks(2, lambda g: ckpt.save_checkpoint(tmp_path, 2, shard(g), g, CONFIG))

    def resume(g):
        model = torch.nn.Linear(2, 3 if g.rank == 1 else 2)  # rank 1 built another model
        return ckpt.resume_training(tmp_path, "auto", g, CONFIG, model,
                                    torch.optim.SGD(model.parameters(), lr=0.1))
    results = on_ranks(2, resume)
    assert all(isinstance(r, CheckpointError) for r in results), results
    assert all("could not restore its model, optimizer or RNG state" in str(r)
               and "ranks [1] failed" in str(r) for r in results), results
    assert "size mismatch" in str(results[1])


def test_a_resume_restores_every_ranks_model_and_returns_the_data_position(tmp_path):
    def shard(g):
        model = torch.nn.Linear(2, 2)
        with torch.no_grad():
            model.weight.fill_(g.rank + 1)
        return ckpt.training_shard(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   {"epoch": g.rank})
    on_ranks(2, lambda g: ckpt.save_checkpoint(tmp_path, 2, shard(g), g, CONFIG))

    def resume(g):
        model = torch.nn.Linear(2, 2)
        data, path = ckpt.resume_training(tmp_path, "auto", g, CONFIG, model,
                                          torch.optim.SGD(model.parameters(), lr=0.1))
        return data, path, model.weight.detach().clone()
    for rank, (data, path, weight) in enumerate(on_ranks(2, resume)):
        assert data == {"epoch": rank} and path == tmp_path / "step-00000002"
        assert torch.equal(weight, torch.full((2, 2), float(rank + 1)))


def test_a_missing_shard_is_refused_on_every_rank(tmp_path):
    save_two_ranks(tmp_path)
    (tmp_path / "step-00000007" / "rank-00001.pt").unlink()
    results = on_ranks(2, lambda g: ckpt.load_checkpoint(tmp_path / "step-00000007", g, CONFIG))
    assert all(isinstance(r, CheckpointError) for r in results), results
    assert all("rank 1: its shard is missing" in str(r) for r in results)
    assert "rank-00001.pt is missing" in str(results[1])


def test_a_damaged_shard_is_refused(tmp_path):
    save_two_ranks(tmp_path)
    shard = tmp_path / "step-00000007" / "rank-00000.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    results = on_ranks(2, lambda g: ckpt.load_checkpoint(tmp_path / "step-00000007", g, CONFIG))
    assert all(isinstance(r, CheckpointError) and "rank 0: its shard is damaged" in str(r)
               for r in results), results


def test_a_checkpoint_of_another_world_size_is_refused(tmp_path):
    save_two_ranks(tmp_path)
    with pytest.raises(CheckpointError, match="written by 2 ranks, this run has 1"):
        ckpt.load_checkpoint(tmp_path / "step-00000007", ProcessGroup(None), CONFIG)


def test_a_checkpoint_of_another_configuration_is_refused_naming_the_setting(tmp_path):
    save_two_ranks(tmp_path)
    other = dict(CONFIG, lr=0.2)
    results = on_ranks(2, lambda g: ckpt.load_checkpoint(tmp_path / "step-00000007", g, other))
    assert all(isinstance(r, CheckpointError) for r in results)
    assert "lr: checkpoint 0.1, this run 0.2" in str(results[0])


def test_an_unfinished_save_is_never_the_latest_checkpoint(tmp_path):
    save_two_ranks(tmp_path, step=4)
    unfinished = tmp_path / "step-00000009"
    unfinished.mkdir()
    (unfinished / "rank-00000.pt").write_bytes(b"half")
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step-00000004"
    results = on_ranks(2, lambda g: ckpt.load_checkpoint(unfinished, g, CONFIG))
    assert all(isinstance(r, CheckpointError) and "no manifest" in str(r) for r in results)


def test_older_checkpoints_beyond_keep_are_removed(tmp_path):
    for step in (2, 4, 6):
        save_two_ranks(tmp_path, step=step, keep=2)
    assert [s for s, _, ok in ckpt.list_checkpoints(tmp_path)] == [4, 6]


def test_an_interrupted_write_leaves_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "f.bin"
    ckpt.write_atomic(target, b"old")

    def broken_fsync(fd):
        raise OSError("disk full")
    monkeypatch.setattr(ckpt.os, "fsync", broken_fsync)
    with pytest.raises(OSError):
        ckpt.write_atomic(target, b"new contents")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]  # no temporary file left


def test_rng_states_come_back_exactly():
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    state = ckpt.rng_state()
    first = (torch.rand(3), np.random.rand(3), random.random())
    torch.rand(5), np.random.rand(5), random.random()
    ckpt.set_rng_state(state)
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(first[0], again[0]) and np.array_equal(first[1], again[1])
    assert first[2] == again[2]
