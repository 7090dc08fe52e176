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
def test_dropout_differs_per_member_and_is_reproducible(mode):
    workload = TinyMLP()
    same = {"seed": 5, "data_seed": 3, "dropout": 0.5}
    members = [(key, dict(same)) for key in ("a", "b", "c")]
    runs = []
    for _ in range(2):
        array = FusedArray(workload, members, mode=mode)
        reports = train(array, array.steps_per_epoch)
        runs.append((array, reports))
    (array, reports), (again, reports_again) = runs
    weights = [array.member_state(key)["params"]["0.weight"] for key in ("a", "b", "c")]
    assert not torch.equal(weights[0], weights[1]) and not torch.equal(weights[1], weights[2])
    assert reports == reports_again  # same stream, same companions: same results
    assert array.evaluate() == array.evaluate()  # eval mode: dropout off


def test_auto_mode_picks_by_model_and_size():
    mlp, cnn = TinyMLP(), TinyCNN()
    two = [("a", {"seed": 1}), ("b", {"seed": 2})]
    assert FusedArray(mlp, two).mode == "bmm"
    assert FusedArray(cnn, two).mode == "vmap"
    assert FusedArray(cnn, two[:1]).mode == "serial"
    with pytest.raises(ValueError, match="hand-fusable"):
        FusedArray(cnn, two, mode="bmm")


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
