"""The memory probe, on the CPU (estimate) and on CUDA (measured), and fused training on CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.support.tiny_workloads import TinyCNN, TinyMLP
from worker.fused import FusedArray, train
from worker.memory import probe

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def test_cpu_probe_fits_a_positive_line_that_grows_with_the_model():
    workload = TinyMLP()
    small = probe(workload, {"hidden": 16, "optimizer": "adam"})
    large = probe(workload, {"hidden": 128, "optimizer": "adam"})
    for result in (small, large):
        assert not result.measured
        assert result.base_bytes > 0 and result.per_trial_bytes > 0
        assert set(result.peak_by_k) == {1, 2} and set(result.throughput_by_k) == {1, 2}
        assert all(rate > 0 for rate in result.throughput_by_k.values())
        assert result.bytes_for(2) == result.peak_by_k[2]
    assert large.per_trial_bytes > small.per_trial_bytes
    # Adam keeps two slots per parameter: param + grad + 2 slots = 4 copies per trial at least.
    params = sum(
        p.numel() * p.element_size()
        for p in workload.build_model(workload.resolve({"hidden": 128})).parameters()
    )
    assert large.per_trial_bytes >= 4 * params
    splits = workload.data(workload.resolve({}))
    data = sum(t.nbytes for split in splits for t in (split.x, split.y))
    assert large.base_bytes >= data


def test_cpu_probe_of_a_cnn_under_vmap():
    result = probe(TinyCNN(), {"batch_norm": True}, ks=(1, 2, 4), mode="vmap")
    assert set(result.peak_by_k) == {1, 2, 4}
    assert result.peak_by_k[1] < result.peak_by_k[2] < result.peak_by_k[4]
    assert result.per_trial_bytes > 0


def test_cpu_probe_of_decoupled_segments_counts_each_alone():
    """A segment unit's probe counts its segment's weights, optimizer state and activations:
    less per trial than the decoupled model whole, and the segments' sum near the whole's
    (the model's weights are split between them)."""
    from packtune.spec import TrainingSettings

    workload, config = TinyMLP(), {"hidden": 128, "layers": 4, "optimizer": "adam"}
    training = TrainingSettings(mode="decoupled", segments=2, units="segment")
    whole = probe(workload, config, training=training)
    parts = [probe(workload, config, training=training, segment=j) for j in (0, 1)]
    assert all(0 < p.per_trial_bytes < whole.per_trial_bytes for p in parts)
    total = sum(p.per_trial_bytes for p in parts)
    assert 0.8 * whole.per_trial_bytes <= total <= 1.2 * whole.per_trial_bytes


def test_probe_needs_two_sizes():
    with pytest.raises(ValueError, match="two array sizes"):
        probe(TinyMLP(), {}, ks=(2,))


@gpu
@needs_cuda
def test_cuda_probe_measures_the_allocator_peak():
    workload = TinyMLP()
    small = probe(workload, {"hidden": 64, "dtype": "float32"}, device="cuda")
    large = probe(workload, {"hidden": 1024, "layers": 3, "dtype": "float32"}, device="cuda")
    for result in (small, large):
        assert result.measured
        assert result.per_trial_bytes > 0 and result.peak_by_k[2] > result.peak_by_k[1]
    assert large.per_trial_bytes > small.per_trial_bytes
    print(f"cuda probe: small {small}, large {large}")


@gpu
@needs_cuda
@pytest.mark.parametrize(
    "workload_cls,mode",
    [(TinyMLP, "bmm"), (TinyMLP, "vmap"), (TinyCNN, "vmap"), (TinyCNN, "serial")],
)
def test_cuda_fused_array_matches_plain_runs(workload_cls, mode):
    from tests.test_fused import member_configs, plain_run

    workload = workload_cls()
    members = member_configs("adam", {"batch_norm": True})
    array = FusedArray(workload, members, device="cuda", mode=mode)
    reports = train(array, 2 * array.steps_per_epoch)
    worst = 0.0
    for key, cfg in members:
        model, epoch_losses, val_loss = plain_run(workload, {**cfg}, epochs=2)
        fused = [r.metrics[key]["train_loss"] for r in reports]
        fused.append(reports[-1].metrics[key]["val_loss"])
        worst = max(
            worst, *(abs(a - b) for a, b in zip(fused, [*epoch_losses, val_loss], strict=True))
        )
        state = array.member_state(key)
        for name, ref in model.state_dict().items():
            mine = state["params"].get(name, state["buffers"].get(name))
            assert torch.allclose(mine, ref, rtol=1e-9, atol=1e-9), (key, name)
    print(f"cuda {workload.name} {mode}: largest loss difference {worst:.2e}")
    assert worst < 1e-9


#: how many times the forward of _Widened repeats its hidden layer's output, set per trial by
#: WidenedGlobal.build_model (undeclared: a value kept outside the model)
WIDTH = 1


class _Widened(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = torch.relu(self.fc1(x)).repeat(1, WIDTH)  # what the step keeps grows with it
        return self.fc2(torch.tanh(wide).reshape(x.shape[0], WIDTH, 16).mean(1))


class WidenedGlobal(TinyMLP):
    name = "widened-global"
    params = {**TinyMLP.params, "width": 1}
    fusible = frozenset({"width"})

    def build_model(self, config):
        global WIDTH
        WIDTH = int(self.resolve(config)["width"])
        return _Widened().double()


def test_cpu_memory_estimate_runs_each_stack_with_its_own_values_kept_outside_the_model():
    """Each stack's forward is measured with its members' value of ``WIDTH``: before, with
    the last one built, for every stack (so the estimate depended on the build order)."""
    from worker.memory import _cpu_peak

    def peak(widths):
        members = [(i, {"seed": i, "lr": 0.1, "width": w}) for i, w in enumerate(widths)]
        array = FusedArray(WidenedGlobal(), members)
        assert len(array.groups) == len(widths)  # each member its own stack
        return _cpu_peak(array, next(array.epoch_inputs(0, 0, 1)))

    wide_last, wide_first = peak([1, 64]), peak([64, 1])
    assert wide_last == wide_first
    assert wide_last > peak([1, 2]) + 20_000  # the 64-wide stack's activations counted
