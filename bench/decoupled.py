"""i. Decoupled training with synthetic intermediate labels against end-to-end training.

A 6-layer fully connected network (digits-mlp with 5 hidden layers) on scikit-learn's
digits, cut in two (``worker.decoupled``), trained end to end and decoupled, with the same
optimizer, batches and epochs, over ``--seeds`` seeds: validation accuracy and loss of the
(composed) network, device bytes one training step needs (weights, gradients, optimizer
state and the activations autograd keeps; for decoupled training the larger segment's,
since the segments need not be on a device together), and seconds per trial.

    python -m bench.decoupled
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from pathlib import Path
from typing import Any

from bench import recording

CONFIG: dict[str, Any] = {"hidden": 128, "layers": 5, "batch_size": 64, "lr": 1e-3}


def _step_bytes(params: list[Any], step: Any) -> int:
    """Bytes one training ``step()`` keeps: parameters, their gradients, Adam's two moments,
    and the tensors autograd saves for the backward pass (each storage once)."""
    import torch

    seen: set[int] = set()
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            saved += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    weights = sum(p.numel() * p.element_size() for p in params)
    return 4 * weights + saved  # weights, gradients, two moments


def _step(part: Any, optimizer: Any, rule: Any, x: Any, y: Any, noise: Any) -> None:
    """One optimizer step of ``part``: on the true inputs and classes (end to end, ``rule``
    None), or on its segment's inputs, targets and loss."""
    from torch.nn import functional as F

    optimizer.zero_grad()
    if rule is None:
        loss = F.cross_entropy(part(x), y)
    else:
        loss = rule.loss(part(rule.inputs(x, y, noise)), y, F.cross_entropy)
    loss.backward()
    optimizer.step()


def train(seed: int, epochs: int, decoupled: bool, segments: int = 2) -> dict[str, Any]:
    import torch
    from torch.nn import functional as F

    from packtune.workloads import get_workload
    from worker.decoupled import Segment, compose, split, synthetic_labels, widths
    from worker.workloads.digits import digits_splits

    workload = get_workload("digits-mlp")
    config = workload.resolve(CONFIG)
    train_split, val = digits_splits("cpu")
    torch.manual_seed(seed)
    model = workload.build_model(config)
    assert isinstance(model, torch.nn.Sequential)
    size = int(config["batch_size"])
    order = torch.Generator().manual_seed(seed)
    if decoupled:
        parts = split(model, segments)
        labels = synthetic_labels(10, widths(parts, train_split.x[:2]), seed)
        rules = [Segment(j, segments, labels) for j in range(segments)]
        optimizers = [torch.optim.Adam(p.parameters(), lr=config["lr"]) for p in parts]
        noise = torch.Generator().manual_seed(seed + 1)
    else:
        parts, optimizers = [model], [torch.optim.Adam(model.parameters(), lr=config["lr"])]
        rules, noise = [], None
    peak = 0
    started = time.perf_counter()
    for _ in range(epochs):
        perm = torch.randperm(train_split.x.shape[0], generator=order)
        for first in range(0, perm.numel() - size + 1, size):
            index = perm[first : first + size]
            x, y = train_split.x[index], train_split.y[index]
            for j, (part, optimizer) in enumerate(zip(parts, optimizers, strict=True)):
                step = functools.partial(
                    _step, part, optimizer, rules[j] if decoupled else None, x, y, noise
                )
                if first == 0:  # an epoch's first batch: measure
                    peak = max(peak, _step_bytes(list(part.parameters()), step))
                else:
                    step()
    seconds = time.perf_counter() - started
    with torch.no_grad():
        out = compose(parts, val.x)
        accuracy = float((out.argmax(1) == val.y).float().mean())
        loss = float(F.cross_entropy(out, val.y))
    return {"accuracy": accuracy, "val_loss": loss, "step_bytes": peak, "seconds": seconds}


def packtune_seconds(seed: int, epochs: int, decoupled: bool, segments: int = 2) -> float:
    """Seconds packtune's worker takes to train one such trial (a fused array of one, as a
    worker runs it: on a CPU the segments one after another)."""
    from packtune.spec import TrainingSettings
    from packtune.workloads import get_workload
    from worker.fused import FusedArray, train

    workload = get_workload("digits-mlp")
    config = {**CONFIG, "optimizer": "adam", "seed": seed, "data_seed": seed}
    training = TrainingSettings(mode="decoupled" if decoupled else "end_to_end", segments=segments)
    array = FusedArray(workload, [(0, config)], training=training)
    started = time.perf_counter()
    train(array, epochs * array.steps_per_epoch)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument(
        "--threads", type=int, default=None,
        help="torch threads (default: cores - 1, as a worker uses)",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="tiny run; appends nothing")
    parser.add_argument("--out-dir", type=Path, default=None, help="JSON here")
    parser.add_argument("--no-append", action="store_true", help="leave HISTORY.md alone")
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.epochs = 1, 2
    import torch

    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 2) - 1))
    load = recording.load_average()
    info = recording.machine("cpu")
    runs: dict[str, list[dict[str, Any]]] = {"end_to_end": [], "decoupled": []}
    for seed in range(args.seeds):  # alternating, so that drift in the machine hits both
        for mode in runs:
            run = train(seed, args.epochs, decoupled=mode == "decoupled")
            run["packtune_seconds"] = packtune_seconds(seed, args.epochs, mode == "decoupled")
            runs[mode].append(run)
    summary = {
        mode: {key: recording.median([r[key] for r in rows]) for key in rows[0]}
        for mode, rows in runs.items()
    }
    body = recording.table(
        ["training", "val accuracy (median)", "val_loss", "bytes per step",
         "s per trial (one loop)", "s per trial (packtune worker)"],
        [[mode, s["accuracy"], s["val_loss"], int(s["step_bytes"]), s["seconds"],
          s["packtune_seconds"]] for mode, s in summary.items()],
    )  # fmt: skip
    body += [
        "",
        f"digits-mlp {CONFIG}, Adam, {args.epochs} epochs, {args.seeds} seeds; decoupled: "
        "cut in two, synthetic labels uniform in [0, 1) per class, noise 0.1 on a "
        "segment's synthetic inputs. One loop: both segments in turn in a plain training "
        f"loop; packtune worker: a fused array of one, {torch.get_num_threads()} torch "
        "thread(s).",
    ]
    recording.publish("decoupled_cpu", "i. decoupled training", body, info, load,
                      {"config": CONFIG, "epochs": args.epochs, "runs": runs,
                       "summary": summary}, args)  # fmt: skip


if __name__ == "__main__":
    main()
