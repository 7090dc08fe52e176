"""Models as users write them, trained in fused arrays: each member must end as a plain torch
run of its model ends (weights, losses), whatever else the array holds."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from torch import nn

from tests.support.tiny_workloads import Ramp, TinyMLP
from tests.worker.test_fused import compare, member_configs
from worker.fused import FusedArray, train
from worker.spill import chain_of
from worker.ties import aliases


class _Block(nn.Module):
    def __init__(self, projection: torch.Tensor) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8, dtype=torch.float64)
        self.register_buffer("projection", projection)  # one fixed tensor, in every block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x @ self.projection))


class _SharedBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        projection = torch.linalg.qr(torch.randn(8, 8, dtype=torch.float64))[0]
        self.a, self.b = _Block(projection), _Block(projection)
        self.head = nn.Linear(8, 3, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(self.a(x)))


class _TiedOutput(nn.Module):
    """A layer whose weight is the input layer's (weight tying), outside a Sequential."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8, dtype=torch.float64)
        self.body = nn.Linear(8, 8, dtype=torch.float64)
        self.out = nn.Linear(8, 8, bias=False, dtype=torch.float64)
        self.out.weight = self.inp.weight
        self.head = nn.Linear(8, 3, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(torch.tanh(self.inp(x))))
        return self.head(torch.tanh(self.out(h)))


class _Reused(TinyMLP):
    """Models holding one module or tensor at several places."""

    def __init__(self, how: str) -> None:
        self.how = how

    def build_model(self, config: dict[str, Any]) -> nn.Module:
        if self.how == "activation":  # one activation object at every place
            act = nn.Tanh()
            layers = (nn.Linear(8, 6), act, nn.Linear(6, 6), act, nn.Linear(6, 3))
            return nn.Sequential(*layers).double()
        if self.how == "linear":  # one Linear applied twice
            mid = nn.Linear(6, 6)
            return nn.Sequential(
                nn.Linear(8, 6), nn.Tanh(), mid, nn.Tanh(), mid, nn.Tanh(), nn.Linear(6, 3)
            ).double()
        if self.how == "tied-linears":  # two Linears sharing one weight
            first, second = nn.Linear(6, 6), nn.Linear(6, 6)
            second.weight = first.weight
            return nn.Sequential(
                nn.Linear(8, 6), nn.Tanh(), first, nn.Tanh(), second, nn.Tanh(), nn.Linear(6, 3)
            ).double()
        if self.how == "buffer":
            return _SharedBuffer()
        return _TiedOutput()


@pytest.mark.parametrize("how", ["activation", "linear", "tied-linears", "buffer", "tied-output"])
def test_a_module_or_tensor_at_several_places_trains_as_plain_torch(how: str) -> None:
    """A Sequential reusing one module, tied weights, a buffer shared by two blocks: every
    member of an array, and a member resumed from its exported state, ends as a plain torch
    run. Before, the hand-fused walk skipped a module's second place (``named_children``
    lists it once: 0.28 apart in weights, both packed and alone), and a tied tensor's second
    name read the meta template's own tensor: uninitialised memory on a CPU (a different
    val_loss at each run), or a KeyError / "expected device meta" for trainable ties."""
    workload = _Reused(how)
    members = member_configs("sgd", {})[:3]
    array = FusedArray(workload, members)
    reports = train(array, 2 * array.steps_per_epoch)
    for key, cfg in members:
        compare(array, reports, key, cfg, 1e-10)
    # the exported state names every place of a tied tensor, as a model's state_dict does:
    # the user's own model takes it, and a resumed member trains on as an unbroken one
    key, cfg = members[1]
    torch.manual_seed(0)
    own = workload.build_model(workload.resolve(cfg))
    state = array.member_state(key)
    own.load_state_dict({**state["params"], **state["buffers"]})
    half = FusedArray(workload, [(key, cfg)])
    train(half, half.steps_per_epoch)
    resumed = FusedArray(workload, [(key, cfg)], states=[half.member_state(key)])
    train(resumed, 2 * resumed.steps_per_epoch)
    for name, tensor in state["params"].items():
        assert torch.allclose(resumed.member_state(key)["params"][name], tensor, atol=1e-12), name


def test_tied_models_are_neither_spilled_nor_cut_into_segments() -> None:
    """A shard or a segment would hold one place of a tied tensor without the other."""
    torch.manual_seed(0)
    for how in ("linear", "tied-linears"):
        model = _Reused(how).build_model({})
        assert chain_of(model) is None
    model = _Reused("activation").build_model({})
    assert chain_of(model) is None and not aliases(model)  # a module at two places
    assert chain_of(TinyMLP().build_model(TinyMLP().resolve({}))) is not None


class _Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.div_(4.0)  # input scaling in place, as ``pixels.div_(255)``


class _InPlace(TinyMLP):
    """Training that changes its batch in place: a forward scaling its input (in a model with
    dropout, whose members train one per stack), or a loss smoothing its targets."""

    def __init__(self, where: str) -> None:
        self.where = where

    def build_model(self, config: dict[str, Any]) -> nn.Module:
        if self.where == "forward":
            return nn.Sequential(
                _Scale(), nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 3)
            ).double()
        return super().build_model(config)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.where == "loss":
            smooth = torch.nn.functional.one_hot(targets, 3).double()
            smooth.mul_(0.9).add_(0.1 / 3)
            targets = smooth.argmax(1)
            targets.add_(0)  # an in-place op on a tensor of its own: not the batch's
            return torch.nn.functional.cross_entropy(outputs, smooth)
        return super().loss(outputs, targets)


class _SmoothsTargets(TinyMLP):
    """A loss that changes the batch's own targets in place (binary targets, smoothed)."""

    def data(self, config: Any, device: Any = "cpu") -> tuple[Any, Any]:
        from packtune.workloads.base import Split

        train_split, val_split = super().data(config, device)
        return (
            Split(train_split.x, (train_split.y == 0).double()),
            Split(val_split.x, (val_split.y == 0).double()),
        )

    def build_model(self, config: dict[str, Any]) -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1), nn.Flatten(0)).double()

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        targets.mul_(0.9).add_(0.05)
        return torch.nn.functional.binary_cross_entropy_with_logits(outputs, targets)

    def metrics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        return {}


def _trains_as_alone(
    workload: Any, members: list[Any], epochs: int = 2, tol: float = 0.0
) -> FusedArray:
    """Train ``members`` as one array and each alone; assert every member ends equal (to
    the bit, or within ``tol`` where fused arithmetic rounds otherwise)."""
    packed = FusedArray(workload, members)
    reports = train(packed, epochs * packed.steps_per_epoch)
    for key, cfg in members:
        alone = FusedArray(workload, [(key, cfg)])
        alone_reports = train(alone, epochs * alone.steps_per_epoch)
        mine, ref = packed.member_state(key), alone.member_state(key)
        for name, tensor in ref["params"].items():
            assert torch.allclose(mine["params"][name], tensor, rtol=tol, atol=tol), (key, name)
        ours, theirs = reports[-1].metrics[key], alone_reports[-1].metrics[key]
        assert ours == pytest.approx(theirs, rel=tol, abs=tol), key
    return packed


@pytest.mark.parametrize("workload", [_InPlace("forward"), _SmoothsTargets()], ids=["x", "y"])
def test_training_that_changes_its_batch_in_place_trains_as_alone(workload: Any) -> None:
    """One batch is handed to every stack and member of an array: a forward dividing its
    input in place, or a loss smoothing its targets in place, changed the batch the next
    member trained on (and the stored validation split). Before: up to 5e-2 apart in weights
    from alone, no warning. Now the probe sees it: one member per stack, each on its own
    copy, with a note; and the data splits are left as they were."""
    members = member_configs("sgd", {})[:3]
    train_split, val_split = workload.data(workload.resolve(members[0][1]))
    before = [t.clone() for t in (train_split.x, train_split.y, val_split.x, val_split.y)]
    packed = FusedArray(workload, members, data=(train_split, val_split))
    train(packed, 2 * packed.steps_per_epoch)
    assert packed.copies_batches and any("in place" in note for note in packed.notes)
    for now, was in zip(
        (train_split.x, train_split.y, val_split.x, val_split.y), before, strict=True
    ):
        assert torch.equal(now, was)
    _trains_as_alone(workload, members)


def test_a_loss_changing_a_tensor_of_its_own_in_place_still_fuses() -> None:
    array = FusedArray(_InPlace("loss"), member_configs("sgd", {})[:3])
    assert not array.copies_batches and array.mode == "bmm"


class _ScalesLargeBatches(TinyMLP):
    """Changes its input in place only after a warm-up longer than the probe's forwards."""

    def build_model(self, config: dict[str, Any]) -> nn.Module:
        return _Wrapped(super().build_model(config))


class _Wrapped(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body, self.steps = body, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.steps += 1
            if self.steps > 5:  # past the probe's five forwards
                x.mul_(1.0)
        return self.body(x)


def test_a_batch_changed_in_place_that_the_probe_missed_stops_the_array() -> None:
    """Where the probe could not see it (here: only after a warm-up), a step that
    changes a batch the next stack trains on (serial: one member per stack) raises, naming
    the cause, instead of training the next member on what it left."""
    workload = _ScalesLargeBatches()
    members = member_configs("sgd", {})[:2]
    array = FusedArray(workload, members, mode="serial")
    with pytest.raises(RuntimeError, match="changed its input batch in place"):
        train(array, array.steps_per_epoch)
    alone = FusedArray(workload, members[:1])  # nothing is shared: it trains
    train(alone, alone.steps_per_epoch)
    # one vmap stack: its forward's change of its input is made once, for all members alike
    fused = FusedArray(workload, member_configs("sgd", {})[:2])
    assert fused.mode == "vmap"
    train(fused, fused.steps_per_epoch)


class _Counter(TinyMLP):
    """Draws (RReLU's slopes): one member per stack, each reseeded."""

    def build_model(self, config: dict[str, Any]) -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.RReLU(), Ramp(20), nn.Linear(16, 3)).double()


def test_python_state_of_a_forward_is_each_members_own() -> None:
    """Members trained one per stack shared one template module, so a counter kept on it
    advanced k times a step. Before: 8.7e-2 apart in weights from alone."""
    packed = _trains_as_alone(_Counter(), member_configs("sgd", {})[:3])
    assert [mode for _, mode in packed.stacks] == ["serial"] * 3


class _Skip(nn.Module):
    def __init__(self, draw: str) -> None:
        super().__init__()
        self.f = nn.Linear(8, 8)
        self.draw = draw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import numpy

        coin = random.random() if self.draw == "python" else float(numpy.random.rand())
        if self.training and coin < 0.5:
            return x  # stochastic depth
        return x + torch.tanh(self.f(x))


class _HostRandom(TinyMLP):
    def __init__(self, draw: str) -> None:
        self.draw = draw

    def build_model(self, config: dict[str, Any]) -> nn.Module:
        return nn.Sequential(
            nn.Linear(8, 8), _Skip(self.draw), _Skip(self.draw), nn.Linear(8, 3)
        ).double()


@pytest.mark.parametrize("draw", ["python", "numpy"])
def test_draws_from_pythons_or_numpys_generator_are_each_members_own(draw: str) -> None:
    """Stochastic depth drawn with ``random.random()`` (or NumPy's): the probe watched only
    torch's generators, so the array fused and one draw decided for every member. Before:
    9.8e-2 apart in weights from alone. Now each member draws from its own stream, seeded
    from its trial seed, whoever it is packed with; and a second run draws the same."""
    workload = _HostRandom(draw)
    members = member_configs("sgd", {})[:3]
    packed = _trains_as_alone(workload, members)
    assert packed.stochastic and packed.host_random
    again = FusedArray(workload, members)
    train(again, 2 * again.steps_per_epoch)
    for key, _ in members:
        assert torch.equal(again.member_state(key)["params"]["1.f.weight"],
                           packed.member_state(key)["params"]["1.f.weight"])  # fmt: skip


class _RunningMean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(8, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.mean = 0.9 * self.mean + 0.1 * x.mean(0)  # replaced, not updated in place
        return x - self.mean


class _Reassigns(TinyMLP):
    def build_model(self, config: dict[str, Any]) -> nn.Module:
        return nn.Sequential(_RunningMean(), nn.Linear(8, 3)).double()


def test_a_buffer_replaced_in_forward_is_refused_by_name() -> None:
    """Buffers live in stacked tensors: a forward assigning a new one kept the old value
    (the running mean stayed 0, alone and packed, silently). Now it is an error naming the
    buffer and the fix."""
    with pytest.raises(ValueError, match=r"replaces its buffer '0.mean'.*in place"):
        FusedArray(_Reassigns(), member_configs("sgd", {})[:1])


class _KeepsOnSelf(TinyMLP):
    """``build_model`` keeps a per-trial value on the workload object, which ``loss`` (given
    no config) then reads: label smoothing from a fusible parameter."""

    def build_model(self, config: dict[str, Any]) -> nn.Module:
        self.smoothing = 2 * float(config["lr"])
        return super().build_model(config)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(outputs, targets, label_smoothing=self.smoothing)


def test_a_value_build_model_keeps_on_the_workload_is_each_members_own() -> None:
    """Members were built one after another on one workload object, so every member's loss
    read the last-built member's value. Before: 1.5e-1 apart in weights from alone, no
    warning. Now each member has its own copy of the workload; members whose copies differ
    train one per stack, with a note naming the attribute."""
    packed = _trains_as_alone(_KeepsOnSelf(), member_configs("sgd", {})[:3])
    assert any("set 'smoothing' on the workload object" in note for note in packed.notes)
    same = FusedArray(_KeepsOnSelf(), [(k, {**c, "lr": 0.1}) for k, c in member_configs("sgd", {})])
    assert same.mode == "bmm" and not same.notes  # equal values: fused as before


class _Augmented:
    """A dataset that augments with torch's global generator (as torchvision's random
    transforms do), read by a loader without worker processes."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, augment: bool) -> None:
        self.x, self.y, self.augment = x, y, augment

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = 0.1 * torch.randn(self.x[i].shape, dtype=self.x.dtype) if self.augment else 0
        return self.x[i] + noise, self.y[i]


class _StreamsAugmented(TinyMLP):
    sizes = (128, 32)

    def train_batches(self, config: Any, epoch: int) -> Any:
        from torch.utils.data import DataLoader

        from packtune.workloads.base import epoch_generator

        cfg = self.resolve(config)
        train_split, _ = super().data(cfg)
        return DataLoader(
            _Augmented(train_split.x, train_split.y, True), batch_size=int(cfg["batch_size"]),
            shuffle=True, drop_last=True, generator=epoch_generator(cfg, epoch),
        )  # fmt: skip

    def val_batches(self, config: Any) -> Any:
        from torch.utils.data import DataLoader

        _, val_split = super().data(self.resolve(config))
        return DataLoader(_Augmented(val_split.x, val_split.y, False), batch_size=16)

    def data(self, config: Any, device: Any = "cpu") -> Any:  # streamed: no in-memory data
        raise NotImplementedError


def test_a_loader_augmenting_in_the_training_process_draws_the_same_packed_or_resumed() -> None:
    """The dataset drew from wherever the trainer had left torch's global generator (the
    last member's build, the probes, earlier steps): 2-4% apart from alone, 1-2% from an
    unbroken run after a resume mid-epoch, no warning. An epoch's loader now draws from
    streams of its own, seeded from the epoch (as a loader's worker processes are)."""
    workload = _StreamsAugmented()
    assert workload.streams
    members = member_configs("sgd", {"batch_size": 16})[:3]
    packed = FusedArray(workload, members)
    steps = 2 * packed.steps_per_epoch
    train(packed, steps)
    for key, cfg in members[:2]:
        first = FusedArray(workload, [(key, cfg)])
        train(first, packed.steps_per_epoch + 3)  # stopped in the middle of an epoch
        resumed = FusedArray(workload, [(key, cfg)], states=[first.member_state(key)])
        train(resumed, steps)
        for name, tensor in resumed.member_state(key)["params"].items():
            assert torch.equal(packed.member_state(key)["params"][name], tensor), (key, name)


def test_a_members_host_random_stream_is_saved_with_it(tmp_path: Any) -> None:
    """Python's and NumPy's streams of a member that draws from them were not part of its
    checkpoint: a resumed member drew again from its seed (21% apart from an unbroken run).
    They are saved now, through the restricted unpickler checkpoints are read with."""
    from worker.checkpoints import load_checkpoint, save_checkpoint

    for draw in ("python", "numpy"):
        workload = _HostRandom(draw)
        key, cfg = member_configs("sgd", {})[0]
        whole = FusedArray(workload, [(key, cfg)])
        train(whole, 2 * whole.steps_per_epoch)
        first = FusedArray(workload, [(key, cfg)])
        train(first, first.steps_per_epoch + 2)
        path = save_checkpoint(tmp_path, 1, f"{draw}-{key}", first.member_state(key))
        resumed = FusedArray(workload, [(key, cfg)], states=[load_checkpoint(path)])
        train(resumed, 2 * resumed.steps_per_epoch)
        assert torch.equal(resumed.member_state(key)["params"]["1.f.weight"],
                           whole.member_state(key)["params"]["1.f.weight"]), draw  # fmt: skip


class _MeanOverBatch(TinyMLP):
    """Regression with its own step, reduced over the batch only: a loss of shape ``[1]``."""

    def build_model(self, config: dict[str, Any]) -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).double()

    def training_loss(self, model: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        return ((model(x) - y.double().unsqueeze(1)) ** 2).mean(0)

    def validation_metrics(self, model: Any, batch: Any) -> dict[str, Any]:
        x, y = batch
        return {"val_loss": ((model(x) - y.double().unsqueeze(1)) ** 2).mean()}


def test_a_loss_of_shape_one_trains_each_member_once_a_step() -> None:
    """A ``[k, 1]`` loss failed when recorded, after the optimizer's step: the array split
    per member and ran the step again, so every member took its first batch twice (7
    optimizer steps in 6; 0.5-5.8x apart from alone) under a note saying nothing changed."""
    packed = _trains_as_alone(_MeanOverBatch(), member_configs("sgd", {})[:3], tol=1e-12)
    assert packed.mode == "vmap" and not packed.notes


class _PerPosition(TinyMLP):
    """An MLP applied at each of 2 positions of a ``[B, 2, 4]`` input, then flattened."""

    def data(self, config: Any, device: Any = "cpu") -> Any:
        from packtune.workloads.base import Split

        splits = super().data(config, device)
        return tuple(Split(s.x.reshape(-1, 2, 4), s.y) for s in splits)

    def build_model(self, config: dict[str, Any]) -> nn.Module:
        layers = (nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3), nn.Flatten(), nn.Linear(6, 3))
        return nn.Sequential(*layers).double()


def test_a_hand_fused_linear_takes_inputs_of_more_dimensions() -> None:
    """A Sequential of Linears over ``[B, T, F]`` was taken for hand fusion, whose Linear
    took ``[k, B, in]`` only: "batch1 must be a 3D tensor", packed and alone."""
    workload = _PerPosition()
    members = member_configs("sgd", {})[:3]
    array = FusedArray(workload, members)
    assert array.mode == "bmm"
    reports = train(array, 2 * array.steps_per_epoch)
    for key, cfg in members:
        compare(array, reports, key, cfg, 1e-10)


class _KeepsEqualValues(TinyMLP):
    """build_model keeps values equal for every trial: a criterion, an array, a dict of
    tensors; data() keeps one that loss reads."""

    def data(self, config: Any, device: Any = "cpu") -> Any:
        self.classes = 3
        return super().data(config, device)

    def build_model(self, config: dict[str, Any]) -> nn.Module:
        import numpy

        self.criterion = nn.CrossEntropyLoss()
        self.weights = numpy.ones(3)
        self.stats = {"mean": torch.zeros(8), "std": torch.ones(8)}
        return super().build_model(config)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        assert outputs.shape[-1] == self.classes
        return self.criterion(outputs, targets)


def test_values_equal_for_every_trial_on_the_workload_keep_the_members_fused() -> None:
    """Only values that differ between trials split an array: a criterion module, an array
    or a dict of tensors made anew by each build_model compared as different objects (every
    member then trained alone), and values set by data() were missing from per-member
    copies of the workload (AttributeError)."""
    array = FusedArray(_KeepsEqualValues(), member_configs("sgd", {})[:3])
    assert array.mode == "bmm" and len(array.groups) == 1 and not array.notes
    train(array, array.steps_per_epoch)


class _GrowingCache(nn.Module):
    """A table rebuilt when the input outgrows it (a rotary or mask cache): a non-persistent
    buffer replaced in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.ones(1, 8, dtype=torch.float64), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.table.shape[0] < x.shape[0]:
            table = torch.ones(x.shape[0], 8, dtype=torch.float64)
            self.register_buffer("table", table, persistent=False)
        return x * self.table[: x.shape[0]]


class _Cached(TinyMLP):
    def build_model(self, config: dict[str, Any]) -> nn.Module:
        return nn.Sequential(_GrowingCache(), nn.Linear(8, 3)).double()


def test_a_cache_buffer_rebuilt_in_forward_is_not_refused() -> None:
    """A non-persistent buffer is not state: rebuilding it in forward is allowed (it was
    refused with the persistent ones)."""
    members = member_configs("sgd", {})[:2]
    array = FusedArray(_Cached(), members)
    reports = train(array, 2 * array.steps_per_epoch)
    for key, cfg in members:
        compare(array, reports, key, cfg, 1e-10)


def test_a_loss_overridden_below_a_batched_one_is_the_loss_trained() -> None:
    """A user's subclass of a classification workload (whose batched cross-entropy,
    ``stacked_loss``, the array calls) that overrides ``loss`` alone, with label smoothing:
    its members train by that loss and are measured by it, as plain torch runs of it.
    Before, they trained by the inherited cross-entropy, fused and alone alike (0.63 from a
    plain run of the user's loss), and their val_loss was the cross-entropy the inherited
    ``metrics`` return (1.33 against the user's 1.59)."""
    import torch.nn.functional as F

    from tests.support.plugins.trap_workloads import HiddenActMLP

    class Smoothed(HiddenActMLP):
        name = "smoothed-mlp"

        def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(outputs, targets, label_smoothing=0.2)

    workload = Smoothed()
    members = [(f"s{i}", {"seed": 5 + i, "data_seed": 2, "lr": 0.05 * (i + 1)}) for i in range(3)]
    array = FusedArray(workload, members)
    reports = train(array, 2 * array.steps_per_epoch)
    for key, cfg in members:
        compare(array, reports, key, cfg, 1e-5)


class _ListRef(nn.Module):
    """Reads its weights through a Python container or a plain attribute, not the registered
    ones (``how``)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        f64 = torch.float64  # built so: .double() would give the buffer a new tensor
        self.fc1, self.fc2 = nn.Linear(8, 6, dtype=f64), nn.Linear(6, 3, dtype=f64)
        self.register_buffer("scale", torch.ones(6, dtype=f64))
        self.how = how
        if how == "list":
            self.weights = [self.fc1.weight, self.fc2.weight]
        elif how == "dict":
            self.weights = {"layers": (self.fc1.weight, self.fc2.weight)}
        elif how == "attribute":  # a buffer under another name: not registered again
            self.gain = self.scale
        elif how == "view":  # the parameter's storage, which plain torch trains with it
            self.rows = self.fc1.weight.detach()[:3]
        elif how == "closure":
            weight = self.fc1.weight
            self.first = lambda x: torch.nn.functional.linear(x, weight, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how in ("list", "dict"):
            w1, w2 = self.weights if self.how == "list" else self.weights["layers"]
            h = torch.relu(torch.nn.functional.linear(x, w1, self.fc1.bias))
            return torch.nn.functional.linear(h, w2, self.fc2.bias)
        if self.how == "closure":
            return self.fc2(torch.relu(self.first(x) + self.fc1.bias))
        if self.how == "attribute":
            return self.fc2(torch.relu(self.fc1(x)) * self.gain)
        return self.fc2(torch.relu(self.fc1(x))) + self.rows.sum()


class _WeightsElsewhere(TinyMLP):
    def __init__(self, how: str) -> None:
        self.how = how

    def build_model(self, config: dict[str, Any]) -> nn.Module:
        return _ListRef(self.how)


@pytest.mark.parametrize(
    ("how", "named"),
    [
        ("list", r"parameter 'fc1.weight' in 'weights\[0\]'"),
        ("dict", r"parameter 'fc1.weight' in \"weights\['layers'\]\[0\]\""),
        ("attribute", r"buffer 'scale' in 'gain'"),
        ("view", r"parameter 'fc1.weight' in 'rows'"),
        ("closure", r"parameter 'fc1.weight' in 'first \(closure of"),
    ],
)
def test_weights_read_outside_their_registered_attribute_are_refused_by_name(
    how: str, named: str
) -> None:
    """A forward reading a parameter through a Python list (``self.ws = [self.w1]``) read
    the template's initial tensor, never the member's stacked one: those weights never
    trained, alone and packed alike (0 change against 2.4 in plain torch). Now it is an
    error naming the place, the parameter and the fix."""
    with pytest.raises(ValueError, match=named + r".*nn.ParameterList"):
        FusedArray(_WeightsElsewhere(how), member_configs("sgd", {})[:1])


def test_torchs_own_bookkeeping_of_registered_tensors_is_not_refused() -> None:
    """An RNN's flat weights, parametrizations and attention layers hold registered tensors
    in lists or attributes of their own, which torch keeps up to date: they build."""
    from torch.nn.utils import parametrizations

    from packtune.workloads import get_workload
    from worker.model_rules import refuse_unsupported

    models = [
        nn.LSTM(4, 8, 2), nn.GRU(4, 8, bidirectional=True),
        parametrizations.weight_norm(nn.Linear(4, 4)), parametrizations.orthogonal(nn.Linear(4, 4)),
        nn.MultiheadAttention(8, 2), nn.TransformerEncoderLayer(8, 2, 16),
    ]  # fmt: skip
    for name in ("digits-mlp", "digits-cnn", "resnet-cifar", "synthetic-mlp"):
        workload = get_workload(name)
        models.append(workload.build_model(workload.resolve({"seed": 0, "data_seed": 0})))
    for model in models:
        refuse_unsupported("m", model)


class _Hooked(TinyMLP):
    def build_model(self, config: dict[str, Any]) -> nn.Module:
        model = super().build_model(config)
        mask = torch.ones(model[0].weight.shape[0], 1, dtype=torch.float64)
        mask[:4] = 0  # rows frozen
        model[0].weight.register_hook(lambda g: g * mask)
        return model


def test_a_gradient_hook_on_a_parameter_is_refused() -> None:
    """A hook ``build_model`` registers on a parameter (freezing rows) stayed on the built
    tensor: the stacked one trained without it (frozen rows moved by 8e-3 against 0 in plain
    torch). Now it is an error saying so and what to write instead."""
    with pytest.raises(ValueError, match=r"hook on its parameter '0.weight'.*in forward"):
        FusedArray(_Hooked(), member_configs("sgd", {})[:1])


class _Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh())
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return self.head(checkpoint(self.block, x, use_reentrant=False))


class _Sparse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb((x.abs() * 3).long().clamp(max=9)).mean(1))


class _Lazy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.LazyLinear(6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class _Unsupported(TinyMLP):
    def __init__(self, model: type[nn.Module]) -> None:
        self.model = model

    def build_model(self, config: dict[str, Any]) -> nn.Module:
        return self.model().double()


@pytest.mark.parametrize("mode", ["serial", "vmap"])
def test_a_checkpointed_forward_is_a_trial_error_naming_it(mode: str) -> None:
    """torch.utils.checkpoint runs the block again in backward, on the template, after the
    members' tensors were swapped out: it failed with "Tensor on device meta is not on the
    expected device cpu!". Now the trial's error names the cause and the fix."""
    from worker.execute import TrialError

    array = FusedArray(_Unsupported(_Checkpointed), member_configs("sgd", {})[:2], mode=mode)
    with pytest.raises(ValueError, match=r"torch.utils.checkpoint.*remove") as caught:
        train(array, 1)
    assert TrialError(caught.value).text.startswith("ValueError: tiny-mlp's model runs part")


@pytest.mark.parametrize(
    ("model", "named"),
    [
        (_Sparse, r"'emb' \(Embedding\) with sparse=True.*use sparse=False"),
        (_Lazy, r"'fc1' \(LazyLinear\), whose 'weight', 'bias' are not initialised.*in_features"),
    ],
)
def test_a_sparse_embedding_or_a_lazy_module_is_refused_by_name(
    model: type[nn.Module], named: str
) -> None:
    """Both failed in packtune's own code ("Could not run 'aten::select_backward' ...
    SparseCPU" in backward; "Can't access the shape of an uninitialized parameter" in the
    fusion guard), alone too. Now each is an error naming the module and the fix."""
    with pytest.raises(ValueError, match=named):
        FusedArray(_Unsupported(model), member_configs("sgd", {})[:1])
