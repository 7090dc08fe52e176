"""Each member's own dropout masks in a model of the user's own (not a hand-fusable
``nn.Sequential``) whose only draws are its ``nn.Dropout`` modules'.

Under ``vmap`` every member's dropout would draw from torch's one generator, so a member's
masks would depend on its stack; such models trained one member per stack. Here the
template's ``nn.Dropout`` modules take their masks from the stack instead
(:func:`enable`): a stack of one draws each mask from its member's own generator
(:class:`~worker.fused_forward.MemberStreams`, seeded before each step) as its forward
reaches the module; a ``vmap`` stack draws them all before the forward, each member's from
its own generator, in the order and shapes one member's forward calls its modules (read once
per input shape by a forward of member 0 that changes nothing), and hands each member its
own. So a member draws the same masks in any stack, of any size. A forward that calls its
modules otherwise than that reading (a call a Python counter decides) raises
:class:`MaskMismatch`: the array learns that the model draws, and its pack trains again,
one member per stack (``FusedArray._masks_mismatched``).
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from worker.fused_forward import Forward, MemberStreams, member, member_mask
from worker.module_state import kept_python_state

#: one dropout call of a member's forward: its input's shape and dtype, and ``p``
Call = tuple[tuple[int, ...], torch.dtype, float]


class MaskMismatch(RuntimeError):
    """A forward called its dropout modules otherwise than its shape reading said."""


@dataclass
class _Run:
    """The masks of the forward running in a thread: drawn as it goes from ``generator``,
    handed out from ``masks``, or (neither) the calls recorded in ``calls``."""

    generator: torch.Generator | None = None
    masks: list[Tensor] | None = None
    calls: list[Call] = field(default_factory=list)
    at: int = 0


class _Current(threading.local):
    run: _Run | None = None


_CURRENT = _Current()


def _dropout(self: nn.Dropout, x: Tensor) -> Tensor:
    """``nn.Dropout.forward`` with the running stack's mask (:data:`_CURRENT`)."""
    if not self.training or self.p == 0:
        return x
    run = _CURRENT.run
    if run is None:
        raise RuntimeError("a Dropout of a stack's template ran outside the stack's forward")
    keep = 1.0 - float(self.p)
    if run.generator is not None:
        mask = member_mask(x.shape, x.dtype, x.device, keep, run.generator)
    elif run.masks is not None:
        if run.at >= len(run.masks) or run.masks[run.at].shape != x.shape:
            raise MaskMismatch(
                f"dropout call {run.at + 1} of the forward (input {tuple(x.shape)}) is not "
                "what a forward of this input shape called before"
            )
        mask, run.at = run.masks[run.at], run.at + 1
    else:
        run.calls.append((tuple(x.shape), x.dtype, float(self.p)))
        return x
    return x * 0.0 if keep <= 0.0 else x * mask / keep


def enable(template: nn.Module) -> None:
    """Give ``template``'s ``nn.Dropout`` modules the stack's masks (copies of the template
    keep them: a deep copy binds the method to the copy)."""
    for module in template.modules():
        if type(module) is nn.Dropout:
            module.forward = types.MethodType(_dropout, module)  # type: ignore[method-assign]


def _running(run: _Run, call: Callable[[], Tensor]) -> Tensor:
    outer, _CURRENT.run = _CURRENT.run, run
    try:
        return call()
    finally:
        _CURRENT.run = outer


def single_forward(template: nn.Module, streams: MemberStreams, stacked: bool = False) -> Forward:
    """One member's plain call (a stack of one), its masks drawn from its generator."""

    def forward(params: dict[str, Tensor], buffers: dict[str, Tensor], x: Tensor) -> Tensor:
        own = member(params, buffers)
        run = _Run(generator=streams.generators[0] if template.training else None)
        out = _running(run, lambda: functional_call(template, own, (x[0] if stacked else x,)))
        return out.unsqueeze(0)

    return forward


@dataclass
class _Calls:
    """The dropout calls of one member's forward, per input shape."""

    by_shape: dict[tuple[Any, ...], list[Call]] = field(default_factory=dict)

    def of(self, template: nn.Module, params: dict[str, Tensor], buffers: dict[str, Tensor],
           x: Tensor) -> list[Call]:  # fmt: skip
        key = (tuple(x.shape), x.dtype, x.device)
        if key not in self.by_shape:
            run = _Run()
            # member 0's forward, changing nothing: its buffers copied (running statistics),
            # its modules' Python state kept (a step counter), no gradients
            own = ({n: p[0].detach() for n, p in params.items()},
                   {n: b[0].clone() for n, b in buffers.items()})  # fmt: skip
            with torch.no_grad(), kept_python_state(template):
                _running(run, lambda: functional_call(template, own, (x,)))
            self.by_shape[key] = run.calls
        return self.by_shape[key]


def vmap_forward(template: nn.Module, streams: MemberStreams, stacked: bool = False) -> Forward:
    """``vmap`` of ``functional_call`` over the members, each handed its own masks."""

    def one(params: dict[str, Tensor], buffers: dict[str, Tensor], x: Tensor,
            masks: tuple[Tensor, ...]) -> Tensor:  # fmt: skip
        run = _Run(masks=list(masks))
        out = _running(run, lambda: functional_call(template, (params, buffers), (x,)))
        if run.at != len(masks):
            raise MaskMismatch(
                f"the forward called {run.at} dropout modules where a forward of this input "
                f"shape called {len(masks)}"
            )
        return out

    dims = (0, 0, 0 if stacked else None, 0)
    batched = vmap(one, in_dims=dims, randomness="different")
    calls = _Calls()

    def forward(params: dict[str, Tensor], buffers: dict[str, Tensor], x: Tensor) -> Tensor:
        k = next(iter(params.values())).shape[0]
        if not template.training:  # no masks: each module returns its input
            return batched(params, buffers, x, ())  # type: ignore[no-any-return]
        first = x[0] if stacked else x
        device = first.device
        masks = tuple(
            torch.stack([
                member_mask(shape, dtype, device, 1.0 - p, g) for g in streams.generators[:k]
            ])
            for shape, dtype, p in calls.of(template, params, buffers, first)
        )  # fmt: skip
        return batched(params, buffers, x, masks)  # type: ignore[no-any-return]

    return forward
