"""Spilled stacks: a fused stack larger than its device, trained shard by shard.

Hydra's shard parallelism with spilling, for a stack whose model is an ``nn.Sequential``
(a chain of layers) and whose step is the plain ``loss(model(x), y)``. The stack's
parameters, buffers and optimizer state stay in host memory (page-locked on a GPU); the
chain is cut into shards of consecutive layers (:func:`packtune.spilling.plan_shards`),
each fitting half the device budget so that the next shard's copy can arrive while the
current one computes. One training step:

1. forward, shards in order, without autograd: each shard's input is kept on the device
   (with the random-number state it met and its buffers as they were), its output feeds
   the next; the last shard runs with autograd, and the loss's backward runs through it;
2. backward, the other shards in reverse: each is run again from its kept input with
   autograd (recomputation: cheaper than keeping every activation) and back-propagates
   the gradient of its output, passing its input's gradient to the shard before it;
3. each shard's parameter gradients go to the host as they are ready, and the stacked
   optimizer updates the host parameters once every gradient is there, so that gradient
   clipping sees the whole gradient. The optimizer state never moves.

Shards are copied ahead of need: on a GPU on a side stream (the copy of the next shard
runs while the current one computes: double buffering); on a CPU the "device" is the host
and nothing is copied, which is how the tests run it with a small simulated budget. The
arithmetic is the in-memory step's: the same operations on the same values, so spilled
training equals in-memory training to float rounding (BatchNorm statistics are updated
once, by the first pass; dropout masks are redrawn from the same generator state).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from packtune.spilling import Unspillable, plan_shards
from packtune.workloads.base import Workload
from worker.fused_forward import Forward, bmm_forward, bmm_plan, single_forward, vmap_forward
from worker.fused_group import DeviceLosses, Group, HostLosses, Stack, backward, full
from worker.module_state import kept_python_state
from worker.optim import StackedOptimizer
from worker.rng import GLOBAL_RNG
from worker.ties import aliases, reused_modules


def chain_of(template: nn.Module) -> list[tuple[str, nn.Module]] | None:
    """The layers of a model that is a plain ``nn.Sequential`` (not a subclass, whose
    ``forward`` may do more than call them in turn) of distinct layers holding no tensor
    under two names (:mod:`worker.ties`: a shard or segment would not have all of a tied
    tensor's places); None for any other model."""
    if type(template) is not nn.Sequential or reused_modules(template) or aliases(template):
        return None
    return list(template.named_children())


def spill_problem(workload: Workload, template: nn.Module) -> str | None:
    """Why a stack of ``template`` cannot be spilled, in one sentence; None when it can."""
    if workload.custom_step:
        return f"{workload.name} defines its own training_loss(), which sees the whole model"
    if chain_of(template) is None:
        return f"{workload.name}'s model is a {type(template).__name__}, not an nn.Sequential chain"
    return None


def stack_forward(sub: nn.Sequential, mode: str, stacked: bool) -> Forward:
    """The forward of a stack over the layers ``sub`` (a part of its template) in ``mode``:
    from the shared batch, or with ``stacked`` from the members' own inputs."""
    if mode == "bmm":
        plan = bmm_plan(sub, convs=True)
        if plan is not None:
            return bmm_forward(plan, stacked=stacked)
        mode = "vmap"
    if mode == "vmap":
        return vmap_forward(sub, stacked=stacked)
    return single_forward(sub, stacked=stacked)


@dataclass
class Shard:
    """Layers ``layers`` of the chain: their parameter and buffer names, and the forwards
    of the stack over them: from the members' own inputs ``[k, B, ...]`` (``stacked``), and
    for the first shard from the batch every member shares (``shared``)."""

    layers: range
    params: list[str]
    buffers: list[str]
    stacked: Forward
    shared: Forward | None

    def forward(self, from_shared: bool) -> Forward:
        return self.shared if from_shared and self.shared is not None else self.stacked


def _costs(chain: list[tuple[str, nn.Module]], x: Tensor, k: int) -> tuple[list[int], list[int]]:
    """Each layer's device bytes for a stack of ``k`` (weights and their gradients, and its
    output twice: what it hands on and what autograd keeps), and each layer's output bytes;
    shapes from a pass on the meta device (``chain`` is the meta template's)."""
    costs, outputs = [], []
    h = torch.empty(x.shape, dtype=x.dtype, device="meta")
    # under the lock on torch's global generator: a layer that draws on the meta device
    # draws nothing, but fork_rng restores the generator's state on the way out, which must
    # not land in the middle of another array's seeded build in another thread
    layers = [layer for _, layer in chain]
    with GLOBAL_RNG, torch.no_grad(), torch.random.fork_rng(devices=[]), kept_python_state(*layers):
        for _, layer in chain:
            h = layer(h)
            weights = sum(p.numel() * p.element_size() for p in layer.parameters())
            out = h.numel() * h.element_size() * k
            costs.append(2 * weights * k + 2 * out)
            outputs.append(out)
    return costs, outputs


class SpilledGroup(Group):
    """A :class:`~worker.fused_group.Group` whose tensors live on the host and whose steps
    and evaluations move its shards through ``device``, ``budget`` bytes of it at most."""

    def __init__(
        self,
        keys: list[Hashable],
        params: dict[str, Tensor],
        buffers: dict[str, Tensor],
        optimizer: StackedOptimizer,
        stack: Stack,
        precision: str,
        device: torch.device,
        budget: int,
        prefetch: bool = True,
    ) -> None:
        super().__init__(keys, params, buffers, optimizer, stack, precision)
        #: copy the next shard in while the current one computes (False: the stack
        #: alternates with another on its device, one shard in its share at a time; or a
        #: layer is too large for half the budget)
        self.prefetch = prefetch
        self.alternating = not prefetch
        chain = chain_of(stack.template)
        if chain is None:
            raise Unspillable(f"a {type(stack.template).__name__} is not a chain of layers")
        self.chain, self.budget = chain, budget
        self.device, self.on_host = device, device.type == "cpu"
        self.losses = HostLosses(len(keys)) if self.on_host else DeviceLosses(len(keys), device)
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.shards: list[Shard] = []

    # -- the plan ----------------------------------------------------------------------

    def _plan(self, x: Tensor) -> list[Shard]:
        """Cut the chain for inputs shaped like ``x`` (once: the batch shape is fixed)."""
        if self.shards:
            return self.shards
        k = len(self.keys)
        sample = x[0] if self.stack.stacked else x
        costs, outputs = _costs(self.chain, sample, k)
        # cut only before a layer with parameters: a shard's forward takes the members'
        # count from its parameters (and a lone activation is not worth a transfer)
        starts = [0] + [
            i for i, (_, layer) in enumerate(self.chain)
            if i > 0 and any(True for _ in layer.parameters())
        ]  # fmt: skip
        blocks = [range(a, b) for a, b in zip(starts, [*starts[1:], len(self.chain)],
                                              strict=True)]  # fmt: skip
        block_costs = [sum(costs[i] for i in block) for block in blocks]
        kinds = [type(layer).__name__ for _, layer in self.chain]
        names = [
            f"layers {b.start}-{b.stop - 1} ({', '.join(kinds[i] for i in b)})"
            if len(b) > 1 else f"layer {b.start} ({kinds[b.start]})"
            for b in blocks
        ]  # fmt: skip
        batch = sample.numel() * sample.element_size() * k

        def cut(buffers: int) -> list[range]:
            # the activations kept at the shards' boundaries depend on the cuts: reserve
            # what the cuts keep, and cut again, until the reserve covers them (it only
            # grows, through values of a finite set: this ends, in a plan or Unspillable)
            reserved = batch
            while True:
                cuts = [
                    range(blocks[r.start].start, blocks[r.stop - 1].stop)
                    for r in plan_shards(block_costs, self.budget, reserved, names, buffers)
                ]
                need = batch + sum(outputs[r.start - 1] for r in cuts[1:])
                if need <= reserved:
                    return cuts
                reserved = need

        try:
            cuts = cut(2 if self.prefetch else 1)
        except Unspillable:
            if not self.prefetch:
                raise
            # a layer fits the budget but not half of it: one shard at a time, without
            # copying the next one in during the compute (slower, not failed)
            cuts, self.prefetch = cut(1), False
        for j, layers in enumerate(cuts):
            named = [self.chain[i] for i in layers]
            sub = nn.Sequential(OrderedDict(named))  # the template's own layers and names
            own = {f"{name}.{n}" for name, layer in named for n, _ in layer.named_parameters()}
            bufs = {f"{name}.{n}" for name, layer in named for n, _ in layer.named_buffers()}
            self.shards.append(Shard(
                layers, [n for n in self.params if n in own],
                [n for n in self.buffers if n in bufs], stack_forward(sub, self.mode, True),
                stack_forward(sub, self.mode, False) if j == 0 else None,
            ))  # fmt: skip
        return self.shards

    @property
    def shard_count(self) -> int:
        return len(self.shards)

    # -- moving shards ---------------------------------------------------------------------

    def _fetch(self, shard: Shard) -> tuple[dict[str, Tensor], dict[str, Tensor], Any]:
        """Start copying ``shard``'s tensors to the device (on the side stream on a GPU)."""
        if self.side is None:
            return (
                {n: self.params[n] for n in shard.params},
                {n: self.buffers[n] for n in shard.buffers},
                None,
            )
        with torch.cuda.stream(self.side):
            params = {n: self.params[n].detach().to(self.device, non_blocking=True)
                      for n in shard.params}  # fmt: skip
            buffers = {n: self.buffers[n].to(self.device, non_blocking=True)
                       for n in shard.buffers}  # fmt: skip
            event = torch.cuda.Event()
            event.record(self.side)
        return params, buffers, event

    def _arrived(
        self, fetched: tuple[dict[str, Tensor], dict[str, Tensor], Any]
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """The fetched tensors, once their copy is done (the compute stream waits for it)."""
        params, buffers, event = fetched
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for t in (*params.values(), *buffers.values()):
                t.record_stream(current)  # allocated on the side stream, used on this one
        return params, buffers

    def _walk(self, order: list[int]) -> Iterator[tuple[dict[str, Tensor], dict[str, Tensor]]]:
        """The tensors of the shards ``order`` names, on the device, one after another; with
        ``prefetch`` the next shard's copy starts before the current one is handed out
        (double buffering), else only once it is asked for (the device's other share is
        another stack's, alternating)."""
        ahead = self._fetch(self.shards[order[0]]) if order else None
        for n in range(len(order)):
            fetched = ahead if ahead is not None else self._fetch(self.shards[order[n]])
            ahead = None
            if self.prefetch and n + 1 < len(order):
                ahead = self._fetch(self.shards[order[n + 1]])
            yield self._arrived(fetched)

    def _return_buffers(self, shard: Shard, buffers: dict[str, Tensor]) -> None:
        if self.side is not None:
            for n in shard.buffers:
                self.buffers[n].copy_(buffers[n])

    def _rng_state(self) -> tuple[Tensor, Tensor | None]:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.get_rng_state(), cuda

    def _set_rng_state(self, state: tuple[Tensor, Tensor | None]) -> None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], self.device)

    # -- training and evaluation -------------------------------------------------------

    def step(self, batch: Any, workload: Workload, number: int) -> None:
        """Optimizer step ``number`` on ``batch``, shard by shard (see the module docstring)."""
        x, y = batch
        shards = self._plan(x)
        last, shared = len(shards) - 1, not self.stack.stacked
        kept: list[tuple[Tensor, dict[str, Tensor], tuple[Tensor, Tensor | None] | None]] = []
        # forward 0..last, then the backward's recompute last-1..0. Only a stochastic stack
        # (trained under GLOBAL_RNG) saves and restores torch's global generator for the
        # recompute: another stack's restore, unlocked, would rewind the generator under an
        # array being built in another thread (its members' initial weights then drawn from
        # the wrong point of the stream; seen as a spilled array in one thread and a fresh one
        # in another ending 0.1% apart from their runs alone)
        walk = self._walk([*range(last + 1), *range(last - 1, -1, -1)])
        h = x
        for j, shard in enumerate(shards[:last]):
            params, buffers = next(walk)
            rng = self._rng_state() if self.stochastic else None
            kept.append((h, {n: b.clone() for n, b in buffers.items()}, rng))
            with torch.no_grad(), self.autocast():
                h = shard.forward(j == 0 and shared)(params, buffers, h)
            self._return_buffers(shard, buffers)
            del params, buffers  # before the next shard's copy: two on the device at most
        params, buffers = next(walk)
        h = h.detach().requires_grad_(last > 0)
        leaves = {n: p.detach().requires_grad_(p.requires_grad) for n, p in params.items()}
        with self.autocast():
            out = shards[last].forward(last == 0 and shared)(leaves, buffers, h)
        self._return_buffers(shards[last], buffers)
        after = self._rng_state() if self.stochastic else None
        losses = self._losses(full(out), y, workload, self.stack.stacked)
        backward(losses, workload.name)
        self._gradients_home(leaves)
        grad = h.grad
        del params, buffers, leaves, out
        for j in range(last - 1, -1, -1):
            params, _ = next(walk)
            inputs, scratch, rng = kept[j]
            if rng is not None:
                self._set_rng_state(rng)
            h = inputs.detach().requires_grad_(j > 0)
            leaves = {n: p.detach().requires_grad_(p.requires_grad) for n, p in params.items()}
            with self.autocast():
                # scratch buffers: the statistics are updated once, by the first pass
                out = shards[j].forward(j == 0 and shared)(leaves, scratch, h)
            out.backward(grad)
            self._gradients_home(leaves)
            grad = h.grad
            del params, leaves, out
        if after is not None:
            self._set_rng_state(after)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.losses.record(losses.detach(), number)
        self.proven = True

    def _gradients_home(self, leaves: dict[str, Tensor]) -> None:
        """Give the host parameters the gradients their device copies received."""
        for n, leaf in leaves.items():
            if leaf.grad is not None:
                self.params[n].grad = leaf.grad.to(self.params[n].device)

    def outputs(self, x: Tensor) -> Tensor:
        """The members' outputs ``[k, B, ...]`` on a shared input, shard by shard."""
        shards = self._plan(x)
        h = x
        with torch.no_grad():
            for j, (params, buffers) in enumerate(self._walk(list(range(len(shards))))):
                with self.autocast():
                    h = shards[j].forward(j == 0)(params, buffers, h)
                del params, buffers
        return full(h)
