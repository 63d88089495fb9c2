"""`rocmoe plot RUN.jsonl`: PNG pictures of a training run's JSON lines.

Reads the records the examples print (examples/moe_train.py, examples/dlrm_train.py; lines
that are not JSON objects are ignored, so a captured stdout works too). A run resumed from
a checkpoint appends to its file: for every step the last record wins.

moe_train: ``<name>_loss.png`` (train and validation bits per byte against the unigram
entropy), ``<name>_routing.png`` (per MoE layer: tokens per expert over the steps as a heat
map, tokens per rank with the balance ratio, and the vExpert placement's where the run has
it), ``<name>_step_time.png`` (the step's parts).
dlrm_train: ``<name>_loss.png`` (train and test loss, test accuracy and ROC AUC) and
``<name>_step_time.png`` (ms per iteration). Needs matplotlib (``pip install rocmoe[plot]``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .errors import ConfigurationError, DataFormatError

MAX_LAYERS_DRAWN = 4


def read_records(path) -> list[dict]:
    """The JSON objects of a JSON-lines file (other lines skipped)."""
    records = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and "event" in record:
                records.append(record)
    return records


def by_step(records, event: str, key: str = "step") -> list[dict]:
    """The records of `event`, the last one for each step, in step order."""
    last = {}
    for r in records:
        if r.get("event") == event and r.get(key) is not None:
            last[r[key]] = r
    return [last[s] for s in sorted(last)]


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ConfigurationError(
            "rocmoe plot needs matplotlib: pip install matplotlib (or pip install rocmoe[plot])"
        ) from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def balance_series(routed: list[dict], layer: int) -> dict:
    """MoE layer `layer`'s balance ratios over the train records `routed` (NaN where a record
    has none): "balance ratio" (the static layout's loads) and, for a run under the vExpert
    scheduler (moe_train --vexpert), "vExpert balance ratio" (on the placement each step
    ran on)."""
    def ratio(values):
        value = values[layer] if values and layer < len(values) else None
        return math.nan if value is None else value
    series = {"balance ratio": [ratio(r.get("balance_ratio")) for r in routed]}
    if any("vexpert" in r for r in routed):
        series["vExpert balance ratio"] = [ratio(r.get("vexpert", {}).get("balance_ratio"))
                                           for r in routed]
    return series


def _moe_pictures(plt, records, out: Path, name: str) -> list[Path]:
    train, evals = by_step(records, "train"), by_step(records, "eval")
    config = next((r for r in reversed(records) if r.get("event") == "config"), {})
    written = []
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in train], [r["bpb"] for r in train], label="train", lw=1)
    if evals:
        ax.plot([r["step"] for r in evals], [r["val_bpb"] for r in evals], "o-",
                label="validation")
    if config.get("unigram_entropy_bits"):
        ax.axhline(config["unigram_entropy_bits"], color="gray", ls="--",
                   label=f"unigram entropy ({config['unigram_entropy_bits']:.2f})")
    ax.set_xlabel("step")
    ax.set_ylabel("bits per byte")
    ax.set_title(f"GPT-MoE on stdlib bytes, {config.get('ranks', '?')} ranks "
                 f"({config.get('backend', '?')})")
    ax.legend()
    written.append(_save(fig, out / f"{name}_loss.png"))
    plt.close(fig)

    routed = [r for r in train if r.get("tokens_per_expert")]
    if routed:
        layers = min(MAX_LAYERS_DRAWN, len(routed[0]["tokens_per_expert"]))
        fig, axes = plt.subplots(layers, 2, figsize=(11, 3.2 * layers), squeeze=False)
        steps = [r["step"] for r in routed]
        for layer in range(layers):
            heat = [[row for row in r["tokens_per_expert"][layer]] for r in routed]
            left, right = axes[layer]
            image = left.imshow(list(map(list, zip(*heat))), aspect="auto", origin="lower",
                                interpolation="nearest",
                                extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, len(heat[0]) - 0.5))
            fig.colorbar(image, ax=left, label="tokens")
            left.set_ylabel(f"MoE layer {layer}: expert")
            left.set_xlabel("step")
            per_rank = [r["tokens_per_rank"][layer] for r in routed]
            for rank in range(len(per_rank[0])):
                right.plot(steps, [p[rank] for p in per_rank], lw=1, label=f"rank {rank}")
            right.set_ylabel("tokens per rank")
            right.set_xlabel("step")
            twin = right.twinx()
            for (label, ratios), style in zip(balance_series(routed, layer).items(),
                                              (":", "-")):
                twin.plot(steps, ratios, color="black", lw=1.5, ls=style, label=label)
            twin.set_ylabel("balance ratio (max / mean)")
            right.legend(loc="upper left", fontsize="small")
            twin.legend(loc="upper right", fontsize="small")
        axes[0][0].set_title("tokens per expert")
        axes[0][1].set_title("tokens per rank and balance ratio")
        written.append(_save(fig, out / f"{name}_routing.png"))
        plt.close(fig)

    timed = [r for r in train if r.get("time_parts")]
    if timed:
        parts = list(timed[0]["time_parts"])
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.stackplot([r["step"] for r in timed],
                     [[1000 * r["time_parts"].get(p, 0.0) for r in timed] for p in parts],
                     labels=parts)
        ax.set_xlabel("step")
        ax.set_ylabel("ms")
        ax.set_title("step time by part")
        ax.legend(loc="upper right", fontsize="small")
        written.append(_save(fig, out / f"{name}_step_time.png"))
        plt.close(fig)
    return written


def _dlrm_pictures(plt, records, out: Path, name: str) -> list[Path]:
    train, tests = by_step(records, "train"), by_step(records, "test")
    written = []
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss", lw=1)
    with_loss = [r for r in tests if r.get("loss") is not None]
    if with_loss:
        ax.plot([r["step"] for r in with_loss], [r["loss"] for r in with_loss], "o-",
                label="test loss")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss")
    scored = [r for r in tests if r.get("roc_auc") is not None or r.get("accuracy") is not None]
    if scored:
        twin = ax.twinx()
        for key, style in (("roc_auc", "s--"), ("accuracy", "^--")):
            points = [(r["step"], r[key]) for r in scored if r.get(key) is not None]
            if points:
                twin.plot(*zip(*points), style, label=f"test {key}")
        twin.set_ylabel("test metric")
        twin.legend(loc="upper right")
    ax.legend(loc="upper left")
    ax.set_title("DLRM")
    written.append(_save(fig, out / f"{name}_loss.png"))
    plt.close(fig)
    if train:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([r["step"] for r in train], [r["ms_per_it"] for r in train])
        ax.set_xlabel("iteration")
        ax.set_ylabel("ms per iteration")
        ax.set_title("DLRM step time")
        written.append(_save(fig, out / f"{name}_step_time.png"))
        plt.close(fig)
    return written


def plot_run(path, out_dir=None) -> list[Path]:
    """Write the PNGs of the run in JSON-lines file `path`; returns their paths."""
    path = Path(path)
    records = read_records(path)
    examples = {r.get("example") for r in records if r.get("event") in ("train", "config")}
    out = Path(out_dir) if out_dir is not None else path.parent
    out.mkdir(parents=True, exist_ok=True)
    name = path.stem
    plt = _pyplot()
    if "moe_train" in examples:
        return _moe_pictures(plt, records, out, name)
    if "dlrm_train" in examples:
        return _dlrm_pictures(plt, records, out, name)
    raise DataFormatError(
        f"{path} has no training records of examples/moe_train.py or examples/dlrm_train.py "
        "(JSON lines with \"event\": \"train\")")
