"""``packtune check WORKLOAD``: know before you run whether and how a workload fuses.

Builds a few members from a spec's space (or from the workload's defaults with a spread
of learning rates), holding the structural parameters at one value so that they share a
fusion key, trains them a few steps as one fused array and each one alone, and reports:
which parameters are structural and fusible, how far fused training is from one-by-one
training (the largest parameter difference), which forward each stack took (``bmm``:
hand-fused; ``vmap``; ``serial``: one by one), the step time for k = 1, 2, 4, 8, and any
warning (the fusion guard's, vmap's fallbacks). The check fails where fusion would be
wrong (a difference beyond float rounding) or impossible (members the guard stacked apart).
"""

from __future__ import annotations

import copy
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from packtune.errors import PacktuneError
from packtune.space import parse_space, sample_config, trial_seed
from packtune.workloads import get_workload
from packtune.workloads.base import ConfigReads, Workload, data_splits, varying_reads
from worker import outside_state as outside
from worker import torch_settings
from worker.decoupled_group import decoupled_problem
from worker.fused import FusedArray, train
from worker.model_rules import refuse_unsupported
from worker.probe import UnseenDraws
from worker.spill import spill_problem
from worker.ties import meta_template

#: relative and absolute tolerance of "equal to float rounding" after a few steps
RTOL, ATOL = 1e-4, 1e-5
#: the members' horizons (``config["max_epochs"]``), taken in turn
CHECK_HORIZONS = (1.0, 3.0)


class NothingToCompare(PacktuneError):
    """Every member diverged: no trained parameters to compare fused against one by one."""


class CheckTooLong(PacktuneError):
    """The check ran past its time (``PACKTUNE_CHECK_SECONDS`` on a service's runner)."""


def error_line(exc: Exception) -> str:
    """``exc`` as the check's one-line error: a workload's exception with its type, the
    check's own (:class:`NothingToCompare`) as its message."""
    own = isinstance(exc, NothingToCompare | CheckTooLong)
    return str(exc) if own else f"{type(exc).__name__}: {exc}"


@dataclass
class CheckReport:
    workload: str
    structural: list[str]
    fusible: list[str]
    members: list[dict[str, Any]]
    max_difference: float = 0.0
    exact: bool = True
    stacks: list[tuple[list[Any], str]] = field(default_factory=list)
    step_ms: dict[int, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    split: bool = False  # the fusion guard stacked members apart
    #: the first stack's leaf layers: (name, module type, how they run: ``bmm`` hand-fused,
    #: ``vmap``, ``serial`` one member at a time)
    layers: list[tuple[str, str, str]] = field(default_factory=list)
    #: why a trial larger than the device could not train spilled (None: it can)
    spill_problem: str | None = None
    #: why the model could not train decoupled in two segments (None: it can)
    decoupled_problem: str | None = None

    def as_json(self) -> dict[str, Any]:
        """The report as JSON values (member keys as they are, ``step_ms`` keyed by k)."""
        return {
            "workload": self.workload, "structural": self.structural, "fusible": self.fusible,
            "members": self.members, "max_difference": self.max_difference,
            "exact": self.exact, "split": self.split, "ok": self.ok,
            "stacks": [[list(keys), mode] for keys, mode in self.stacks],
            "step_ms": {str(k): ms for k, ms in self.step_ms.items()},
            "layers": [list(layer) for layer in self.layers],
            "warnings": list(self.warnings),
            "spill_problem": self.spill_problem,
            "decoupled_problem": self.decoupled_problem,
        }  # fmt: skip

    @property
    def ok(self) -> bool:
        """Fusion is exact and possible: no difference beyond float rounding, and no member
        stacked apart by the guard (a stochastic model's one-member stacks are by design)."""
        return self.exact and not self.split


def member_configs(
    workload: Workload, space: Mapping[str, Any] | None, k: int, seed: int = 0
) -> list[dict[str, Any]]:
    """``k`` configs of one fusion key: sampled from ``space`` with the structural values of
    the first sample, or the defaults with learning rates spread over a decade."""
    if space:
        dims = parse_space(dict(space))
        samples = [sample_config(dims, seed, i) for i in range(k)]
        structural = workload.structural_params()
        shared = {key: v for key, v in samples[0].items() if key in structural}
        configs = [{**sample, **shared} for sample in samples]
    else:
        base = float(workload.params.get("lr", 0.05))
        configs = [{"lr": base * 10 ** (i / max(1, k - 1) - 0.5)} for i in range(k)]
    # members of one array may come from studies of different max_resource: alternate the
    # horizon, so that data or batches that (against the contract) follow it show up
    return [
        {**config, "seed": trial_seed(seed, i), "data_seed": seed,
         "max_epochs": CHECK_HORIZONS[i % len(CHECK_HORIZONS)]}
        for i, config in enumerate(configs)
    ]  # fmt: skip


def layer_paths(array: FusedArray) -> list[tuple[str, str, str]]:
    """Each leaf layer of the array's first stack, with the path it runs through."""
    group = array.groups[0]
    return [
        (name, type(module).__name__, group.mode)
        for name, module in group.template.named_modules()
        if not list(module.children())
    ]


def _params(array: FusedArray, key: Any) -> dict[str, torch.Tensor]:
    return dict(array.member_state(key)["params"])


def check(
    name: str,
    space: Mapping[str, Any] | None = None,
    *,
    members: int = 4,
    steps: int = 5,
    ks: Sequence[int] = (1, 2, 4, 8),
    device: str = "cpu",
    stop: threading.Event | None = None,
    seconds: float | None = None,
) -> CheckReport:
    """Run the check of workload ``name`` (see the module docstring); ``stop`` set ends it
    at the next training step with :class:`CheckTooLong` (``seconds``: its time, said so)."""

    def trained(array: FusedArray, steps: int) -> None:
        train(array, steps, stop=stop)
        if stop is not None and stop.is_set():
            raise CheckTooLong(
                f"the check ran past its {seconds or 0:g} s (PACKTUNE_CHECK_SECONDS) and was "
                "stopped, as packs waited behind it: ask for fewer steps or members"
            )

    workload = get_workload(name)
    configs = member_configs(workload, space, max(members, max(ks)))
    report = CheckReport(
        workload=name,
        structural=sorted(workload.structural_params()),
        fusible=sorted(workload.fusible_params()),
        members=[
            {k: v for k, v in c.items() if k not in ("data_seed", "max_epochs")} for c in configs
        ],  # fmt: skip
    )
    # the data of the first member, as an array shares it; a parameter it reads that the
    # members differ in makes the service train them as arrays apart, and each alone here
    # trains on its own data, as it would unpacked
    reads: set[str] = set()
    first = ConfigReads(workload.resolve(configs[0]), reads)
    data = None if workload.streams else data_splits(workload, first, device)
    varying = varying_reads(workload, [workload.resolve(c) for c in configs[:members]], reads)
    if varying:
        report.warnings.append(
            f"{name}.data() reads {', '.join(repr(k) for k in varying)}, which the members "
            "differ in: they share the first member's batches in one array, so the service "
            "trains such members as separate arrays; declare it structural to say so"
        )
    torch.manual_seed(0)
    # built on a copy, and undone: what this build sets, on the workload, outside it or in
    # torch's settings, is neither the arrays' below nor a later pack's of this process
    before = outside.fresh(outside.namespaces(workload))
    held = outside.fresh_attributes(workload)  # objects the copy shares
    settings = torch_settings.read()
    try:
        model = copy.copy(workload).build_model(workload.resolve(configs[0]))
    finally:
        torch_settings.put(settings)
        outside.undo(before)
        outside.put_attributes(workload, held)
    refuse_unsupported(workload.name, model)  # as the arrays below would, before its template
    template = meta_template(model)
    report.spill_problem = spill_problem(workload, template)
    report.decoupled_problem = decoupled_problem(
        workload, template, 2, data[0].y if data is not None else None
    )
    chosen = [(i, configs[i]) for i in range(members)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused = FusedArray(workload, chosen, device=device, data=data)
        report.layers = layer_paths(fused)  # before training: diverged members leave it
        for attempt in range(3):  # as the service does: its pack trains again, knowing
            try:
                trained(fused, steps)
                break
            except UnseenDraws as exc:  # torch's draws may show first, the host's later
                if attempt == 2:
                    raise
                report.warnings.append(str(exc))
                fused = FusedArray(workload, chosen, device=device, data=data)
        if len(fused.diverged) == len(chosen):
            raise NothingToCompare(
                f"every member diverged (its loss not finite by step {max(fused.diverged.values())}"
                "): nothing trained to compare fused with one-by-one training; check with a "
                "space whose members train (lower learning rates?)"
            )
        report.stacks = fused.stacks
        report.warnings += fused.notes
        if fused.warning:
            report.split = True
            report.warnings.append(fused.warning)
        for key, config in chosen:
            own = None if varying else data
            alone = FusedArray(workload, [(key, config)], device=device, data=own)
            trained(alone, steps)
            packed_at, alone_at = fused.diverged.get(key), alone.diverged.get(key)
            if packed_at is not None or alone_at is not None:
                if packed_at != alone_at:  # a member must diverge where it does alone
                    report.exact = False
                    report.warnings.append(
                        f"member {key} diverged at step {packed_at or 'never'} fused, "
                        f"{alone_at or 'never'} alone"
                    )
                continue
            mine, ref = _params(fused, key), _params(alone, key)
            for pname, tensor in ref.items():
                diff = float((mine[pname].float() - tensor.float()).abs().max())
                report.max_difference = max(report.max_difference, diff)
                if not torch.allclose(mine[pname].float(), tensor.float(), RTOL, ATOL):
                    report.exact = False
        if fused.diverged:
            gone = ", ".join(str(k) for k, _ in chosen if k in fused.diverged)
            report.warnings.append(
                f"members {gone} diverged (loss "
                "not finite) and were dropped, as the service drops them; the others were "
                "compared"
            )
        untimed = []
        # timed on members that train: the configs of the first that did not diverge, then
        # the rest in turn (those the comparison did not try may diverge still)
        trains = [c for i, c in enumerate(configs) if i not in fused.diverged]
        for k in ks:
            array = FusedArray(workload, list(enumerate(trains[:k])) + [
                (i, trains[i % len(trains)]) for i in range(len(trains), k)
            ], device=device, data=data)  # fmt: skip
            trained(array, 1)  # warm-up: first-call costs out of the timing
            started = time.perf_counter()
            trained(array, 1 + steps)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            if array.diverged:  # fewer members than k trained: not k's step time
                untimed.append(k)
                continue
            report.step_ms[k] = 1000 * (time.perf_counter() - started) / steps
        if untimed:
            report.warnings.append(
                f"no step time for k = {', '.join(map(str, untimed))}: members diverged there"
            )
    report.warnings += sorted({str(w.message) for w in caught})
    return report
