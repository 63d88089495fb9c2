"""Train GPT-MoE (rocmoe.models.gpt_moe) on the bytes of the standard library's .py files.

Expert-parallel MoE layers over the rocmoe context, data-parallel everything else. Byte
vocabulary (256), a fixed file-level train/validation split (rocmoe.data.byte_corpus).
Checkpoints per rank, resumes, stops cleanly on SIGUSR1/SIGTERM for a Slurm requeue.

    mpiexec -n 4 --oversubscribe python examples/moe_train.py            # ~1 minute, host
    mpiexec -n 4 --oversubscribe python examples/moe_train.py --checkpoint-dir ckpt
    mpiexec -n 4 --oversubscribe python examples/moe_train.py --vexpert --moe-every 1
    python examples/moe_train.py --backend none --device cuda --dtype bfloat16 \\
        --layers 8 --hidden 1024 --heads 16 --ffn 1024 --experts 64 --moe-every 1 \\
        --seq-len 1024 --batch-size 16 --block-size 128 --steps 60        # one GPU

stdout: JSON lines (rank 0), each with "event" and "example": "moe_train":
  config      once per start: "ranks", "backend", "device", "dtype", "model" (the
              GPTMoEConfig), "parameters", "expert_parameters_per_rank", "corpus",
              "unigram_entropy_bits", "combine", "start_step"
  resume      "step", "path": the checkpoint this start continued from
  train       every --log-every steps: "step" (steps done), "loss" (global-batch mean
              cross-entropy, nats), "bpb" (loss in bits per byte), "aux_loss", "lr",
              "tokens" (so far), "step_s", "tokens_per_s", "time_parts" {data, forward,
              backward, grad_sync, optimizer: seconds}, "tokens_per_expert" [[per expert] per
              MoE layer, summed over ranks], "tokens_per_rank" [[per rank] per MoE layer],
              "balance_ratio" [per MoE layer: max rank load / mean rank load, experts
              where the static layout puts them]; with --vexpert also "vexpert" {"steps"
              (the scheduler's), "balance_ratio" [per MoE layer, on the vExpert placement
              the step ran on], "changes" (placement changes started at this step),
              "vexperts" [per MoE layer: slots holding an expert]} and time_parts "vexpert"
  eval        "step", "val_loss", "val_bpb"
  checkpoint  "step", "path", "seconds"
  stopped     "step", "signal", "checkpoint": stopped early; the exit status is 75
  summary     "steps", "val_loss", "val_bpb", "unigram_entropy_bits", "learned" (val_bpb
              below the unigram entropy), "tokens_per_s" (mean after the first 3 steps),
              "params_sha256" (every rank's parameters: equal digests, equal models),
              "ranks", "backend", "experts", "experts_per_rank", "combine", "vexpert"
stderr: the tqdm bar and text. Exit status: 0, 1 when the model did not learn, 75 after a
requested stop (SIGUSR1/SIGTERM or --stop-after-step) with its checkpoint written.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np
import torch

from rocmoe.data.byte_corpus import ByteCorpus, unigram_entropy_bits
from rocmoe.errors import ConfigurationError, RocmoeError
from rocmoe.models.gpt_moe import GPTMoE, GPTMoEConfig
from rocmoe.moe import VExpertScheduler
from rocmoe.train import checkpoint as ckpt
from rocmoe.train.data_parallel import GradientSync, group_digest, split_parameters, tensor_digest
from rocmoe.train.group import ProcessGroup
from rocmoe.train.preemption import EXIT_REQUEUE, StopSignals
from rocmoe.train.run_log import RunLog, StepTimer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the settings a resumed run must share with the checkpoint (the others may change)
RESUME_KEYS = ("model", "steps", "batch_size", "lr", "min_lr", "warmup", "weight_decay",
               "seed", "dtype", "validation_percent", "max_files")


def moe_option(text: str):
    """KEY=VALUE for DroplessMoE; VALUE as an int, float, true/false, or a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--moe-option wants KEY=VALUE, got {text!r}")
    for parse in (int, float):
        try:
            return key, parse(value)
        except ValueError:
            pass
    return key, {"true": True, "false": False}.get(value.lower(), value)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--layers", type=int, default=4)
    m.add_argument("--hidden", type=int, default=128)
    m.add_argument("--heads", type=int, default=4)
    m.add_argument("--ffn", type=int, default=256, help="FFN width, dense and per expert")
    m.add_argument("--experts", type=int, default=8)
    m.add_argument("--top-k", type=int, default=2)
    m.add_argument("--moe-every", type=int, default=2, help="MoE FFN every N layers (0: none)")
    m.add_argument("--block-size", type=int, default=None,
                   help="DroplessMoE block size (default: the layer's, 128)")
    m.add_argument("--moe-option", type=moe_option, action="append", default=[],
                   metavar="KEY=VALUE", help="more DroplessMoE keywords (repeatable)")
    m.add_argument("--vexpert", action="store_true",
                   help="vExpert placement (placement=vexpert) under a VExpertScheduler: hot "
                        "experts get replicas in spare slots of other ranks as the load drifts")
    m.add_argument("--seq-len", type=int, default=64)
    m.add_argument("--dropout", type=float, default=0.0)
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=300)
    t.add_argument("--batch-size", type=int, default=32, help="global sequences per step")
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--min-lr", type=float, default=2e-4, help="end of the cosine decay")
    t.add_argument("--warmup", type=int, default=10)
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--eval-every", type=int, default=100)
    t.add_argument("--eval-batches", type=int, default=4)
    t.add_argument("--validation-percent", type=int, default=5)
    t.add_argument("--max-files", type=int, default=None, help="use the first N files only")
    r = p.add_argument_group("runtime")
    r.add_argument("--backend", default="auto",
                   help="rocmoe backend (auto, host, ipc, ...) or none: no rocmoe context "
                        "(one process; needs no native library)")
    r.add_argument("--device", default=None, help="default: the context's (cpu on host)")
    r.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    r.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: cores / ranks on this node)")
    o = p.add_argument_group("checkpoints and output")
    o.add_argument("--checkpoint-dir", default=None)
    o.add_argument("--checkpoint-every", type=int, default=100)
    o.add_argument("--keep-checkpoints", type=int, default=2)
    o.add_argument("--resume", default="auto",
                   help="auto (newest complete checkpoint in --checkpoint-dir, if any), never, "
                        "or a step directory")
    o.add_argument("--stop-after-step", type=int, default=None,
                   help="stop as on SIGUSR1 after this step (checkpoint, exit 75)")
    o.add_argument("--log-every", type=int, default=1)
    o.add_argument("--jsonl", default=None, help="also write the JSON lines to this file")
    o.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    return p.parse_args(argv)


def learning_rate(step: int, args) -> float:
    """Linear warm-up, then cosine from --lr to --min-lr at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    span = max(1, args.steps - args.warmup)
    frac = min(1.0, (step - args.warmup) / span)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * frac))


def open_context(args):
    if args.backend == "none":
        return None
    import rocmoe
    return rocmoe.init(backend=args.backend)


def set_threads(args, ctx) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    elif "OMP_NUM_THREADS" not in os.environ:
        local = getattr(ctx, "local_size", 1) or 1
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))


def routing_stats(layers, totals: np.ndarray, world: int) -> tuple[list, list, list]:
    """Tokens per expert, per rank and the balance ratio (max rank load / mean), per MoE
    layer, from the layers' histograms summed over ranks (`totals`, layer after layer)."""
    per_expert, per_rank, ratio = [], [], []
    start = 0
    for layer in layers:
        counts = totals[start:start + layer.num_experts]
        start += layer.num_experts
        ranks = counts.reshape(world, -1).sum(axis=1)
        per_expert.append([int(c) for c in counts])
        per_rank.append([int(c) for c in ranks])
        ratio.append(float(ranks.max() / ranks.mean()) if ranks.mean() > 0 else None)
    return per_expert, per_rank, ratio


def vexpert_stats(scheduler) -> dict:
    """The scheduler's view of its last step: "steps" (its step count), "balance_ratio" (per
    MoE layer, on the vExpert placement the step ran on; on a GPU the scheduler reads the
    step before's counts, so the first step has None), "changes" (placement changes it
    started at this step, all layers), "vexperts" (per layer: slots holding an expert)."""
    record = scheduler.log[-1] if scheduler.log else {"layers": []}
    entries = record["layers"]
    return {"steps": scheduler.steps,
            "balance_ratio": [None if e is None else float(e["balance_ratio"])
                              for e in entries],
            "changes": sum(1 for e in entries if e is not None and e.get("decision")
                           and "skipped" not in e["decision"]),
            "vexperts": [int((layer.dispatcher.placement.slot_expert >= 0).sum())
                         for layer in scheduler.layers]}


def step_totals(loss, aux, stop_flag: bool, layers, group) -> np.ndarray:
    """One all-reduce per step for everything the log and the stop vote need:
    [loss, aux loss, stop votes, every MoE layer's tokens per expert], summed over ranks."""
    counts = [l.tokens_per_expert.to("cpu", torch.float64) for l in layers]
    values = torch.cat([torch.tensor([float(loss.detach()), float(aux.detach()), float(stop_flag)],
                                     dtype=torch.float64)] + counts).numpy()
    return group.allreduce_(np.ascontiguousarray(values), "step metrics")


def evaluate(model, batches, group, device) -> float:
    model.eval()
    total = np.zeros(2)
    with torch.no_grad():
        for x, y in batches:
            _, loss = model(x.to(device), y.to(device))
            total += [float(loss) * y.numel(), y.numel()]
    model.train()
    group.allreduce_(total, "validation loss")
    return float(total[0] / total[1])


def main(argv=None) -> int:
    args = parse_args(argv)
    ctx = open_context(args)
    group = ProcessGroup.of_context(ctx) if ctx is not None else ProcessGroup.world()
    if ctx is None and group.world_size > 1:
        raise SystemExit("--backend none runs one process; start several ranks with a backend")
    if ctx is None:
        return train(args, ctx, group)
    # on an error the other ranks may be inside a collective: no collective clean-up then
    # (leaving the context on an exception releases this rank's heap only)
    with ctx:
        status = train(args, ctx, group)
        group.close()
    return status


def agreed_corpus(args, group) -> ByteCorpus:
    """The corpus, checked to be the same on every rank before the model's first collective:
    each rank draws its rows of the global batch from it with the same seeds. A rank that
    cannot read it, or reads another (another Python's standard library on another node,
    another --max-files), makes every rank raise ConfigurationError naming it."""
    corpus, problem = None, None
    try:
        corpus = ByteCorpus(validation_percent=args.validation_percent, max_files=args.max_files)
    except (RocmoeError, OSError) as exc:
        problem = exc
    group.raise_together(problem, "corpus setup", "reading the corpus failed",
                         ConfigurationError)
    group.same_everywhere(
        [corpus.train_files, corpus.validation_files, corpus.train.numel(),
         corpus.validation.numel()],
        ["training files", "validation files", "training bytes", "validation bytes"],
        "corpus setup", "the ranks read different corpora", ConfigurationError,
        "run one Python installation (one standard library) on every node, with the same "
        "--max-files and --validation-percent")
    return corpus


def train(args, ctx, group) -> int:
    rank, world = group.rank, group.world_size
    set_threads(args, ctx)
    device = torch.device(args.device) if args.device else \
        (ctx.device if ctx is not None else torch.device("cpu"))
    dtype = DTYPES[args.dtype]
    options = dict(args.moe_option)
    if args.block_size is not None:
        options["block_size"] = args.block_size
    if args.vexpert:
        options.setdefault("placement", "vexpert")
    config = GPTMoEConfig(seq_len=args.seq_len, layers=args.layers, hidden=args.hidden,
                          heads=args.heads, ffn_hidden=args.ffn, experts=args.experts,
                          top_k=args.top_k, moe_every=args.moe_every, dropout=args.dropout,
                          moe_options=options)
    corpus = agreed_corpus(args, group)
    entropy = unigram_entropy_bits(corpus.train)
    model = GPTMoE(config, ctx=ctx if world > 1 else None, seed=args.seed).to(device, dtype)
    experts = model.expert_parameters()
    replicated, local = split_parameters(model, experts)
    sync = GradientSync(replicated, local, group)
    sync.check_replicas_equal()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=args.weight_decay)
    val_batches = corpus.validation_batches(args.eval_batches, args.batch_size, args.seq_len,
                                            rank, world, args.seed)
    run_config = {k: (config.to_dict() if k == "model" else getattr(args, k)) for k in RESUME_KEYS}
    # (every vExpert layer of the model; its pre-hook on opt.step sums the replicas'
    # gradients and installs landed copies)
    scheduler = VExpertScheduler(model, opt) if args.vexpert and model.moe_layers() else None

    position, resumed_from = ckpt.resume_training(args.checkpoint_dir, args.resume, group,
                                                  run_config, model, opt)
    start_step = int(position["step"]) if position else 0
    if scheduler is not None and position and position.get("vexpert") is not None:
        # the placements came back with the model; the scheduler's loads, cost model and
        # calibration come from the data position
        scheduler.load_state_dict(position["vexpert"])

    moe = model.moe_layers()
    combine = None
    if world > 1 and moe:
        from rocmoe.moe.parallel import combine_kind
        combine = combine_kind(moe[0])
    log = RunLog(rank, "moe_train", args.jsonl, append=resumed_from is not None,
                 total=args.steps, initial=start_step, progress=not args.no_progress)
    n_params = sum(p.numel() for p in model.parameters())
    log.record("config", ranks=world, backend=ctx.backend if ctx is not None else "none",
               device=str(device), dtype=args.dtype, model=config.to_dict(), parameters=n_params,
               expert_parameters_per_rank=sum(p.numel() for p in experts),
               corpus=corpus.describe(), unigram_entropy_bits=entropy, combine=combine,
               start_step=start_step)
    if resumed_from:
        log.record("resume", step=start_step, path=str(resumed_from))
        log.text(f"resumed from {resumed_from} at step {start_step}")

    def save(step: int) -> None:
        t0 = time.perf_counter()
        data = {"step": step}
        if scheduler is not None:
            data["vexpert"] = scheduler.state_dict()
        shard = ckpt.training_shard(model, opt, data)
        path = ckpt.save_checkpoint(args.checkpoint_dir, step, shard, group, run_config,
                                    keep=args.keep_checkpoints)
        log.record("checkpoint", step=step, path=str(path),
                   seconds=round(time.perf_counter() - t0, 4))

    timer = StepTimer(device)
    tokens_per_step = args.batch_size * args.seq_len
    speeds, val_loss = [], None
    stopped = None
    with StopSignals() as stop:
        step = start_step
        while step < args.steps:
            lr = learning_rate(step, args)
            for g in opt.param_groups:
                g["lr"] = lr
            timer.start()
            x, y = corpus.train_batch(step, args.batch_size, args.seq_len, rank, world, args.seed)
            x, y = x.to(device), y.to(device)
            timer.mark("data")
            _, loss = model(x, y)
            aux = model.aux_loss if model.aux_loss is not None else torch.zeros((), device=device)
            total = loss + aux.to(loss.dtype)
            timer.mark("forward")
            opt.zero_grad(set_to_none=True)
            total.backward()
            timer.mark("backward")
            sync()
            timer.mark("grad_sync")
            opt.step()
            timer.mark("optimizer")
            if scheduler is not None:
                scheduler.step()  # loads, policy, Expand / Shrink / Migrate (collective)
                timer.mark("vexpert")
            step += 1
            step_s = timer.total
            if args.stop_after_step is not None and step == args.stop_after_step:
                stop.request("stop-after-step")
            totals = step_totals(loss, aux, stop.received is not None, moe, group)
            mean_loss, mean_aux = float(totals[0]) / world, float(totals[1]) / world
            stop_votes = float(totals[2])
            per_expert, per_rank, ratio = routing_stats(moe, totals[3:], world)
            speed = tokens_per_step / step_s
            if step - start_step > 3:
                speeds.append(speed)
            if step % args.log_every == 0 or step == args.steps:
                extra = {} if scheduler is None else {"vexpert": vexpert_stats(scheduler)}
                log.record("train", step=step, loss=mean_loss, bpb=mean_loss / math.log(2),
                           aux_loss=mean_aux, lr=lr, tokens=step * tokens_per_step,
                           step_s=step_s, tokens_per_s=speed,
                           time_parts={k: round(v, 6) for k, v in timer.parts.items()},
                           tokens_per_expert=per_expert, tokens_per_rank=per_rank,
                           balance_ratio=ratio, **extra)
            log.advance(1, loss=f"{mean_loss:.3f}", tok_s=f"{speed:.0f}")
            if step % args.eval_every == 0 or step == args.steps:
                val_loss = evaluate(model, val_batches, group, device)
                log.record("eval", step=step, val_loss=val_loss, val_bpb=val_loss / math.log(2))
                log.text(f"step {step}: train {mean_loss / math.log(2):.3f} bpb, "
                         f"validation {val_loss / math.log(2):.3f} bpb "
                         f"(unigram entropy {entropy:.3f})")
            if stop_votes > 0:  # every rank saw the same sum: all stop after this step
                if args.checkpoint_dir:
                    save(step)
                stopped = stop.received or "a peer's signal"
                break
            if args.checkpoint_dir and (step % args.checkpoint_every == 0 or step == args.steps):
                save(step)
        else:
            if val_loss is None:  # resumed at the end: evaluate the loaded model
                val_loss = evaluate(model, val_batches, group, device)
    if scheduler is not None:
        scheduler.close()
    if stopped is not None:
        log.record("stopped", step=step, signal=stopped, checkpoint=bool(args.checkpoint_dir))
        log.text(f"stopped after step {step} ({stopped})"
                 + (f"; checkpoint in {args.checkpoint_dir}" if args.checkpoint_dir else ""))
        log.close()
        return EXIT_REQUEUE
    # (the tensors: a vExpert layer's placement is a dict entry, agreed by the layer itself)
    digest = group_digest(group, tensor_digest(v for v in model.state_dict().values()
                                               if isinstance(v, torch.Tensor)),
                          "parameter digest")
    val_bpb = val_loss / math.log(2)
    learned = val_bpb < entropy
    log.record("summary", steps=step, val_loss=val_loss, val_bpb=val_bpb,
               unigram_entropy_bits=entropy, learned=learned,
               tokens_per_s=float(np.mean(speeds)) if speeds else None, params_sha256=digest,
               ranks=world, backend=ctx.backend if ctx is not None else "none",
               experts=args.experts, experts_per_rank=args.experts // world, combine=combine,
               vexpert=scheduler is not None)
    log.close()
    return 0 if learned else 1


if __name__ == "__main__":
    sys.exit(main())
