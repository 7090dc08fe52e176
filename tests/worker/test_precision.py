"""``precision: bf16``: the forward pass under bfloat16 autocast, float32 master weights.

Stated tolerances: a fused bf16 array equals its members trained alone in bf16 to 1e-6
relative (the MLP's hand-fused stack does each member's bf16 arithmetic; seen: 2e-8; the
CNN, which would stack through vmap, trains one member at a time in bf16: equal), and bf16
training stays within 5% of float32 training's validation loss after two epochs at these
stable learning rates while differing from it (autocast really ran).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from packtune.errors import SpecError
from packtune.spec import validate_spec
from packtune.workloads import get_workload
from worker.fused import FusedArray, train

LRS = [0.02, 0.05, 0.08]


def run(workload: str, precision: str, keys: list[int], extra: dict[str, Any]) -> Any:
    w = get_workload(workload)
    array = FusedArray(w, [
        (i, {**extra, "lr": LRS[i], "seed": 10 + i, "data_seed": 1, "precision": precision})
        for i in keys
    ])  # fmt: skip
    return array, train(array, 2 * array.steps_per_epoch)


@pytest.mark.parametrize(
    ("workload", "extra"),
    [("digits-mlp", {"batch_norm": True}), ("digits-cnn", {"channels": 4})],
)
def test_bf16_fused_equals_bf16_alone_and_is_close_to_fp32(
    workload: str, extra: dict[str, Any]
) -> None:
    fused, reports = run(workload, "bf16", [0, 1, 2], extra)
    assert fused.precision == "bf16"
    for key in (0, 1, 2):
        _, mine = run(workload, "bf16", [key], extra)
        for name, value in reports[-1].metrics[key].items():
            assert value == pytest.approx(mine[-1].metrics[key][name], rel=1e-6), (key, name)
        _, full = run(workload, "fp32", [key], extra)
        bf16_loss, fp32_loss = (
            reports[-1].metrics[key]["val_loss"],
            full[-1].metrics[key]["val_loss"],
        )
        assert bf16_loss == pytest.approx(fp32_loss, rel=0.05), key
        assert bf16_loss != fp32_loss  # autocast ran: bf16 rounds differently
    # master weights and optimizer state stay float32
    state = fused.member_state(0)
    assert all(t.dtype == torch.float32 for t in state["params"].values())


def test_bf16_stacks_that_would_need_vmap_train_one_member_at_a_time() -> None:
    fp32, _ = run("digits-cnn", "fp32", [0, 1], {"channels": 4})
    bf16, _ = run("digits-cnn", "bf16", [0, 1], {"channels": 4})
    assert fp32.stacks == [([0, 1], "vmap")]
    assert bf16.stacks == [([0], "serial"), ([1], "serial")]
    mlp, _ = run("digits-mlp", "bf16", [0, 1], {})
    assert mlp.stacks == [([0, 1], "bmm")]


def test_the_forward_runs_in_bf16_and_the_weights_do_not() -> None:
    array, _ = run("digits-mlp", "bf16", [0, 1], {})
    group = array.groups[0]
    assert array.train_split is not None
    with group.autocast():
        out = group.forward(group.params, group.buffers, array.train_split.x[:8])
    assert out.dtype == torch.bfloat16
    assert group.outputs(array.train_split.x[:8]).dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in group.params.values())


def test_precision_is_structural_and_checked_in_the_spec() -> None:
    workload = get_workload("digits-mlp")
    assert "precision" in workload.structural_params()
    spec = {
        "name": "amp", "workload": "digits-mlp", "hyperband": {"max_resource": 3},
        "space": {"precision": {"type": "choice", "values": ["bf16"]}},
    }  # fmt: skip
    assert validate_spec(spec).space["precision"]["values"] == ["bf16"]
    spec["space"] = {"precision": {"type": "choice", "values": ["fp16"]}}
    with pytest.raises(SpecError) as caught:
        validate_spec(spec)
    assert caught.value.field == "space.precision"
    assert "fp32, bf16" in str(caught.value)
