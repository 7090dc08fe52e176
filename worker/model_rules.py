"""What a built model may not do for packtune to train it as plain torch would: each is an
error naming the place and the fix (:func:`refuse_unsupported`), rather than wrong training.

A fused array trains *new* tensors: each member's parameters and buffers stacked
(:func:`worker.fused._stack`), swapped into a meta-device template by ``functional_call``
for each forward. So

- a parameter or buffer the model also holds outside its registered attribute (in a Python
  list, ``self.ws = [self.w1]``; an unregistered attribute) is never swapped: a forward
  reading it there reads the template's initial tensor, which never trains;
- a hook registered on a parameter tensor (``p.register_hook``) stays on the original
  tensor: the stacked one's gradient is never passed through it;
- a lazy module (``nn.LazyLinear``) has no shape to stack until a forward has run;
- a sparse embedding's gradient (``nn.Embedding(sparse=True)``) cannot flow back through
  the selection of one member's slice of the stack;
- a backward that runs the forward again (``torch.utils.checkpoint``) runs it on the
  template after the members' tensors were swapped out (:func:`recomputed_error`).
"""

from __future__ import annotations

import functools
import re
import types
from collections.abc import Hashable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parameter import UninitializedBuffer, UninitializedParameter
from torch.utils.checkpoint import CheckpointError

#: what every ``nn.Module`` keeps in its ``__dict__`` (parameters, buffers, hooks, ``training``)
_MODULE_OWN = frozenset(vars(nn.Module()))
#: torch's own bookkeeping that holds registered tensors, rebuilt as it needs, in a user's
#: subclass of a torch module (an RNN's flat weights follow every assignment of its
#: parameters, ``functional_call``'s too)
_TORCH_KEEPS = ((nn.RNNBase, "_flat_weights"),)
#: how deep :func:`_held` looks into containers and objects, and how many values in all
_DEPTH, _VALUES = 6, 100_000


def refuse_unsupported(name: str, model: nn.Module) -> None:
    """Raise a ValueError naming what of ``model`` (workload ``name``'s, just built) packtune
    cannot train as plain torch would, and what to change."""
    for path, module in model.named_modules():
        where = f"{path!r} ({type(module).__name__})" if path else type(module).__name__
        lazy = [n for n, t in (*module._parameters.items(), *module._buffers.items())
                if isinstance(t, UninitializedParameter | UninitializedBuffer)]  # fmt: skip
        if lazy:
            raise ValueError(
                f"{name}'s model has {where}, whose {', '.join(map(repr, lazy))} are not "
                "initialised after build_model (a lazy module): packtune stacks the trials' "
                "parameters before any forward; give its input size (nn.Linear(in_features, "
                "out_features) for nn.LazyLinear), or run one forward on an example batch at "
                "the end of build_model"
            )
        if isinstance(module, nn.Embedding | nn.EmbeddingBag) and module.sparse:
            raise ValueError(
                f"{name}'s model has {where} with sparse=True: packtune trains the trials' "
                "stacked weights by dense gradients, and a sparse gradient cannot flow back "
                "to a stack; use sparse=False"
            )
    named = _registered(model)
    for tensor_name, tensor in model.named_parameters():
        if tensor._backward_hooks or getattr(tensor, "_post_accumulate_grad_hooks", None):
            raise ValueError(
                f"{name}'s model registers a hook on its parameter {tensor_name!r} "
                "(Tensor.register_hook): packtune trains stacked copies of the parameters, "
                "which do not carry tensor hooks, so it would never run; change the gradient "
                "in forward instead (rows frozen by a mask: torch.where(mask, w, w.detach()))"
            )
    for path, module in model.named_modules():
        if type(module).__module__.split(".")[0] == "torch":
            continue  # torch's own modules keep what they hold up to date (as python_state)
        for attr, value in vars(module).items():
            if attr in _MODULE_OWN or isinstance(value, nn.Module):
                continue
            if any(isinstance(module, cls) and attr == kept for cls, kept in _TORCH_KEEPS):
                continue
            full = f"{path}.{attr}" if path else attr
            found = _held(value, full, named, [_VALUES], set(), 0)
            if found is not None:
                place, (kind, registered) = found
                raise ValueError(
                    f"{name}'s model holds its {kind} {registered!r} in {place!r}, which is not "
                    f"registered (a Python list, dict or plain attribute): packtune trains "
                    f"stacked copies of the registered {kind}s, and a forward reading it there "
                    f"would read its initial value, which never trains; register it "
                    f"(nn.ParameterList, nn.ParameterDict, a submodule) or read the registered "
                    f"attribute ({registered}) in forward; one kept but never read: remove it"
                )


def _registered(model: nn.Module) -> dict[Hashable, tuple[str, str]]:
    """Each parameter and buffer of ``model``, by its id and by its memory (a view of it,
    ``.data``, ``.detach()``) -> (its kind, its first name)."""
    out: dict[Hashable, tuple[str, str]] = {}
    for kind, named in (("buffer", model.named_buffers()), ("parameter", model.named_parameters())):
        for n, t in named:
            out[id(t)] = (kind, n)
            memory = _memory(t)
            if memory is not None:
                out[memory] = (kind, n)
    return out


def _memory(tensor: Tensor) -> Hashable | None:
    """Where ``tensor``'s elements live (its storage), or None: none of its own (meta, empty)."""
    if tensor.is_meta or tensor.numel() == 0 or tensor.layout != torch.strided:
        return None
    pointer = tensor.untyped_storage().data_ptr()
    return ("memory", tensor.device, pointer) if pointer else None


def _held(
    value: Any,
    place: str,
    named: dict[Hashable, tuple[str, str]],
    budget: list[int],
    seen: set[int],
    depth: int,
) -> tuple[str, tuple[str, str]] | None:
    """The first place under ``value`` (containers, plain objects' attributes, functions'
    closures) holding a tensor of ``named`` or a view of one: (place, its kind and name)."""
    budget[0] -= 1
    if budget[0] < 0 or depth > _DEPTH:
        return None
    if isinstance(value, Tensor):
        for key in (id(value), _memory(value)):
            if key is not None and key in named:
                return place, named[key]
        return None
    if value is None or isinstance(value, bool | int | float | complex | str | bytes):
        return None
    if id(value) in seen or isinstance(value, nn.Module | type | types.ModuleType):
        return None  # a module of the tree is walked itself; one outside it is its own
    seen.add(id(value))
    deeper = functools.partial(_held, named=named, budget=budget, seen=seen, depth=depth + 1)
    items: list[tuple[str, Any]]
    if isinstance(value, list | tuple):
        items = [(f"{place}[{i}]", v) for i, v in enumerate(value)]
    elif isinstance(value, set | frozenset):
        items = [(f"{place}[...]", v) for v in value]
    elif isinstance(value, dict):
        items = [(f"{place}[{k!r}]", v) for k, v in value.items()]
    elif isinstance(value, types.FunctionType):
        cells = value.__closure__ or ()
        items = [(f"{place} (closure of {value.__qualname__})", c.cell_contents)
                 for c in cells if _filled(c)]  # fmt: skip
    elif isinstance(value, types.MethodType):
        items = [(place, value.__self__)]
    elif isinstance(value, functools.partial):
        items = [(place, v) for v in (*value.args, *value.keywords.values())]
    elif isinstance(value, torch.dtype | torch.device | torch.Generator):
        return None
    elif hasattr(value, "__dict__") and not isinstance(value, types.BuiltinFunctionType):
        items = [(f"{place}.{k}", v) for k, v in vars(value).items()]
    else:
        return None
    for where, item in items:
        found = deeper(item, where)
        if found is not None:
            return found
    return None


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


#: a backward that read the template's meta tensors: the forward ran again there
_META = re.compile(r"\bmeta\b")


def recomputed_error(name: str, error: BaseException) -> ValueError | None:
    """A clear error for ``error``, raised by a training backward pass, where it comes of a
    forward run again in backward (``torch.utils.checkpoint``): the recomputation runs on
    the template, whose tensors are on the meta device once ``functional_call`` has swapped
    the members' out. None: another error."""
    if not (isinstance(error, CheckpointError) or _META.search(str(error))):
        return None
    return ValueError(
        f"{name}'s model runs part of its forward again in backward (torch.utils.checkpoint), "
        "which packtune cannot: the trials' stacked parameters are swapped in only for the "
        "forward; remove torch.utils.checkpoint from forward "
        f"[{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}]"
    )
