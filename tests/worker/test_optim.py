"""Stacked optimizers match torch.optim member by member."""

from __future__ import annotations

import pytest
import torch

import worker.optim
from packtune.schedules import Schedule, schedule_of
from worker.optim import OPTIMIZER_HYPER, build_optimizer

K = 4
HYPER = {
    "lr": [0.1, 0.01, 0.3, 0.05],
    "momentum": [0.9, 0.0, 0.5, 0.99],
    "weight_decay": [0.0, 0.1, 0.01, 1e-3],
    "beta1": [0.9, 0.8, 0.5, 0.95],
    "beta2": [0.999, 0.99, 0.9, 0.98],
    "eps": [1e-8, 1e-6, 1e-3, 1e-7],
    "alpha": [0.99, 0.9, 0.5, 0.999],
    "rho": [0.9, 0.5, 0.95, 0.99],
}
SHAPES = {"w": (5, 3), "b": (5,), "conv": (2, 1, 3, 3)}


def torch_optimizer(name: str, params: list[torch.Tensor], i: int, nesterov: bool):
    h = {key: values[i] for key, values in HYPER.items()}
    if name == "sgd":
        return torch.optim.SGD(
            params,
            lr=h["lr"],
            momentum=h["momentum"],
            weight_decay=h["weight_decay"],
            nesterov=nesterov and h["momentum"] > 0,
        )
    if name == "rmsprop":
        return torch.optim.RMSprop(
            params, lr=h["lr"], alpha=h["alpha"], eps=h["eps"],
            weight_decay=h["weight_decay"], momentum=h["momentum"],
        )  # fmt: skip
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=h["lr"], eps=h["eps"], weight_decay=h["weight_decay"])
    if name == "adadelta":
        return torch.optim.Adadelta(
            params, lr=h["lr"], rho=h["rho"], eps=h["eps"], weight_decay=h["weight_decay"]
        )
    cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
    return cls(
        params,
        lr=h["lr"],
        betas=(h["beta1"], h["beta2"]),
        eps=h["eps"],
        weight_decay=h["weight_decay"],
    )


def run_both(name: str, nesterov: bool, dtype: torch.dtype, steps: int = 6):
    """Stacked and per-member torch.optim runs on the same random gradients."""
    gen = torch.Generator().manual_seed(0)
    init = {n: torch.randn(K, *s, generator=gen, dtype=dtype) for n, s in SHAPES.items()}
    stacked = {n: t.clone().requires_grad_() for n, t in init.items()}
    hyper = {key: torch.tensor(values, dtype=torch.float64) for key, values in HYPER.items()}
    opt = build_optimizer(name, stacked, hyper, nesterov=nesterov)
    refs = []
    for i in range(K):
        params = [init[n][i].clone().requires_grad_() for n in SHAPES]
        refs.append((params, torch_optimizer(name, params, i, nesterov)))
    for _ in range(steps):
        grads = {n: torch.randn(K, *s, generator=gen, dtype=dtype) for n, s in SHAPES.items()}
        for n, p in stacked.items():
            p.grad = grads[n].clone()
        opt.step()
        opt.zero_grad()
        for i, (params, ref) in enumerate(refs):
            for n, p in zip(SHAPES, params, strict=True):
                p.grad = grads[n][i].clone()
            ref.step()
    return stacked, refs, opt


RULES = [
    ("sgd", False), ("sgd", True), ("adam", False), ("adamw", False),
    ("rmsprop", False), ("adagrad", False), ("adadelta", False),
]  # fmt: skip
#: the rules torch has fused CPU kernels for; the others are element-wise everywhere
KERNEL_RULES = ("sgd", "adam", "adamw")


@pytest.mark.parametrize("name,nesterov", RULES)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-14), (torch.float32, 2e-6)])
@pytest.mark.parametrize("kernels", [True, False], ids=["fused-kernels", "element-wise"])
def test_matches_torch_optim_per_member(name, nesterov, dtype, tol, kernels, monkeypatch):
    """On a CPU each member's row goes through torch's fused kernel; element-wise ops over
    the whole buffer are the path elsewhere (a GPU) and where torch lacks the kernels."""
    if not kernels and name not in KERNEL_RULES:
        pytest.skip("element-wise either way")
    monkeypatch.setattr(worker.optim, "FUSED_KERNELS", kernels and worker.optim.FUSED_KERNELS)
    stacked, refs, opt = run_both(name, nesterov, dtype)
    assert opt.by_member == (kernels and worker.optim.FUSED_KERNELS and name in KERNEL_RULES)
    worst = 0.0
    for i, (params, _) in enumerate(refs):
        for n, p in zip(SHAPES, params, strict=True):
            worst = max(worst, float((stacked[n][i] - p).detach().abs().max()))
            assert torch.allclose(stacked[n][i], p, rtol=tol, atol=tol), (name, n, i)
    print(f"{name} nesterov={nesterov} {dtype}: largest difference {worst:.2e}")


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw", "rmsprop", "adagrad", "adadelta"])
@pytest.mark.parametrize("kernels", [True, False], ids=["fused-kernels", "element-wise"])
def test_member_state_moves_to_another_array(name, kernels, monkeypatch):
    """Members exported from an array of 4 and resumed in an array of 2 (new companion)."""
    monkeypatch.setattr(worker.optim, "FUSED_KERNELS", kernels and worker.optim.FUSED_KERNELS)
    stacked, _, opt = run_both(name, False, torch.float64, steps=3)
    exported = [opt.member_state(i) for i in (2, 0)]
    assert exported[0]["step"] == 3.0
    gen = torch.Generator().manual_seed(1)
    rows = [2, 0]
    params = {n: stacked[n].detach()[rows].clone().requires_grad_() for n in SHAPES}
    hyper = {key: torch.tensor(values, dtype=torch.float64)[rows] for key, values in HYPER.items()}
    moved = build_optimizer(name, params, hyper, states=exported)
    continued = build_optimizer(
        name,
        {n: stacked[n].detach().clone().requires_grad_() for n in SHAPES},
        {key: torch.tensor(v, dtype=torch.float64) for key, v in HYPER.items()},
        states=[opt.member_state(i) for i in range(K)],
    )
    for _ in range(3):
        grads = {
            n: torch.randn(K, *s, generator=gen, dtype=torch.float64) for n, s in SHAPES.items()
        }
        for n in SHAPES:
            params[n].grad = grads[n][rows].clone()
            continued.params[n].grad = grads[n].clone()
        moved.step()
        continued.step()
    for n in SHAPES:
        assert torch.equal(params[n], continued.params[n][rows])


def test_select_drops_a_members_state():
    stacked, _, opt = run_both("adam", False, torch.float64, steps=2)
    before = [opt.member_state(i) for i in range(K)]
    keep = [0, 1, 3]
    opt.select(keep, {n: p.detach()[keep].clone().requires_grad_() for n, p in stacked.items()})
    assert opt.size == 3
    for new, old in enumerate(keep):
        state = opt.member_state(new)
        for n in SHAPES:
            assert torch.equal(state["state"][n]["exp_avg"], before[old]["state"][n]["exp_avg"])
    assert torch.equal(opt.hyper["lr"], torch.tensor(HYPER["lr"], dtype=torch.float64)[keep])


@pytest.mark.parametrize("kernels", [True, False], ids=["fused-kernels", "element-wise"])
def test_fresh_member_beside_resumed_one_starts_its_momentum_from_its_gradient(
    kernels, monkeypatch
):
    """SGD's first step copies the gradient into the buffer, per member, as torch.optim does."""
    monkeypatch.setattr(worker.optim, "FUSED_KERNELS", kernels and worker.optim.FUSED_KERNELS)
    stacked, _, opt = run_both("sgd", False, torch.float64, steps=2)
    params = {n: stacked[n].detach()[:2].clone().requires_grad_() for n in SHAPES}
    hyper = {key: torch.tensor(values, dtype=torch.float64)[:2] for key, values in HYPER.items()}
    mixed = build_optimizer("sgd", params, hyper, states=[opt.member_state(0), None])
    fresh_ref = [params[n][1].detach().clone().requires_grad_() for n in SHAPES]
    ref = torch_optimizer("sgd", fresh_ref, 1, False)
    for _ in range(2):
        grads = {n: torch.randn(2, *s, dtype=torch.float64) for n, s in SHAPES.items()}
        for n, p in zip(SHAPES, fresh_ref, strict=True):
            params[n].grad = grads[n].clone()
            p.grad = grads[n][1].clone()
        mixed.step()
        ref.step()
    for n, p in zip(SHAPES, fresh_ref, strict=True):
        assert torch.allclose(params[n][1], p, rtol=1e-14, atol=1e-14)


def test_unknown_optimizer_and_missing_hyper_are_rejected():
    params = {"w": torch.zeros(2, 3, requires_grad=True)}
    hyper = {key: torch.ones(2) for key in OPTIMIZER_HYPER}
    with pytest.raises(ValueError, match="unknown optimizer"):
        build_optimizer("lion", params, hyper)
    with pytest.raises(ValueError, match="beta2"):
        build_optimizer("adam", params, {k: v for k, v in hyper.items() if k != "beta2"})


def test_parameters_move_into_one_buffer_and_stay_the_callers_tensors():
    gen = torch.Generator().manual_seed(2)
    stacked = {n: torch.randn(K, *s, generator=gen).requires_grad_() for n, s in SHAPES.items()}
    before = {n: p.detach().clone() for n, p in stacked.items()}
    hyper = {key: torch.tensor(values, dtype=torch.float64) for key, values in HYPER.items()}
    opt = build_optimizer("adam", stacked, hyper)
    assert all(opt.params[n] is p for n, p in stacked.items())
    assert len({p.untyped_storage().data_ptr() for p in stacked.values()}) == 1
    assert (
        len(
            {t.untyped_storage().data_ptr() for slots in opt.state.values() for t in slots.values()}
        )
        == 2
    )  # exp_avg, exp_avg_sq: one buffer each
    for n, p in stacked.items():
        assert p.is_leaf and p.requires_grad and torch.equal(p, before[n])
        assert p[1].is_contiguous()  # one member's slice stays contiguous


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_a_parameter_without_a_gradient_is_left_alone_as_in_torch_optim(name):
    """Steps where a parameter has no gradient leave it and its state alone; the others
    update as torch.optim's do. (Adam's step count is per member here, per parameter
    in torch.optim: a parameter that skipped steps gets other bias corrections later.)"""
    gen = torch.Generator().manual_seed(3)
    init = {n: torch.randn(K, *s, generator=gen, dtype=torch.float64) for n, s in SHAPES.items()}
    stacked = {n: t.clone().requires_grad_() for n, t in init.items()}
    hyper = {key: torch.tensor(values, dtype=torch.float64) for key, values in HYPER.items()}
    opt = build_optimizer(name, stacked, hyper)
    refs = []
    for i in range(K):
        params = [init[n][i].clone().requires_grad_() for n in SHAPES]
        refs.append((params, torch_optimizer(name, params, i, False)))
    for step in range(5):
        skipped = {1: "b", 2: "conv", 4: "b"}.get(step)
        grads = {
            n: torch.randn(K, *s, generator=gen, dtype=torch.float64) for n, s in SHAPES.items()
        }
        for n, p in stacked.items():
            p.grad = None if n == skipped else grads[n].clone()
        if skipped is not None:
            frozen = stacked[skipped].detach().clone(), opt.member_state(0)["state"][skipped]
        opt.step()
        opt.zero_grad()
        if skipped is not None:
            assert torch.equal(stacked[skipped], frozen[0])
            after = opt.member_state(0)["state"][skipped]
            assert all(torch.equal(after[key], t) for key, t in frozen[1].items())
        for i, (params, ref) in enumerate(refs):
            for n, p in zip(SHAPES, params, strict=True):
                p.grad = None if n == skipped else grads[n][i].clone()
            ref.step()
    compared = list(SHAPES) if name == "sgd" else ["w"]  # "w" has a gradient at every step
    for i, (params, _) in enumerate(refs):
        for n, p in zip(SHAPES, params, strict=True):
            if n in compared:
                assert torch.allclose(stacked[n][i], p, rtol=1e-14, atol=1e-14), (name, n, i)


# -- schedules and clipping ---------------------------------------------------------------

SPE = 3  # steps per epoch
SCHEDULES = [
    {"schedule": "constant"},
    {"schedule": "step", "decay_epochs": 1.0, "gamma": 0.5},
    {"schedule": "cosine", "final_lr_ratio": 0.1},
    {"schedule": "cosine", "warmup_epochs": 1.0},  # linear warm-up, then cosine
]


def torch_schedule(config: dict, opt: torch.optim.Optimizer, total: int):
    """The same schedule from torch.optim.lr_scheduler, stepped once per optimizer step."""
    sched = torch.optim.lr_scheduler
    kind, warmup = config["schedule"], round(config.get("warmup_epochs", 0) * SPE)
    if kind == "step":
        return sched.StepLR(opt, step_size=round(config["decay_epochs"] * SPE), gamma=0.5)
    if kind == "cosine":
        lr = opt.param_groups[0]["lr"]
        cosine = sched.CosineAnnealingLR(
            opt, T_max=total - warmup, eta_min=lr * config.get("final_lr_ratio", 0.0)
        )
        if not warmup:
            return cosine
        ramp = sched.LinearLR(opt, start_factor=1 / warmup, end_factor=1.0, total_iters=warmup - 1)
        return sched.SequentialLR(opt, [ramp, cosine], milestones=[warmup])
    return sched.LambdaLR(opt, lambda _: 1.0)


@pytest.mark.parametrize("name", ["sgd", "adam", "rmsprop", "adagrad"])
@pytest.mark.parametrize("kernels", [True, False], ids=["fused-kernels", "element-wise"])
def test_each_member_follows_its_own_schedule_as_torch_lr_scheduler(name, kernels, monkeypatch):
    """Four members, four schedules (constant, step, cosine to 10%, warm-up then cosine) over
    a 4-epoch horizon and beyond it, each equal to torch.optim with torch's scheduler."""
    monkeypatch.setattr(worker.optim, "FUSED_KERNELS", kernels and worker.optim.FUSED_KERNELS)
    total = 4 * SPE
    gen = torch.Generator().manual_seed(4)
    init = {n: torch.randn(K, *s, generator=gen, dtype=torch.float64) for n, s in SHAPES.items()}
    stacked = {n: t.clone().requires_grad_() for n, t in init.items()}
    hyper = {key: torch.tensor(values, dtype=torch.float64) for key, values in HYPER.items()}
    configs = [{**c, "gamma": 0.5} if c["schedule"] == "step" else c for c in SCHEDULES]
    plans = [schedule_of(c, SPE, 4.0) for c in configs]
    opt = build_optimizer(name, stacked, hyper, schedules=plans)
    assert opt.scheduled
    refs = []
    for i in range(K):
        params = [init[n][i].clone().requires_grad_() for n in SHAPES]
        ref = torch_optimizer(name, params, i, False)
        refs.append((params, ref, torch_schedule(configs[i], ref, total)))
    for _ in range(total + 2):  # past the horizon the cosine stays at its floor
        grads = {
            n: torch.randn(K, *s, generator=gen, dtype=torch.float64) for n, s in SHAPES.items()
        }
        for n, p in stacked.items():
            p.grad = grads[n].clone()
        opt.step()
        for i, (params, ref, scheduler) in enumerate(refs):
            for n, p in zip(SHAPES, params, strict=True):
                p.grad = grads[n][i].clone()
            ref.step()
            if configs[i]["schedule"] != "cosine" or scheduler.last_epoch < total:
                scheduler.step()  # (torch's cosine would rise again past T_max)
        for i in range(K):
            assert opt.values["lr"][i] == pytest.approx(
                HYPER["lr"][i] * plans[i].factor(int(opt.steps[i]) - 1), rel=1e-12
            )
    for i, (params, _, _) in enumerate(refs):
        for n, p in zip(SHAPES, params, strict=True):
            assert torch.allclose(stacked[n][i], p, rtol=1e-9, atol=1e-12), (name, i, n)


def test_a_schedule_resumed_from_a_members_state_continues_exactly():
    """Five steps, exported, resumed in a new array beside a fresh member, five more: equal
    to ten steps in one go (the schedule follows the member's own step count)."""
    config = {"schedule": "cosine", "warmup_epochs": 1.0, "final_lr_ratio": 0.05}
    plan = schedule_of(config, SPE, 4.0)
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(2, 5, 3, generator=gen, dtype=torch.float64) for _ in range(10)]
    hyper = {key: torch.tensor(v[:2], dtype=torch.float64) for key, v in HYPER.items()}
    start = torch.randn(2, 5, 3, generator=gen, dtype=torch.float64)

    def run(params, opt, steps):
        for g in steps:
            params["w"].grad = g.clone()
            opt.step()

    whole = {"w": start.clone().requires_grad_()}
    run(whole, build_optimizer("adam", whole, hyper, schedules=[plan, plan]), grads)
    first = {"w": start.clone().requires_grad_()}
    opt = build_optimizer("adam", first, hyper, schedules=[plan, plan])
    run(first, opt, grads[:5])
    state = opt.member_state(0)
    other = Schedule()  # a fresh, unscheduled companion at step 0
    resumed = {"w": torch.stack([first["w"].detach()[0], start[1]]).requires_grad_()}
    opt2 = build_optimizer("adam", resumed, hyper, states=[state, None], schedules=[plan, other])
    run(resumed, opt2, grads[5:])
    assert torch.equal(resumed["w"][0], whole["w"][0])


@pytest.mark.parametrize("name", ["sgd", "adam", "rmsprop"])
def test_clipping_per_member_matches_clip_grad_norm(name):
    """clip_norm 0 (off), 0.5, 2 and 1e6 (never binding), each as torch's clip_grad_norm_
    over the member's whole gradient before its step; one parameter skips a step."""
    clip = [0.0, 0.5, 2.0, 1e6]
    gen = torch.Generator().manual_seed(6)
    init = {n: torch.randn(K, *s, generator=gen, dtype=torch.float64) for n, s in SHAPES.items()}
    stacked = {n: t.clone().requires_grad_() for n, t in init.items()}
    hyper = {key: torch.tensor(values, dtype=torch.float64) for key, values in HYPER.items()}
    opt = build_optimizer(name, stacked, {**hyper, "clip_norm": torch.tensor(clip)})
    assert opt.clipping
    refs = []
    for i in range(K):
        params = [init[n][i].clone().requires_grad_() for n in SHAPES]
        refs.append((params, torch_optimizer(name, params, i, False)))
    binding = [False] * K
    for step in range(4):
        skipped = "b" if step == 2 else None
        grads = {
            n: 3 * torch.randn(K, *s, generator=gen, dtype=torch.float64) for n, s in SHAPES.items()
        }
        for n, p in stacked.items():
            p.grad = None if n == skipped else grads[n].clone()
        opt.step()
        for i, (params, ref) in enumerate(refs):
            for n, p in zip(SHAPES, params, strict=True):
                p.grad = None if n == skipped else grads[n][i].clone()
            if clip[i]:
                with_grad = [p for p in params if p.grad is not None]
                norm = float(torch.nn.utils.clip_grad_norm_(with_grad, clip[i]))
                binding[i] |= norm > clip[i]
            ref.step()
    # Adam counts steps per member, torch.optim per parameter: "b" (skipped once) differs
    compared = ["w", "conv"] if name == "adam" else list(SHAPES)
    for i, (params, _) in enumerate(refs):
        for n, p in zip(SHAPES, params, strict=True):
            if n in compared:
                assert torch.allclose(stacked[n][i], p, rtol=1e-12, atol=1e-12), (name, i, n)
    assert binding == [False, True, True, False]  # not vacuous: the tight clips bit
