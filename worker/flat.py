"""One ``[k, N]`` buffer per dtype for an array's stacked parameters.

With each of an array's P parameters a tensor of its own, every element-wise
op of an optimizer update runs P times, and on a CPU each run costs a few
microseconds of dispatch whatever its size. Laid out in one buffer, the
update is a handful of ops over the whole array.

The layout is member-major: row ``i`` of the ``[k, N]`` buffer holds every
parameter of member ``i``, one after another (parameter ``j`` in columns
``spans[j]``). A parameter is a ``[k, *shape]`` view of its columns, so a
per-member hyperparameter is a ``[k, 1]`` tensor that broadcasts over the
whole buffer, and one member's slice of any parameter stays contiguous.

:func:`flatten_` moves existing leaf tensors into such a buffer by
reassigning their ``.data``: the tensors stay the same objects (still leaves,
still what the forward pass and the caller hold) but now share one storage.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch
from torch import Tensor


class FlatStack:
    """Tensors ``[k, *shape]`` of one dtype and device, as views of one ``[k, N]`` buffer."""

    def __init__(
        self,
        names: list[str],
        shapes: list[torch.Size],
        k: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.names, self.shapes, self.k = names, shapes, k
        self.dtype, self.device = dtype, device
        self.spans: list[slice] = []
        start = 0
        for shape in shapes:
            size = math.prod(shape)
            self.spans.append(slice(start, start + size))
            start += size
        self.width = start

    def empty(self, pin: bool = False) -> Tensor:
        """An uninitialised ``[k, N]`` buffer; ``pin``: in page-locked host memory (what an
        asynchronous copy to a GPU reads from)."""
        return torch.empty(self.k, self.width, dtype=self.dtype, device=self.device,
                           pin_memory=pin)  # fmt: skip

    def zeros(self) -> Tensor:
        return torch.zeros(self.k, self.width, dtype=self.dtype, device=self.device)

    def view(self, buffer: Tensor, j: int) -> Tensor:
        """Tensor ``j`` as a ``[k, *shape]`` view of ``buffer``'s columns."""
        return buffer[:, self.spans[j]].view(buffer.shape[0], *self.shapes[j])

    def views(self, buffer: Tensor) -> dict[str, Tensor]:
        return {name: self.view(buffer, j) for j, name in enumerate(self.names)}

    def pack(self, tensors: Iterable[Tensor], out: Tensor) -> Tensor:
        """Copy ``tensors`` (``[k, *shape]`` each, in order) into ``out`` with one ``cat``."""
        return torch.cat([t.reshape(self.k, -1) for t in tensors], dim=1, out=out)


def flatten_(params: Mapping[str, Tensor], pin: bool = False) -> list[tuple[FlatStack, Tensor]]:
    """Move ``params`` (stacked ``[k, ...]`` tensors) into one buffer per dtype and device
    (``pin``: host buffers page-locked, for a spilled array's copies to its GPU).

    Returns ``(layout, buffer)`` pairs; every tensor of ``params`` now views its
    columns of ``buffer`` (same object, same values, same ``requires_grad``).
    """
    groups: dict[tuple[torch.dtype, torch.device], list[str]] = {}
    for name, p in params.items():
        groups.setdefault((p.dtype, p.device), []).append(name)
    stacks = []
    for (dtype, device), names in groups.items():
        tensors = [params[name] for name in names]
        k = tensors[0].shape[0]
        stack = FlatStack(names, [t.shape[1:] for t in tensors], k, dtype, device)
        with torch.no_grad():
            buffer = stack.pack(
                [t.detach() for t in tensors], stack.empty(pin and device.type == "cpu")
            )
            for j, t in enumerate(tensors):
                t.data = stack.view(buffer, j)
        stacks.append((stack, buffer))
    return stacks
