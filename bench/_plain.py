"""The baseline a user would write: one model, ``torch.optim``, a plain training loop.

The peers benchmark (Optuna, Ray Tune) trains its trials with these functions,
and the throughput benchmark uses them for its "k serial runs" and "k
concurrent processes" variants. They take packtune's workload objects, so
every variant trains the same models on the same batches; only the way the
trials share the device differs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
from torch import nn

from packtune.workloads import get_workload
from packtune.workloads.base import Split, Workload


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class PlainRun:
    """One trial as a user would train it: its own model, optimizer and data on ``device``."""

    workload: Workload
    config: dict[str, Any]
    model: nn.Module
    optimizer: torch.optim.Optimizer
    train: Split
    val: Split
    device: torch.device

    @classmethod
    def build(cls, name: str, config: Mapping[str, Any], device: torch.device) -> PlainRun:
        workload = get_workload(name)
        cfg = workload.resolve(config)
        torch.manual_seed(int(cfg.get("seed", 0)))
        model = workload.build_model(cfg).to(device).train()
        kind = str(cfg["optimizer"])
        optimizer: torch.optim.Optimizer
        if kind == "sgd":
            optimizer = torch.optim.SGD(
                model.parameters(), lr=float(cfg["lr"]), momentum=float(cfg["momentum"]),
                weight_decay=float(cfg["weight_decay"]), nesterov=bool(cfg["nesterov"]),
            )  # fmt: skip
        else:
            adam = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
            optimizer = adam(
                model.parameters(), lr=float(cfg["lr"]), betas=(cfg["beta1"], cfg["beta2"]),
                eps=float(cfg["eps"]), weight_decay=float(cfg["weight_decay"]),
            )  # fmt: skip
        train, val = workload.data(cfg, device)
        return cls(workload, cfg, model, optimizer, train, val, device)

    def batches(self, epoch: int) -> list[torch.Tensor]:
        return [b.to(self.device) for b in self.workload.batch_indices(self.config, epoch)]

    def step(self, index: torch.Tensor) -> torch.Tensor:
        x, y = self.train.x[index], self.train.y[index]
        if self.config.get("precision") == "bf16":  # as packtune's bf16: the forward only
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                out = self.model(x)
            loss = self.workload.loss(out.float(), y)
        else:
            loss = self.workload.loss(self.model(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def epoch(self, epoch: int) -> None:
        for index in self.batches(epoch):
            self.step(index)

    @torch.no_grad()
    def val_loss(self) -> float:
        self.model.eval()
        try:
            size = int(self.config["batch_size"])
            x = self.val.x
            out = torch.cat([self.model(x[i : i + size]) for i in range(0, x.shape[0], size)])
            return float(self.workload.loss(out, self.val.y))
        finally:
            self.model.train()


def cycle(batches: list[torch.Tensor]) -> Iterator[torch.Tensor]:
    while True:
        yield from batches


def timed_steps(run: PlainRun, steps: int, warmup: int = 1) -> float:
    """Seconds for ``steps`` optimizer steps after ``warmup`` untimed ones."""
    source = cycle(run.batches(0))
    for _ in range(warmup):
        run.step(next(source))
    sync(run.device)
    start = time.perf_counter()
    for _ in range(steps):
        run.step(next(source))
    sync(run.device)
    return time.perf_counter() - start


def serve(conn: Connection, threads: int, tf32: bool | None = None) -> None:
    """A long-lived process of the concurrent variant: build, report ready, wait, train.

    Messages in: ``("run", workload, config, device, steps)`` then ``"go"``;
    ``"exit"`` ends it. Out: ``"ready"``, then ``("done", seconds)``. ``tf32``: as the
    worker's setting (None: torch's defaults).
    """
    from worker.jobs import allow_tf32

    torch.set_num_threads(threads)
    allow_tf32(tf32)
    while True:
        message = conn.recv()
        if message == "exit":
            return
        _, name, config, device_name, steps = message
        device = torch.device(device_name)
        run = PlainRun.build(name, config, device)
        source = cycle(run.batches(0))
        run.step(next(source))  # warm-up: kernels chosen, caches filled
        sync(device)
        conn.send("ready")
        if conn.recv() != "go":
            return
        start = time.perf_counter()
        for _ in range(steps):
            run.step(next(source))
        sync(device)
        conn.send(("done", time.perf_counter() - start))
        del run, source
