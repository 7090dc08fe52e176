"""Compiled training steps: a stack's forward and loss, and with them its backward, through
``torch.compile`` (``PACKTUNE_COMPILE_STEP=on``; eager is the default and the fallback).

A compiled step is made once per *step key* -- workload, model structure
(:func:`worker.fusion_guard.model_signature`), stack mode, stacked batches, precision and
device -- and kept for the process: later arrays of the key, in this pack or the next,
reuse it. Shapes follow torch's automatic dynamic shapes: the first array size and batch
shape compile as they are, the first other one (the last, shorter batch of an epoch is one)
compiles again with that dimension symbolic, and later sizes reuse it (k=1 keeps one of its
own): about three compilations per key, up to :data:`RECOMPILE_LIMIT` variants. That holds
for a workload whose losses come in one call (``stacked_loss``, as the built-in ones'); a
loop or vmap over the members' losses fixes the size, so such a key compiles per size.
Each entry owns its own copy of the stack's template, kept in train mode, so that an array
evaluating (eval mode) never changes what another array's compiled step runs.

On a GPU the default mode is ``reduce-overhead`` (CUDA graphs: a step's kernels replayed
with one launch); on a CPU ``default``. ``PACKTUNE_COMPILE_MODE`` overrides it. A step
whose compilation fails (an op the compiler cannot take, a backend error) is dropped for
its key with a warning, once per process, and the array goes on from the same
state (:class:`worker.fused.FusedArray` restores what the failed step changed); a key's
first failure is retried with fixed shapes (symbolic sizes fail where the model's code
needs concrete ones, as vmap's convolution rule does), and only a second one goes eager.

A forward that changes Python attributes of its modules (a step counter) would change them
on that one shared copy, for every array of the key: the first compiled step at each batch
shape compares them before and after (:func:`worker.module_state.python_state`), and a key
whose step changed one trains eagerly from then on, each stack on its own template, with a
note (the attributes the step changed are carried over to the stack's template).

Not compiled: stacks that draw random numbers (their draws would no longer match an
unpacked run's), spilled and decoupled stacks, the optimizer's update and evaluation.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import threading
import types
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch

from worker.fused_forward import Losses
from worker.fusion_guard import workload_differences

log = logging.getLogger(__name__)

#: the compile mode per device type, unless the settings name one
DEFAULT_MODES = {"cuda": "reduce-overhead", "cpu": "default"}
#: ``torch.compile``'s backend (the tests put a failing one in its place)
BACKEND = "inductor"
#: compiled variants (array sizes x batch shapes) one step key may hold (torch's default: 8)
RECOMPILE_LIMIT = 64

_LOCK = threading.Lock()
#: held while a step runs code for the first time: torch compiles one function at a time
COMPILING = threading.RLock()
_STEPS: dict[Hashable, Losses] = {}
#: per step key, the workload values (``vars()``) each of its variants was made with
_VARIANTS: dict[Hashable, list[dict[str, Any]]] = {}
#: each compiled key's own template (the module its compiled step runs)
_TEMPLATES: dict[Hashable, torch.nn.Module] = {}
#: keys whose compilation failed once: they compile with fixed shapes (per shape)
_STATIC: set[Hashable] = set()
#: keys whose compilation failed in this process (they train eagerly from then on)
_FAILED: dict[Hashable, str] = {}


def compile_mode(device: torch.device, setting: str | None) -> str:
    """The ``torch.compile`` mode for ``device``: ``setting`` if given, else its default."""
    return setting or DEFAULT_MODES.get(device.type, "default")


def compiled_step(
    key: Hashable,
    make: Callable[[torch.nn.Module], Losses],
    template: torch.nn.Module,
    device: torch.device,
    mode: str | None = None,
) -> Losses | None:
    """The compiled losses of ``key`` (on first use, ``make`` of its own copy of
    ``template``), or None where its compilation failed before in this process. Shapes:
    torch's automatic dynamic shapes, or fixed ones for a key whose symbolic recompilation
    failed."""
    with _LOCK:
        if key in _FAILED:
            return None
        step = _STEPS.get(key)
        if step is None:
            torch._dynamo.config.recompile_limit = max(
                torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT
            )
            own = _TEMPLATES[key] = own_template(template)
            step = torch.compile(
                own_code(make(own), key), mode=compile_mode(device, mode), backend=BACKEND,
                dynamic=False if key in _STATIC else None,
            )  # fmt: skip
            _STEPS[key] = step
        return step


def own_code(fn: Losses, key: Hashable) -> Losses:
    """``fn`` with a code object of its own, named after ``key``: every key's losses function
    is a closure of one ``def``, and torch keeps compiled variants per code object (running
    eagerly, silently but for a log line, past :data:`RECOMPILE_LIMIT` of them) and which
    sizes changed per code name (so one key's changing array size made another key's first
    compilation symbolic)."""
    assert isinstance(fn, types.FunctionType)
    name = f"{fn.__name__}_{hashlib.sha1(repr(key).encode()).hexdigest()[:12]}"
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def drop(key: Hashable, error: BaseException) -> str:
    """Forget ``key``'s compiled step after ``error``; the note to tell (logged once per key
    and outcome). A key's first failure leaves it compiling with fixed shapes (one
    compilation per shape: symbolic sizes fail where a model's code needs concrete ones, as
    vmap's convolution rule does); a failure with fixed shapes, eager."""
    root = error
    while (inner := root.__cause__ or getattr(root, "inner_exception", None)) is not None:
        root = inner  # torch wraps a backend's error: name what it raised
    reason = f"{type(root).__name__}: {str(root).splitlines()[0] if str(root) else ''}"
    with _LOCK:
        _STEPS.pop(key, None)
        _TEMPLATES.pop(key, None)
        if key not in _STATIC:
            _STATIC.add(key)
            note = f"the compiled step failed ({reason}); it compiles again with fixed shapes"
            first = True
        else:
            first = key not in _FAILED
            _FAILED[key] = reason
            note = f"the compiled step failed with fixed shapes ({reason}); it trains eagerly"
    if first:
        log.warning("%s (said once per process)", note)
    return note


def variant_key(key: Hashable, values: Mapping[str, Any]) -> Hashable:
    """``key`` and the variant of it made for a workload object holding ``values`` (its
    ``vars()``, compared by value): a compiled step reads the workload it was made with,
    and build_model may keep values on it that the loss reads (a label smoothing), so each
    set of such values compiles a step of its own."""
    with _LOCK:
        made = _VARIANTS.setdefault(key, [])
        for i, seen in enumerate(made):
            if not workload_differences([seen, values]):
                return (key, i)
        made.append(dict(values))
        return (key, len(made) - 1)


def template_of(key: Hashable) -> torch.nn.Module | None:
    """The module ``key``'s compiled step runs (None once the key is dropped)."""
    with _LOCK:
        return _TEMPLATES.get(key) if key in _STEPS else None


def refuse(key: Hashable, reason: str) -> str:
    """Train ``key`` eagerly from here on in this process, for ``reason``; the note to tell
    (logged once per key)."""
    with _LOCK:
        _STEPS.pop(key, None)
        _TEMPLATES.pop(key, None)
        first = key not in _FAILED
        _FAILED[key] = reason
    note = f"{reason}; it trains eagerly"
    if first:
        log.warning("%s (said once per process)", note)
    return note


def own_template(template: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``template`` in train mode for a compiled step alone."""
    return copy.deepcopy(template).train()


def reset() -> None:
    """Forget every compiled step and failure, and what torch learnt of their shapes (tests)."""
    torch._dynamo.reset()
    with _LOCK:
        _STEPS.clear()
        _TEMPLATES.clear()
        _VARIANTS.clear()
        _STATIC.clear()
        _FAILED.clear()
