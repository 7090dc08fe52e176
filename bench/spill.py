"""h. Spilled training: a model about twice the device budget, against the same in memory.

One synthetic-mlp trial (a wide MLP) is trained in memory and spilled, alternating, the
spilled one with a budget of half its probed memory (so it needs several shards); the
figure is spilled over in-memory trial-steps/s (medians over ``--repeats``). On a GPU it
also measures the host-to-device bandwidth of a page-locked copy and states the bound it
sets: a spilled step moves the weights down twice (forward, and the backward's recompute)
and the gradients up, so it cannot beat ``3 * weight bytes / bandwidth`` per step. On a
CPU nothing is copied (the device is the host): the figure is the cost of the recompute
and of the shard-by-shard walk alone.

With ``--alternate``, also two such trials (different seeds) one after another, each with
the budget, against the two alternating (in two threads, each in half the budget, one
shard at a time), as the worker runs a pack of two spilled arrays. A GPU figure: on a CPU
the two threads also split the cores, which says nothing about alternation.

    python -m bench.spill                 # this CPU
    python -m bench.spill --device cuda   # a GPU
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from bench import recording

#: its HISTORY.md section's title (the machine line names the device)
SECTION = "h. spilled training"
CONFIG: dict[str, Any] = {
    "input_dim": 256, "hidden": 1024, "layers": 8, "output_dim": 10, "n_train": 4096,
    "n_val": 512, "batch_size": 128, "optimizer": "adam", "lr": 1e-3, "seed": 1, "data_seed": 1,
}  # fmt: skip
QUICK = {**CONFIG, "input_dim": 16, "hidden": 64, "layers": 4, "n_train": 128, "n_val": 32,
         "batch_size": 16}  # fmt: skip


def _steps_per_second(config: dict[str, Any], device: str, budget: int | None,
                      steps: int) -> tuple[float, int]:  # fmt: skip
    """Trial-steps/s of one trial trained ``steps`` steps after one warm-up step; and the
    shards it used (0 in memory)."""
    import torch

    from packtune.workloads import get_workload
    from worker.fused import FusedArray, train
    from worker.spill import SpilledGroup

    workload = get_workload("synthetic-mlp")
    array = FusedArray(workload, [(0, config)], device=device, spill_budget=budget)
    train(array, 1)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    started = time.perf_counter()
    train(array, 1 + steps)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    shards = sum(g.shard_count for g in array.groups if isinstance(g, SpilledGroup))
    return steps / seconds, shards


def _alternation(config: dict[str, Any], device: str, budget: int, steps: int) -> dict[str, float]:
    """Seconds for two spilled trials of ``steps`` steps: one after another, and alternating."""
    import threading

    import torch

    from packtune.workloads import get_workload
    from worker.fused import FusedArray, train

    workload = get_workload("synthetic-mlp")
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def arrays(share: int) -> list[FusedArray]:
        built = [
            FusedArray(workload, [(0, {**config, "seed": seed})], device=device,
                       spill_budget=budget // share, spill_prefetch=share == 1)
            for seed in (1, 2)
        ]  # fmt: skip
        for array in built:
            train(array, 1)  # warm-up and shard plan
        sync()
        return built

    one, two = arrays(1), arrays(2)
    started = time.perf_counter()
    for array in one:
        train(array, 1 + steps)
    sync()
    sequential = time.perf_counter() - started
    started = time.perf_counter()
    threads = [threading.Thread(target=train, args=(a, 1 + steps)) for a in two]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    sync()
    return {"sequential_s": sequential, "alternating_s": time.perf_counter() - started}


def _bandwidth(device: str, size: int = 256 * 2**20) -> float | None:
    """Bytes/s of a page-locked host-to-device copy (None on a CPU)."""
    if not device.startswith("cuda"):
        return None
    import torch

    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(size, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return size / best


def measure(
    config: dict[str, Any],
    device: str,
    repeats: int,
    steps: int,
    fraction: float = 0.5,
    alternate: bool = False,
) -> dict[str, Any]:
    import torch

    from packtune.workloads import get_workload
    from worker.memory import probe

    workload = get_workload("synthetic-mlp")
    estimate = probe(workload, config, torch.device(device), ks=(1, 2), steps=1).bytes_for(1)
    budget = int(estimate * fraction)
    runs: dict[str, list[float]] = {"memory": [], "spilled": []}
    shards = 0
    for _ in range(repeats):  # alternating, so that drift in the machine hits both
        runs["memory"].append(_steps_per_second(config, device, None, steps)[0])
        value, shards = _steps_per_second(config, device, budget, steps)
        runs["spilled"].append(value)
    model = workload.build_model(workload.resolve(config))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = _bandwidth(device)
    memory, spilled = recording.median(runs["memory"]), recording.median(runs["spilled"])
    alternation = None
    if alternate:
        timed = [_alternation(config, device, budget, steps) for _ in range(repeats)]
        alternation = {
            key: recording.median([t[key] for t in timed])
            for key in ("sequential_s", "alternating_s")
        }
    return {
        "config": config,
        "estimated_bytes": estimate,
        "budget_bytes": budget,
        "weight_bytes": weights,
        "shards": shards,
        "steps": steps,
        "runs": runs,
        "memory_steps_per_s": memory,
        "spilled_steps_per_s": spilled,
        "fraction": spilled / memory,
        "bandwidth_bytes_per_s": bandwidth,
        "bound_steps_per_s": bandwidth / (3 * weights) if bandwidth else None,
        "alternation": alternation,
    }


def report(result: dict[str, Any]) -> list[str]:
    lines = recording.table(
        ["estimated bytes", "budget", "shards", "in memory steps/s", "spilled steps/s",
         "spilled / in memory"],
        [[result["estimated_bytes"], result["budget_bytes"], result["shards"],
          result["memory_steps_per_s"], result["spilled_steps_per_s"],
          f"{result['fraction']:.2f}x"]],
    )  # fmt: skip
    if result["bandwidth_bytes_per_s"]:
        lines += [
            "",
            f"Host-to-device bandwidth (page-locked): {result['bandwidth_bytes_per_s'] / 1e9:.1f}"
            f" GB/s; a spilled step moves 3 x {result['weight_bytes'] / 1e6:.1f} MB of weights "
            f"and gradients: at most {result['bound_steps_per_s']:.1f} steps/s.",
        ]
    if result.get("alternation"):
        a = result["alternation"]
        lines += [
            "",
            f"Two spilled trials, {result['steps']} steps each: one after another "
            f"{a['sequential_s']:.2f} s, alternating {a['alternating_s']:.2f} s "
            f"({a['sequential_s'] / a['alternating_s']:.2f}x).",
        ]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run")
    parser.add_argument("--budget", type=float, default=0.5,
                        help="the spilled run's device budget, a fraction of the trial's "
                        "estimated memory")  # fmt: skip
    parser.add_argument(
        "--alternate", action="store_true",
        help="also two spilled trials alternating vs one after another (a GPU figure)",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="tiny sizes; appends nothing")
    parser.add_argument("--out-dir", type=Path, default=None, help="JSON here")
    parser.add_argument("--no-append", action="store_true", help="leave HISTORY.md alone")
    args = parser.parse_args(argv)
    config = QUICK if args.quick else CONFIG
    if args.quick:  # the tiny model's data set is most of its memory
        args.repeats, args.steps, args.budget = 1, 2, 1.0
    load = recording.load_average()
    info = recording.machine(args.device)
    result = measure(config, args.device, args.repeats, args.steps, args.budget, args.alternate)
    body = report(result)
    kind = recording.device_kind(info)
    recording.publish(f"spill_{kind}", SECTION, body, info, load,
                      {"result": result}, args)  # fmt: skip


if __name__ == "__main__":
    main()
