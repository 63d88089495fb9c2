"""Train DLRM (rocmoe.models.dlrm) with facebookresearch/dlrm's flags; fused embedding all-to-all.

The flags are dlrm's (dlrm_s_pytorch.py), with their defaults and meanings: sizes as
dash-separated lists ("13-512-256-64-16"; --arch-mlp-top without its input width, which
the interaction decides), --mini-batch-size is the global batch (each rank trains on its
slice; it must divide by the ranks), --num-batches 0 means the whole data,
--data-generation random is dlrm's synthetic data and dataset reads --raw-data-file in the
Criteo Kaggle/Terabyte TSV format, streaming (rocmoe.data.criteo; tables of --max-ind-range
rows, or the 26 sizes of --arch-embedding-size, categories hashed modulo the size).
Boolean flags take a value as in dlrm (--round-targets True); unlike dlrm's type=bool,
"False" and "0" mean false.

    mpiexec -n 4 --oversubscribe python examples/dlrm_train.py \\
        --arch-sparse-feature-size 16 --arch-mlp-bot 13-512-256-64-16 --arch-mlp-top 512-256-1 \\
        --data-generation dataset --raw-data-file train.txt --max-ind-range 100000 \\
        --loss-function bce --round-targets True --learning-rate 0.1 --mini-batch-size 128 \\
        --print-freq 1024 --test-freq 10240 --checkpoint-dir ckpt

stderr: dlrm's log lines ("Finished training it 10/100 of epoch 0, 3.21 ms/it, loss
0.693147, 311.5 it/s"; "Testing at - ..." and the accuracy line) beside the tqdm bar.
stdout: JSON lines (rank 0), each with "event" and "example": "dlrm_train":
  config      "ranks", "backend", "arch" {sparse_feature_size, embedding_sizes, mlp_bot,
              mlp_top, interaction, interaction_itself}, "tables_per_rank", "data_generation",
              "num_batches", "nepochs", "mini_batch_size", "loss_function", "start_iteration",
              "lookup" (batched or per-table)
  resume      "iteration", "path"
  train       every --print-freq iterations: "epoch", "iteration" (in the epoch),
              "num_batches", "step" (iterations so far), "loss" (mean since the last line),
              "ms_per_it", "it_per_s", "samples_per_s"
  test        every --test-freq iterations: "epoch", "iteration", "step", "loss",
              "accuracy", "roc_auc" (scikit-learn; null where undefined), "samples",
              "best_accuracy"
  checkpoint  "step", "path", "seconds"
  stopped     "step", "signal", "checkpoint" (exit status 75)
  summary     "steps", "first_loss", "last_loss" (first and last train lines), "test" (the
              last test record or null), "bad_lines", "params_sha256", "ranks", "backend",
              "tables"
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np
import torch

import rocmoe
from rocmoe.data import criteo
from rocmoe.data.dlrm_random import random_batch
from rocmoe.models.dlrm import DLRM, check_architecture, table_range
from rocmoe.train import checkpoint as ckpt
from rocmoe.train.data_parallel import GradientSync, group_digest, split_parameters, tensor_digest
from rocmoe.train.group import ProcessGroup
from rocmoe.train.preemption import EXIT_REQUEUE, StopSignals
from rocmoe.train.run_log import RunLog

RESUME_KEYS = ("arch_sparse_feature_size", "arch_embedding_size", "arch_mlp_bot",
               "arch_mlp_top", "arch_interaction_op", "arch_interaction_itself",
               "loss_function", "loss_weights", "round_targets", "data_size", "num_batches",
               "data_generation", "raw_data_file", "max_ind_range", "num_indices_per_lookup",
               "num_indices_per_lookup_fixed", "mini_batch_size", "nepochs", "learning_rate",
               "optimizer", "numpy_rand_seed", "skip_bad_lines", "test_every_nth_line")


# -- dlrm's argument types ----------------------------------------------------------------
def dash_separated(kind, name: str):
    """dlrm's dash-separated list type: it keeps the text ("4-3-2") and splits it later,
    checking here only that every part is a `kind`."""
    def check(value: str) -> str:
        for part in value.split("-"):
            try:
                kind(part)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"{value} is not a valid dash separated list of {name}") from None
        return value
    return check


dash_separated_ints = dash_separated(int, "ints")
dash_separated_floats = dash_separated(float, "floats")


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split("-")]


def dlrm_bool(value: str) -> bool:
    """dlrm declares these type=bool, so any non-empty text (even "False") is true there;
    here true/1/yes and false/0/no mean what they say, anything else is an error."""
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "y", "t"):
        return True
    if text in ("false", "0", "no", "n", "f", ""):
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {value!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    # model (dlrm's names, defaults and formats)
    p.add_argument("--arch-sparse-feature-size", type=int, default=2)
    p.add_argument("--arch-embedding-size", type=dash_separated_ints, default="4-3-2")
    p.add_argument("--arch-mlp-bot", type=dash_separated_ints, default="4-3-2")
    p.add_argument("--arch-mlp-top", type=dash_separated_ints, default="4-2-1")
    p.add_argument("--arch-interaction-op", type=str, choices=["dot", "cat"], default="dot")
    p.add_argument("--arch-interaction-itself", action="store_true", default=False)
    p.add_argument("--loss-function", choices=["mse", "bce", "wbce"], default="mse")
    p.add_argument("--loss-weights", type=dash_separated_floats, default="1.0-1.0")
    p.add_argument("--round-targets", type=dlrm_bool, default=False)
    # data
    p.add_argument("--data-size", type=int, default=1)
    p.add_argument("--num-batches", type=int, default=0)
    p.add_argument("--data-generation", choices=["random", "dataset"], default="random")
    p.add_argument("--data-set", choices=["kaggle", "terabyte"], default="kaggle",
                   help="both use the same TSV format")
    p.add_argument("--raw-data-file", type=str, default="")
    p.add_argument("--max-ind-range", type=int, default=-1)
    p.add_argument("--num-indices-per-lookup", type=int, default=10)
    p.add_argument("--num-indices-per-lookup-fixed", type=dlrm_bool, default=False)
    # training
    p.add_argument("--mini-batch-size", type=int, default=1)
    p.add_argument("--nepochs", type=int, default=1)
    p.add_argument("--learning-rate", type=float, default=0.01)
    p.add_argument("--optimizer", choices=["sgd", "adagrad"], default="sgd")
    p.add_argument("--numpy-rand-seed", type=int, default=123)
    p.add_argument("--print-freq", type=int, default=1)
    p.add_argument("--test-freq", type=int, default=-1)
    p.add_argument("--test-mini-batch-size", type=int, default=-1)
    p.add_argument("--print-time", action="store_true", default=False,
                   help="accepted for dlrm's command lines; the time is always printed")
    # rocmoe's own
    r = p.add_argument_group("rocmoe")
    r.add_argument("--skip-bad-lines", action="store_true",
                   help="skip (and count) malformed TSV lines instead of stopping at the first")
    r.add_argument("--test-every-nth-line", type=int, default=7,
                   help="dataset: line n is a test line when n %% N == 0 (default 7)")
    r.add_argument("--backend", default="auto")
    r.add_argument("--lookup", choices=["batched", "per-table"], default="batched",
                   help="the embedding lookup: one EmbeddingAllToAll handle's batched call on "
                   "the packed tables, or the functional op once per step on per-table views")
    r.add_argument("--checkpoint-dir", default=None)
    r.add_argument("--checkpoint-every", type=int, default=0, help="iterations (0: at the end only)")
    r.add_argument("--keep-checkpoints", type=int, default=2)
    r.add_argument("--resume", default="auto", help="auto, never, or a step directory")
    r.add_argument("--stop-after-iteration", type=int, default=None,
                   help="stop as on SIGUSR1 after this many iterations (checkpoint, exit 75)")
    r.add_argument("--jsonl", default=None, help="also write the JSON lines to this file")
    r.add_argument("--no-progress", action="store_true")
    return p


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    if args.test_mini_batch_size < 0:  # dlrm: the training batch size unless set
        args.test_mini_batch_size = args.mini_batch_size
    return args


# -- data ------------------------------------------------------------------------------------
class Data:
    """The batches of dlrm's two data sources, in one shape: (dense, indices, offsets,
    targets, position), the position being what a checkpoint needs to come back here."""

    def __init__(self, args, world: int):
        self.args, self.world = args, world
        self.bottom = ints(args.arch_mlp_bot)
        if args.data_generation == "dataset":
            if not args.raw_data_file:
                raise rocmoe.ConfigurationError("--data-generation dataset needs --raw-data-file")
            sizes = ints(args.arch_embedding_size)
            if args.max_ind_range > 0:
                sizes = [args.max_ind_range] * criteo.NUM_SPARSE
            elif len(sizes) != criteo.NUM_SPARSE:
                raise rocmoe.ConfigurationError(
                    "--data-generation dataset streams the file without a dictionary pass: give "
                    "--max-ind-range N (26 tables of N rows, categories hashed modulo N) or 26 "
                    f"sizes in --arch-embedding-size (got {len(sizes)})")
            self.table_sizes = sizes
            self.bottom[0] = criteo.NUM_DENSE  # dlrm sets the input width from the data
            self.train = criteo.CriteoTSV(args.raw_data_file, sizes, "train",
                                          args.test_every_nth_line, args.skip_bad_lines)
            self.test = criteo.CriteoTSV(args.raw_data_file, sizes, "test",
                                         args.test_every_nth_line, args.skip_bad_lines)
            samples = self.train.samples_in_file()
        else:
            self.table_sizes = ints(args.arch_embedding_size)
            samples = args.data_size
        self.num_batches = args.num_batches if args.num_batches > 0 else \
            math.ceil(samples / args.mini_batch_size)

    @property
    def bad_lines(self) -> int:
        return self.train.bad_lines if self.args.data_generation == "dataset" else 0

    def _random(self, j: int, batch_size: int):
        a = self.args
        dense, idx, off, targets = random_batch(
            j, batch_size, self.bottom[0], self.table_sizes, a.num_indices_per_lookup,
            a.num_indices_per_lookup_fixed, a.round_targets, a.numpy_rand_seed)
        return dense, idx, off, targets, {"batch": j + 1}

    def epoch(self, position: dict | None):
        """Training batches of one epoch from `position` (None: its start)."""
        if self.args.data_generation == "random":
            first = position["batch"] if position else 0
            for j in range(first, self.num_batches):
                yield self._random(j, self.args.mini_batch_size)
            return
        start = criteo.Position(**position["reader"]) if position else None
        for b in self.train.batches(self.args.mini_batch_size, start):
            yield (b.dense, *b.stacked_lookups(), b.labels, {"reader": b.position.to_dict()})

    def test_batches(self):
        size = self.args.test_mini_batch_size
        if self.args.data_generation == "random":  # dlrm's test set: the same generator
            for j in range(self.num_batches):
                yield self._random(j, size)[:4]
            return
        for b in self.test.batches(size):
            yield (b.dense, *b.stacked_lookups(), b.labels)


def agreed_data(args, world: int, group) -> Data:
    """Data(args, world), checked across the ranks before the model's first collective. Every
    rank reads the whole global batch, so all must read the same data: a rank that cannot
    read its --raw-data-file (a node-local path, a missing copy), or reads a file of another
    size, makes every rank raise ConfigurationError naming it. Alone it raised while the
    others waited in the model's creation until ROCMOE_TIMEOUT_S ran out."""
    data, problem = None, None
    try:
        data = Data(args, world)
    except (rocmoe.RocmoeError, OSError) as exc:
        problem = exc
    group.raise_together(problem, "data setup", "reading the training data failed",
                         rocmoe.ConfigurationError)
    size = os.path.getsize(args.raw_data_file) if args.data_generation == "dataset" else 0
    group.same_everywhere([size, data.num_batches], ["bytes", "batches"], "data setup",
                          "the ranks read different training data", rocmoe.ConfigurationError,
                          "each reads the whole global batch, so --raw-data-file must name "
                          "the same file on every node")
    return data


# -- loss and metrics --------------------------------------------------------------------------
def make_loss(args):
    if args.loss_function == "mse":
        return torch.nn.MSELoss(reduction="mean")
    if args.loss_function == "bce":
        return torch.nn.BCELoss(reduction="mean")
    weights = torch.tensor([float(w) for w in args.loss_weights.split("-")])
    bce = torch.nn.BCELoss(reduction="none")
    return lambda p, t: (weights[t.long()] * bce(p, t)).mean()


def test_metrics(args, probs: np.ndarray, targets: np.ndarray) -> dict:
    """Loss, accuracy and ROC AUC from scikit-learn (None where a metric is undefined)."""
    try:
        from sklearn import metrics
    except ImportError:
        raise rocmoe.ConfigurationError(
            "--test-freq needs scikit-learn for the metrics: pip install scikit-learn "
            "(or pip install rocmoe[examples])") from None
    binary = bool(np.isin(targets, (0.0, 1.0)).all())
    if args.loss_function == "mse":
        loss = metrics.mean_squared_error(targets, probs)
    elif args.loss_function == "bce" or not binary:
        loss = metrics.log_loss(targets.round(), probs, labels=[0, 1]) if binary else None
    else:
        w = np.array([float(v) for v in args.loss_weights.split("-")])[targets.astype(int)]
        loss = metrics.log_loss(targets, probs, sample_weight=w, normalize=False,
                                labels=[0, 1]) / len(targets)
    both = binary and 0 < targets.sum() < len(targets)
    return {"loss": None if loss is None else float(loss),
            "accuracy": float(metrics.accuracy_score(targets, probs.round())) if binary else None,
            "roc_auc": float(metrics.roc_auc_score(targets, probs)) if both else None,
            "samples": int(len(targets))}


# -- the run -----------------------------------------------------------------------------------
def main(argv=None) -> int:
    args = parse_args(argv)
    with rocmoe.init(backend=args.backend) as ctx:
        group = ProcessGroup.of_context(ctx)
        # on an error the other ranks may be inside a collective: no collective clean-up then
        status = train(args, ctx, group)
        group.close()
        return status


def my_lookups(model, indices, offsets, device) -> tuple:
    """This rank's tables' lookups on `device`: of stacked lookups (Criteo data: [26, B]
    each) the rows of its tables, one copy each; of listed ones (the random data's bags of
    varying size) a copy a table."""
    if isinstance(indices, torch.Tensor):
        tables = slice(model.my_tables.start, model.my_tables.stop)
        return indices[tables].to(device), offsets[tables].to(device)
    return ([indices[t].to(device) for t in model.my_tables],
            [offsets[t].to(device) for t in model.my_tables])


def evaluate(model, data, args, ctx, group) -> dict:
    probs, targets = [], []
    rank, world = group.rank, group.world_size
    with torch.no_grad():
        for dense, idx, off, t in data.test_batches():
            if len(t) % world:  # dlrm skips a batch the ranks cannot share
                continue
            per = len(t) // world
            mine = slice(rank * per, (rank + 1) * per)
            p = model(dense[mine].to(ctx.device), *my_lookups(model, idx, off, ctx.device))
            pairs = np.stack([p.double().cpu().numpy(), t[mine].double().numpy()])
            everyone = group.allgather(pairs, "test predictions")  # [world, 2, per]
            probs.append(everyone[:, 0].reshape(-1))
            targets.append(everyone[:, 1].reshape(-1))
    if not probs:
        return {"loss": None, "accuracy": None, "roc_auc": None, "samples": 0}
    return test_metrics(args, np.concatenate(probs), np.concatenate(targets))


def train(args, ctx, group) -> int:
    rank, world = group.rank, group.world_size
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, ctx.local_size)))
    if args.mini_batch_size % world or args.test_mini_batch_size % world:
        raise rocmoe.ConfigurationError(
            f"--mini-batch-size {args.mini_batch_size} and --test-mini-batch-size "
            f"{args.test_mini_batch_size} must be divisible by the {world} ranks: each trains "
            "on its slice of the global batch")
    data = agreed_data(args, world, group)
    check_architecture(args.arch_sparse_feature_size, data.bottom, ints(args.arch_mlp_top),
                       len(data.table_sizes))
    # the lookup handle's bounds: the larger of the two batch sizes, and per table one index
    # a sample (a Criteo line) or at most --num-indices-per-lookup (random data)
    max_batch = max(args.mini_batch_size, args.test_mini_batch_size)
    per_sample = 1 if args.data_generation == "dataset" else max(1, args.num_indices_per_lookup)
    model = DLRM(args.arch_sparse_feature_size, data.table_sizes, data.bottom,
                 ints(args.arch_mlp_top), args.arch_interaction_op, args.arch_interaction_itself,
                 ctx=ctx, rank=rank, world_size=world, seed=args.numpy_rand_seed,
                 **(dict(max_batch=max_batch, max_lookups=max_batch * per_sample)
                    if args.lookup == "batched" else {})).to(ctx.device)
    replicated, local = split_parameters(model, model.table_parameters())
    sync = GradientSync(replicated, local, group)
    sync.check_replicas_equal()
    opt_class = torch.optim.SGD if args.optimizer == "sgd" else torch.optim.Adagrad
    opt = opt_class(model.parameters(), lr=args.learning_rate)
    loss_fn = make_loss(args)
    run_config = {k: getattr(args, k) for k in RESUME_KEYS}
    # a checkpoint of the per-table parameters (before the packed tables) is refused by name
    run_config["embedding_tables"] = "packed"

    # everything a resumed run needs to continue as if it had not stopped
    state = {"epoch": 0, "iteration": 0, "position": None, "step": 0,
             "interval": {"loss": 0.0, "samples": 0, "iterations": 0}}
    saved, resumed_from = ckpt.resume_training(args.checkpoint_dir, args.resume, group,
                                               run_config, model, opt)
    state = saved or state

    log = RunLog(rank, "dlrm_train", args.jsonl, append=resumed_from is not None,
                 total=data.num_batches * args.nepochs, initial=state["step"],
                 progress=not args.no_progress, unit="it")
    log.record("config", ranks=world, backend=ctx.backend,
               arch={"sparse_feature_size": args.arch_sparse_feature_size,
                     "embedding_sizes": data.table_sizes, "mlp_bot": data.bottom,
                     "mlp_top": ints(args.arch_mlp_top), "interaction": args.arch_interaction_op,
                     "interaction_itself": args.arch_interaction_itself},
               tables_per_rank=[len(table_range(r, world, len(data.table_sizes)))
                                for r in range(world)],
               data_generation=args.data_generation, num_batches=data.num_batches,
               nepochs=args.nepochs, mini_batch_size=args.mini_batch_size,
               loss_function=args.loss_function, start_iteration=state["step"],
               lookup=args.lookup)
    if resumed_from:
        log.record("resume", iteration=state["step"], path=str(resumed_from))
        log.text(f"resumed from {resumed_from} at iteration {state['step']}")

    saved = {"step": None}

    def save() -> None:
        if saved["step"] == state["step"]:
            return
        saved["step"] = state["step"]
        t0 = time.perf_counter()
        shard = ckpt.training_shard(model, opt, state)
        path = ckpt.save_checkpoint(args.checkpoint_dir, state["step"], shard, group,
                                    run_config, keep=args.keep_checkpoints)
        log.record("checkpoint", step=state["step"], path=str(path),
                   seconds=round(time.perf_counter() - t0, 4))

    n = data.num_batches
    train_lines, last_test, best_acc = [], None, 0.0
    stopped, interval_time = None, 0.0
    dev = ctx.device
    with StopSignals() as stop:
        while state["epoch"] < args.nepochs and stopped is None:
            k = state["epoch"]
            for dense, idx, off, targets, position in data.epoch(state["position"]):
                t0 = time.perf_counter()
                if len(targets) % world:  # dlrm: skip a batch the ranks cannot share
                    log.text(f"Warning: Skipping the batch {state['iteration']} with size "
                             f"{len(targets)}")
                    continue
                per = len(targets) // world
                mine = slice(rank * per, (rank + 1) * per)
                probs = model(dense[mine].to(dev), *my_lookups(model, idx, off, dev))
                loss = loss_fn(probs, targets[mine].to(dev))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                sync()
                opt.step()
                state["iteration"] += 1
                state["step"] += 1
                state["position"] = position
                j = state["iteration"]
                if args.stop_after_iteration is not None and state["step"] == args.stop_after_iteration:
                    stop.request("stop-after-iteration")
                totals = group.allreduce_(np.array([float(loss.detach()),
                                                    float(stop.received is not None)]),
                                          "iteration metrics")
                mean_loss = float(totals[0]) / world
                interval_time += time.perf_counter() - t0
                iv = state["interval"]
                iv["loss"] += mean_loss * len(targets)
                iv["samples"] += len(targets)
                iv["iterations"] += 1
                log.advance(1, loss=f"{mean_loss:.4f}")
                should_print = j % args.print_freq == 0 or j == n
                should_test = args.test_freq > 0 and (j % args.test_freq == 0 or j == n)
                if should_print or should_test:
                    ms = 1000.0 * interval_time / iv["iterations"]
                    train_loss = iv["loss"] / iv["samples"]
                    log.text(f"Finished training it {j}/{n} of epoch {k}, {ms:.2f} ms/it, "
                             f"loss {train_loss:.6f}, {1000.0 / ms:.1f} it/s")
                    log.record("train", epoch=k, iteration=j, num_batches=n, step=state["step"],
                               loss=train_loss, ms_per_it=ms, it_per_s=1000.0 / ms,
                               samples_per_s=iv["samples"] * 1000.0 / (ms * iv["iterations"]))
                    train_lines.append(train_loss)
                    state["interval"] = {"loss": 0.0, "samples": 0, "iterations": 0}
                    interval_time = 0.0
                if should_test:
                    log.text(f"Testing at - {j}/{n} of epoch {k},")
                    result = evaluate(model, data, args, ctx, group)
                    best_acc = max(best_acc, result["accuracy"] or 0.0)
                    acc, auc = result["accuracy"], result["roc_auc"]
                    log.text(f" accuracy {100 * (acc or 0):3.3f} %, best {100 * best_acc:3.3f} %"
                             + (f", auc {auc:.4f}" if auc is not None else ""))
                    last_test = dict(epoch=k, iteration=j, step=state["step"], **result,
                                     best_accuracy=best_acc)
                    log.record("test", **last_test)
                epoch_done = j >= n
                if epoch_done:
                    state.update(epoch=k + 1, iteration=0, position=None)
                if totals[1] > 0:  # the same sum on every rank: all stop after this step
                    if args.checkpoint_dir:
                        save()
                    stopped = stop.received or "a peer's signal"
                    break
                if args.checkpoint_dir and args.checkpoint_every > 0 and \
                        state["step"] % args.checkpoint_every == 0:
                    save()
                if epoch_done:
                    break
            else:  # the data ended before --num-batches
                state.update(epoch=k + 1, iteration=0, position=None)
    if stopped is not None:
        log.record("stopped", step=state["step"], signal=stopped,
                   checkpoint=bool(args.checkpoint_dir))
        log.text(f"stopped after iteration {state['step']} ({stopped})")
        log.close()
        return EXIT_REQUEUE
    if args.checkpoint_dir:
        save()
    digest = group_digest(group, tensor_digest(model.state_dict().values()), "parameter digest")
    log.record("summary", steps=state["step"], first_loss=train_lines[0] if train_lines else None,
               last_loss=train_lines[-1] if train_lines else None, test=last_test,
               bad_lines=data.bad_lines, params_sha256=digest, ranks=world, backend=ctx.backend,
               tables=len(data.table_sizes))
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
