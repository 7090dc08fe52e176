"""A look at a member's training before an array trains it: one training forward and loss of
a copy of its model on a few examples (:func:`probe`), once per process and model signature.

It tells what no list of module classes can: whether training draws random numbers (from
torch's generators or the host's), changes its input batch in place, or replaces a buffer
by assignment; :class:`worker.fused.FusedArray` decides from it how the members train (one
per stack, each on its own copy of the batch, from its own random streams) so that each
ends as it would unpacked, or refuses what it cannot train as written.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from packtune.workloads.base import Workload
from worker import outside_state as outside
from worker.batches import tensors, tree_map
from worker.fused_forward import model_function
from worker.module_state import changed_state, object_state, python_state, restore_object_state
from worker.rng import draws_random

log = logging.getLogger(__name__)

#: examples a probe runs forward first (then a whole batch: a model may draw only on one)
PROBE_EXAMPLES = 4
#: training forwards a probe runs on each batch: a model may draw only after a warm-up
#: (a step counter); what begins later still, :class:`UnseenDraws` finds while it trains
PROBE_FORWARDS = 5
#: (workload, custom step, model signature) -> what a probe of its training saw
_PROBED: dict[Hashable, Probed] = {}


@dataclass(frozen=True)
class Probed:
    """What a training forward and loss of a copy of a member's model did (:func:`probe`).

    ``draws``: it drew from torch's generators; ``host_draws``: from Python's ``random`` or
    NumPy's; ``mutates``: it changed its input batch in place (``x.div_(255)`` in a forward,
    targets smoothed in place in a loss); ``reassigned``: buffers it replaced by assignment
    (``self.mean = ...``); ``workload_state``: attributes of the workload object it changed
    (a counter a loss keeps on ``self``); ``model_state``: Python attributes of the model's
    modules it changed (a step counter a forward keeps); ``note``: why it could not tell
    (every probe raised)."""

    draws: bool = False
    host_draws: bool = False
    mutates: bool = False
    reassigned: tuple[str, ...] = ()
    workload_state: tuple[str, ...] = ()
    model_state: tuple[str, ...] = ()
    #: values outside the model it changed (a counter a forward keeps in a module global),
    #: by ``module.NAME``: each member's own from then on, in this process
    outside_state: tuple[str, ...] = ()
    #: of ``outside_state``, those that held a tensor after the forwards: under vmap such a
    #: value holds the stack's batched value, which no member can hold
    outside_tensors: tuple[str, ...] = ()
    #: larger tensors outside the model it changed in place, which cannot be held per trial
    #: (:func:`worker.outside_state.changed_in_place`)
    unheld_outside: tuple[str, ...] = ()
    #: of ``model_state``, those that held a tensor after the forwards (``self.ema = ...``,
    #: begun as None or as a tensor): under vmap such an attribute holds the stack's value
    tensor_state: tuple[str, ...] = ()
    #: parameters whose training gradient is float rounding (:func:`rounding_noise`)
    noise: tuple[str, ...] = ()
    #: every draw from torch's generators was a ``nn.Dropout`` module's: with their ``p`` at 0
    #: the forwards drew nothing (a hand-fused stack then draws each member's masks from its
    #: own stream: :class:`worker.fused_forward.MemberStreams`)
    dropout_only: bool = False
    note: str | None = None


def probe(
    workload: Workload,
    model: nn.Module,
    signature: Hashable,
    batches: Sequence[Any],
) -> Probed:
    """A training forward and loss of a copy of ``model`` on the first of ``batches`` it runs
    on (a few training examples, then a whole batch: a model may need its batch size), once
    per process and model signature. A probe that raises on every batch counts as drawing
    random numbers: members then train one per stack, as unpacked. Streamed data's batch is
    its first validation batch (:meth:`worker.fused.FusedArray._probe_batches`); without
    one nothing is seen, and :meth:`worker.fused.FusedArray.train_step` still refuses a
    batch changed in place."""
    key = probe_key(workload, signature)
    if key not in _PROBED:
        if not batches:
            return _LEARNED.get(key, Probed())
        _PROBED[key] = _run_probe(workload, model, batches)
    learned = _LEARNED.get(key)
    if learned is None:
        return _PROBED[key]
    seen = _PROBED[key]
    # a draw training showed the probe had not seen is not a Dropout module's, whatever the
    # probe saw of those
    return replace(seen, draws=seen.draws or learned.draws,
                   host_draws=seen.host_draws or learned.host_draws,
                   noise=seen.noise or learned.noise,
                   dropout_only=seen.dropout_only and not learned.draws)  # fmt: skip


def probed_already(workload: Workload, signature: Hashable) -> bool:
    """Whether this process has probed the model of ``signature`` (:func:`probe` would not
    look at its batches)."""
    return probe_key(workload, signature) in _PROBED


def probe_key(workload: Workload, signature: Hashable) -> Hashable:
    return (workload.name, workload.custom_step, signature)


#: what training showed of a model its probe did not (:class:`UnseenDraws`), this process on
_LEARNED: dict[Hashable, Probed] = {}


class UnseenDraws(RuntimeError):
    """A step of members taken for drawing no random numbers drew some (a draw that begins
    after a warm-up, or only at some batch size): they shared one stream, so their results
    would depend on the packing. Learned for this process (:func:`learn_draws`): the pack
    trains again from its checkpoints, each member from its own streams, as unpacked. Not
    the trials' fault: it does not use up an attempt."""


def learn_noise(key: Hashable, names: tuple[str, ...]) -> None:
    """Training showed that the model of probe ``key`` has gradients of float rounding
    (streamed data whose loader gave no batch to probe with)."""
    _LEARNED[key] = replace(_LEARNED.get(key, Probed()), noise=names)


def learn_draws(key: Hashable, *, torch_draws: bool, host_draws: bool) -> None:
    """Training showed that the model of probe ``key`` draws (torch's or the host's)."""
    was = _LEARNED.get(key, Probed())
    _LEARNED[key] = replace(was, draws=was.draws or torch_draws,
                            host_draws=was.host_draws or host_draws)  # fmt: skip


def _run_probe(workload: Workload, model: nn.Module, batches: Sequence[Any]) -> Probed:
    """Each of ``batches`` probed (a model may draw only at some batch size), what any saw."""
    seen: list[Probed] = []
    error: Exception | None = None
    for batch in batches:
        try:
            # rounding on the whole batch only: on a few examples an input that happens to
            # be equal in all of them is cancelled by a BatchNorm too
            largest = batch is batches[-1]
            seen.append(_probe_batch(workload, model, batch, noise=largest))
        except Exception as exc:
            error = exc
    if seen:

        def union(field: str) -> tuple[str, ...]:  # every batch's names, in order, once
            return tuple(dict.fromkeys(n for p in seen for n in getattr(p, field)))

        return Probed(
            draws=any(p.draws for p in seen), host_draws=any(p.host_draws for p in seen),
            mutates=any(p.mutates for p in seen), reassigned=union("reassigned"),
            workload_state=union("workload_state"), model_state=union("model_state"),
            outside_state=union("outside_state"), outside_tensors=union("outside_tensors"),
            unheld_outside=union("unheld_outside"),
            tensor_state=union("tensor_state"), noise=union("noise"),
            dropout_only=any(p.draws for p in seen)
            and all(p.dropout_only for p in seen if p.draws),
        )  # fmt: skip
    note = (
        f"{workload.name}: could not tell whether training draws random numbers (a training "
        f"forward raised {type(error).__name__}: {error}); its members train one per stack, "
        "as they would unpacked"
    )
    log.warning("%s", note)
    return Probed(draws=True, note=note)


def _probe_batch(workload: Workload, model: nn.Module, batch: Any, noise: bool = True) -> Probed:
    """:data:`PROBE_FORWARDS` training forwards and losses of a copy of ``model`` on ``batch``
    (``(x, y)``, or any nesting of tensors a workload's own step takes), then an evaluation;
    raises what they raise."""
    first = next(model.parameters(), None)
    device = first.device if first is not None else None
    trial = copy.deepcopy(model).train()  # its BatchNorm statistics move: a copy's
    # copies: the probe's own in-place changes must not reach the shared split
    own_batch = tree_map(
        lambda t: t.to(device, copy=True) if device is not None else t.clone(), batch
    )
    versions = [t._version for t in tensors(own_batch)]
    buffers = dict(trial.named_buffers())

    def run(trial: nn.Module = trial) -> None:
        # with gradients on, as in training: a counter may count only then
        for _ in range(PROBE_FORWARDS):
            _training_loss(workload, trial, own_batch)

    own, held = python_state(trial), object_state(workload)
    # values kept outside the model (module globals, class attributes) before the forwards:
    # what they change there is training state (:func:`worker.outside_state.learn_trained`)
    spaces = outside.namespaces(workload, model)
    outside_before, large = outside.reading(spaces), outside.large_tensors(spaces)
    copies = outside.large_copies(spaces)  # a larger tensor the forwards change: held from then
    try:
        drew = draws_random(run, device)
        mutates = [t._version for t in tensors(own_batch)] != versions
        now, caches = dict(trial.named_buffers()), _caches(trial)
        reassigned = tuple(n for n, b in buffers.items()
                           if now.get(n) is not b and n not in caches)  # fmt: skip
        _evaluate(workload, trial, tree_map(torch.clone, own_batch))  # what only eval changes
        # draws that stop with every Dropout module's p at 0 were theirs alone
        quiet = without_dropout(model) if drew.torch and not drew.host else None
        if quiet is not None:

            def run_quiet(trial: nn.Module = copy.deepcopy(quiet).train()) -> None:
                for _ in range(PROBE_FORWARDS):
                    _training_loss(workload, trial, tree_map(torch.clone, own_batch))

            dropout_only = not draws_random(run_quiet, device).torch
        else:
            dropout_only = False
        # (a model that draws trains one member per stack, and would seem noisy; one whose
        # draws are its Dropout modules' is looked at without them)
        deterministic = not (drew.host or mutates) and (not drew.torch or dropout_only)
        looked_at = quiet if dropout_only and quiet is not None else model
        rounding = model_noise(workload, looked_at, own_batch) if deterministic and noise else ()
    finally:  # the probe's own changes to the workload object and outside it are undone
        changed = restore_object_state(workload, held)
        outside.held_large(outside_before, copies)
        outside_after = outside.reading(spaces)
        trained = outside.learn_trained(outside_before, outside_after)
        trained_outside = sorted(outside.label(s, n) for s, names in trained.items() for n in names)
        outside_tensors = sorted(
            outside.label(s, n)
            for s, names in trained.items()
            for n in names
            if outside.holds_tensor(outside_after[s].get(n))
        )
        unheld = outside.changed_in_place(large, outside.large_tensors(spaces))
        outside.undo(outside_before, only=trained)
    after = python_state(trial)
    changed_model = changed_state(own, after)
    return Probed(
        draws=drew.torch, host_draws=drew.host, mutates=mutates, reassigned=reassigned,
        dropout_only=dropout_only, workload_state=tuple(changed),
        model_state=tuple(changed_model), tensor_state=tuple(
            n for n in changed_model if isinstance(after.get(n), Tensor)),
        noise=rounding, outside_state=tuple(trained_outside),
        outside_tensors=tuple(outside_tensors), unheld_outside=tuple(unheld),
    )  # fmt: skip


#: the relative change of a gradient's element, when every parameter moves by
#: :data:`NUDGE`, beyond which that element is taken for float rounding. Measured on CPU:
#: a Linear bias a BatchNorm cancels changes by 0.9-1.5 (its gradient, ~1e-8 against the
#: weights' ~1, is what rounding leaves of zero); every other gradient of the built-in
#: workloads by at most 1.2e-3 (resnet-cifar's batch norms, whole tensors), most by ~1e-6.
NOISE_REL = 0.1
#: the relative nudge: two units in the last place of a float32
NUDGE = 2.0**-22
#: the share of a tensor's elements whose gradients must be rounding for it to count: a
#: meaningful gradient's elements are near zero by chance too (one in ~1e6 within rounding
#: of it), and those change wholly as well; a part that is rounding by the model's structure
#: is a whole block (a third of in_proj_bias, every element of a cancelled bias)
NOISE_SHARE = 0.01


def rounding_noise(
    losses: Callable[[dict[str, Tensor]], Tensor], params: dict[str, Tensor]
) -> tuple[str, ...]:
    """The names of ``params`` whose training gradient is float rounding: it changes wholly
    when every parameter moves by a rounding error (:data:`NUDGE`), where a gradient with a
    meaning changes by as little. ``losses(params)``: the training loss (summed) of one
    model at ``params``, on a batch, from buffers of its own each call.

    Such a gradient (a Linear's bias followed by a BatchNorm, which cancels it) is the
    arithmetic's own: a stack of members whose kernels round otherwise (vmap's) gets another
    one. SGD steps by it, ~1e-8 of the weights, and nothing shows; an optimizer that divides
    by the gradient's size (Adam, RMSprop, Adagrad) takes a full step in its arbitrary
    direction, and each member would end apart from its unpacked run. ``params`` are not
    changed; a loss that raises tells nothing (training raises it where it belongs)."""
    nudges = torch.Generator().manual_seed(0)  # not the global generators: no draw to see
    grads = []
    for nudged in (False, True):
        own = {n: t.detach().clone() for n, t in params.items()}
        if nudged:
            for t in own.values():
                sign = torch.randint(0, 2, t.shape, generator=nudges).to(t) * 2 - 1
                t.mul_(1 + NUDGE * sign)
        for n, t in own.items():
            t.requires_grad_(params[n].requires_grad)
        try:
            losses(own).sum().backward()
        except Exception:  # noqa: BLE001 - training raises it where it belongs
            return ()
        grads.append({n: t.grad for n, t in own.items() if t.grad is not None})
    plain, moved = grads
    noisy = []
    for name, grad in plain.items():
        other = moved.get(name)
        if other is None or not bool(torch.isfinite(grad).all()):
            continue
        # element by element, as Adam steps: a tensor may hold meaningful and rounding
        # parts (MultiheadAttention's in_proj_bias: the query's, value's and the key's,
        # which the softmax cancels); an element that is zero in both is not rounding
        changed = ((other - grad).abs() > NOISE_REL * grad.abs()) & ((grad != 0) | (other != 0))
        if int(changed.sum()) >= max(1, NOISE_SHARE * grad.numel()):
            noisy.append(name)
    return tuple(noisy)


def without_dropout(model: nn.Module) -> nn.Module | None:
    """A copy of ``model`` with every ``nn.Dropout`` module's ``p`` at 0 (they then draw
    nothing), or None where it has no active one."""
    if not any(type(m) is nn.Dropout and m.p > 0 for m in model.modules()):
        return None
    quiet = copy.deepcopy(model)
    for module in quiet.modules():
        if type(module) is nn.Dropout:
            module.p = 0.0
    return quiet


def model_noise(workload: Workload, model: nn.Module, batch: Any) -> tuple[str, ...]:
    """:func:`rounding_noise` of ``model``'s training loss on ``batch`` (copies of both:
    nothing of them changes)."""

    def losses(params: dict[str, Tensor]) -> Tensor:
        trial = copy.deepcopy(model).train()  # buffers (BatchNorm statistics) of its own
        run = model_function(trial, params, dict(trial.named_buffers()))
        return _training_loss(workload, run, tree_map(torch.clone, batch))

    return rounding_noise(losses, dict(model.named_parameters()))


def _training_loss(workload: Workload, model: Any, batch: Any) -> Tensor:
    """A training loss of ``model`` (a module, or a function of its inputs) on ``batch``, as
    an array's step computes it: the workload's own step, or ``loss(model(x), y)``."""
    if workload.custom_step:
        return workload.training_loss(model, batch)
    x, y = batch
    return workload.loss(model(x), y)


def _evaluate(workload: Workload, trial: nn.Module, batch: Any) -> None:
    """An evaluation of the probe's model, as an array's (eval mode, no gradients): Python
    state only evaluation changes (a counter in ``metrics``, one an eval-mode forward keeps)
    is seen too. What it raises is the evaluation's business, not the probe's."""
    trial.eval()
    try:
        with torch.no_grad():
            if workload.custom_step:
                workload.validation_metrics(trial, batch)
            else:
                x, y = batch
                out = trial(x)
                workload.loss(out, y)
                workload.metrics(out, y)
    except Exception:  # noqa: BLE001 - an array's evaluation raises it where it belongs
        pass
    finally:
        trial.train()


def _caches(model: nn.Module) -> set[str]:
    """Names of non-persistent buffers: a cache the forward may rebuild (a causal mask, a
    rotary table grown with the input), not state a checkpoint keeps."""
    return {
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules()
        for name in module._non_persistent_buffers_set
    }


def is_stochastic(workload: Workload, model: nn.Module, probed: Probed) -> bool:
    """Whether training draws random numbers: the workload says so (``stochastic = True``),
    the model has active dropout, or the probe saw draws (functional dropout, ``nn.RReLU``,
    noise in a loss, Python's or NumPy's generators). Without a probe (streamed data whose
    loader gave no batch) only the first two are known."""
    dropout = nn.modules.dropout._DropoutNd
    return (
        workload.stochastic
        or probed.draws
        or probed.host_draws
        or any(isinstance(m, dropout) and m.p > 0 for m in model.modules())
    )
