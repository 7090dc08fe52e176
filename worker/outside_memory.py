"""A model's tensors that share memory with a value kept outside it: a module global or a
workload attribute that the model registers as a buffer or parameter
(``self.register_buffer("scale", SCALE)``, ``torch.from_numpy(NORM)``), or a layer kept
outside that it holds as a submodule (``self.enc = ENCODER``).

Where a build fills that value in place (``SCALE.fill_(cfg["scale"])``,
``ENCODER.reset_parameters()``), the next member's build, and the values put back before
it, fill the earlier member's buffer too: every member's model would read the last value
set there. :func:`own_copies` gives a member's model copies of such tensors as its build
left them, and :func:`own_layers` copies of such layers that its build changed, so that
each member's stacked tensors are the ones its build made. The value outside stays what
it is, held and put back per member as any value kept outside
(:mod:`worker.outside_state`), or noted where it is not held (a layer's weights).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from worker.module_state import versioned
from worker.outside_values import MAX_DEPTH, MAX_FIELDS, attributes_of, settings_object

#: a span of host or device memory: (device, first byte, byte after the last)
Span = tuple[str, int, int]


def own_copies(model: nn.Module, holders: Iterable[Any]) -> list[str]:
    """Give ``model`` its own copy of each parameter and buffer whose memory some value of
    ``holders`` (namespaces: modules, classes, a workload object) shares, a few levels into
    dicts, lists and settings objects, whatever its size; the names copied. A large one
    too: a table every model shares (a pretrained embedding, fine-tuned) would otherwise
    take a resumed member's checkpoint in place, and the next build would start from it;
    copying costs a copy per member while the array is built (its stacks hold one anyway).
    A module kept outside (a global ``nn.Module`` the model uses) is left as it is here
    (:func:`own_layers`)."""
    spans = sorted({s for holder in holders for s in _spans_of(vars(holder), 0)})
    if not spans:
        return []
    copied: dict[int, Tensor] = {}
    names: list[str] = []
    for prefix, module in model.named_modules(remove_duplicate=True):
        for table in (module._parameters, module._buffers):
            for name, tensor in list(table.items()):
                if tensor is None or not _shares(tensor, spans):
                    continue
                if id(tensor) not in copied:
                    copied[id(tensor)] = _copy(tensor)
                table[name] = copied[id(tensor)]
                names.append(f"{prefix}.{name}" if prefix else name)
    return names


def _copy(tensor: Tensor) -> Tensor:
    with torch.no_grad():
        clone = tensor.detach().clone()
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(clone, requires_grad=tensor.requires_grad)
    return clone


def _spans_of(values: dict[str, Any], depth: int) -> Iterator[Span]:
    for name, value in list(values.items()):
        if not (name.startswith("__") and name.endswith("__")):
            yield from _spans(value, depth)


def _spans(value: Any, depth: int) -> Iterator[Span]:
    if isinstance(value, Tensor):
        span = _tensor_span(value)
        if span is not None:
            yield span
    elif _is_array(value):
        if value.nbytes:
            numpy = sys.modules["numpy"]
            utils = getattr(numpy.lib, "array_utils", numpy)  # NumPy 2's home, else 1's
            low, high = utils.byte_bounds(value)
            yield ("cpu", low, high)
    elif depth >= MAX_DEPTH or isinstance(value, nn.Module | type):
        return
    elif isinstance(value, dict | list | tuple) and len(value) <= MAX_FIELDS:
        items = value.values() if isinstance(value, dict) else value
        for item in list(items):
            yield from _spans(item, depth + 1)
    elif settings_object(value, lambda cls: True):
        try:
            fields = attributes_of(value)
        except Exception:  # an attribute that raises when read: not a value to look into
            return
        yield from _spans_of(fields, depth + 1)


def _is_array(value: Any) -> bool:
    numpy = sys.modules.get("numpy")  # not imported here: if no one has, there are none
    return numpy is not None and isinstance(value, numpy.ndarray)


def _tensor_span(tensor: Tensor) -> Span | None:
    """The memory ``tensor``'s storage spans (None: it holds none, as a meta tensor, a lazy
    parameter, or a tensor of another kind without storage)."""
    if is_lazy(tensor) or tensor.is_meta:
        return None
    try:
        storage = tensor.untyped_storage()
        start, size = storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return None  # a sparse tensor, a wrapper subclass (its storage is not its data)
    if not start or not size:
        return None
    return (str(tensor.device), start, start + size)


def _shares(tensor: Tensor, spans: list[Span]) -> bool:
    own = _tensor_span(tensor)
    if own is None:
        return False
    device, start, end = own
    return any(d == device and s < end and start < e for d, s, e in spans)


#: the layers kept outside the model (``nn.Module`` values of the holders), each with its
#: tensors' version counters, before a build
Layers = list[tuple[nn.Module, tuple[int, ...]]]


def outside_layers(holders: Iterable[Any]) -> Layers:
    """The ``nn.Module`` values of ``holders`` (namespaces, a workload object) and their
    tensors' versions now, to see which a build changes in place (:func:`own_layers`)."""
    seen: dict[int, tuple[nn.Module, tuple[int, ...]]] = {}
    for holder in holders:
        for value in list(vars(holder).values()):
            if isinstance(value, nn.Module) and id(value) not in seen:
                seen[id(value)] = (value, _versions(value))
    return list(seen.values())


def own_layers(
    model: nn.Module, before: Layers, copy_model: Callable[[nn.Module], nn.Module]
) -> nn.Module:
    """``model``, or where it holds a layer kept outside whose tensors the build changed in
    place since ``before`` (:func:`outside_layers`), a module within one or one of their
    tensors, a copy of it (by ``copy_model``, whole: tied weights stay tied)."""
    changed = [layer for layer, versions in before if _versions(layer) != versions]
    modules = {id(sub) for layer in changed for sub in layer.modules()}
    tensors = {id(t) for layer in changed for t in [*layer.parameters(), *layer.buffers()]}
    holds = any(id(m) in modules for m in model.modules()) or any(
        id(t) in tensors for t in [*model.parameters(), *model.buffers()]
    )
    return copy_model(model) if holds else model


def _versions(module: nn.Module) -> tuple[int, ...]:
    return tuple(t._version for t in [*module.parameters(), *module.buffers()] if versioned(t))
