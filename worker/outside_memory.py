"""A model's tensors that share memory with a value kept outside it: a module global or a
workload attribute that the model registers as a buffer or parameter
(``self.register_buffer("scale", SCALE)``, ``torch.from_numpy(NORM)``).

Where a build fills that value in place (``SCALE.fill_(cfg["scale"])``), the next member's
build, and the values put back before it, fill the earlier member's buffer too: every
member's model would read the last value set there. :func:`own_copies` gives a member's
model copies of such tensors as its build left them, so that each member's stacked buffer
is the one its build made. The value outside stays what it is, held and put back per
member as any value kept outside (:mod:`worker.outside_state`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from worker.outside_values import MAX_DEPTH, MAX_FIELDS, attributes_of, settings_object

#: a span of host or device memory: (device, first byte, byte after the last)
Span = tuple[str, int, int]


def own_copies(model: nn.Module, holders: Iterable[Any]) -> list[str]:
    """Give ``model`` its own copy of each parameter and buffer whose memory some value of
    ``holders`` (namespaces: modules, classes, a workload object) shares, a few levels into
    dicts, lists and settings objects; the names copied. A module kept outside (a global
    ``nn.Module`` the model uses) is left as it is: its tensors are its own."""
    spans = sorted({span for holder in holders for span in _spans_of(vars(holder), 0)})
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
    except (RuntimeError, NotImplementedError):  # a sparse or other storage-less tensor
        return None
    start = storage.data_ptr()
    if not start or not storage.nbytes():
        return None
    return (str(tensor.device), start, start + storage.nbytes())


def _shares(tensor: Tensor, spans: list[Span]) -> bool:
    own = _tensor_span(tensor)
    if own is None:
        return False
    device, start, end = own
    return any(d == device and s < end and start < e for d, s, e in spans)
