"""Fused arrays: k trials of one fusion key trained as one stacked model.

Each member's model is built exactly as a plain run would build it
(``torch.manual_seed(config["seed"])`` then ``workload.build_model``), and the
members' parameters and buffers are stacked with
``torch.func.stack_module_state``: every tensor becomes ``[k, ...]``, the
BatchNorm running statistics included, and run by one of the forward passes
of :mod:`worker.fused_forward` (``bmm``, ``vmap`` or ``serial``).

``mode="auto"`` takes ``bmm`` where the model allows it, else ``vmap`` (or
``serial`` for a single member, and for a model that draws random numbers).
Members are stacked together only when their built models are equal but for
tensor values (:mod:`worker.fusion_guard`); an array whose members are not
(a parameter the workload wrongly declared fusible, a model that depends on
the seed) trains each part as its own stack on the same batches, with a
warning naming the parameter. Train/eval mode is set on each stack's
template module, so its members switch together: train mode for steps (batch
statistics, dropout on), eval mode for validation (running statistics,
dropout off).

Data: an array trains on the workload's in-memory splits (``data()``: batches are index
tensors into them) or on streamed batches (``train_batches()``: one loader per array,
every member on the same batch, or one per member where the workload asks for
per-member batches; :mod:`worker.batches` moves them to the device). A workload with its
own step (``training_loss``) runs it under vmap; a vmap stack whose first step fails
(code vmap cannot batch) is split into one stack per member, with a warning, once what the
failed step changed is put back (buffers, parameters changed in place, Python attributes of
the model's modules and of the workload object, random streams): the members then train one
at a time, as they would unpacked. So is one whose first evaluation fails (code that only
eval mode runs), from that evaluation on.

Randomness (dropout, or draws seen in a probe forward: :func:`worker.probe.is_stochastic`): each
member owns a CPU ``torch.Generator`` seeded from its trial seed; its state is part of
the member's exported state. A hand-fusable model whose only draws are its ``nn.Dropout``
modules' (:attr:`worker.probe.Probed.dropout_only`) stacks ``bmm``: before each step every
member's stream seeds a generator of its own that draws its masks
(:class:`worker.fused_forward.MemberStreams`), the same in a stack of one as in any.
Otherwise, before each step of a stack the global generator is
reseeded from one draw of each of its members' generators, and the stack's ops draw
from it. In ``auto`` mode such a model runs ``serial`` (a stack of one), so each
trial's draws come from its own stream alone: the same as when it trains unpacked,
whoever it is packed with. (Forced ``bmm``/``vmap`` stacks share one draw; with
``vmap(randomness="different")`` each member still gets different masks, reproducible
given the companions.) Models without randomness do not touch any generator.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
from torch import Tensor, nn

from packtune.errors import DETAILS
from packtune.schedules import SCHEDULE_PARAMS, Schedule, schedule_of
from packtune.spec import TrainingSettings
from packtune.spilling import Unspillable
from packtune.tuning import CUDA_CHECK_EVERY
from packtune.workloads.base import (
    OPTIMIZER_PARAMS,
    PRECISIONS,
    Split,
    Workload,
    data_splits,
    epoch_seed,
)
from worker import compiled, own_masks, torch_settings
from worker import outside_state as outside
from worker.batches import (
    batch_size,
    epoch_batches,
    on_device,
    stack_batches,
    started,
    tensors,
    tree_map,
)
from worker.decoupled_group import decoupled_group, decoupled_problem, segment_names
from worker.fused_forward import (
    MemberStreams,
    bmm_forward,
    bmm_plan,
    custom_losses,
    single_forward,
    vmap_forward,
)
from worker.fused_group import (
    Group,
    Stack,
    losses_function,
    shapes,
    validation_values,
)
from worker.fusion_guard import model_signature, partition, split_causes, workload_differences
from worker.model_rules import refuse_unsupported
from worker.module_state import (
    MISSING,
    SMALL_TENSOR,
    changed_state,
    checkpointable,
    copy_state,
    object_state,
    put,
    python_state,
    restore_object_state,
    restore_python_state,
    set_python_state,
)
from worker.optim import OPTIMIZER_HYPER, build_optimizer
from worker.outside_memory import Layers, outside_layers, own_copies, own_layers
from worker.outside_state import MAX_HELD_LARGE
from worker.probe import (
    PROBE_EXAMPLES,
    UnseenDraws,
    is_stochastic,
    learn_draws,
    learn_noise,
    probe,
    probe_key,
    probed_already,
    rounding_noise,
)
from worker.rng import (
    GLOBAL_RNG,
    Fingerprint,
    HostState,
    Shared,
    decode_host,
    encode_host,
    host_fingerprint,
    host_state,
    same_states,
    seed_host,
    seed_torch,
    set_host_state,
    torch_states,
)
from worker.spill import SpilledGroup, spill_problem
from worker.ties import aliases, meta_template, with_aliases

StackMode = Literal["auto", "vmap", "bmm", "serial"]
_T = TypeVar("_T")

log = logging.getLogger(__name__)

_RNG_MIX = 6364136223846793005  # Knuth's MMIX multiplier, to fold member draws into one seed
#: folded into an evaluation's seed, so that it is not the next training step's
_EVAL_SALT = 0x5EED_E7A1
#: what arrays of this process said once in the log (every pack of a workload would say
#: it again): a workload's vmap step split per member, its values kept outside the model
_LOGGED: set[Hashable] = set()


def _first_three(names: Sequence[str]) -> str:
    """``names`` as a note shows them: the first three, then "..." for the rest."""
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def _warn_once(said: Hashable, message: str) -> None:
    if said not in _LOGGED:
        _LOGGED.add(said)
        log.warning("%s (said once per process)", message)


def _folded(seed: int, draws: Sequence[int]) -> int:
    """``draws`` folded into ``seed``, one after another (:data:`_RNG_MIX`)."""
    for draw in draws:
        seed = (seed * _RNG_MIX + draw) % 2**63
    return seed


def hyper_tensors(configs: Sequence[Mapping[str, Any]]) -> dict[str, Tensor]:
    """The fusible optimizer hyperparameters of ``configs`` as ``[k]`` float64 tensors (the
    schedule's aside: :func:`schedules`)."""
    return {
        key: torch.tensor(
            [float(c.get(key, OPTIMIZER_PARAMS[key])) for c in configs], dtype=torch.float64
        )
        for key in OPTIMIZER_HYPER
        if key not in SCHEDULE_PARAMS
    }


def schedules(configs: Sequence[Mapping[str, Any]], steps_per_epoch: int) -> list[Schedule]:
    """Each config's learning-rate schedule, over ``max_epochs`` (the study's
    ``max_resource``, which the worker adds to a trial's config; 1 where absent)."""
    return [schedule_of(c, steps_per_epoch, float(c.get("max_epochs", 1.0))) for c in configs]


def _suspects(config: Mapping[str, Any]) -> str:
    """The parameters most likely at fault: numbers too large for any layer (beyond 2**31),
    else every parameter but the seeds."""
    params = {k: v for k, v in config.items() if k not in ("seed", "data_seed")}
    huge = {
        k: v
        for k, v in params.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and abs(v) >= 2**31
    }
    shown = huge or params
    return ", ".join(f"{k}={v!r}" for k, v in sorted(shown.items()))


class BuildError(ValueError):
    """A workload's ``build_model`` raised: its message is the cause first (``ValueError:
    ...``, which trials with the same fault share), then the trial's details in brackets."""


def _build_model(
    workload: Workload,
    config: Mapping[str, Any],
    state: Mapping[str, Any] | None,
    built: Callable[[nn.Module], nn.Module] | None = None,
) -> nn.Module:
    """One member's model, initialised exactly as a plain run of ``config`` would be;
    ``built`` is called with it as ``build_model`` returns (before a resumed state is
    loaded), and returns the model to go on with."""
    seed_torch(int(config["seed"]))
    try:
        model = workload.build_model(config)
    except Exception as exc:  # name what was asked for: the trial's error says it
        raise BuildError(
            f"{type(exc).__name__}: {exc} [{DETAILS}{workload.name}.build_model could not "
            f"build the model of {_suspects(config)}]"
        ) from exc
    if not isinstance(model, nn.Module):
        raise BuildError(
            f"{workload.name}.build_model() returned a {type(model).__name__}; it must return "
            "a torch.nn.Module (layers in a list: wrap them in nn.Sequential)"
        )
    refuse_unsupported(workload.name, model)  # before its state: a lazy module's too
    if built is not None:
        model = built(model)
    if state is not None:
        # by every name of a tied tensor, as the model's own state_dict has it
        model.load_state_dict(with_aliases({**state["params"], **state["buffers"]}, aliases(model)))
    return model.train()


def _start_from(workload: Any, base: Mapping[str, Any]) -> None:
    """Put ``workload``'s attributes back to the objects of ``base`` (its ``vars()`` before
    any member's build): what an earlier member's build or resumed state set on it (a value
    its build sets only for some trials) is gone, as in a fresh process."""
    now = vars(workload)
    for name in [n for n in now if n not in base]:
        delattr(workload, name)
    for name, value in base.items():
        if now.get(name, MISSING) is not value:
            setattr(workload, name, value)


def _member_generator(
    config: Mapping[str, Any], state: Mapping[str, Any] | None
) -> torch.Generator:
    """A member's own random stream: resumed from ``state``, else seeded from its trial seed."""
    gen = torch.Generator()
    if state is not None:
        gen.set_state(state["rng"])
    else:
        gen.manual_seed(int(config["seed"]) + 1_000_003)  # not the init stream itself
    return gen


def _check_fusible(workload: Workload, configs: Sequence[Mapping[str, Any]]) -> None:
    shared = sorted(workload.structural_params() | {"data_seed"})
    for key in shared:
        values = {repr(c.get(key)) for c in configs}
        if len(values) > 1:
            raise ValueError(f"members of one array must share {key!r}; got {sorted(values)}")


def _stack(
    models: Sequence[nn.Module], device: torch.device, only: set[str] | None = None
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The members' parameters and buffers as ``[k, ...]`` tensors on ``device`` (as
    ``torch.func.stack_module_state``, which also insists on one class object: classes made
    per ``build_model`` call are distinct objects of equal code, vetted by the guard);
    ``only``: those of these names (a segment unit's), the rest left on the host."""
    named = [(dict(m.named_parameters()), dict(m.named_buffers())) for m in models]
    first_params, first_buffers = named[0]
    params = {
        n: torch.stack([ps[n].detach() for ps, _ in named]).to(device).requires_grad_(
            p.requires_grad)
        for n, p in first_params.items() if only is None or n in only
    }  # fmt: skip
    buffers = {n: torch.stack([bs[n] for _, bs in named]).to(device) for n in first_buffers
               if only is None or n in only}  # fmt: skip
    return params, buffers


def stack_of(
    workload: Workload,
    template: nn.Module,
    mode: str,
    stochastic: bool,
    streams: MemberStreams | None = None,
) -> Stack:
    """How a stack of ``template``'s members runs in ``mode`` (``bmm``, ``vmap``, ``serial``).
    With ``streams`` (a stack of a model whose only draws are its Dropout modules'), each
    member's masks come from its own stream, so a stack of one draws what it would in any
    stack: through the hand-fused forward (``bmm``, or ``serial`` of a hand-fusable model), or
    with the template's Dropout modules taking the stack's masks (:mod:`worker.own_masks`)."""
    stacked = workload.per_member_batches
    plan = bmm_plan(template, convs=mode == "bmm") if mode == "bmm" or streams is not None else None
    if mode == "bmm" or (plan is not None and streams is not None and mode != "vmap"):
        assert plan is not None
        forward = bmm_forward(plan, streams=streams)
        train_forward = bmm_forward(plan, stacked=True, streams=streams)
    elif streams is not None:
        own_masks.enable(template)
        of = own_masks.vmap_forward if mode == "vmap" else own_masks.single_forward
        forward, train_forward = of(template, streams), of(template, streams, stacked=True)
    elif mode == "vmap":
        forward, train_forward = vmap_forward(template), vmap_forward(template, stacked=True)
    else:
        forward, train_forward = single_forward(template), single_forward(template, True)
    losses = None
    if workload.custom_step:
        losses = custom_losses(workload.training_loss, template, mode == "serial", stacked)
    return Stack(
        forward, template, stochastic, mode, stacked=stacked,
        train_forward=train_forward if stacked else None, losses=losses, streams=streams,
    )  # fmt: skip


def _forwards(
    workload: Workload,
    template: nn.Module,
    part: list[int],
    mode: StackMode,
    stochastic: bool,
    precision: str = "fp32",
    apart: bool = False,
    rounding: bool = False,
    dropout_only: bool = False,
    shared_as: Mapping[int, Any] | None = None,
) -> list[tuple[list[int], Stack]]:
    """The stacks a part of equal models runs as: ``(member indices, stack)``.

    In ``auto`` mode a bf16 model that would stack through vmap runs ``serial``: bf16
    rounding of vmap's batched convolution differs from one model's by ~1e-3, and training
    grows that (digits-cnn: 13% apart after two epochs at lr 0.08), so the result would
    depend on the pack. The hand-fused ``bmm`` path rounds like one model's in bf16 too.
    ``apart``: the members train one per stack (their steps change the batch in place, or
    build_model kept values on the workload that differ between them). ``rounding``: a
    gradient is float rounding and the optimizer scales it to a full step
    (:func:`worker.probe.rounding_noise`): through vmap, whose batched kernels round
    otherwise, each member would end apart from its unpacked run, so it runs ``serial``.
    Stacks of one member each have a template of their own: Python state a forward keeps on
    its module (a step counter) is then each member's, as unpacked. ``dropout_only``: the
    model's only draws are its ``nn.Dropout`` modules' (:attr:`worker.probe.Probed.dropout_only`):
    a hand-fusable one then stacks ``bmm`` (or ``serial``, ``apart``) with each member's masks
    from its own stream, the same masks in any stack (:class:`MemberStreams`).
    """
    plan = None if workload.custom_step else bmm_plan(template, convs=mode == "bmm")
    # a model of its own (vmap) in bf16 keeps one member per stack, as bf16 vmap stacks do
    own = (dropout_only and stochastic and not workload.stochastic and not workload.custom_step
           and (plan is not None or precision != "bf16"))  # fmt: skip
    if own:  # its draws are each member's own, no longer the stack's
        stochastic = False
        if plan is not None and mode != "vmap":
            mode = "serial" if apart or mode == "serial" else "bmm"
        elif mode == "auto":
            alike = apart or len(part) == 1 or rounding
            mode = "serial" if alike else "vmap"
    elif mode == "auto":
        if stochastic or apart:
            mode = "serial"  # each member draws from its own stream alone, as when unpacked
        elif plan is not None:
            mode = "bmm"
        else:
            alike = len(part) == 1 or precision == "bf16" or rounding
            mode = "serial" if alike else "vmap"
    if mode == "bmm" and plan is None:
        raise ValueError(f"{workload.name}'s model is not a hand-fusable Sequential")

    def stack(template: nn.Module) -> Stack:
        return stack_of(workload, template, mode, stochastic, MemberStreams() if own else None)

    if mode == "serial":
        return [([i], stack(own_copy(template, n, shared_as))) for n, i in enumerate(part)]
    return [(list(part), stack(template))]


def own_copy(template: nn.Module, n: int, shared_as: Mapping[int, Any] | None = None) -> nn.Module:
    """The template of a stack's ``n``-th one-member stack: the first takes ``template``,
    each other one a copy of it (meta tensors: no memory; ``shared_as``: as
    :func:`worker.outside_state.copy_model`)."""
    return template if n == 0 else outside.copy_model(template, shared_as)


def _split_warning(
    workload: Workload,
    keys: Sequence[Hashable],
    configs: Sequence[Mapping[str, Any]],
    parts: Sequence[Sequence[int]],
) -> str:
    causes = split_causes(configs, parts)
    groups = "; ".join(", ".join(str(keys[i]) for i in part) for part in parts)
    if causes == ["seed"]:  # no parameter to name: the model depends on the trial itself
        return (
            f"{workload.name}: members build models that differ in more than tensor values, "
            "in something build_model makes per trial (an architecture drawn from the seed, "
            "a tensor kept outside the registered parameters and buffers, an object made per "
            f"model), so they are trained as {len(parts)} separate stacks ({groups}), not "
            "fused; `packtune check` shows what differs"
        )
    return (
        f"{workload.name}: members build models that differ in more than tensor values "
        f"(parameter {', '.join(repr(c) for c in causes)}), so they are trained as "
        f"{len(parts)} separate stacks ({groups}), not fused. Declare the parameter "
        "structural, or carry it in the model as a tensor if it is meant to be fusible."
    )


class FusedArray:
    """k trials of one workload and fusion key, trained on shared batches.

    ``members`` are ``(key, config)`` pairs: ``key`` identifies the trial
    (its id), ``config`` carries ``seed`` and ``data_seed``. ``states``
    optionally gives each member's exported :meth:`member_state` (``None`` for
    a fresh one); every member must be at the same step. ``data`` may pass
    the workload's (train, validation) splits to share them between arrays.

    Members whose built models differ in anything but tensor values
    (:func:`worker.fusion_guard.model_signature`) are stacked apart: each such
    part has its own template and forward, on the same batches. ``warning``
    then says why, naming the parameter; ``mode`` is the first part's.

    ``spill_budget`` (bytes): the array does not fit its device; its stacks keep their
    tensors on the host and train shard by shard through that much of the device
    (:mod:`worker.spill`), with the same results; ``spill_prefetch`` False: one shard at a
    time in that budget (another array alternates with it). A model that cannot be spilled (not an
    ``nn.Sequential``, or a workload with its own ``training_loss``) raises
    :class:`~packtune.spilling.Unspillable`.
    """

    def __init__(
        self,
        workload: Workload,
        members: Sequence[tuple[Hashable, Mapping[str, Any]]],
        *,
        device: str | torch.device = "cpu",
        mode: StackMode = "auto",
        states: Sequence[Mapping[str, Any] | None] | None = None,
        data: tuple[Split, Split] | None = None,
        spill_budget: int | None = None,
        spill_prefetch: bool = True,
        training: TrainingSettings | None = None,
        segment: int | None = None,
        compile_step: bool = False,
        compile_mode: str | None = None,
    ) -> None:
        if not members:
            raise ValueError("an array needs at least one member")
        # the array's own workload object: what build_model keeps on it (a value its loss
        # reads) is then this array's, not another array's trained beside it in a thread
        workload = copy.copy(workload)
        outside.share(workload)
        states = list(states) if states is not None else [None] * len(members)
        keys = [key for key, _ in members]
        if len(set(keys)) != len(keys) or len(states) != len(keys):
            raise ValueError("member keys must be unique, with one state (or None) each")
        configs = [workload.resolve(config) for _, config in members]
        _check_fusible(workload, configs)
        done = {int(s["steps_done"]) if s else 0 for s in states}
        if len(done) != 1:
            raise ValueError(f"members of one array must be at the same step; got {sorted(done)}")
        self.workload, self.device = workload, torch.device(device)
        #: device bytes a spilled array may use (None: the array trains in device memory)
        self.spill_budget, self.spill_prefetch = spill_budget, spill_prefetch
        #: decoupled segments (training.mode), or None: end to end
        self.decoupled = training if training and training.mode == "decoupled" else None
        if self.decoupled is not None and spill_budget is not None:
            raise ValueError(
                "it needs more memory than the device has, and decoupled training and "
                "spilling do not combine yet"
            )
        if segment is not None and self.decoupled is None:
            raise ValueError("a segment trains alone only in decoupled training")
        #: the one segment this array trains (a segment unit), or None: the whole model
        self.segment = segment
        home = torch.device("cpu") if spill_budget is not None else self.device
        self.config = configs[0]
        self.configs = dict(zip(keys, configs, strict=True))
        self.step = done.pop()
        self.steps_per_epoch = workload.steps_per_epoch(self.config)
        self.diverged: dict[Hashable, int] = {}
        self.check_every = CUDA_CHECK_EVERY if self.device.type == "cuda" else 1
        # each member built from its trial seed, torch's generators and the host's (Python's
        # random, NumPy's) alike, and the host's left to its own stream from there
        host = host_state()
        models: list[nn.Module] = []
        #: the workload object's attributes its training changes (a counter its loss keeps),
        #: and the model's modules' (a step counter a forward keeps): each member's own,
        #: carried in its checkpoints (:meth:`member_state`), so that a trial resumed at
        #: any step goes on as an unbroken one, however its training was cut
        self.workload_state: set[str] = set()
        self.model_state: set[str] = set()
        self._active: Hashable | None = None  # whose values the workload object holds
        #: the workload object before any member's build_model or resumed values: each
        #: member's build starts from it, as a fresh process's would
        base = dict(vars(workload))
        #: each member's own host random stream (used by an array that draws from it)
        self.host_streams: dict[Hashable, HostState] = {}
        #: the workload object's attributes after each member's build_model, which may keep
        #: values on it that its loss reads (:func:`worker.fusion_guard.workload_differences`)
        built: dict[Hashable, dict[str, Any]] = {}
        #: where the workload may keep values outside its model and its workload object
        #: (module globals, class attributes: :mod:`worker.outside_state`), and each member's
        #: values there after its build, put back before its stack's steps and evaluations
        self.outside_spaces: list[outside.Namespace] = []
        self.outside_built: dict[Hashable, outside.Reading] = {}
        #: the members whose outside values the namespaces hold within a hold of the lock
        #: (:meth:`_outside_held`), or None: outside one
        self._outside_on: list[Hashable] | None = None
        #: the names kept outside that changed by these members' builds (or since the last)
        seeded: set[tuple[outside.Namespace, str]] = set()
        #: each member's workload attributes that a build may change in place, held after it
        held_attributes: dict[Hashable, dict[str, Any]] = {}
        #: the workload's attributes these members' builds changed in place
        changed_attributes: set[str] = set()
        #: the member whose held workload attributes the workload holds within a hold of the
        #: lock (:meth:`_workload_held`)
        self._attributes_on: Hashable | None = None
        #: the process's torch settings (the default dtype, ...), which each member's build
        #: starts from, and each member's after its build
        self.torch_base = torch_settings.read()
        torch_after: dict[Hashable, torch_settings.Settings] = {}
        #: larger tensors kept outside the model that a build changed in place (not held)
        unheld: set[str] = set()
        #: a resumed member's values kept outside the model as its build left them (before
        #: its checkpoint's were put in their place)
        as_built: dict[Hashable, outside.Reading] = {}
        #: the dicts, lists and sets each name held after each build, by id
        containers: dict[tuple[outside.Namespace, str], dict[int, Any]] = {}
        try:
            for key, config, state in zip(keys, configs, states, strict=True):
                _start_from(workload, base)  # not another member's build or resumed values
                torch_settings.put(self.torch_base)
                seed_host(int(config["seed"]))
                before = outside.fresh(outside.namespaces(workload))
                objects_before = outside.containers(before)
                objects, before_attributes = (
                    dict(vars(workload)),
                    outside.fresh_attributes(workload),
                )
                copies = outside.large_copies(before)
                large = outside.large_tensors(before)
                layers = outside_layers([*before, workload])

                def after_build(
                    model: nn.Module,
                    large: outside.Versions = large,
                    spaces: Any = before,
                    copies: outside.Copies = copies,
                    layers: Layers = layers,
                ) -> nn.Module:
                    # the build's own changes (not a resumed state's load into a module
                    # global its model holds as a buffer); those held from now on first
                    outside.held_large(spaces, copies)
                    unheld.update(outside.changed_in_place(large, outside.large_tensors(spaces)))
                    # a buffer or a layer kept outside (a global the next build fills or
                    # initialises in place): the member's own, as its build left it
                    model = own_layers(model, layers, outside.copy_model)
                    own_copies(model, [*outside.namespaces(workload, model), workload])
                    return model

                model = _build_model(workload, config, state, after_build)
                torch_after[key] = torch_settings.read()
                held_attributes[key] = outside.attributes(workload)
                changed_attributes |= outside.learn_attributes(
                    workload, objects, before_attributes, held_attributes[key]
                )
                saved_held = state.get("python", {}).get("workload_held") if state else None
                if saved_held:  # what its training had made of them
                    outside.resume_attributes(workload, held_attributes[key], saved_held)
                spaces = outside.namespaces(workload, model)
                objects_after = outside.containers(spaces)
                outside.note_set_anew(objects_before, objects_after)
                self.outside_built[key] = outside.reading(spaces)
                for where, value in objects_after.items():  # (set anew per build?)
                    containers.setdefault(where, {})[id(value)] = value
                seeded |= outside.learn(before, self.outside_built[key])
                self.outside_spaces += [s for s in spaces if s not in self.outside_spaces]
                saved_python = state.get("python") if state else None
                if saved_python and saved_python.get("outside"):
                    as_built[key] = {s: dict(v) for s, v in self.outside_built[key].items()}
                    outside.resume(self.outside_built[key], saved_python["outside"])
                if saved_python:
                    set_python_state(model, saved_python.get("model", {}))
                    for name, value in saved_python.get("workload", {}).items():
                        built_value = vars(workload).get(name)
                        if isinstance(value, Tensor) and isinstance(built_value, Tensor):
                            value = value.to(built_value.device)  # saved on the CPU
                        setattr(workload, name, copy.deepcopy(value))
                models.append(model)
                built[key] = dict(vars(workload))
                # resumed: where the stream stood at the checkpoint (an array drawing from
                # it saves it)
                saved = state.get("host_rng") if state else None
                self.host_streams[key] = decode_host(saved) if saved else host_state()
        finally:  # the process's own between its steps (not a failed build's either)
            torch_settings.put(self.torch_base)
            set_host_state(host)
        #: each member's torch settings that some member's build changed, put back around
        #: its stack's steps and evaluations (:meth:`_put_outside`), the process's after them
        self.torch_own, changed_torch, torch_apart = torch_settings.members_own(
            self.torch_base, torch_after
        )
        #: each member's workload attributes that a build may change in place (a settings
        #: object, a generator), held; those some build in this process changed
        #: (:meth:`_workload_held`) are put back before its steps and carried after them
        self.attributes_built = held_attributes
        drifted = sorted(
            set(workload_differences(list(built.values())))
            | set(outside.differing_attributes(held_attributes.values(), changed_attributes))
        )
        outside_names = outside.kept(self.outside_spaces)
        #: a kept name's container that builds set anew (``CONFIG = {...}``): a member's
        #: model may hold the one its build made, which later builds' starts fill in place,
        #: so the array's templates hold the one there now instead (:data:`shared_as`), and
        #: each member's values are put back into it (:meth:`_put_outside`)
        self.outside_targets: dict[tuple[outside.Namespace, str], Any] = {}
        #: objects a copy of a member's model holds as another (by id: the target; while
        #: the templates are made, the builds' containers too)
        self.shared_as: dict[int, Any] = {}
        for (space, name), made in containers.items():
            target = vars(space).get(name)
            # (held as a plain copy, which put_back fills into the container there: one of
            # other values, or of more entries, is put back into its own object)
            plain = all(
                type(held) in (dict, list, set)
                for held in (r.get(space, {}).get(name) for r in self.outside_built.values())
            )
            if name in outside_names.get(space, ()) and plain and type(target) in (dict, list, set):
                if target is outside.set_anew(space, name):
                    # one of the array's own (not a dict a build took: a table's entry)
                    target = copy.deepcopy(target)
                self.outside_targets[space, name] = target
                for obj in [*made.values(), target]:  # (a copy of a template holds it)
                    self.shared_as.update(outside.paired(obj, target))
        kept_apart = (
            outside.differing(self.outside_built.values(), outside_names, seeded)
            if outside_names
            else []
        )
        #: of those, the ones the builds set differently (the rest differ only in the values
        #: resumed members' checkpoints carry: a counter another workload of the module kept)
        built_apart = (
            outside.differing(
                [as_built.get(key, self.outside_built[key]) for key in keys], outside_names, seeded
            )
            if kept_apart and as_built
            else kept_apart
        )
        carried_apart = [name for name in kept_apart if name not in built_apart]
        #: each member's values of the attributes its build_model set differently per trial,
        #: put back on the workload before its stack's steps and evaluation (one per stack;
        #: :data:`MISSING`: its build set none, and the class's value shows)
        self.member_values = {
            key: {name: values.get(name, MISSING) for name in drifted}
            for key, values in built.items()
        }
        #: each member's tied tensors' other names (:mod:`worker.ties`), for its exported state
        self.ties = {key: aliases(model) for key, model in zip(keys, models, strict=True)}
        signatures = [model_signature(m) for m in models]
        parts = partition(signatures)
        self.warning = _split_warning(workload, keys, configs, parts) if len(parts) > 1 else None
        if self.warning:
            log.warning("%s", self.warning)
        self.generators = {
            key: _member_generator(config, state)
            for key, config, state in zip(keys, configs, states, strict=True)
        }
        self.precision = str(self.config.get("precision", "fp32"))
        if self.precision not in PRECISIONS:  # fp32 would train without a word
            raise ValueError(
                f"{workload.name}: precision {self.precision!r} is not one of "
                f"{', '.join(PRECISIONS)}"
            )
        #: what the array did that its caller should know (a vmap stack split per member)
        self.notes: list[str] = []
        if built_apart:
            shown = _first_three([repr(n) for n in built_apart])
            self.notes.append(
                f"{workload.name}: build_model set {shown} outside the model (a module global "
                "or a class attribute), differently per trial, and every model in a process "
                "reads the last value set there; its members train one at a time, each with "
                "its own values put back, as unpacked. Keep per-trial values in the model (a "
                "buffer) for them to be fused; a cache build_model fills on first use (a "
                "helper loaded into a global that was None) counts too: fill it at import or "
                "in data()"
            )
            _warn_once(("outside", workload.name, tuple(built_apart)), self.notes[-1])
        if carried_apart:
            self.notes.append(
                f"{workload.name}: its resumed members' checkpoints hold different values of "
                f"{_first_three([repr(n) for n in carried_apart])}, kept outside the model (a "
                "module global or a class attribute that a build or a training step in the "
                "module changed); its members train one at a time, each with its own values "
                "put back, as unpacked"
            )
            log.info("%s", self.notes[-1])
        if unheld:
            self._note_unheld(sorted(unheld), "build_model changed")
        if changed_torch:
            self.notes.append(
                f"{workload.name}: build_model set {', '.join(changed_torch)}, which every "
                "model in a process computes under; each member's build starts from the "
                "process's settings, and its own are in force around its steps and "
                "evaluations only" + (", one member at a time, as unpacked" if torch_apart else "")
            )
            _warn_once(("torch", workload.name, tuple(changed_torch)), self.notes[-1])
        if drifted:
            self.notes.append(
                f"{workload.name}: build_model set {', '.join(repr(a) for a in drifted)} on the "
                "workload object, differently per trial; its members train one at a time, "
                "each with its own values put back, as unpacked. Keep per-trial values "
                "in the model (a buffer) for them to be fused"
            )
        self.streaming = workload.streams
        self.train_split: Split | None = None
        self.val_split: Split | None = None
        if not self.streaming:
            if data is None:  # read as before any build (as a worker reads them)
                outside.fresh(outside.namespaces(workload))
            self.train_split, self.val_split = data or data_splits(
                workload, self.config, self.device
            )
        #: the model draws from the host's generators: each member's step from its own stream
        self.host_random = False
        #: training changes its batch in place: each stack steps on (and evaluates) a copy
        self.copies_batches = False
        probes: list[tuple[Tensor, Tensor]] = []
        if self.train_split is not None:
            size = int(self.config.get("batch_size", PROBE_EXAMPLES))
            for n in sorted({PROBE_EXAMPLES, max(1, size)}):
                probes.append((self.train_split.x[:n], self.train_split.y[:n]))
        self.groups: list[Group] = []
        #: each member's probe (:func:`worker.probe.probe_key`): what its steps teach it
        self.probe_keys: dict[Hashable, Hashable] = {}
        #: the probes that ran on no batch (streamed data whose loader gave none)
        self.unprobed: set[Hashable] = set()
        #: the optimizer scales each gradient to a full step (all but SGD, which steps by a
        #: gradient of float rounding, ~1e-8 of the weights, and nothing shows)
        self.scales_gradients = str(self.config.get("optimizer", "sgd")) != "sgd"
        for part in parts:
            template = meta_template(
                models[part[0]], lambda m: outside.copy_model(m, self.shared_as)
            )
            for i in part:
                self.probe_keys[keys[i]] = probe_key(workload, signatures[part[0]])
            if self.streaming and not probes and not probed_already(workload, signatures[part[0]]):
                probes = self._probe_batches()
                if not probes:  # the first step looks at what it can (_rounding_noise)
                    self.unprobed.add(self.probe_keys[keys[part[0]]])
            self._put_outside(keys[part[0]])
            try:
                probed = probe(
                    self._with_values(keys[part[0]]), models[part[0]], signatures[part[0]], probes
                )
            finally:
                torch_settings.put(self.torch_base)  # its own were in force for its probe only
            for reading in [*self.outside_built.values(), *as_built.values()]:
                outside.settle(reading)  # a larger tensor the probe saw a step change
            if probed.reassigned:
                names = ", ".join(repr(n) for n in probed.reassigned)
                raise ValueError(
                    f"{workload.name}'s model replaces its buffer {names} in forward (self.x = "
                    "...): packtune holds buffers as stacked tensors and would keep the old "
                    "value; update it in place instead (self.x.copy_(...), .mul_(), .add_())"
                )
            if probed.unheld_outside:
                self._note_unheld(list(probed.unheld_outside), "a training step changes")
            stochastic = is_stochastic(workload, models[part[0]], probed)
            self.host_random |= probed.host_draws
            self.model_state.update(probed.model_state)
            if probed.workload_state:
                self.workload_state.update(probed.workload_state)
                for i in part:  # from its own build_model's (or checkpoint's) values
                    values = self.member_values.setdefault(keys[i], {})
                    for name in probed.workload_state:
                        values.setdefault(name, copy.deepcopy(built[keys[i]].get(name, MISSING)))
                names = ", ".join(repr(n) for n in sorted(probed.workload_state))
                self.notes.append(
                    f"{workload.name}: a training step changes {names} on the workload object "
                    "(one object per array); its members train one at a time, each with its "
                    "own values, as unpacked. Keep such state in the model (a buffer) for "
                    "them to be fused"
                )
            unsaved = sorted(
                n for n in probed.workload_state
                if not checkpointable(built[keys[part[0]]].get(n))
            ) + sorted(
                n for n, v in python_state(models[part[0]]).items()
                if n in probed.model_state and not checkpointable(v)
            )  # fmt: skip
            if unsaved:
                self.notes.append(
                    f"{workload.name}: training changes {', '.join(repr(n) for n in unsaved)}, "
                    "which a checkpoint cannot hold (not numbers, strings or containers of "
                    "them): a trial resumed at a rung starts them from build_model's values, "
                    "so its result depends on where its training is cut; keep such state in "
                    "a buffer"
                )
            if probed.note is not None:
                self.notes.append(probed.note)
            if probed.mutates and not self.copies_batches:
                self.copies_batches = True
                self.notes.append(
                    f"{workload.name}: training changes its input batch in place (an in-place "
                    "op on a forward's input, targets changed in a loss); its members train "
                    "one at a time, each on its own copy of the batch, as unpacked. Make the "
                    "operation out of place (x = x / 255) for them to be fused"
                )
            if self.decoupled is not None:
                targets = self.train_split.y if self.train_split is not None else None
                problem = decoupled_problem(workload, template, self.decoupled.segments, targets)
                if problem is not None:
                    raise ValueError(f"cannot train decoupled: {problem}")
            problem = spill_problem(workload, template) if spill_budget is not None else None
            if problem is not None:
                raise Unspillable(
                    f"{workload.name} needs more memory than the device has ({spill_budget:,} "
                    f"bytes), and it cannot be spilled: {problem}"
                )
            only = (None if self.decoupled is None or segment is None
                    else segment_names(template, self.decoupled.segments, segment))  # fmt: skip
            # a tensor a forward keeps on its module (not a buffer: self.ema = ...), or in a
            # module global, holds a stack's batched value under vmap, which no member can
            # hold or save: apart
            apart = (probed.mutates or bool(drifted) or bool(kept_apart) or bool(torch_apart)
                     or bool(probed.workload_state) or bool(probed.tensor_state)
                     or bool(probed.outside_tensors))  # fmt: skip
            if probed.outside_tensors:
                names = _first_three([repr(n) for n in probed.outside_tensors])
                note = (
                    f"{workload.name}: a training step sets {names} outside the model (a "
                    "module global or a class attribute) to a tensor, which fused members' "
                    "forward would fill with all of theirs at once; its members train one at "
                    "a time, each with its own value, as unpacked. Keep such state in the "
                    "model (a buffer) for them to be fused"
                )
                if note not in self.notes:
                    self.notes.append(note)
            rounding = bool(probed.noise) and self.scales_gradients
            # spilled and decoupled stacks run their layers in shards (worker.spill), whose
            # masks come from torch's generator (a spilled one's recompute redraws them)
            own_masks = probed.dropout_only and spill_budget is None and self.decoupled is None
            stacks = _forwards(workload, template, part, mode, stochastic, self.precision,
                               apart=apart, rounding=rounding, dropout_only=own_masks,
                               shared_as=self.shared_as)  # fmt: skip
            if mode == "auto" and len(stacks) > 1 and not apart:  # say why, as for the rest
                why = (
                    "draws random numbers (dropout, or a draw in its forward): fused, its "
                    "members would share one stream of draws" if stochastic else
                    "trains in bf16 through vmap, whose batched rounding is not one model's"
                )  # fmt: skip
                note = (f"{workload.name}: the model {why}, so results would depend on the "
                        "packing; its members train one at a time, as unpacked")  # fmt: skip
                if rounding and not stochastic and self.precision != "bf16":
                    note = self._rounding_note(probed.noise)
                if note not in self.notes:
                    self.notes.append(note)
            for idx, stack in stacks:
                params, buffers = _stack([models[i] for i in idx], home, only)
                self.groups.append(self._group(
                    [keys[i] for i in idx], params, buffers,
                    [s["optimizer"] if s else None for s in (states[i] for i in idx)], stack,
                ))  # fmt: skip
        # (the builds' own containers may go now, and their ids be another's: the targets)
        self.shared_as = {
            k: v for t in self.outside_targets.values() for k, v in outside.paired(t, t).items()
        }
        self.stochastic = any(group.stochastic for group in self.groups)
        #: each compiled group's step key (:mod:`worker.compiled`), and the compile mode
        self.step_keys: dict[int, Hashable] = {}
        self.compile_mode = compile_mode
        #: seconds and steps of compiled groups' guarded steps (compilations): left out of
        #: the array's measured throughput, which is the steady state's
        self.compile_seconds, self.compile_steps = 0.0, 0
        if compile_step:
            for group in self.groups:
                self._compile(group)
        #: steps of the current epoch trained before a member's checkpoint (taken in the
        #: middle of an epoch, when its pack gave its device up): their summed losses are
        #: carried, so that the epoch's train_loss is the one an unbroken epoch gives
        self.carried_steps: dict[Hashable, int] = {}
        for key, state in zip(keys, states, strict=True):
            if state and "epoch_loss" in state:
                group, i = self._locate(key)
                group.losses.carry(i, float(state["epoch_loss"]))
                self.carried_steps[key] = int(state["epoch_loss_steps"])
        if spill_budget is not None:  # the data set lives on the device beside the shards
            splits = [split for split in (self.train_split, self.val_split) if split is not None]
            held = sum(t.numel() * t.element_size() for split in splits for t in (split.x, split.y))
            for group in self.groups:
                if isinstance(group, SpilledGroup):
                    group.budget = spill_budget - held

    def _group(
        self,
        keys: list[Hashable],
        params: dict[str, Tensor],
        buffers: dict[str, Tensor],
        optimizer_states: Sequence[Any],
        stack: Stack,
    ) -> Group:
        configs = [self.configs[key] for key in keys]

        def build(params: dict[str, Tensor], states: Sequence[Any]) -> Any:
            return build_optimizer(
                str(self.config["optimizer"]), params, hyper_tensors(configs),
                nesterov=bool(self.config.get("nesterov", False)),
                states=list(states),
                schedules=schedules(configs, self.steps_per_epoch),
                pin=self.spill_budget is not None and self.device.type == "cuda",
            )  # fmt: skip

        if self.decoupled is not None:
            assert self.train_split is not None
            return decoupled_group(
                keys, params, buffers, optimizer_states, stack, self.precision, self.decoupled,
                int(self.config.get("data_seed", 0)), self.train_split.x[:2], build,
                self.segment,
            )  # fmt: skip
        optimizer = build(params, optimizer_states)
        if self.spill_budget is not None:
            return SpilledGroup(keys, params, buffers, optimizer, stack, self.precision,
                                self.device, self.spill_budget, self.spill_prefetch)  # fmt: skip
        return Group(keys, params, buffers, optimizer, stack, self.precision)

    def _compile(self, group: Group) -> None:
        """Give ``group`` its compiled step (:mod:`worker.compiled`) where one applies."""
        if (type(group) is not Group or group.stochastic or group.stack.streams is not None
                or self.workload_state or self._keeps_outside()):  # fmt: skip
            # spilled and decoupled stacks, random draws, steps that change the workload
            # object (its compiled step would hold one frozen copy of it), and values kept
            # outside the model (put back per member, which a compiled step may have frozen)
            # stay eager
            return
        device, precision = self.device, self.precision
        # this stack's values put back, frozen in a copy of the workload for its compiled
        # step, which later arrays whose workload holds the same values reuse
        workload = copy.copy(self.workload_of(group))
        key = compiled.variant_key(
            (workload.name, model_signature(group.template), group.mode,
             workload.per_member_batches, precision, device.type, device.index),
            vars(workload),
        )  # fmt: skip

        def make(own: nn.Module) -> Any:
            stack = stack_of(workload, own, group.mode, group.stochastic)
            return losses_function(stack, workload, precision, device)

        group.compiled = compiled.compiled_step(
            key, make, group.template, device, self.compile_mode
        )
        if group.compiled is not None:
            self.step_keys[id(group)] = key

    def _uncompile_stateful(self, group: Group, own: nn.Module, changed: list[str]) -> None:
        """``group``'s compiled step changed Python attributes of its (shared) template: the
        step stands (it is the eager one's), the changes go to the group's own template, and
        the key trains eagerly from here on."""
        copy_state(own, group.template, changed)
        names = _first_three([repr(n) for n in changed])
        note = compiled.refuse(
            self.step_keys.pop(id(group)),
            f"a training step changed Python attributes of its modules ({names}), which a "
            "compiled step would share between every array of the model in this process",
        )
        self.notes.append(f"{self.workload.name}: {note}")
        group.compiled = None
        group.compiled_shapes.clear()

    def _recompile(self, group: Group) -> None:
        """``group``'s compiled step anew (its key was dropped or went eager in another
        array): the key's current one, or eager."""
        self.step_keys.pop(id(group), None)
        group.compiled = None
        group.compiled_shapes.clear()
        self._compile(group)
        note = f"{self.workload.name}: its compiled step went eager in another array"
        if group.compiled is None and note not in self.notes:
            self.notes.append(note)

    def _rounding_note(self, noise: tuple[str, ...]) -> str:
        names = _first_three([repr(n) for n in noise])
        return (
            f"{self.workload.name}: the model has gradients that are float rounding ({names}: "
            "e.g. a bias a BatchNorm cancels, or attention's key bias, which the softmax "
            f"cancels), which {self.config.get('optimizer')} scales to full steps: through "
            "vmap, whose batched rounding is not one model's, each member would take other "
            "steps, so results would depend on the packing; its members train one at a time, "
            "as unpacked. Such a bias does nothing: without it (bias=False) they fuse"
        )

    def _vmap_failed(self, group: Group, error: BaseException, what: str = "step") -> list[Group]:
        """``group``'s members as one stack each: its vmap ``what`` (its first step, or its
        first evaluation) failed."""
        note = (
            f"{self.workload.name}: vmap could not run the fused {what} "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); "
            f"members {', '.join(map(str, group.keys))} "
            + ("train one at a time instead" if what == "step" else
               "are evaluated and train one at a time from here on")
        )  # fmt: skip
        _warn_once(("split", self.workload.name), note)
        self.notes.append(note)
        return self._split_per_member(group)

    def _hold(self, group: Group, workload: Workload) -> _Held:
        """What a guarded first step or evaluation of ``group`` may change before it fails
        (its forward runs in part), for :meth:`_put_back`: buffers, parameters (a forward may
        change one in place: a decay under ``no_grad``; held on the host), the Python
        attributes of the template's modules (a step counter; per-member templates are copies
        of it) and ``workload``'s (the workload object, with the group's values)."""
        # a spilled stack's forward on a GPU runs on device copies of its host parameters
        on_device = isinstance(group, SpilledGroup) and group.side is not None
        return _Held(
            params={} if on_device else {
                n: p.detach().to("cpu", copy=True) for n, p in group.params.items()},
            buffers={n: b.clone() for n, b in group.buffers.items()},
            python=python_state(group.template),
            workload=object_state(workload),
        )  # fmt: skip

    def _put_back(self, group: Group, workload: Workload, held: _Held) -> None:
        """``group`` and ``workload`` as :meth:`_hold` found them."""
        with torch.no_grad():
            for n, p in held.params.items():
                group.params[n].copy_(p)
            for n, b in held.buffers.items():
                group.buffers[n].copy_(b)
        restore_python_state(group.template, held.python)
        restore_object_state(workload, held.workload)

    def _rounding_noise(self, group: Group, batch: Any) -> tuple[str, ...]:
        """Before the first step of a vmap stack that no probe ran on (streamed data whose
        validation loader gave no batch to probe with), under
        an optimizer that scales its gradients to full steps: the parameters whose gradient
        is float rounding (:func:`worker.probe.rounding_noise`), on member 0's part of the
        batch; learned for this process, so that later arrays of its model train apart from
        the start. Changes nothing of the group (copies; the workload object's attributes put
        back)."""
        if (
            type(group) is not Group
            or group.mode != "vmap"
            or group.proven
            or self.probe_keys[group.keys[0]] not in self.unprobed
            or not self.scales_gradients
        ):
            return ()
        workload = self.workload_of(group)
        first = tree_map(lambda t: t[0:1], batch) if group.stack.stacked else batch
        buffers = {n: b[0:1] for n, b in group.buffers.items()}
        held = object_state(workload)

        def losses(params: dict[str, Tensor]) -> Tensor:
            # each run from the same state: a step counter on a module or on the workload
            # object moved by the first would make the second's gradient another one
            restore_object_state(workload, held)
            own = outside.copy_model(group.template, self.shared_as)
            single = stack_of(workload, own, "serial", group.stochastic)
            run = losses_function(single, workload, self.precision, self.device)
            return run(params, {n: b.clone() for n, b in buffers.items()}, first)

        try:
            names = rounding_noise(losses, {n: p[0:1] for n, p in group.params.items()})
        finally:
            restore_object_state(workload, held)
        if names:
            learn_noise(self.probe_keys[group.keys[0]], names)
        return names

    def _split_per_member(self, group: Group) -> list[Group]:
        """``group``'s members as one stack each, in its place among the array's groups: the
        same tensors, optimizer state and epoch loss so far, trained one at a time from here
        on."""
        singles = [
            self._group(
                [key],
                {
                    n: p.detach()[i : i + 1].clone().requires_grad_(p.requires_grad)
                    for n, p in group.params.items()
                },
                {n: b[i : i + 1].clone() for n, b in group.buffers.items()},
                [group.optimizer.member_state(i)],
                stack_of(
                    self.workload,
                    own_copy(group.template, i, self.shared_as),
                    "serial",
                    group.stochastic,
                    MemberStreams() if group.stack.streams is not None else None,
                ),
            )  # fmt: skip
            for i, key in enumerate(group.keys)
        ]
        # the epoch's losses so far (carried from a checkpoint taken mid-epoch, or summed
        # before the failing step) go with each member: its train_loss divides by them
        sums, bad = group.losses.totals(), group.losses.bad_steps()
        for i, single in enumerate(singles):
            single.losses.carry(0, sums[i], bad[i])
        at = self.groups.index(group)
        self.groups[at : at + 1] = singles
        return singles

    def spill_notes(self) -> list[str]:
        """What a spilled array says of how it ran (nothing for an array in device memory)."""
        return [
            f"spilled: larger than the device's {group.budget:,} bytes, so "
            f"{'trials' if len(group.keys) > 1 else 'trial'} {', '.join(map(str, group.keys))} "
            f"trained in {group.shard_count} shards of layers, moved through the device in turn"
            + (
                ", alternating with the pack's other spilled arrays"
                if group.alternating
                else ""
                if group.prefetch
                else ", one at a time (a layer is too large to copy the next in meanwhile)"
            )
            for group in self.groups
            if isinstance(group, SpilledGroup) and group.shard_count
        ]

    @property
    def mode(self) -> str:
        """The forward of the first stack (``bmm``, ``vmap`` or ``serial``)."""
        return self.groups[0].mode if self.groups else "serial"

    @property
    def stacks(self) -> list[tuple[list[Hashable], str]]:
        """Each stack's members and the forward it runs (what ``packtune check`` reports)."""
        return [(list(group.keys), group.mode) for group in self.groups]

    def stack_records(self) -> list[dict[str, Any]]:
        """Each stack as a pack records it: its members, its forward, and ``compiled`` for
        a stack that trained through a compiled step."""
        return [
            {"trials": list(group.keys), "mode": group.mode,
             **({"compiled": True} if group.compiled is not None else {})}
            for group in self.groups
        ]  # fmt: skip

    @property
    def keys(self) -> list[Hashable]:
        """Keys of the members still training, in order."""
        return [key for group in self.groups for key in group.keys]

    def workload_of(self, group: Group) -> Workload:
        """The workload ``group`` trains and is measured with: with its (first) member's own
        values of what build_model set per trial put back on it (members of a stack have
        equal ones), and its values kept outside the model (:meth:`_put_outside`)."""
        if self._outside_on is not None:
            self._carry_outside()
            self._outside_on = list(group.keys)
        self._put_outside(group.keys[0])
        return self._with_values(group.keys[0])

    @contextmanager
    def measured_with(self, group: Group) -> Iterator[Workload]:
        """The workload ``group``'s forward runs with outside a step (a memory estimate's
        forward): its members' values kept outside the model and their torch settings in
        force, as around its steps (:meth:`workload_of`), the process's put back after."""
        with self._outside_held() if self._keeps_outside() else nullcontext():
            yield self.workload_of(group)

    def _note_unheld(self, where: list[str], what: str) -> None:
        """Say that ``what`` (a build, a training step) changed the larger tensors ``where``
        (kept outside the model) in place: values packtune cannot hold per trial."""
        shown = _first_three(where)
        self.notes.append(
            f"{self.workload.name}: {what} {shown} in place, a tensor kept outside the model "
            f"and too large for packtune to hold per trial (over {SMALL_TENSOR:,} elements; "
            f"of those, a module global or class attribute of up to {MAX_HELD_LARGE:,} is "
            "held once a build or the probe's forwards change it): "
            "every trial in a worker process reads the last value set there (a model that "
            "holds it, as a buffer or a layer, has its own copy, as its build left it), "
            "packed or not, "
            "and its result may depend on what trained before it (a scratch buffer a "
            "forward overwrites before it reads it is harmless). Keep it in the model (a "
            "buffer), or set it anew (NAME = torch...) rather than in place"
        )
        _warn_once(("unheld", self.workload.name, tuple(where)), self.notes[-1])

    def _outside_values(self, key: Hashable) -> dict[outside.Namespace, dict[str, Any]]:
        """``key``'s values of the names kept outside the model (none for most workloads)."""
        if not self.outside_spaces:
            return {}
        names = outside.kept(self.outside_spaces)
        return outside.values_of(self.outside_built[key], names) if names else {}

    def _put_outside(self, key: Hashable) -> None:
        """``key``'s values kept outside the model (module globals, class attributes that
        its build_model set) put back where its forward reads them."""
        values = self._outside_values(key)
        for (space, name), target in self.outside_targets.items():
            if vars(space).get(name) is not target:  # (another array's build set its own)
                setattr(space, name, target)
        if values:
            outside.put_back(values)
        if self.torch_own:
            torch_settings.put(self.torch_own[key])

    def _carry_outside(self) -> None:
        """What the members whose values are out now made of them (a counter a forward
        keeps in a module global): theirs from here on."""
        for key in self._outside_on or ():
            values = self._outside_values(key)
            for space, held in outside.now(values).items():
                self.outside_built[key].setdefault(space, {}).update(held)
        if self._attributes_on is not None:  # a settings object, a generator of the workload
            now = outside.attributes(self.workload)
            self.attributes_built[self._attributes_on].update(
                {name: now[name] for name in self._workload_held() if name in now}
            )
            self._attributes_on = None

    def _workload_held(self) -> list[str]:
        """The workload's attributes that builds in this process changed in place (another
        array's build may add to them at any time)."""
        kept = outside.kept_attributes(self.workload)
        if not kept:
            return []
        built = self.attributes_built.values()
        return [name for name in sorted(kept) if any(name in held for held in built)]

    def _keeps_outside(self) -> bool:
        """Whether the members keep values outside the model (or change the workload object's
        in place): their steps and evaluations hold the process's lock alone (another
        array's would put its own values back)."""
        return (
            bool(self._workload_held())
            or bool(self.torch_own)
            or (bool(self.outside_spaces) and bool(outside.kept(self.outside_spaces)))
        )

    @contextmanager
    def _outside_held(self) -> Iterator[None]:
        """Within a hold of the lock: the values the members' steps leave outside the
        model carried back to them at each switch and at the end."""
        self._outside_on = []
        try:
            yield
        finally:
            self._carry_outside()
            self._outside_on = None
            if self.torch_own:
                torch_settings.put(self.torch_base)

    def _with_values(self, key: Hashable) -> Workload:
        active = self._active
        values = self.member_values.get(key, {})
        held = self._workload_held()
        if held:  # objects every array's workload shares: put back each time
            own = self.attributes_built.get(key, {})
            outside.put_attributes(self.workload, {n: own[n] for n in held if n in own})
            if self._outside_on is not None:  # carried back at the hold's end or next switch
                self._attributes_on = key
        if active == key and self.workload_state:
            return self.workload  # it holds this member's values, as its training left them
        if self.workload_state and active is not None:
            self.member_values[active].update(self._trained_values())  # what it made of them
        for name, value in values.items():
            if name not in held:
                put(self.workload, name, value)
        self._active = key
        return self.workload

    def _trained_values(self) -> dict[str, Any]:
        """The workload object's values now of the attributes training changes (copies)."""
        held = vars(self.workload)
        return {
            name: copy.deepcopy(held[name]) if name in held else MISSING
            for name in self.workload_state
        }

    def python_values(self, key: Hashable) -> dict[str, dict[str, Any]]:
        """``key``'s values of the Python state training changes (:attr:`workload_state`,
        :attr:`model_state`), of those kept outside the model (:mod:`worker.outside_state`)
        and of the workload's objects builds changed in place (:meth:`_workload_held`)
        that a checkpoint can hold; empty when there are none."""
        out: dict[str, dict[str, Any]] = {}
        if self._keeps_outside() and (kept_outside := outside.saved(self._outside_values(key))):
            out["outside"] = kept_outside
        if names := self._workload_held():
            values = self.attributes_built.get(key, {})
            held = {
                name: entry
                for name in names
                if name in values and (entry := outside.saved_value(values[name])) is not None
            }
            if held:
                out["workload_held"] = held
        if self.workload_state:
            now = self._trained_values() if key == self._active else self.member_values[key]
            out["workload"] = {
                n: v.detach().to("cpu", copy=True) if isinstance(v, Tensor) else copy.deepcopy(v)
                for n in sorted(self.workload_state)
                if (v := now.get(n, MISSING)) is not MISSING and checkpointable(v)
            }
        if self.model_state:
            group, _ = self._locate(key)
            state = python_state(group.template)
            out["model"] = {
                n: copy.deepcopy(state[n])
                for n in sorted(self.model_state)
                if n in state and checkpointable(state[n])
            }
        return out

    def _locate(self, key: Hashable) -> tuple[Group, int]:
        for group in self.groups:
            if key in group.keys:
                return group, group.keys.index(key)
        raise KeyError(f"{key!r} is not an active member of this array")

    def _member_draws(self, group: Group, peek: bool = False) -> list[int]:
        """One draw of each of ``group``'s members' own streams, in order; ``peek``: from
        copies of them (the streams are not advanced)."""
        draws = []
        for key in group.keys:
            generator = self.generators[key]
            if peek:
                generator = torch.Generator()
                generator.set_state(self.generators[key].get_state())
            draws.append(int(torch.randint(0, 2**62, (1,), generator=generator)))
        return draws

    def _seed_step(self, group: Group) -> None:
        """Before a step of ``group``: a stochastic stack reseeds torch's global generator
        from one draw of each member's own stream; one with per-member dropout streams seeds
        each of them from its member's draw; any other draws nothing."""
        if group.stochastic:
            seed_torch(_folded(0, self._member_draws(group)))
        elif group.stack.streams is not None:
            group.stack.streams.seed(self._member_draws(group), self.device)

    def _seed_evaluation(self, group: Group, part: int) -> None:
        """Before ``group``'s evaluation of validation batch ``part`` (0: the whole split in
        memory): a stochastic stack (a model or loss that draws, in eval mode too) reseeds
        torch's generator from its members' streams, read without being advanced, so a
        member draws the same in evaluation alone as in any pack, and its training draws
        are those of a run without evaluation. The host's generators too (Python's
        ``random``, NumPy's), where the model draws from them."""
        if not group.stochastic:
            return
        seed = _folded(_EVAL_SALT, [*self._member_draws(group, peek=True), part])
        seed_torch(seed)
        if self.host_random:  # its steps draw from each member's own host stream
            seed_host(seed)

    def train_step(self, batch: Any) -> None:
        """One step of every member on ``batch``: indices into the train split (in-memory
        data), or one item of :meth:`epoch_inputs` (streamed data).

        A member whose loss is not finite leaves the array, at the next
        divergence check: every step on a CPU, every :data:`CUDA_CHECK_EVERY`
        steps (and at each :func:`train` report) on a GPU. Until then it trains on
        alone in its slice: members share no arithmetic, so the others are unchanged.
        """
        pairs = self.group_batches(batch)
        for group, own in pairs:
            shared = self._shares(len(pairs), group, own)
            versions = [t._version for t in shared]
            # a step that draws from the global generators holds them; one that must not
            # shares them with its like, and is checked
            keeps = self._keeps_outside()
            exclusive = group.stochastic or self.host_random or keeps
            with GLOBAL_RNG if exclusive else GLOBAL_RNG.shared() as held, ExitStack() as hold:
                if not exclusive and self._keeps_outside():  # another array's build just now
                    keeps = hold.enter_context(GLOBAL_RNG) is not None
                before = self._generators(group)
                with self._outside_held() if keeps else nullcontext():
                    try:
                        if self.host_random:
                            self._host_step(group, own)
                        else:
                            self._step_group(group, own)
                    except own_masks.MaskMismatch as exc:
                        self._masks_mismatched(group, exc)
                if not isinstance(held, Shared) or held.undisturbed():  # else others' draws mix in
                    self._no_unseen_draws(group, before)
            if [t._version for t in shared] != versions:
                raise RuntimeError(
                    f"{self.workload.name}: a training step changed its input batch in place "
                    "(an in-place op on a forward's input, or targets changed in a loss), "
                    "which the trials of an array share: make the operation out of place "
                    "(x = x / 255)"
                )
        self.step += 1
        if self.step % self.check_every == 0:
            self.check_divergence()

    def _masks_mismatched(self, group: Group, exc: own_masks.MaskMismatch) -> None:
        """``group``'s forward called its dropout modules otherwise than its reading of them
        (a call that depends on a Python counter, say): this process learns that its model
        draws, and the pack trains again from its checkpoints, one member per stack."""
        raise self._draws_learned(
            group.keys, True, False,
            f"its forward called its dropout modules otherwise than before at step "
            f"{self.step + 1} ({exc}): each member's masks cannot be drawn ahead",
        ) from exc  # fmt: skip

    def _generators(self, group: Group) -> tuple[list[Tensor] | None, Fingerprint | None]:
        """The global generators ``group``'s step must leave alone: torch's unless it draws
        from its members' own streams, the host's unless the array does."""
        return (None if group.stochastic else torch_states(self.device),
                None if self.host_random else host_fingerprint())  # fmt: skip

    def _no_unseen_draws(
        self, group: Group, before: tuple[list[Tensor] | None, Fingerprint | None]
    ) -> None:
        """Raise :class:`UnseenDraws` where the step drew from a generator its members share
        (the probe saw no draw: one that begins after a warm-up, or at another batch size).
        Another array's step in the shared hold of :data:`GLOBAL_RNG` at once may be the one
        that drew: both learn it (safe: they train one at a time, as unpacked)."""
        self._unseen(group.keys, before, f"training drew from {{where}} at step {self.step + 1}, "
                     "which its probe had not seen (a draw after a warm-up, or at another batch "
                     "size)")  # fmt: skip

    def _unseen(
        self,
        keys: Sequence[Hashable],
        before: tuple[list[Tensor] | None, Fingerprint | None],
        what: str,
    ) -> None:
        """Raise :class:`UnseenDraws` (``what`` happened, ``{where}`` naming the generator)
        where torch's or the host's generators moved since ``before`` (None: not watched),
        once ``keys``' probes have learned that their model draws."""
        torch_before, host_before = before
        drew = torch_before is not None and not same_states(torch_before, torch_states(self.device))
        host_drew = host_before is not None and host_before != host_fingerprint()
        if not (drew or host_drew):
            return
        where = "torch's generators" if drew else "Python's or NumPy's generator"
        raise self._draws_learned(
            keys, drew, host_drew, f"{what.format(where=where)}: its members shared one stream"
        )

    def _draws_learned(
        self, keys: Sequence[Hashable], torch_draws: bool, host_draws: bool, why: str
    ) -> UnseenDraws:
        """``keys``' probes learn that their model draws (``why``); the fault that has their
        pack train again from its checkpoints, each member from its own stream."""
        for key in keys:
            learn_draws(self.probe_keys[key], torch_draws=torch_draws, host_draws=host_draws)
        return UnseenDraws(
            f"{self.workload.name}: {why}, so the pack trains again from its checkpoints, each "
            "member from its own, as unpacked"
        )

    def _shares(self, groups: int, group: Group, batch: Any) -> list[Tensor]:
        """The tensors of ``group``'s training ``batch`` that another member reads after it
        (a change in place would reach that member): all of a batch other stacks take too;
        of a stack's own, the targets its members' losses each read (a vmap forward's change
        of its input is made once, for all). None where each stack steps on a copy, or its
        members' batches are their own."""
        if self.copies_batches or self.workload.per_member_batches:
            return []
        if groups > 1:
            return tensors(batch)
        plain = not self.workload.custom_step and isinstance(batch, tuple) and len(batch) == 2
        return tensors(batch[1]) if plain and len(group.keys) > 1 else []

    def _host_step(self, group: Group, batch: Any) -> None:
        """A step of ``group`` drawing from its (first) member's own host random stream."""
        key, outer = group.keys[0], host_state()
        set_host_state(self.host_streams[key])
        try:
            self._step_group(group, batch)
        finally:
            self.host_streams[key] = host_state()
            set_host_state(outer)

    def group_batches(self, batch: Any) -> list[tuple[Group, Any]]:
        """Each group with the training batch it takes from ``batch`` (see :meth:`train_step`):
        ``(x, y)`` shared by all, or its members' own batches stacked; a copy for each
        where training changes its batch in place."""
        if self.copies_batches:
            return [(group, tree_map(torch.clone, own)) for group, own in self._batches(batch)]
        return self._batches(batch)

    def _batches(self, batch: Any) -> list[tuple[Group, Any]]:
        if not self.streaming:
            assert self.train_split is not None
            index = batch.to(self.device)
            shared = (self.train_split.x[index], self.train_split.y[index])
            return [(group, shared) for group in self.groups]
        if not self.workload.per_member_batches:
            return [(group, batch) for group in self.groups]
        return [(group, stack_batches([batch[key] for key in group.keys])) for group in self.groups]

    def _step_group(self, group: Group, batch: Any) -> None:
        if group.compiled is not None and compiled.template_of(self.step_keys[id(group)]) is None:
            self._recompile(group)  # its key was dropped, or went eager, in another array
        if group.settled(batch):
            self._seed_step(group)
            group.step(batch, self.workload_of(group), self.step + 1)
            return
        # A vmap stack's first step (vmap may be unable to batch the model's code), or a
        # compiled step's first at a batch shape (it compiles). What its forward may change
        # before it fails (buffers, parameters changed in place, Python attributes of the
        # modules and of the workload object) and the members' random streams are put back
        # on failure, and the step runs eagerly (a compiled step failed) or the members go on
        # one stack each (vmap): a change the failed attempt made is not made twice.
        noise = self._rounding_noise(group, batch)
        if noise:
            self.notes.append(self._rounding_note(noise))
            self._step_alone(group, self._split_per_member(group), batch)
            return
        workload = self.workload_of(group)
        held = self._hold(group, workload)
        streams = {key: self.generators[key].get_state() for key in group.keys}
        began = time.perf_counter()
        try:
            self._seed_step(group)
            if group.compiled is not None:
                with compiled.COMPILING:  # one array's first step at a time: its check too
                    own = compiled.template_of(self.step_keys[id(group)])
                    if own is not None:  # dropped with its key if the step fails
                        before = python_state(own)
                        group.step(batch, workload, self.step + 1)
                        changed = changed_state(before, python_state(own))
                if own is None:  # dropped, or gone eager, while this array waited
                    self._recompile(group)
                    self._step_group(group, batch)
                    return
                group.compiled_shapes.add(shapes(batch))
                self.compile_seconds += time.perf_counter() - began
                self.compile_steps += 1
                if changed:
                    self._uncompile_stateful(group, own, changed)
            else:
                group.step(batch, workload, self.step + 1)
        except (torch.cuda.OutOfMemoryError, Unspillable):
            raise
        except Exception as exc:
            self._put_back(group, workload, held)
            for p in group.params.values():
                p.grad = None
            for key, state in streams.items():
                self.generators[key].set_state(state)
            if group.compiled is not None:
                note = compiled.drop(self.step_keys.pop(id(group)), exc)
                self.notes.append(f"{self.workload.name}: {note}")
                group.compiled_shapes.clear()
                self._compile(group)  # with fixed shapes, or eager
                self._step_group(group, batch)
                return
            self._step_alone(group, self._vmap_failed(group, exc), batch)

    def _step_alone(self, group: Group, singles: list[Group], batch: Any) -> None:
        """The step of ``group``'s members, split off it (:meth:`_split_per_member`), each on
        its part of ``group``'s training ``batch``."""
        for single in singles:
            self._step_group(single, _member_batch(batch, group, single))

    def epoch_inputs(self, epoch: int, skip: int, count: int) -> Iterator[Any]:
        """What :meth:`train_step` takes for steps ``skip`` to ``skip + count`` of
        ``epoch``: index tensors (in-memory data) or streamed batches on the device (one per
        member, by key, where the workload streams per member)."""
        if not self.streaming:
            batches = list(self.workload.batch_indices(self.config, epoch))
            yield from batches[skip : skip + count]
            return
        name = f"{self.workload.name}.train_batches(epoch={epoch})"
        if not self.workload.per_member_batches:
            source = self.workload.train_batches(self.config, epoch)
            seed = epoch_seed(self.config, epoch)
            yield from epoch_batches(source, skip, count, self.device, name, seed)
            return
        streams = {
            key: epoch_batches(self.workload.train_batches(config, epoch), skip, count,
                               self.device, name, epoch_seed(config, epoch, per_trial=True))
            for key, config in self.configs.items()
        }  # fmt: skip
        for _ in range(count):
            yield {key: next(stream) for key, stream in streams.items()}

    def check_divergence(self) -> None:
        """Drop the members whose loss was not finite at some step (one device read)."""
        if not self.groups:
            return
        bad = [step for group in self.groups for step in group.losses.bad_steps()]
        if not any(bad):
            return
        start = 0
        for group in list(self.groups):
            size = len(group.keys)
            self._drop_diverged(group, bad[start : start + size])
            start += size

    def _drop_diverged(self, group: Group, bad_steps: list[int]) -> None:
        for key, bad in zip(group.keys, bad_steps, strict=True):
            if bad:
                self.diverged[key] = bad
        keep = [i for i, bad in enumerate(bad_steps) if not bad]
        if len(keep) == len(bad_steps):
            return
        if keep:
            group.keep(keep)
        else:
            self.groups.remove(group)

    def reset_train_loss(self) -> None:
        self.carried_steps = {}
        for group in self.groups:
            group.losses.reset()

    def train_loss(self, steps: int) -> dict[Hashable, float]:
        """Each member's summed step losses since :meth:`reset_train_loss` (or carried from
        its checkpoint), over ``steps`` (plus the steps carried)."""
        return {
            key: float(total) / max(steps + self.carried_steps.get(key, 0), 1)
            for group in self.groups
            for key, total in zip(group.keys, group.losses.totals(), strict=True)
        }

    def epoch_loss(self, key: Hashable) -> dict[str, Any]:
        """What a checkpoint taken in the middle of an epoch carries of it: ``key``'s summed
        step losses so far and over how many steps (nothing at an epoch boundary)."""
        steps = self.step % self.steps_per_epoch
        if not steps:
            return {}
        group, i = self._locate(key)
        return {"epoch_loss": group.losses.totals()[i], "epoch_loss_steps": steps}

    @torch.no_grad()
    def evaluate(self) -> dict[Hashable, dict[str, float]]:
        """``val_loss`` and the workload's metrics of every member, in eval mode.

        In-memory data with the workload's own forward: the whole validation split's
        outputs at once. Streamed data, or a workload's own step: the size-weighted means
        of the validation batches' values.
        """
        if self.segment is not None:
            # one segment is not the trial's model: the composed one is evaluated once
            # every segment has ended the span (worker.segment_units)
            return {key: {} for key in self.keys}
        # a model that draws, draws in eval too (each stack reseeded: _seed_evaluation); one
        # reading values kept outside it has its own put back
        if self.stochastic or self._keeps_outside():
            keeps = bool(self.outside_spaces or self._workload_held() or self.torch_own)
            with GLOBAL_RNG, self._outside_held() if keeps else nullcontext():
                return self._evaluate_members()
        # members taken to draw nothing are evaluated in the shared hold, and checked: a draw
        # in eval mode only (noise under no_grad) is none a probe of training forwards sees
        with GLOBAL_RNG.shared() as held:
            before = torch_states(self.device), host_fingerprint()
            values = self._evaluate_members()
            if held.undisturbed():
                self._unseen(self.keys, before, "evaluation drew from {where}, which its probe "
                             "had not seen (a draw in eval mode only)")  # fmt: skip
            return values

    def _evaluate_members(self) -> dict[Hashable, dict[str, float]]:
        templates = {id(group.template): group.template for group in self.groups}
        for template in templates.values():
            template.eval()
        try:
            if self.streaming or self.workload.custom_step:
                return self._evaluate_batches()
            assert self.val_split is not None
            y = self.val_split.y
            results: dict[Hashable, dict[str, float]] = {}
            own = self.copies_batches  # each forward, loss and metric on a copy of its own

            def outputs(group: Group) -> list[Tensor]:  # each member's, on the whole split
                chunks = [group.outputs(x.clone() if own else x)
                          for x, _ in self._validation_batches()]  # fmt: skip
                return list(torch.cat(chunks, dim=1).unbind(0))

            for group in list(self.groups):  # a stack may split per member (_evaluated)
                workload = self.workload_of(group)
                self._seed_evaluation(group, 0)
                for key, out in zip(group.keys, self._evaluated(group, outputs), strict=True):
                    results[key] = validation_values(workload, out, y.clone() if own else y)
            return results
        finally:  # and the templates of stacks split per member
            templates.update({id(group.template): group.template for group in self.groups})
            for template in templates.values():
                template.train()

    def _evaluated(self, group: Group, evaluate: Callable[[Group], list[_T]]) -> list[_T]:
        """``evaluate(group)``: a value for each of its members, in order. A vmap stack's
        first evaluation (the whole split in memory, a streamed one's first batch) may fail
        where its steps did not: vmap cannot batch code that only eval mode runs (``.item()``
        under ``if not self.training``). What it changed is then put back, and the stack is
        split into one stack per member, evaluated, and trained from then on, one at a time,
        as unpacked, with a note."""
        if group.eval_proven or self.workload.custom_step:  # a custom one: per member anyway
            return evaluate(group)
        workload = self.workload_of(group)
        held = self._hold(group, workload)
        try:
            values = evaluate(group)
        except (torch.cuda.OutOfMemoryError, Unspillable):
            raise
        except Exception as exc:
            self._put_back(group, workload, held)
            if group.compiled is not None:  # its members' steps are eager from here on
                self.step_keys.pop(id(group), None)
            singles = self._vmap_failed(group, exc, "evaluation")
            values = []
            for single in singles:
                single.template.eval()  # the first is the stack's own, the others copies
                values.extend(evaluate(single))
            return values
        group.eval_proven = True
        return values

    def _probe_batches(self) -> list[Any]:
        """Streamed data's batch to probe a model on (:mod:`worker.probe`) before it trains:
        the first validation batch (its training batches are the epochs' own, and each
        training batch it draws is a step). Nothing where the loader cannot give one: the
        probe then sees nothing, and training finds what it can."""
        batches = self._validation_batches()
        try:
            return [next(batches)]
        except Exception:  # noqa: BLE001 - an evaluation raises it where it belongs
            return []
        finally:
            batches.close()  # type: ignore[attr-defined]

    def _validation_batches(self) -> Iterator[Any]:
        if self.streaming:
            source = self.workload.val_batches(self.config)
            yield from on_device(started(source, epoch_seed(self.config, -1)), self.device)
            return
        assert self.val_split is not None
        x, y, size = self.val_split.x, self.val_split.y, int(self.config["batch_size"])
        for start in range(0, x.shape[0], size):
            yield x[start : start + size], y[start : start + size]

    def _evaluate_batches(self) -> dict[Hashable, dict[str, float]]:
        sums: dict[Hashable, dict[str, float]] = {key: {} for key in self.keys}
        examples = 0
        for part, batch in enumerate(self._validation_batches()):
            examples += batch_size(batch)
            for group in list(self.groups):  # a stack may split per member (_evaluated)
                own = tree_map(torch.clone, batch) if self.copies_batches else batch
                self._seed_evaluation(group, part)

                def evaluate(g: Group, own: Any = own) -> list[dict[str, float]]:
                    return g.batch_metrics(own, self.workload_of(g))

                metrics = self._evaluated(group, evaluate)
                for key, values in zip(group.keys, metrics, strict=True):
                    for name, value in values.items():
                        sums[key][name] = sums[key].get(name, 0.0) + value
        if examples == 0:
            raise ValueError(f"{self.workload.name}.val_batches() yielded no batch")
        return {key: {n: v / examples for n, v in values.items()} for key, values in sums.items()}

    def member_state(self, key: Hashable) -> dict[str, Any]:
        """What resuming ``key`` elsewhere needs, on the CPU (checkpoint-ready); of an array
        training one segment, that segment's part only (its group holds no other), marked
        with the segment."""
        group, i = self._locate(key)
        params = {n: p[i].detach().to("cpu", copy=True) for n, p in group.params.items()}
        buffers = {n: b[i].to("cpu", copy=True) for n, b in group.buffers.items()}
        return {
            **({"segment": self.segment} if self.segment is not None else {}),
            "key": key,
            "config": dict(self.configs[key]),
            # a tied tensor under each of its names, as the model's state_dict() has it
            "params": with_aliases(params, self.ties[key]),
            "buffers": with_aliases(buffers, self.ties[key]),
            "optimizer": group.optimizer.member_state(i),
            "rng": self.generators[key].get_state(),
            **({"host_rng": encode_host(self.host_streams[key])} if self.host_random else {}),
            **({"python": python} if (python := self.python_values(key)) else {}),
            "steps_done": self.step,
            **self.epoch_loss(key),
        }


@dataclass(frozen=True)
class _Held:
    """A stack's tensors and Python state before a guarded step or evaluation
    (:meth:`FusedArray._hold`)."""

    params: dict[str, Tensor]
    buffers: dict[str, Tensor]
    python: dict[str, Any]
    workload: dict[str, Any]


def _member_batch(batch: Any, group: Group, single: Group) -> Any:
    """The slice of ``group``'s training ``batch`` that ``single``'s member takes: the
    batch itself when shared, its member's row when stacked."""
    if not group.stack.stacked:
        return batch
    i = group.keys.index(single.keys[0])
    return tree_map(lambda t: t[i : i + 1], batch)


class Dropped(Exception):
    """:func:`train` stopped for a give-up before any report of its call: the array's state
    since its start is to be thrown away (the members resume from their checkpoints)."""


@dataclass(frozen=True)
class Report:
    """Metrics of every active member at ``step``; ``resource`` is in epochs."""

    step: int
    resource: float
    metrics: dict[Hashable, dict[str, float]]
    diverged: tuple[Hashable, ...] = ()


def train(
    array: FusedArray,
    to_step: int,
    on_report: Callable[[Report], None] | None = None,
    stop: threading.Event | None = None,
    give_up: threading.Event | None = None,
    drop: Callable[[], bool] | None = None,
) -> list[Report]:
    """Train ``array`` from its current step to global step ``to_step``.

    Step ``s`` uses the batch at position ``s % steps_per_epoch`` of epoch
    ``s // steps_per_epoch``, so stopping and resuming at any step is exact.
    At each epoch boundary and at ``to_step`` the members are evaluated; the
    report's ``train_loss`` is the mean step loss of the epoch's steps run in
    this call, and of those its checkpoints carried (an epoch broken by a give-up).
    ``stop`` set (e.g. the study was cancelled) ends training at the next
    step boundary, without evaluating the epoch begun: the reports so far stand.
    ``give_up`` set (the device is wanted for a study with a better fair share) ends it at
    the next step boundary where divergence was just checked and no member diverged in
    this epoch yet (else at the epoch's end), after at least one step: the array is then
    checkpointed there with the epoch's losses so far, and resumed exactly, every epoch's
    metrics whole. ``drop``: asked at each step while ``give_up`` is set and nothing has
    been reported in this call yet; True raises :class:`Dropped` there at once (the caller
    throws the call's training away, cheaper than checkpointing it when it has just begun).
    """
    if to_step < array.step:
        raise ValueError(f"array is at step {array.step}, past to_step={to_step}")
    spe = array.steps_per_epoch
    reports: list[Report] = []
    first = array.step
    while array.step < to_step and array.groups:
        epoch = array.step // spe
        end, start = min(to_step, (epoch + 1) * spe), array.step
        inputs = array.epoch_inputs(epoch, start - epoch * spe, end - start)
        diverged_before = set(array.diverged)
        if not (start == first and start % spe and array.carried_steps):
            array.reset_train_loss()  # not when resuming an epoch whose losses were carried
        for batch in inputs:
            if stop is not None and stop.is_set():
                return reports
            if give_up is not None and give_up.is_set() and not reports and drop and drop():
                raise Dropped(f"dropped at step {array.step} (began at {first})")
            if (
                give_up is not None and give_up.is_set() and array.step > first
                and array.step % array.check_every == 0
                and not set(array.diverged) - diverged_before
            ):  # fmt: skip
                return reports
            array.train_step(batch)
            if not array.groups:
                break
        array.check_divergence()
        train_loss, evaluated = array.train_loss(array.step - start), array.evaluate()
        report = Report(
            step=array.step,
            resource=array.step / spe,
            metrics={key: {"train_loss": train_loss[key], **evaluated[key]} for key in array.keys},
            diverged=tuple(k for k in array.diverged if k not in diverged_before),
        )
        reports.append(report)
        if on_report is not None:
            on_report(report)
        if give_up is not None and give_up.is_set() and array.step % spe == 0:
            break
    return reports
