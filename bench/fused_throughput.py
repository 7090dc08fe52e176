"""Benchmark a: trial-steps per second of k trials sharing one device, three ways.

- ``fused``: packtune's fused array (``FusedArray``, mode ``auto``: hand-fused
  ``baddbmm`` for MLPs, ``vmap`` for CNNs) — what a packed job runs;
- ``serial``: k plain runs (``torch.optim``) one after another — what one
  trial per job, or Optuna in one process, gives;
- ``concurrent``: k plain runs in k processes at once on the same device —
  what Ray Tune's fractional GPUs (``num_gpus=1/k``) give;
- ``hand-fused`` (asked for by ``--variants``): the fused array in mode ``bmm``, which for
  a CNN (an ``nn.Sequential``) runs HFTA's fused convolutions (k members' Conv2d as one
  grouped convolution, BatchNorm2d over k*C channels) instead of vmap's rule; n/a for a
  model that is not such a chain;
- ``compiled`` (asked for by ``--variants``): the fused array with its training step compiled
  (``PACKTUNE_COMPILE_STEP=on``: ``torch.compile``, CUDA graphs on a GPU); its compilation
  happens in the warm-up steps (one per batch shape), outside the timing, and is printed.

Every variant trains the same models on the same batches, timing only the
optimizer steps (after one warm-up step). The variants are interleaved
(rotated per repeat) and the median of the repeats is reported.

    python -m bench.fused_throughput                 # this CPU, all three workloads
    python -m bench.fused_throughput --device cuda   # a GPU
    python -m bench.fused_throughput --quick         # seconds: a smoke run, writes nothing
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from bench import recording
from bench._plain import PlainRun, serve, sync, timed_steps
from packtune.workloads import get_workload
from worker.fused import FusedArray
from worker.jobs import allow_tf32

VARIANTS = ("fused", "serial", "concurrent")
#: variants run only when asked for
EXTRA_VARIANTS = ("hand-fused", "compiled")

#: workload -> structural config used for the benchmark, per device type
CONFIGS: dict[str, dict[str, dict[str, Any]]] = {
    "synthetic-mlp": {"cpu": {}, "cuda": {}},
    "digits-mlp": {"cpu": {}, "cuda": {}},
    "digits-cnn": {"cpu": {"channels": 16}, "cuda": {"channels": 16}},
    "resnet-cifar": {
        "cpu": {"width": 16, "blocks": 1, "n_train": 1024, "n_val": 256, "batch_size": 32},
        "cuda": {"width": 16, "blocks": 1, "n_train": 5000, "n_val": 1000},
    },
}
QUICK_CONFIGS: dict[str, dict[str, Any]] = {
    "synthetic-mlp": {"n_train": 512, "n_val": 64},
    "digits-mlp": {},
    "digits-cnn": {"channels": 4},
    "resnet-cifar": {"width": 4, "blocks": 1, "n_train": 128, "n_val": 32, "batch_size": 32},
}


def member_config(base: dict[str, Any], j: int, k: int) -> dict[str, Any]:
    """Member j of k: its own seed and learning rate (fusible), the shared structure."""
    return {**base, "lr": 0.01 * (1 + j / k), "momentum": 0.9, "seed": 1000 + j, "data_seed": 0}


def fused_seconds(
    name: str,
    base: dict[str, Any],
    k: int,
    steps: int,
    device: torch.device,
    mode: str = "auto",
    compile_step: bool = False,
) -> float:
    workload = get_workload(name)
    members = [(j, member_config(base, j, k)) for j in range(k)]
    array = FusedArray(workload, members, device=device, mode=mode,  # type: ignore[arg-type]
                       compile_step=compile_step)  # fmt: skip
    batches = [b.to(device) for b in workload.batch_indices(array.config, 0)]
    warm = time.perf_counter()
    for batch in {len(b): b for b in (batches[0], batches[-1])}.values():  # each batch shape
        array.train_step(batch)
    sync(device)
    if compile_step:
        print(f"  {name} k={k}: compiled in {time.perf_counter() - warm:.1f} s", flush=True)
    start = time.perf_counter()
    for s in range(steps):
        array.train_step(batches[(s + 1) % len(batches)])
    sync(device)
    return time.perf_counter() - start


def hand_fusable(name: str, base: dict[str, Any]) -> bool:
    """The workload's model is a chain the ``bmm`` mode fuses by hand, convolutions too."""
    from worker.fused_forward import bmm_plan

    workload = get_workload(name)
    return bmm_plan(workload.build_model(member_config(base, 0, 1)), convs=True) is not None


def serial_seconds(
    name: str, base: dict[str, Any], k: int, steps: int, device: torch.device
) -> float:
    total = 0.0
    for j in range(k):
        run = PlainRun.build(name, member_config(base, j, k), device)
        total += timed_steps(run, steps)
        del run
    return total


class Pool:
    """Long-lived processes for the concurrent variant (started once: start-up not timed)."""

    def __init__(self, size: int, threads: int, tf32: bool | None = None) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs = []
        for _ in range(size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=serve, args=(child, threads, tf32), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def seconds(self, name: str, base: dict[str, Any], k: int, steps: int, device: str) -> float:
        """Wall time from "go" to the last process done (all k built and warmed up first)."""
        conns = self.conns[:k]
        for j, conn in enumerate(conns):
            conn.send(("run", name, member_config(base, j, k), device, steps))
        for conn in conns:
            if conn.recv() != "ready":
                raise RuntimeError("a concurrent process failed to start its run")
        start = time.perf_counter()
        for conn in conns:
            conn.send("go")
        for conn in conns:
            conn.recv()
        return time.perf_counter() - start

    def close(self) -> None:
        for conn in self.conns:
            conn.send("exit")
        for proc in self.procs:
            proc.join(timeout=30)


def calibrate(name: str, base: dict[str, Any], device: torch.device, target: float) -> int:
    """Steps per trial so that one plain trial takes about ``target`` seconds."""
    run = PlainRun.build(name, member_config(base, 0, 1), device)
    per_step = timed_steps(run, 3) / 3
    return max(3, min(300, round(target / max(per_step, 1e-6))))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    kind = device.type
    torch.set_num_threads(args.threads)
    allow_tf32(args.tf32)
    concurrent_ks = [k for k in args.ks if k <= args.max_concurrent]
    pool = None
    if "concurrent" in args.variants and concurrent_ks:
        pool = Pool(max(concurrent_ks), args.threads, args.tf32)
    results: dict[str, Any] = {}
    try:
        for name in args.workloads:
            base = QUICK_CONFIGS[name] if args.quick else CONFIGS[name][kind]
            if args.precision != "fp32":
                base = {**base, "precision": args.precision}
            steps = args.steps or calibrate(name, base, device, args.target)
            load = recording.load_average()
            rows: dict[str, dict[str, list[float]]] = {}
            for ki, k in enumerate(args.ks):
                rows[str(k)] = {v: [] for v in args.variants}
                for rep in range(args.repeats):
                    shift = (rep + ki) % len(args.variants)
                    for variant in args.variants[shift:] + args.variants[:shift]:
                        if variant == "concurrent" and k > args.max_concurrent:
                            continue
                        if variant == "hand-fused" and not hand_fusable(name, base):
                            continue
                        if variant in ("fused", "hand-fused", "compiled"):
                            mode = "bmm" if variant == "hand-fused" else "auto"
                            seconds = fused_seconds(name, base, k, steps, device, mode,
                                                    variant == "compiled")  # fmt: skip
                        elif variant == "serial":
                            seconds = serial_seconds(name, base, k, steps, device)
                        else:
                            assert pool is not None
                            seconds = pool.seconds(name, base, k, steps, str(device))
                        rows[str(k)][variant].append(k * steps / seconds)
                medians = {v: recording.median(x) for v, x in rows[str(k)].items()}
                print(
                    f"{name} k={k}: "
                    + ", ".join(f"{v} {m:.0f}" for v, m in medians.items())
                    + " trial-steps/s",
                    flush=True,
                )
            results[name] = {"config": base, "steps": steps, "load_before": load, "ks": rows}
    finally:
        if pool is not None:
            pool.close()
    return results


def report(results: dict[str, Any], variants: list[str]) -> list[str]:
    header = ["workload", "k", *[f"{v} (trial-steps/s)" for v in variants]]
    ratios = [v for v in ("serial", "concurrent") if v in variants and "fused" in variants]
    header += [f"fused / {v}" for v in ratios]
    against_fused = [v for v in EXTRA_VARIANTS if v in variants and "fused" in variants]
    header += [f"{v} / fused" for v in against_fused]
    rows = []
    for name, data in results.items():
        # saved JSON has its keys sorted as strings ("1", "16", "2", ...): order them by k
        for k, samples in sorted(data["ks"].items(), key=lambda item: int(item[0])):
            m = {v: recording.median(samples[v]) for v in variants}
            rows.append(
                [
                    name,
                    k,
                    *[round(m[v]) if samples[v] else "n/a" for v in variants],
                    *[f"{m['fused'] / m[v]:.2f}x" if samples[v] else "n/a" for v in ratios],
                ]
            )
            for v in against_fused:
                ok = samples[v] and samples["fused"]
                rows[-1].append(f"{m[v] / m['fused']:.2f}x" if ok else "n/a")
    configs = "; ".join(
        f"{n}: {d['config'] or 'defaults'}, {d['steps']} timed steps per trial"
        for n, d in results.items()
    )
    return [*recording.table(header, rows), "", f"Configs: {configs}."]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--workloads", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--ks", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS),
                        choices=VARIANTS + EXTRA_VARIANTS)  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--precision",
        choices=["fp32", "bf16"],
        default="fp32",
        help="every variant's precision (bf16: the forward under autocast)",
    )
    parser.add_argument(
        "--tf32",
        choices=["on", "off"],
        default=None,
        help="TF32 matmuls and convolutions on a GPU (default: torch's)",
    )
    parser.add_argument("--steps", type=int, default=None, help="timed steps per trial")
    parser.add_argument(
        "--target",
        type=float,
        default=None,
        help="seconds one plain trial should train (sets --steps)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per process (default: cores - 1, as workers)",
    )
    parser.add_argument(
        "--max-concurrent",
        type=int,
        default=None,
        help="most processes for the concurrent variant (default: 32 on a GPU, "
        "16 on a CPU, where each process holds ~0.4 GB)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes; appends nothing")
    parser.add_argument(
        "--out-dir", type=Path, default=None, help="JSON here (default bench/results)"
    )
    parser.add_argument("--no-append", action="store_true", help="leave HISTORY.md alone")
    args = parser.parse_args(argv)
    args.threads = args.threads or max(1, (os.cpu_count() or 2) - 1)
    args.tf32 = None if args.tf32 is None else args.tf32 == "on"
    if args.max_concurrent is None:
        args.max_concurrent = 32 if args.device.startswith("cuda") else 16
    if args.target is None:
        args.target = 0.3 if args.device.startswith("cuda") else 0.4
    if args.quick:
        args.ks = [k for k in args.ks if k <= 2] or [1, 2]
        args.repeats, args.steps = 1, args.steps or 2
    load = recording.load_average()
    info = recording.machine(args.device)
    results = measure(args)
    body = report(results, args.variants)
    print("\n".join(body))
    if args.quick and args.out_dir is None:
        return
    kind = recording.device_kind(info)
    if args.workloads != list(CONFIGS):  # a subset: do not overwrite the full run's figures
        kind += "_" + "_".join(args.workloads)
    if args.precision != "fp32" or args.tf32 is not None:  # the same: its own figures
        kind += f"_{args.precision}" + (
            "" if args.tf32 is None else f"_tf32-{'on' if args.tf32 else 'off'}"
        )
    recording.save_json(
        f"fused_throughput_{kind}",
        {
            "machine": info,
            "date": recording.now(),
            "command": recording.command_line(),
            "threads": args.threads,
            "precision": args.precision,
            "tf32": args.tf32,
            "results": results,
        },
        args.out_dir,
    )
    if not (args.quick or args.no_append):
        recording.append_section(
            f"a. Fused throughput — {info['device']}",
            info,
            [
                f"torch threads per process: {args.threads}; precision {args.precision}, TF32 "
                f"{ {None: 'as torch defaults', True: 'on', False: 'off'}[args.tf32] }; medians "
                f"of {args.repeats} repeats, variants interleaved; concurrent processes up to "
                f"k={args.max_concurrent}.",
                "",
                *body,
            ],
            load,
        )


if __name__ == "__main__":
    main()
