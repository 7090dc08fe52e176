"""A fused array trains each member exactly as a plain run of its config would."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from packtune.workloads.base import Workload
from tests.support.tiny_workloads import TinyCNN, TinyMLP
from worker.fused import FusedArray, Report, train

EPOCHS = 2
HYPER: dict[str, list[Any]] = {
    "momentum": [0.9, 0.5, 0.0, 0.99],
    "weight_decay": [0.0, 1e-3, 1e-2, 0.0],
    "beta1": [0.9, 0.8, 0.95, 0.5],
    "beta2": [0.999, 0.99, 0.9, 0.98],
    "eps": [1e-8, 1e-6, 1e-7, 1e-5],
}
LR = {"sgd": [0.05, 0.1, 0.02, 0.2], "adam": [1e-3, 3e-3, 1e-2, 3e-4]}


def member_configs(optimizer: str, extra: dict[str, Any], nesterov: bool = False):
    lrs = LR["sgd" if optimizer == "sgd" else "adam"]
    return [
        (
            f"t{i}",
            {
                "seed": 11 + i,
                "data_seed": 3,
                "optimizer": optimizer,
                "nesterov": nesterov,
                "lr": lrs[i],
                **{key: values[i] for key, values in HYPER.items()},
                **extra,
            },
        )
        for i in range(4)
    ]


def torch_optimizer(model: torch.nn.Module, cfg: dict[str, Any]) -> torch.optim.Optimizer:
    if cfg["optimizer"] == "sgd":
        return torch.optim.SGD(
            model.parameters(),
            lr=cfg["lr"],
            momentum=cfg["momentum"],
            weight_decay=cfg["weight_decay"],
            nesterov=cfg["nesterov"] and cfg["momentum"] > 0,
        )
    cls = torch.optim.Adam if cfg["optimizer"] == "adam" else torch.optim.AdamW
    return cls(
        model.parameters(),
        lr=cfg["lr"],
        betas=(cfg["beta1"], cfg["beta2"]),
        eps=cfg["eps"],
        weight_decay=cfg["weight_decay"],
    )


def plain_run(workload: Workload, config: dict[str, Any], epochs: int = EPOCHS):
    """The reference: one ordinary model, torch.optim, the workload's batches."""
    cfg = workload.resolve(config)
    torch.manual_seed(cfg["seed"])
    model = workload.build_model(cfg).train()
    opt = torch_optimizer(model, cfg)
    train_split, val_split = workload.data(cfg)
    epoch_losses = []
    for epoch in range(epochs):
        losses = []
        for idx in workload.batch_indices(cfg, epoch):
            loss = workload.loss(model(train_split.x[idx]), train_split.y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        epoch_losses.append(sum(losses) / len(losses))
    model.eval()
    with torch.no_grad():
        val_loss = float(workload.loss(model(val_split.x), val_split.y))
    return model, epoch_losses, val_loss


def compare(
    array: FusedArray, reports: list[Report], key: str, config: dict[str, Any], tol: float
) -> float:
    """Assert member ``key`` matches its plain run; the largest difference seen."""
    model, epoch_losses, val_loss = plain_run(array.workload, config, len(reports))
    fused = [r.metrics[key]["train_loss"] for r in reports] + [reports[-1].metrics[key]["val_loss"]]
    worst = max(abs(a - b) for a, b in zip(fused, [*epoch_losses, val_loss], strict=True))
    assert worst <= tol, (key, fused, epoch_losses, val_loss)
    state = array.member_state(key)
    for name, ref in model.state_dict().items():
        mine = state["params"].get(name, state["buffers"].get(name))
        assert mine is not None, name
        assert torch.allclose(mine, ref, rtol=tol, atol=tol), (key, name)
    return worst


CASES = [
    (TinyMLP, {}, "bmm"),
    (TinyMLP, {}, "vmap"),
    (TinyMLP, {"batch_norm": True}, "bmm"),
    (TinyMLP, {"batch_norm": True}, "vmap"),
    (TinyMLP, {"batch_norm": True}, "serial"),
    (TinyCNN, {}, "vmap"),
    (TinyCNN, {"batch_norm": True}, "vmap"),
    (TinyCNN, {"batch_norm": True}, "serial"),
    # hand-fused convolutions: one grouped Conv2d, BatchNorm2d over k*C channels
    (TinyCNN, {}, "bmm"),
    (TinyCNN, {"batch_norm": True}, "bmm"),
]
OPTIMIZERS = [("sgd", False), ("sgd", True), ("adam", False), ("adamw", False)]


@pytest.mark.parametrize("optimizer,nesterov", OPTIMIZERS)
@pytest.mark.parametrize("workload_cls,extra,mode", CASES)
def test_fused_array_matches_plain_runs(workload_cls, extra, mode, optimizer, nesterov):
    workload = workload_cls()
    members = member_configs(optimizer, extra, nesterov)
    array = FusedArray(workload, members, mode=mode)
    assert array.mode == mode
    reports = train(array, EPOCHS * array.steps_per_epoch)
    assert [r.resource for r in reports] == [1.0, 2.0]
    worst = max(compare(array, reports, key, cfg, 1e-10) for key, cfg in members)
    print(
        f"{workload.name} {extra} {mode} {optimizer} nesterov={nesterov}: "
        f"largest loss difference {worst:.2e}"
    )


@pytest.mark.parametrize("mode", ["bmm", "vmap", "serial"])
def test_diverged_member_leaves_and_the_others_are_unchanged(mode):
    workload = TinyMLP()
    members = member_configs("sgd", {"batch_norm": True})
    members[2][1]["lr"] = 1e300  # overflows to inf within a couple of steps
    array = FusedArray(workload, members, mode=mode)
    reports = train(array, EPOCHS * array.steps_per_epoch)
    assert list(array.diverged) == ["t2"]
    assert 1 <= array.diverged["t2"] <= 3
    assert reports[0].diverged == ("t2",) and reports[1].diverged == ()
    assert array.keys == ["t0", "t1", "t3"]
    assert all(set(r.metrics) == {"t0", "t1", "t3"} for r in reports)
    with pytest.raises(KeyError):
        array.member_state("t2")
    healthy = [m for m in members if m[0] != "t2"]
    without = FusedArray(workload, healthy, mode=mode)
    train(without, EPOCHS * without.steps_per_epoch)
    for key, cfg in healthy:
        mine, ref = array.member_state(key), without.member_state(key)
        for part in ("params", "buffers"):
            for name, tensor in ref[part].items():
                assert torch.equal(mine[part][name], tensor), (key, name)
        compare(array, reports, key, cfg, 1e-10)


@pytest.mark.parametrize("mode", ["bmm", "vmap"])
def test_forced_dropout_masks_are_each_members_own(mode: str) -> None:
    """A forced bmm or vmap stack draws each member's masks from its own stream: members of
    one seed train alike, another seed's otherwise, and again the same."""
    workload = TinyMLP()
    members = [(key, {"seed": seed, "data_seed": 3, "dropout": 0.5})
               for key, seed in (("a", 5), ("b", 5), ("c", 6))]  # fmt: skip
    runs = []
    for _ in range(2):
        array = FusedArray(workload, members, mode=mode)
        assert array.mode == mode
        runs.append((array, train(array, array.steps_per_epoch)))
    (array, reports), (_, reports_again) = runs
    weights = [array.member_state(key)["params"]["0.weight"] for key in ("a", "b", "c")]
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[1], weights[2])
    assert reports == reports_again
    assert array.evaluate() == array.evaluate()  # eval mode: dropout off


def test_auto_mode_picks_by_model_and_size():
    mlp, cnn = TinyMLP(), TinyCNN()
    two = [("a", {"seed": 1}), ("b", {"seed": 2})]
    assert FusedArray(mlp, two).mode == "bmm"
    assert FusedArray(cnn, two).mode == "vmap"
    assert FusedArray(cnn, two[:1]).mode == "serial"
    assert FusedArray(cnn, two, mode="bmm").mode == "bmm"  # fused convolutions, asked for
    with pytest.raises(ValueError, match="hand-fusable"):
        FusedArray(WrappedCNN(), two, mode="bmm")


class _Wrapper(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)  # type: ignore[no-any-return]


class WrappedCNN(TinyCNN):
    """TinyCNN's chain inside a module of its own: not a chain the bmm mode can follow."""

    name = "tiny-cnn-wrapped"

    def build_model(self, config: dict[str, Any]) -> torch.nn.Module:
        return _Wrapper(super().build_model(config))


def test_members_must_share_structure_and_step():
    workload = TinyMLP()
    with pytest.raises(ValueError, match="hidden"):
        FusedArray(workload, [("a", {"seed": 1}), ("b", {"seed": 2, "hidden": 8})])
    with pytest.raises(ValueError, match="data_seed"):
        FusedArray(workload, [("a", {"seed": 1, "data_seed": 1}), ("b", {"seed": 2})])
    trained = FusedArray(workload, [("a", {"seed": 1})])
    train(trained, 2)
    with pytest.raises(ValueError, match="same step"):
        FusedArray(
            workload,
            [("a", {"seed": 1}), ("b", {"seed": 2})],
            states=[trained.member_state("a"), None],
        )


def test_report_resources_at_epoch_boundaries_and_end():
    workload = TinyMLP()
    array = FusedArray(workload, [("a", {"seed": 1})])
    spe = array.steps_per_epoch
    seen: list[Report] = []
    train(array, spe + 2, on_report=seen.append)
    assert [r.step for r in seen] == [spe, spe + 2]
    assert seen[-1].resource == pytest.approx((spe + 2) / spe)
    assert set(seen[0].metrics["a"]) == {"train_loss", "val_loss", "val_accuracy"}
    train(array, 2 * spe, on_report=seen.append)
    assert [r.step for r in seen] == [spe, spe + 2, 2 * spe]
    with pytest.raises(ValueError, match="past"):
        train(array, spe)


def test_digits_mlp_fuses_by_hand_and_matches_plain_runs():
    """The built-in digits-mlp (float32) is hand-fusable and matches its plain runs."""
    from packtune.workloads import get_workload

    workload = get_workload("digits-mlp")
    members = [
        (
            f"d{i}",
            {"seed": i, "data_seed": 1, "hidden": 32, "batch_norm": True, "lr": 0.02 * (i + 1)},
        )
        for i in range(3)
    ]
    array = FusedArray(workload, members)
    assert array.mode == "bmm"
    reports = train(array, array.steps_per_epoch)
    # float32: the fused matmuls sum in another order than F.linear; differences
    # stay at a few float32 ulps of the loss after one epoch (~20 steps).
    worst = max(compare(array, reports, key, cfg, 2e-4) for key, cfg in members)
    print(f"digits-mlp float32 bmm: largest loss difference {worst:.2e}")


@pytest.mark.parametrize(
    "name,extra",
    [("synthetic-mlp", {}), ("synthetic-mlp", {"task": "regression"}), ("digits-mlp", {})],
)
def test_built_in_stacked_losses_match_their_per_member_losses(name, extra):
    """The batched losses a fused array uses equal the workload's loss per member, values
    and gradients, in float64 (to rounding) and float32 (to a few ulps)."""
    from packtune.workloads import get_workload

    workload = get_workload(name)
    cfg = workload.resolve(extra)
    train_split, _ = workload.data(cfg)
    x, y = train_split.x[:16], train_split.y[:16]
    k = 3
    for dtype, tol in ((torch.float64, 1e-13), (torch.float32, 1e-6)):
        models = []
        for seed in range(k):
            torch.manual_seed(seed)
            models.append(workload.build_model(cfg).to(dtype))
        target = y.to(dtype) if y.is_floating_point() else y
        out = torch.stack([m(x.to(dtype)) for m in models]).detach().requires_grad_()
        stacked = workload.stacked_loss(out, target)
        assert stacked is not None and stacked.shape == (k,)
        (grad,) = torch.autograd.grad(stacked.sum(), out)
        loop = torch.stack([workload.loss(o, target) for o in out.unbind(0)])
        (ref,) = torch.autograd.grad(loop.sum(), out)
        assert torch.allclose(stacked, loop, rtol=tol, atol=tol), (dtype, stacked, loop)
        assert torch.allclose(grad, ref, rtol=tol, atol=tol), dtype


@pytest.mark.parametrize("name", ["digits-mlp", "synthetic-mlp"])
def test_a_members_train_loss_does_not_depend_on_its_arrays_size(name: str) -> None:
    """A member alone took ``F.cross_entropy``'s mean, in an array the batched loss's
    per-example mean: its recorded train_loss differed in the last bits (116 of 200 batches)
    with the array it was packed into. Now the same to the bit, alone or beside others.

    Its weights too: MKL on an AMD EPYC rounded a last layer's weight gradient of a stack of
    one (``[1, 10, B] @ [1, B, 128]``) apart from the same product in a stack of three."""
    from packtune.workloads import get_workload

    workload = get_workload(name)
    members = [(f"m{i}", {"seed": i, "data_seed": 1, "lr": 0.02 * (i + 1)}) for i in range(3)]
    alone = FusedArray(workload, members[:1])
    together = FusedArray(workload, members)
    assert together.mode == alone.mode == "bmm"
    steps = alone.steps_per_epoch // 2
    for a, b in zip(train(alone, steps), train(together, steps), strict=True):
        assert a.metrics["m0"]["train_loss"] == b.metrics["m0"]["train_loss"], a.step
    mine, packed = alone.member_state("m0")["params"], together.member_state("m0")["params"]
    assert all(torch.equal(mine[n], packed[n]) for n in mine)


def test_convolutions_are_hand_fused_only_when_asked_and_only_plain_ones() -> None:
    from torch import nn

    from worker.fused_forward import bmm_plan

    cnn = TinyCNN().build_model({"batch_norm": True})
    assert bmm_plan(cnn) is None  # auto mode: vmap, as before
    plan = bmm_plan(cnn, convs=True)
    assert plan is not None
    assert [kind for kind, _, _ in plan] == [
        "conv", "batch_norm", "pointwise", "pool", "flatten", "linear"
    ]  # fmt: skip
    for odd in (
        nn.Conv2d(1, 2, 3, padding=1, padding_mode="reflect"),
        nn.MaxPool2d(2, return_indices=True),
        nn.Conv1d(1, 2, 3),
        nn.BatchNorm2d(2, momentum=None),
    ):
        assert bmm_plan(nn.Sequential(odd, nn.Flatten()), convs=True) is None, odd


@pytest.mark.parametrize("stacked", [False, True])
def test_hand_fused_convolutions_equal_each_member_alone(stacked: bool) -> None:
    """Strides, dilation, groups, no bias, BatchNorm2d in training, average and adaptive
    pooling: the fused forward, its gradients and the running statistics are each member's
    own (float64, to rounding)."""
    from torch import nn
    from torch.func import functional_call, stack_module_state

    from worker.fused_forward import bmm_forward, bmm_plan

    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=2, bias=False),
            nn.AvgPool2d(2), nn.Conv2d(8, 4, 1), nn.AdaptiveMaxPool2d(1), nn.Flatten(),
            nn.Linear(4, 3),
        ).double()  # fmt: skip

    k = 3
    models = [build(seed) for seed in range(k)]
    params, buffers = stack_module_state(models)  # type: ignore[arg-type]
    params = {n: p.detach().requires_grad_() for n, p in params.items()}
    torch.manual_seed(7)
    x = torch.randn(k, 5, 3, 12, 12, dtype=torch.float64) if stacked else torch.randn(
        5, 3, 12, 12, dtype=torch.float64
    )  # fmt: skip
    plan = bmm_plan(models[0], convs=True)
    assert plan is not None
    out = bmm_forward(plan, stacked=stacked)(params, buffers, x)
    out.pow(2).sum().backward()
    for j, model in enumerate(models):
        mine = {n: p[j] for n, p in params.items()}
        alone = functional_call(model, dict(model.named_parameters()), (x[j] if stacked else x,))
        assert torch.allclose(out[j], alone, rtol=1e-10, atol=1e-12), j
        alone.pow(2).sum().backward()
        for name, p in model.named_parameters():
            assert p.grad is not None
            assert torch.allclose(params[name].grad[j], p.grad, rtol=1e-9, atol=1e-12), name
            assert torch.equal(mine[name].detach(), p.detach())
        for name, b in model.named_buffers():
            assert torch.allclose(buffers[name][j], b, rtol=1e-12, atol=0), name


class _ScaledLinear(torch.nn.Linear):
    """A Linear with a forward of its own: the hand-fused path reads only its weights."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 3.0 * super().forward(x)


class _OddLinearMLP(TinyMLP):
    """TinyMLP whose first Linear is a subclass with its own forward, or has a hook."""

    def __init__(self, odd: str) -> None:
        self.odd = odd

    def build_model(self, config: dict[str, Any]) -> torch.nn.Module:
        model = super().build_model(config)
        first = model[0]
        if self.odd == "subclass":
            scaled = _ScaledLinear(first.in_features, first.out_features).to(first.weight.dtype)
            scaled.load_state_dict(first.state_dict())
            model[0] = scaled
        else:
            first.register_forward_hook(lambda _m, _i, out: out.clamp(-0.1, 0.1))
        return model


@pytest.mark.parametrize("odd", ["subclass", "hook"])
def test_a_linear_with_its_own_forward_or_a_hook_trains_as_written(odd: str) -> None:
    """Before, the hand-fused path took any ``nn.Linear`` subclass for a Linear and ignored
    hooks: the array trained a different model from the user's (3x outputs or unclamped),
    alone and fused alike, so no comparison between the two could catch it. Now such a
    model is not hand-fused, and every member matches its plain torch run."""
    from worker.fused_forward import bmm_plan

    workload = _OddLinearMLP(odd)
    assert bmm_plan(TinyMLP().build_model({})) is not None
    assert bmm_plan(workload.build_model({})) is None
    members = member_configs("sgd", {})
    array = FusedArray(workload, members)
    assert array.mode != "bmm"
    reports = train(array, EPOCHS * array.steps_per_epoch)
    for key, cfg in members:
        compare(array, reports, key, cfg, 1e-10)


def test_a_hook_on_every_module_stops_hand_fusion() -> None:
    from torch.nn.modules.module import register_module_forward_hook

    from worker.fused_forward import bmm_plan

    model = TinyMLP().build_model({})
    handle = register_module_forward_hook(lambda _m, _i, out: out)
    try:
        assert bmm_plan(model) is None
    finally:
        handle.remove()
    assert bmm_plan(model) is not None


class _Branchy(torch.nn.Module):
    """A model vmap cannot run (a tensor read as a bool): its array splits per member."""

    def __init__(self, body: torch.nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        return out * 1.0 if out.sum() > -1e9 else out


class _BranchyMLP(TinyMLP):
    def build_model(self, config: dict[str, Any]) -> torch.nn.Module:
        return _Branchy(super().build_model(config))


def test_an_array_split_per_member_keeps_the_epoch_loss_it_resumed_with() -> None:
    """Two members stop in the middle of an epoch (their states carry the epoch's losses so
    far) and resume in an array whose vmap step fails, so it splits per member: the epoch's
    train_loss is the unbroken epoch's. Before, the split's new groups started their sums
    at 0 and the epoch's train_loss was about half (the steps before the stop were lost)."""
    workload = _BranchyMLP()
    members = member_configs("sgd", {})[:2]
    straight = FusedArray(workload, members)
    whole = train(straight, straight.steps_per_epoch)
    half = straight.steps_per_epoch // 2
    first = FusedArray(workload, members)
    train(first, half)
    states = [first.member_state(key) for key, _ in members]
    assert all(state["epoch_loss_steps"] == half for state in states)
    resumed = FusedArray(workload, members, states=states, mode="vmap")
    rest = train(resumed, straight.steps_per_epoch)  # to the epoch's end
    assert "vmap could not run the fused step" in " ".join(resumed.notes)
    for key, _ in members:
        assert rest[-1].metrics[key]["train_loss"] == pytest.approx(
            whole[-1].metrics[key]["train_loss"], rel=1e-9
        ), key


class _FunctionalDropout(torch.nn.Module):
    def __init__(self, body: torch.nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(self.body(x), 0.3, self.training)


class _RandomByOtherMeans(TinyMLP):
    """Training that draws random numbers without a Dropout module: ``F.dropout`` in a
    module's forward, ``nn.RReLU`` (a random slope), or noise added in the workload's own
    step."""

    def __init__(self, how: str) -> None:
        self.how = how

    def build_model(self, config: dict[str, Any]) -> torch.nn.Module:
        model = super().build_model(config)
        if self.how == "functional":
            return _FunctionalDropout(model)
        if self.how == "rrelu":
            model[1] = torch.nn.RReLU()
        return model

    def training_loss(self, model: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        if self.how == "noise":
            x = x + 0.5 * torch.randn_like(x)
        return self.loss(model(x), y)

    def validation_metrics(self, model: Any, batch: Any) -> dict[str, Any]:
        x, y = batch
        return {"val_loss": self.loss(model(x), y)}


@pytest.mark.parametrize("how", ["functional", "rrelu", "noise"])
def test_randomness_outside_dropout_modules_trains_as_alone(how: str) -> None:
    """Each member of an array whose training draws random numbers some other way than a
    Dropout module ends with the weights it has trained alone: its draws come from its own
    stream. Before, only Dropout modules were seen: such arrays fused, and a member's draws
    depended on its companions (up to 0.1 apart after 6 steps)."""
    workload = _RandomByOtherMeans(how)
    members = member_configs("sgd", {})[:3]
    packed = FusedArray(workload, members)
    train(packed, packed.steps_per_epoch)
    for key, cfg in members:
        alone = FusedArray(workload, [(key, cfg)])
        train(alone, alone.steps_per_epoch)
        mine, ref = packed.member_state(key)["params"], alone.member_state(key)["params"]
        for name, tensor in ref.items():
            assert torch.equal(mine[name], tensor), (how, key, name)
    assert packed.stochastic


class _LateDraws(torch.nn.Module):
    """Draws only after 8 training forwards (a warm-up counted in Python), past the probe's;
    or (``big``) only on batches of more than 8 examples, where the probe began with 4."""

    def __init__(self, body: torch.nn.Module, how: str) -> None:
        super().__init__()
        self.body, self.how, self.steps = body, how, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import random

        if self.training:
            self.steps += 1
            if self.how == "big" and x.shape[0] > 8:
                x = x + 0.3 * torch.randn_like(x)
            elif self.how == "torch" and self.steps > 8:
                x = x + 0.3 * torch.randn_like(x)
            elif self.how == "host" and self.steps > 8 and random.random() < 0.5:
                x = x * 0.5
        return self.body(x)


class _LateDrawsMLP(TinyMLP):
    def __init__(self, how: str) -> None:
        self.how, self.name = how, f"late-draws-{how}"

    def build_model(self, config: dict[str, Any]) -> torch.nn.Module:
        return _LateDraws(super().build_model(config), self.how)


@pytest.mark.parametrize("how", ["torch", "host", "big"])
def test_draws_the_probe_did_not_see_are_each_members_own(how: str) -> None:
    """A model that draws only after a warm-up, or only at its batch size, looked drawless to
    its probe (one forward of 4 examples): its members fused, shared one stream of draws, and
    ended 2-30% apart from their unpacked runs. The probe now runs several forwards at each
    batch size; a draw it still misses stops the array at that step (the pack trains again
    from its checkpoints: a fault, not an attempt), and this process then trains the model's
    members each from its own streams, as alone."""
    from worker.probe import UnseenDraws

    workload = _LateDrawsMLP(how)
    members = member_configs("sgd", {})[:3]
    packed = FusedArray(workload, members)
    if how == "big":  # the probe's whole batch shows it
        assert packed.stochastic
    else:
        assert not packed.stochastic and not packed.host_random
        with pytest.raises(UnseenDraws, match="had not seen"):
            train(packed, 3 * packed.steps_per_epoch)
        packed = FusedArray(workload, members)  # the pack's next attempt
        assert packed.stochastic if how == "torch" else packed.host_random
    train(packed, 3 * packed.steps_per_epoch)
    for key, cfg in members:
        alone = FusedArray(workload, [(key, cfg)])
        train(alone, 3 * alone.steps_per_epoch)
        mine, ref = packed.member_state(key)["params"], alone.member_state(key)["params"]
        for name, tensor in ref.items():
            assert torch.equal(mine[name], tensor), (how, key, name)


class _Tracking(torch.nn.Module):
    """Keeps a running mean of its inputs in a plain tensor attribute, not a buffer: begun
    as zeros, or as None (set at the first forward)."""

    def __init__(self, body: torch.nn.Module, lazy: bool) -> None:
        super().__init__()
        self.body = body
        self.ema: torch.Tensor | None = None if lazy else torch.zeros(8, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            mean = x.mean(0).detach()
            self.ema = mean if self.ema is None else 0.9 * self.ema + 0.1 * mean
        return self.body(x if self.ema is None else x - self.ema)


class _TrackingMLP(TinyMLP):
    def __init__(self, lazy: bool) -> None:
        self.lazy, self.name = lazy, f"tracking-mlp-{lazy}"

    def build_model(self, config: dict[str, Any]) -> torch.nn.Module:
        return _Tracking(super().build_model(config), self.lazy)


@pytest.mark.parametrize("lazy", [False, True])
def test_a_tensor_a_forward_keeps_on_its_module_is_each_members_own(lazy: bool) -> None:
    """A running mean kept in a plain tensor attribute (``self.ema = ...``): under vmap it
    held the stack's batched value, and the first checkpoint of the array failed
    ("Cannot access storage of BatchedTensorImpl"), every trial failing packed while it
    trained unpacked. Its members now train one per stack, each keeping its own, also
    where the attribute begins as None (a review found that one still fused)."""
    workload, members = _TrackingMLP(lazy), member_configs("sgd", {})[:2]
    packed = FusedArray(workload, members)
    train(packed, 2 * packed.steps_per_epoch)
    for key, cfg in members:
        alone = FusedArray(workload, [(key, cfg)])
        train(alone, 2 * alone.steps_per_epoch)
        mine, ref = packed.member_state(key), alone.member_state(key)
        for name, tensor in ref["params"].items():
            assert torch.equal(mine["params"][name], tensor), (key, name)


def test_a_model_without_randomness_is_still_fused() -> None:
    array = FusedArray(TinyMLP(), member_configs("sgd", {}))
    assert not array.stochastic and array.mode == "bmm"


class _FixedBatch(torch.nn.Module):
    """A model that only runs on its batch size (16): a probe of 4 examples raises."""

    def __init__(self, body: torch.nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x.reshape(16, 8))


class _FixedBatchMLP(TinyMLP):
    def build_model(self, config: dict[str, Any]) -> torch.nn.Module:
        return _FixedBatch(super().build_model(config))


def test_a_model_that_needs_its_batch_size_is_probed_with_a_whole_batch() -> None:
    array = FusedArray(_FixedBatchMLP(), member_configs("sgd", {})[:2])
    assert not array.stochastic and array.mode == "vmap" and array.notes == []


def test_a_stack_of_one_multiplies_expanded_and_transposed_operands_as_a_stack_of_three() -> None:
    """The check of whether a stack of one rounds as a stack of several made its random
    operands with the real ones' strides and raised on an expanded gradient (a loss that
    sums the outputs: strides (0, 0, 0)); and its answer, cached per shapes, did not depend
    on torch's thread count, which on MKL decides it (found by a review)."""
    from worker.fused_forward import stacked_product

    generator = torch.Generator().manual_seed(3)
    g = torch.randn(3, 64, 10, generator=generator)
    h = torch.randn(3, 64, 128, generator=generator)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 1, 2):
            torch.set_num_threads(n)
            full = torch.bmm(g.mT, h)[:1]
            assert torch.equal(stacked_product(g[:1].mT, h[:1]), full), n
            ones = torch.ones(1, 1, 1).expand(1, 64, 10)
            assert torch.equal(stacked_product(ones.mT, h[:1]),
                               torch.bmm(ones.expand(3, 64, 10).mT, h)[:1])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
