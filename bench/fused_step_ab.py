"""A/B of one fused step against k plain steps, interleaved in one process.

``fused_throughput`` times whole variants one after another, so on a shared
machine a burst of other work lands on one variant and not the other. Here
one fused array of k and k plain runs (``torch.optim``, the same workload
code) are built once, then timed in short alternating blocks: each pair is
a fused block of ``--steps`` steps and the k plain runs' ``--steps`` steps
each, back to back. Reported: the per-pair ratio (plain time / fused time,
i.e. fused trial-steps/s over serial trial-steps/s) and its median.

    python -m bench.fused_step_ab --workload synthetic-mlp --k 8 --pairs 15
    python -m bench.fused_step_ab --workload digits-mlp --config dropout=0.2  # stochastic

It prints its figures; with ``--out-dir DIR`` it also writes them to
``DIR/fused_step_ab_<workload>_k<k>.json`` (``bench/ab.sh`` passes ``--out-dir`` and
``--no-append``; this benchmark appends nothing to HISTORY.md either way).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench import recording
from bench._plain import PlainRun, cycle
from bench.fused_throughput import CONFIGS, member_config
from packtune.workloads import get_workload
from worker.fused import FusedArray

#: CPU time of this thread (torch runs one thread here): another process's burst on the
#: shared cores adds wall time but little of it; ``--clock wall`` for wall time.
CLOCK = time.thread_time


def config_values(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs as workload config values (VALUE read as JSON where it is JSON:
    ``dropout=0.2`` is a float, ``activation=tanh`` a string)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--config {pair}: not KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def measure(
    name: str, k: int, steps: int, pairs: int, config: dict[str, Any] | None = None
) -> list[tuple[float, float]]:
    """``pairs`` (fused seconds per step, plain seconds per trial-step) samples."""
    base: dict[str, Any] = {**CONFIGS.get(name, {}).get("cpu", {}), **(config or {})}
    workload = get_workload(name)
    array = FusedArray(workload, [(j, member_config(base, j, k)) for j in range(k)])
    batches = list(workload.batch_indices(array.config, 0))
    runs = [PlainRun.build(name, member_config(base, j, k), torch.device("cpu")) for j in range(k)]
    sources = [cycle(run.batches(0)) for run in runs]
    position = 0

    def fused_block() -> float:
        nonlocal position
        start = CLOCK()
        for _ in range(steps):
            array.train_step(batches[position % len(batches)])
            position += 1
        return (CLOCK() - start) / steps

    def plain_block() -> float:
        start = CLOCK()
        for run, source in zip(runs, sources, strict=True):
            for _ in range(steps):
                run.step(next(source))
        return (CLOCK() - start) / (steps * k)

    fused_block(), plain_block()  # warm-up
    samples = []
    for i in range(pairs):
        if i % 2:
            plain, fused = plain_block(), fused_block()
        else:
            fused, plain = fused_block(), plain_block()
        samples.append((fused, plain))
    return samples


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="synthetic-mlp")
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20, help="steps per block")
    parser.add_argument("--pairs", type=int, default=15)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: cores - 1, as workers)"
    )
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a workload config value of every member (e.g. dropout=0.2); repeatable",
    )
    parser.add_argument("--out-dir", type=Path, default=None, help="write the figures here")
    parser.add_argument("--no-append", action="store_true", help="(it never appends)")
    args = parser.parse_args(argv)
    global CLOCK
    CLOCK = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 2) - 1))
    config = config_values(args.config)
    samples = measure(args.workload, args.k, args.steps, args.pairs, config)
    ratios = [k * plain / fused for fused, plain in samples for k in [args.k]]
    fused_ms = statistics.median(f for f, _ in samples) * 1e3
    plain_ms = statistics.median(p for _, p in samples) * 1e3
    print(
        f"{args.workload}{''.join(f' {key}={value}' for key, value in config.items())} "
        f"k={args.k}: fused step {fused_ms:.3f} ms, plain step "
        f"{plain_ms:.3f} ms; fused/serial median {statistics.median(ratios):.2f}x "
        f"(per pair {min(ratios):.2f}-{max(ratios):.2f}x: "
        + " ".join(f"{r:.2f}" for r in ratios)
        + ")"
    )
    if args.out_dir is not None:
        recording.save_json(f"fused_step_ab_{args.workload}_k{args.k}", {
            "machine": recording.machine("cpu"), "date": recording.now(),
            "command": recording.command_line(), "workload": args.workload, "k": args.k,
            "config": config, "threads": torch.get_num_threads(), "clock": args.clock,
            "fused_ms": fused_ms, "plain_ms": plain_ms, "ratios": ratios,
        }, args.out_dir)  # fmt: skip


if __name__ == "__main__":
    main()
