"""The workload interface.

A workload says how to build one trial's model from its config, what data it
trains on, how loss and metrics are computed, and how many optimizer steps
make one epoch (the study's resource unit).

This module must stay importable without torch: the API process lists and
validates workloads but never imports torch. Workloads import torch inside
their methods.

Config keys every built-in workload shares (see :data:`OPTIMIZER_PARAMS`):

- ``optimizer`` (structural): one of :data:`OPTIMIZERS` (``sgd``, ``adam``,
  ``adamw``, ``rmsprop``, ``adagrad``, ``adadelta``), torch.optim's rules
- ``nesterov`` (structural): SGD only
- ``batch_size`` (structural)
- ``lr``, ``momentum`` (SGD, RMSprop), ``weight_decay``, ``beta1``, ``beta2``
  (Adam), ``eps``, ``alpha`` (RMSprop), ``rho`` (Adadelta), ``clip_norm``
  (gradient clipping by norm, 0: off): fusible, per-trial ``[k]`` tensors
- ``schedule`` (``constant``, ``step``, ``cosine``), ``warmup_epochs``,
  ``decay_epochs``, ``gamma``, ``final_lr_ratio``: the learning-rate schedule
  (:mod:`packtune.schedules`), fusible: each member follows its own
- ``precision`` (structural): one of :data:`PRECISIONS`: ``fp32``, or ``bf16``
  (the forward pass under ``torch.autocast`` to bfloat16; the weights, their
  gradients and the optimizer stay float32)

**Structural unless declared fusible.** Trials whose configs agree on every
structural parameter may be trained as one fused array, through one shared
template module. So a parameter is fusible only when the fused optimizer
carries it per member (:data:`OPTIMIZER_HYPER`) or when the workload lists it
in :attr:`Workload.fusible`, and then carries it per member itself: as a
tensor (parameter or buffer) of the model, never as a Python value such as a
layer's class or a float attribute. Every other parameter is structural,
whether or not the workload lists it in :attr:`Workload.structural`. The
worker checks the promise when it builds an array (see
``worker.fusion_guard``): members whose models differ in anything but tensor
values are trained apart, with a warning naming the parameter.

The worker adds ``seed`` (the trial's own initialisation seed) and
``data_seed`` (shared by every trial of a study, so that an array's members
see the same batches) before calling the workload.
"""

from __future__ import annotations

import abc
import operator
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from packtune.schedules import SCHEDULE_PARAMS

if TYPE_CHECKING:
    import torch
    from torch import nn

OPTIMIZERS = ("sgd", "adam", "adamw", "rmsprop", "adagrad", "adadelta")
PRECISIONS = ("fp32", "bf16")

OPTIMIZER_PARAMS: dict[str, Any] = {
    "optimizer": "sgd",
    "nesterov": False,
    "lr": 0.05,
    "momentum": 0.9,
    "weight_decay": 0.0,
    "beta1": 0.9,
    "beta2": 0.999,
    "eps": 1e-8,
    "alpha": 0.99,
    "rho": 0.9,
    "clip_norm": 0.0,
    **SCHEDULE_PARAMS,
    "precision": "fp32",
}
OPTIMIZER_STRUCTURAL = frozenset({"optimizer", "nesterov", "precision"})
OPTIMIZER_HYPER = (
    "lr", "momentum", "weight_decay", "beta1", "beta2", "eps", "alpha", "rho", "clip_norm",
    *SCHEDULE_PARAMS,
)  # fmt: skip
"""The fusible optimizer hyperparameters: carried per trial by the fused optimizer (as
``[k]`` tensors, a schedule as one :class:`packtune.schedules.Schedule` per member)."""

# Keys the worker injects; a study's space may not set them. ``max_epochs`` is the study's
# ``max_resource`` (the horizon of a cosine schedule).
RESERVED = frozenset({"seed", "data_seed", "max_epochs"})


def batch_order_seed(data_seed: int, epoch: int) -> int:
    """The seed of one epoch's batch order: ``data_seed * 1_000_003 + epoch``, wrapped into
    63 bits so that any study seed the spec admits (up to 2**63 - 1) seeds a generator
    (torch's take at most 2**64 - 1); for seeds below ~9.2e12 it is the plain formula."""
    return (data_seed * 1_000_003 + epoch) % 2**63


def epoch_generator(config: Mapping[str, Any], epoch: int, *, per_trial: bool = False) -> Any:
    """A ``torch.Generator`` for one epoch's data order (and augmentation): seeded from the
    study's ``data_seed`` and ``epoch``, or, with ``per_trial``, from the trial's own
    ``seed`` too. Give it to a ``DataLoader(shuffle=True, generator=...)``: its order, and
    the seeds of its worker processes, then depend on nothing else.

    Args:
        config: the trial's config as packtune passes it (with ``data_seed`` and ``seed``).
        epoch: the epoch, from 0.
        per_trial: seed from the trial's own ``seed`` too (per-member batches).

    Returns:
        A ``torch.Generator``, new on every call.

    Example:
        >>> g = epoch_generator({"data_seed": 3, "seed": 7}, epoch=0)
        >>> g.initial_seed() == epoch_generator({"data_seed": 3, "seed": 8}, 0).initial_seed()
        True
    """
    import torch

    return torch.Generator().manual_seed(epoch_seed(config, epoch, per_trial=per_trial))


def epoch_seed(config: Mapping[str, Any], epoch: int, *, per_trial: bool = False) -> int:
    """The seed of :func:`epoch_generator`; the worker also seeds the draws a loader makes
    in the training process (a dataset augmenting with torch's global generator) from it."""
    seed = batch_order_seed(int(config.get("data_seed", 0)), epoch)
    if per_trial:
        seed = (seed * 6364136223846793005 + int(config.get("seed", 0))) % 2**63
    return seed


class ConfigReads(dict[str, Any]):
    """A trial's config that notes the keys read from it (``config[key]``, ``.get``, ``in``),
    in ``reads``, shared with the config :meth:`Workload.resolve` makes of it. The worker
    hands one to the data path (``data``, ``steps_per_epoch``, ``batch_indices``): the
    members of an array share its first member's batches, so a parameter read there must
    be equal in all of them. Copies (``dict(config)``, ``{**config}``) read nothing and are
    not followed."""

    def __init__(self, values: Mapping[str, Any], reads: set[str] | None = None) -> None:
        super().__init__(values)
        self.reads: set[str] = set() if reads is None else reads

    def __getitem__(self, key: str) -> Any:
        self.reads.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self.reads.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.reads.add(key)
        return super().__contains__(key)


def varying_reads(
    workload: Workload, resolved: Sequence[Mapping[str, Any]], reads: set[str]
) -> list[str]:
    """The keys of ``reads`` (what the data path read of a config: :class:`ConfigReads`)
    whose values differ between an array's members' ``resolved`` configs: the members share
    the first one's batches, so such members cannot share an array. Structural parameters
    and ``data_seed`` are equal in an array already."""
    shared = workload.structural_params() | {"data_seed"}
    return sorted(key for key in reads - shared if len({repr(c.get(key)) for c in resolved}) > 1)


@dataclass(frozen=True)
class Split:
    """Inputs and targets of one split, already on the target device (what
    :meth:`Workload.data` returns, a training and a validation one).

    Args:
        x: the inputs, ``[N, ...]``.
        y: the targets, ``[N, ...]``.

    Example:
        >>> import torch
        >>> train = Split(torch.randn(100, 20), torch.randint(0, 2, (100,)))
        >>> train.x.shape[0] == train.y.shape[0]
        True
    """

    x: torch.Tensor
    y: torch.Tensor


def data_splits(workload: Workload, config: Mapping[str, Any], device: Any) -> tuple[Split, Split]:
    """``workload.data(config, device)``, checked: its train and validation splits; an error
    naming the method and what it returned otherwise (not an AttributeError later)."""
    value = workload.data(config, device)
    if isinstance(value, tuple | list) and len(value) == 2:
        if all(isinstance(split, Split) for split in value):
            return value[0], value[1]
    shape = type(value).__name__
    if isinstance(value, tuple | list):
        shape += f" of {len(value)}: " + ", ".join(type(v).__name__ for v in value[:3])
    raise TypeError(
        f"{workload.name}.data() returned a {shape}; it must return (Split(x, y), Split(x, y)): "
        "the train and validation splits"
    )


class Workload(abc.ABC):
    """Base class of packtune workloads.

    Subclasses set ``name`` and ``params`` (every parameter with its default)
    as class attributes, optionally ``structural`` and ``fusible``, and
    implement the abstract methods, importing torch inside them. docs/workloads.md
    is the guide; register the class as a ``packtune.workloads`` entry point.

    Raises:
        KeyError: from :meth:`resolve`, for a parameter the workload does not take.

    Example:
        >>> class Tiny(Workload):
        ...     name = "tiny"
        ...     params = {"hidden": 8, "batch_size": 32, **OPTIMIZER_PARAMS}
        ...     def build_model(self, config):
        ...         from torch import nn
        ...         return nn.Sequential(nn.Linear(4, config["hidden"]), nn.Tanh(),
        ...                              nn.Linear(config["hidden"], 2))
        ...     def data(self, config, device="cpu"):
        ...         import torch
        ...         x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
        ...         return Split(x.to(device), y.to(device)), Split(x.to(device), y.to(device))
        ...     def loss(self, outputs, targets):
        ...         import torch.nn.functional as F
        ...         return F.cross_entropy(outputs, targets)
        ...     def train_size(self, config):
        ...         return 64
        >>> Tiny().interface_problem() is None, "hidden" in Tiny().structural_params()
        (True, True)

    ``structural`` documents the parameters that shape the model or the data;
    listing them is optional, since every parameter that is not fusible is
    structural (:meth:`structural_params`). ``fusible`` names parameters
    beyond the optimizer's hyperparameters that may differ inside one fused
    array: the workload must then carry them per member as model tensors.
    A parameter in both is structural.
    """

    name: str
    params: Mapping[str, Any]
    structural: frozenset[str] = frozenset()
    fusible: frozenset[str] = frozenset()
    #: the metrics the workload reports, each with the direction that is better ("min" or
    #: "max"); the worker adds ``train_loss`` and ``val_loss`` to every workload's. None: not
    #: declared (a study may then name any metric; it fails at its first measurement if the
    #: workload never reports it).
    reports: Mapping[str, str] | None = None
    #: inclusive (low, high) limits of numeric parameters the workload can build: a study
    #: whose space reaches outside them is a 422 naming the bound, not trials that fail
    bounds: Mapping[str, tuple[float, float]] = {}
    #: the values a categorical parameter takes (e.g. an activation's names): a study whose
    #: space gives it another is a 422 naming the value, not trials that fail when built
    choices: Mapping[str, Sequence[Any]] = {}

    def reported_metrics(self, config: Mapping[str, Any] | None = None) -> dict[str, str] | None:
        """Every metric a trial of this workload records (of ``config``, given one:
        :meth:`reports_for`), with its better direction; None when the workload does not
        declare its own."""
        reports = self.reports if config is None else self.reports_for(config)
        if reports is None:
            return None
        return {"train_loss": "min", "val_loss": "min", **reports}

    # What a study's spec asks of a configuration, without torch (``packtune.declared``):
    # each is a 422 at submission where it fails, not trials that fail when they train.

    def reports_for(self, config: Mapping[str, Any]) -> Mapping[str, str] | None:
        """The metrics a trial of ``config`` reports, where they depend on it (a ``task``
        parameter): a study whose objective some configuration of its space does not report
        is refused. Default: :attr:`reports`."""
        return self.reports

    def class_targets(self, config: Mapping[str, Any]) -> bool | None:
        """Whether the training targets of ``config`` are class labels (integers), which
        decoupled training needs (it draws a target vector per class): False refuses a
        decoupled study of it. None (the default): not declared."""
        return None

    def max_segments(self, config: Mapping[str, Any]) -> int | None:
        """The most segments decoupled training can cut the model of ``config`` into: the
        number of layers holding parameters of a plain ``nn.Sequential`` (each starts a
        segment, as does its first layer: ``worker.decoupled.cut_points``), 0 for any other
        model; a decoupled study asking for more is refused. None (the default): not
        declared."""
        return None

    def fusible_params(self) -> frozenset[str]:
        """Parameters whose values may differ between the members of one fused array."""
        declared = frozenset(OPTIMIZER_HYPER) | frozenset(self.fusible)
        return (declared & frozenset(self.params)) - frozenset(self.structural)

    def structural_params(self) -> frozenset[str]:
        """Parameters that members of one fused array share: all but :meth:`fusible_params`."""
        return frozenset(self.params) - self.fusible_params()

    def resolve(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """``config`` on top of the defaults; unknown keys raise ``KeyError``."""
        unknown = set(config) - set(self.params) - RESERVED
        if unknown:
            raise KeyError(f"{self.name} does not take parameter(s) {sorted(unknown)}")
        merged = {**self.params, **config}
        return ConfigReads(merged, config.reads) if isinstance(config, ConfigReads) else merged

    @abc.abstractmethod
    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        """One trial's model; the caller seeds torch with ``config['seed']`` first."""

    def data(self, config: Mapping[str, Any], device: Any = "cpu") -> tuple[Split, Split]:
        """(train, validation) tensors on ``device``; the same for every trial with the same
        structure. The in-memory path, the fast one for data that fits the device: implement
        this, or :meth:`train_batches` and :meth:`val_batches` to stream."""
        raise NotImplementedError(
            f"{type(self).__name__} implements neither data() nor train_batches()/val_batches()"
        )

    #: streaming only: each member of a fused array draws its own batches
    #: (``train_batches`` is called with each trial's config, ``seed`` included, e.g. for
    #: augmentation seeded per trial) instead of one shared batch for the whole array
    per_member_batches: bool = False
    #: training draws random numbers some other way than a dropout module: each member of a
    #: fused array then trains in a stack of its own, from its own random stream. Needed only
    #: with streamed data; with ``data()`` a probe forward on a few examples finds such draws
    stochastic: bool = False

    def train_batches(self, config: Mapping[str, Any], epoch: int) -> Iterable[Any]:
        """Optional, streaming: the training batches of ``epoch`` (0-based), e.g. a
        ``torch.utils.data.DataLoader``, on the host; packtune moves them to the device.

        A batch is ``(inputs, targets)`` (tensors, or for :meth:`training_loss` any nesting
        of tuples, lists and dicts of tensors). It must yield at least
        :meth:`steps_per_epoch` batches, the same for every trial of one structure and
        deterministic from ``config["data_seed"]`` and ``epoch`` (use
        :func:`epoch_generator`): a trial resumed mid-epoch skips the batches it trained on.
        """
        raise NotImplementedError

    def val_batches(self, config: Mapping[str, Any]) -> Iterable[Any]:
        """Optional, streaming: the validation batches (the same every time). The metrics of
        a streamed validation are the means of the batches' values weighted by their size,
        so they must be means over examples (a loss, an accuracy)."""
        raise NotImplementedError

    def training_loss(self, model: Callable[..., Any], batch: Any) -> torch.Tensor:
        """Optional, a custom per-batch step: one model's mean loss on one batch.

        ``model`` is the trial's model as a function (call it as many times and with
        whatever inputs the step needs: several inputs, several outputs); ``batch`` is what
        :meth:`train_batches` yielded (or ``(x, y)`` of the in-memory path), on the device.
        A fused array runs it under ``torch.func.vmap`` over the members, so it must use
        no Python control flow on tensor values and no ``.item()``; where vmap cannot run
        it, the array trains its members one at a time instead, with a warning.
        Without it, the step is ``loss(model(inputs), targets)``.
        """
        raise NotImplementedError

    def validation_metrics(self, model: Callable[..., Any], batch: Any) -> dict[str, Any]:
        """With :meth:`training_loss`: ``val_loss`` and the workload's metrics of one
        validation batch (tensors or floats, means over the batch's examples)."""
        raise NotImplementedError

    @property
    def streams(self) -> bool:
        """Whether the workload streams its batches (:meth:`train_batches`)."""
        return type(self).train_batches is not Workload.train_batches

    @property
    def custom_step(self) -> bool:
        """Whether the workload defines its own per-batch step (:meth:`training_loss`)."""
        return type(self).training_loss is not Workload.training_loss

    def interface_problem(self) -> str | None:
        """What the workload lacks to be trained, in one sentence; None when complete."""
        own = type(self)

        def has(method: str) -> bool:
            return getattr(own, method) is not getattr(Workload, method)

        if not (has("data") or self.streams):
            return "it implements neither data() nor train_batches()"
        if self.streams and not has("val_batches"):
            return "it implements train_batches() but not val_batches()"
        if self.per_member_batches and not self.streams:
            return "per_member_batches needs train_batches()"
        if not (has("loss") or self.custom_step):
            return "it implements neither loss() nor training_loss()"
        if self.custom_step and not has("validation_metrics"):
            return "it implements training_loss() but not validation_metrics()"
        if "batch_size" not in self.params and (not self.streams or not has("steps_per_epoch")):
            return (
                "it has no batch_size parameter, which packtune reads to cut its data into "
                'batches (add "batch_size": 64, or your size, to params)'
            )
        return None

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean loss of one model's ``outputs``; must work under ``torch.func.vmap``.
        Required unless the workload defines :meth:`training_loss`."""
        raise NotImplementedError(
            f"{type(self).__name__} defines neither loss() nor training_loss()"
        )

    def stacked_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Optional: the ``[k]`` losses of k models' stacked ``outputs`` (``[k, B, ...]``).

        Each must equal ``loss(outputs[i], targets)`` to float rounding. A fused
        array calls this every step; ``None`` (the default) makes it call
        :meth:`loss` per member (or under ``vmap``), which costs a few ops per
        member where one batched call would do.
        """
        return None

    def metrics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        """Extra validation metrics (e.g. ``{"val_accuracy": 0.93}``) for one model; none
        by default."""
        return {}

    def steps_per_epoch(self, config: Mapping[str, Any]) -> int:
        """Optimizer steps in one epoch: the train split in batches (last partial batch dropped)."""
        cfg = self.resolve(config)
        return max(1, self._train_size(cfg) // int(cfg["batch_size"]))

    def _train_size(self, config: Mapping[str, Any]) -> int:
        size = self.train_size(config)
        try:
            return operator.index(size)  # an int, or a NumPy integer
        except TypeError:
            raise TypeError(
                f"{self.name}.train_size() returned {size!r} ({type(size).__name__}); it must "
                "return the number of training examples, an int"
            ) from None

    @abc.abstractmethod
    def train_size(self, config: Mapping[str, Any]) -> int:
        """Number of training examples (no torch needed)."""

    def batch_indices(self, config: Mapping[str, Any], epoch: int) -> Iterator[torch.Tensor]:
        """Index batches of one epoch: a permutation seeded by ``data_seed`` and ``epoch``."""
        import torch

        cfg = self.resolve(config)
        n, bs = self._train_size(cfg), int(cfg["batch_size"])
        gen = torch.Generator().manual_seed(batch_order_seed(int(cfg.get("data_seed", 0)), epoch))
        perm = torch.randperm(n, generator=gen)
        for step in range(self.steps_per_epoch(cfg)):
            yield perm[step * bs : (step + 1) * bs]

    def describe(self) -> dict[str, Any]:
        """What ``GET /api/workloads`` shows."""
        return {
            "name": self.name,
            "params": dict(self.params),
            "structural": sorted(self.structural_params()),
            "fusible": sorted(self.fusible_params()),
            "metrics": self.reported_metrics(),
            "doc": (self.__doc__ or "").strip().splitlines()[0] if self.__doc__ else "",
        }
