"""Decoupled training's rule (worker.decoupled): where a chain is cut, the synthetic labels,
each segment's inputs and loss; and that a network trained that way classifies digits."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from packtune.spec import TrainingSettings
from tests.support.states import assert_member_states_close
from tests.support.tiny_workloads import TinyMLP
from worker.decoupled import (
    Segment,
    compose,
    cut_points,
    merge_segments,
    split,
    synthetic_labels,
    widths,
)
from worker.decoupled_group import DecoupledGroup
from worker.fused import FusedArray, train


def mlp(layers: int, hidden: int = 32) -> nn.Sequential:
    modules: list[nn.Module] = []
    width = 64
    for _ in range(layers):
        modules += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    return nn.Sequential(*modules, nn.Linear(width, 10))


def test_cuts_are_consecutive_start_at_weights_and_balance_parameters() -> None:
    model = mlp(5)  # 6 Linear layers: 64x32, 4 x 32x32, 32x10
    runs = cut_points(model, 2)
    assert [i for run in runs for i in run] == list(range(len(model)))
    assert all(isinstance(model[run.start], nn.Linear) for run in runs)
    counts = [sum(p.numel() for i in run for p in model[i].parameters()) for run in runs]
    assert max(counts) < 0.7 * sum(counts), counts
    assert len(cut_points(model, 6)) == 6
    with pytest.raises(ValueError, match="cannot be cut into 7 segments"):
        cut_points(model, 7)


def test_segments_share_the_models_weights_and_compose_to_it() -> None:
    torch.manual_seed(0)
    model = mlp(3)
    parts = split(model, 2)
    x = torch.randn(5, 64)
    torch.testing.assert_close(compose(parts, x), model(x))
    assert {id(p) for part in parts for p in part.parameters()} == {
        id(p) for p in model.parameters()
    }
    assert widths(parts, x) == [32]


def test_labels_are_fixed_by_the_seed_and_reachable_after_a_relu() -> None:
    a, b = synthetic_labels(10, [32, 16], seed=3), synthetic_labels(10, [32, 16], seed=3)
    assert [t.shape for t in a] == [torch.Size([10, 32]), torch.Size([10, 16])]
    assert all(torch.equal(s, t) for s, t in zip(a, b, strict=True))
    assert not torch.equal(a[0], synthetic_labels(10, [32, 16], seed=4)[0])
    assert all(((t >= 0) & (t < 1)).all() for t in a)


def test_each_segment_learns_from_labels_not_from_the_segment_before() -> None:
    labels = synthetic_labels(10, [32], seed=0)
    first, last = Segment(0, 2, labels), Segment(1, 2, labels, noise=0.0)
    x, y = torch.randn(4, 64), torch.tensor([0, 3, 3, 9])
    gen = torch.Generator().manual_seed(0)
    assert first.inputs(x, y, gen) is x
    torch.testing.assert_close(last.inputs(x, y, gen), labels[0][y])  # not segment 1's output
    out = torch.randn(4, 32)
    torch.testing.assert_close(first.loss(out, y, F.cross_entropy), F.mse_loss(out, labels[0][y]))
    logits = torch.randn(4, 10)
    torch.testing.assert_close(last.loss(logits, y, F.cross_entropy), F.cross_entropy(logits, y))


def test_a_network_trained_decoupled_classifies_digits() -> None:
    """Seeded, so deterministic: two seeds at 10 epochs reach 0.95-0.97 on this machine;
    the bound leaves a wide margin."""
    from bench.decoupled import train

    for seed in (0, 1):
        result = train(seed, epochs=10, decoupled=True)
        assert result["accuracy"] > 0.85, result


# -- decoupled arrays (worker.decoupled_group): fused, exact, resumable -----------------

DECOUPLED = TrainingSettings(mode="decoupled", segments=2, noise=0.1)


def tiny_members(k: int, extra: dict[str, object] | None = None) -> list[tuple[str, dict]]:
    return [
        (f"t{i}", {"seed": 5 + i, "data_seed": 2, "lr": 0.05 * (i + 1), "hidden": 24,
                   "layers": 3, **(extra or {})})
        for i in range(k)
    ]  # fmt: skip


@pytest.mark.parametrize("mode", ["bmm", "vmap", "serial"])
def test_a_decoupled_array_trains_each_member_as_it_trains_alone(mode: str) -> None:
    mlp = TinyMLP()
    extra = {"optimizer": "adam", "batch_norm": True}
    together = FusedArray(mlp, tiny_members(3, extra), mode=mode, training=DECOUPLED)
    train(together, 14)
    assert isinstance(together.groups[0], DecoupledGroup)
    ev = together.evaluate()
    for key, config in tiny_members(3, extra):
        alone = FusedArray(mlp, [(key, config)], mode=mode, training=DECOUPLED)
        train(alone, 14)
        assert_member_states_close(alone.member_state(key), together.member_state(key))
        assert ev[key]["val_loss"] == pytest.approx(alone.evaluate()[key]["val_loss"], rel=1e-6)


def test_segments_trained_at_once_in_threads_compute_what_they_compute_in_turn() -> None:
    mlp = TinyMLP()
    extra = {"optimizer": "adam", "batch_norm": True, "layers": 4}
    training = TrainingSettings(mode="decoupled", segments=3)
    arrays = []
    for threads in (1, 3):
        array = FusedArray(mlp, tiny_members(2, extra), mode="bmm", training=training)
        (group,) = array.groups
        assert isinstance(group, DecoupledGroup)
        group.threads = threads
        train(array, 14)
        arrays.append(array)
    for key in arrays[0].keys:
        one, other = (a.member_state(key) for a in arrays)
        for name, t in one["params"].items():
            assert torch.equal(other["params"][name], t), name


def test_a_decoupled_array_resumes_exactly_and_differs_from_end_to_end() -> None:
    mlp = TinyMLP()
    straight = FusedArray(mlp, tiny_members(2), training=DECOUPLED)
    train(straight, 14)
    half = FusedArray(mlp, tiny_members(2), training=DECOUPLED)
    train(half, 9)  # mid-epoch
    states = [half.member_state(key) for key in half.keys]
    resumed = FusedArray(mlp, tiny_members(2), training=DECOUPLED, states=states)
    train(resumed, 14)
    for key in straight.keys:
        assert_member_states_close(straight.member_state(key), resumed.member_state(key))
    end_to_end = FusedArray(mlp, tiny_members(2))
    train(end_to_end, 14)
    first = straight.keys[0]
    assert not torch.allclose(  # the segments learned from labels, not through each other
        end_to_end.member_state(first)["params"]["0.weight"],
        straight.member_state(first)["params"]["0.weight"],
    )


def test_a_member_whose_segment_diverges_leaves_and_the_others_are_unchanged() -> None:
    mlp = TinyMLP()
    configs = tiny_members(3, {"optimizer": "sgd", "momentum": 0.0})
    configs[1][1]["lr"] = 1e300  # its weights overflow at the first step: its losses are nan
    together = FusedArray(mlp, configs, mode="bmm", training=DECOUPLED)
    train(together, 14)
    assert list(together.diverged) == ["t1"]
    for key, config in (configs[0], configs[2]):
        alone = FusedArray(mlp, [(key, config)], mode="bmm", training=DECOUPLED)
        train(alone, 14)
        assert_member_states_close(alone.member_state(key), together.member_state(key))


def test_a_model_that_cannot_train_decoupled_says_why() -> None:
    with pytest.raises(ValueError, match="cannot be cut into 5 segments"):
        FusedArray(TinyMLP(), tiny_members(1, {"layers": 1}),
                   training=TrainingSettings(mode="decoupled", segments=5))  # fmt: skip


def test_segments_trained_alone_make_the_array_that_trains_them_together() -> None:
    """Each segment trained alone (a segment unit), from the same state, and the states
    merged: the member states of an array that trains every segment, bit for bit."""
    mlp = TinyMLP()
    extra = {"optimizer": "adam", "batch_norm": True, "layers": 4}
    training = TrainingSettings(mode="decoupled", segments=3, units="segment")
    start = FusedArray(mlp, tiny_members(2, extra), mode="bmm", training=training)
    train(start, 5)
    states = [start.member_state(key) for key in start.keys]
    together = FusedArray(mlp, tiny_members(2, extra), mode="bmm", training=training,
                          states=states)  # fmt: skip
    train(together, 14)
    parts = []
    for j in range(3):
        alone = FusedArray(mlp, tiny_members(2, extra), mode="bmm", training=training,
                           states=states, segment=j)  # fmt: skip
        train(alone, 14)
        assert alone.evaluate() == {key: {} for key in alone.keys}  # one segment: no model
        # it holds its own segment's weights only
        assert set(alone.groups[0].params) < set(together.groups[0].params)
        parts.append({key: alone.member_state(key) for key in alone.keys})
    for key in together.keys:
        merged = merge_segments([part[key] for part in parts])
        want = together.member_state(key)
        assert merged["steps_done"] == want["steps_done"] == 14
        for what in ("params", "buffers"):
            assert merged[what].keys() == want[what].keys()
            for name, t in want[what].items():
                assert torch.equal(merged[what][name], t), name
        assert merged["optimizer"]["step"] == want["optimizer"]["step"]
        for name, slots in want["optimizer"]["state"].items():
            for slot, t in slots.items():
                assert torch.equal(merged["optimizer"]["state"][name][slot], t), (name, slot)


def test_a_segment_outside_the_cut_is_refused() -> None:
    training = TrainingSettings(mode="decoupled", segments=2, units="segment")
    with pytest.raises(ValueError, match="segment 2 of a model cut into 2"):
        FusedArray(TinyMLP(), tiny_members(1), training=training, segment=2)


def test_merging_needs_every_segment_at_one_step() -> None:
    part = {"key": "t", "config": {}, "rng": None, "params": {}, "buffers": {},
            "optimizer": {"step": 3, "state": {}}}  # fmt: skip
    with pytest.raises(ValueError, match="different steps"):
        merge_segments([{**part, "segment": 0, "steps_done": 3},
                        {**part, "segment": 1, "steps_done": 4}])  # fmt: skip
    with pytest.raises(ValueError, match="one state per segment"):
        merge_segments([{**part, "segment": 0, "steps_done": 3},
                        {**part, "segment": 2, "steps_done": 3}])  # fmt: skip


def test_a_decoupled_dropout_array_keeps_one_member_per_reseeded_stack() -> None:
    """Decoupled segments run their layers through the spill path's forwards, which draw
    masks from torch's generator: their members stay on the stochastic path (one member per
    stack, reseeded), never the hand-fused own-mask one, whose step would see a draw its
    probe ruled out (UnseenDraws: the pack trained again) and train as alone."""
    mlp = TinyMLP()
    extra = {"dropout": 0.3}
    together = FusedArray(mlp, tiny_members(3, extra), training=DECOUPLED)
    assert together.stochastic
    assert all(group.stack.streams is None for group in together.groups)
    train(together, 14)
    for key, config in tiny_members(3, extra):
        alone = FusedArray(mlp, [(key, config)], training=DECOUPLED)
        train(alone, 14)
        assert_member_states_close(alone.member_state(key), together.member_state(key))
