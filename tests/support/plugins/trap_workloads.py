"""Workloads that set fusion traps, as a user's plugin might (registered by the tests).

- ``hidden-act-mlp`` takes an ``act`` parameter (relu or tanh) that changes the forward
  pass but no shape, and forgets to list it in ``structural``: it must be structural
  anyway (safe by default).
- ``misdeclared-mlp`` declares ``act`` fusible but builds it as a Python value (a class
  made inside ``build_model`` closing over the activation): the array-build guard must
  train differing members apart; equal ones still fuse (same code, equal closures).
- ``scaled-mlp`` declares ``scale`` fusible and carries it as a buffer, as the contract
  asks: members with different scales fuse, exactly.
- ``horizon-order-mlp`` orders its batches by the study's horizon (``max_epochs``) too,
  against the contract (the order may follow ``data_seed`` and the epoch only): trials of
  studies of different ``max_resource`` may share an array, so ``packtune check`` must fail it.
- ``undeclared-mlp`` does not declare the metrics it reports (``reports = None``): a study
  may name any objective for it, and one it never reports fails its trials saying so.
- ``global-scaled-mlp`` declares ``scale`` fusible but keeps it in a module global that its
  forward reads (``SCALE``): every model in a worker process reads the last value built, so
  packed members must each have their own value put back, and train apart. It sets the
  global only for trials whose scale is below 0.5 (the others read the module's 1.0), and
  builds those in float64 by torch's default dtype (``torch.set_default_dtype``): a member
  built after another must find the module's value and the process's default, not the
  other's, and no other trial of the process may compute under it.
- ``settings-mlp`` does the same through a settings object (``SETTINGS.scale = ...``, a
  dataclass instance changed in place) that its model holds (``self.settings``): each
  member's value must be put back into that object, which every copy of the model shares.
- ``buffer-scaled-mlp`` does the same through a NumPy array (``SCALE_ARRAY[:] = ...``, filled
  in place) that its model registers as a buffer (``torch.from_numpy``, sharing its memory):
  each member's buffer must hold its own build's value, not the one the next build filled in.
- ``dict-scaled-mlp`` does the same through a dict its build sets anew (``SCALE_DICT =
  {...}``) and its model holds (``self.cfg``): each member's model must read its own dict's
  value, though later builds' starts fill the dicts there in place.
- ``table-scaled-mlp`` does the same through a larger NumPy array (``SCALE_TABLE``, 8,192
  elements: past what is held by value until a build is seen to change it), filled in
  place, that its forward reads.
- ``dropout-net-mlp`` is an MLP class of its own with an ``nn.Dropout``: not a hand-fusable
  Sequential, its members stack through vmap, each member's masks its own stream's.
- ``data-scaled-mlp`` declares ``input_scale`` fusible but scales the data with it: members
  with different scales must not share batches (the worker trains them as arrays apart).
- ``counting-mlp`` keeps a step counter on its module, ``global-counting-mlp`` one in a
  module global, ``annealed-loss-mlp`` one on the workload object (its loss's): Python state
  that must be each member's own, start where a fresh process's would, and go on from where
  it stood when a trial resumes, however its training was cut.

- ``late-noise-mlp`` and ``late-coin-mlp`` begin to draw (torch noise, a Python ``random``
  coin) after a warm-up longer than a probe's, ``big-batch-noise-mlp`` only on batches
  larger than a probe's first: members that shared one stream would each end apart from
  their unpacked runs.
- ``batch-norm-mlp`` puts a BatchNorm after each hidden Linear, in a module of its own (so it
  stacks through vmap, not the hand-fused path), to be trained with Adam: the Linear's bias
  gradient is float rounding (BatchNorm cancels it), which Adam scales to full steps, so
  vmap's rounding would send each member its own way; ``attention-mlp`` the same through
  ``nn.MultiheadAttention``'s key bias (a third of one tensor, which the softmax cancels).
- ``side-effect-mlp``'s training forward counts its steps (a Python counter) and shrinks a
  weight in place before it reads a value (``.item()``), which vmap cannot run: the failed
  fused attempt must leave neither change behind when its members go on one at a time.
- ``eval-item-mlp`` reads a value (``.item()``) only in eval mode, after counting its
  evaluations: it trains under vmap, and its fused evaluation must fall back as its step does.

All train on the digits (64 features, 10 classes) with a one-hidden-layer MLP.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy

from packtune.workloads.base import OPTIMIZER_PARAMS, Split
from worker.workloads.digits import N_CLASSES, N_TRAIN, digits_splits
from worker.workloads.parts import ClassificationWorkload, device_name


class _DigitsPlugin(ClassificationWorkload):
    params: Mapping[str, Any] = {"hidden": 32, "act": "relu", "batch_size": 64, **OPTIMIZER_PARAMS}

    def data(self, config: Mapping[str, Any], device: Any = "cpu") -> tuple[Split, Split]:
        self.resolve(config)
        return digits_splits(device_name(device))

    def train_size(self, config: Mapping[str, Any]) -> int:
        return N_TRAIN


class HiddenActMLP(_DigitsPlugin):
    """MLP whose activation parameter is missing from ``structural``."""

    name = "hidden-act-mlp"
    structural = frozenset({"hidden", "batch_size", "optimizer", "nesterov"})  # no "act"

    def build_model(self, config: Mapping[str, Any]) -> Any:
        from torch import nn

        cfg = self.resolve(config)
        act = nn.Tanh() if cfg["act"] == "tanh" else nn.ReLU()
        return nn.Sequential(
            nn.Linear(64, int(cfg["hidden"])), act, nn.Linear(int(cfg["hidden"]), N_CLASSES)
        )


class UndeclaredMLP(HiddenActMLP):
    """``hidden-act-mlp`` without a declaration of its metrics."""

    name = "undeclared-mlp"
    structural = frozenset({"hidden", "act", "batch_size", "optimizer", "nesterov"})
    reports = None


class MisdeclaredMLP(_DigitsPlugin):
    """MLP that declares ``act`` fusible yet closes over it in a class made per call."""

    name = "misdeclared-mlp"
    fusible = frozenset({"act"})

    def build_model(self, config: Mapping[str, Any]) -> Any:
        import torch
        from torch import nn

        cfg = self.resolve(config)
        act = torch.tanh if cfg["act"] == "tanh" else torch.relu
        hidden = int(cfg["hidden"])

        class Net(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.fc1, self.fc2 = nn.Linear(64, hidden), nn.Linear(hidden, N_CLASSES)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.fc2(act(self.fc1(x)))

        return Net()


class ScaledMLP(_DigitsPlugin):
    """MLP with a fusible ``scale`` of its hidden activations, carried as a buffer."""

    name = "scaled-mlp"
    params: Mapping[str, Any] = {**_DigitsPlugin.params, "scale": 1.0}
    fusible = frozenset({"scale"})

    def build_model(self, config: Mapping[str, Any]) -> Any:
        import torch
        from torch import nn

        cfg = self.resolve(config)
        hidden = int(cfg["hidden"])

        class Scaled(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.fc1, self.fc2 = nn.Linear(64, hidden), nn.Linear(hidden, N_CLASSES)
                self.register_buffer("scale", torch.tensor(float(cfg["scale"])))

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.fc2(torch.relu(self.fc1(x)) * self.scale)

        return Scaled()


#: set per trial by GlobalScaledMLP.build_model, read by _GlobalScaled.forward
SCALE = 1.0


def _global_scaled(hidden: int) -> Any:
    import torch
    from torch import nn

    class GlobalScaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(64, hidden), nn.Linear(hidden, N_CLASSES)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(torch.relu(self.fc1(x.to(self.fc1.weight.dtype))) * SCALE)

    return GlobalScaled()


class GlobalScaledMLP(_DigitsPlugin):
    """MLP that declares ``scale`` fusible yet keeps it in the module global ``SCALE``."""

    name = "global-scaled-mlp"
    params: Mapping[str, Any] = {**_DigitsPlugin.params, "scale": 1.0}
    fusible = frozenset({"scale"})
    #: ``scale_seen``: the global's value when the trial is evaluated (its model's to read);
    #: ``float64_seen``: 1 where torch's default dtype then is float64
    reports: Mapping[str, str] | None = {
        "val_accuracy": "max", "scale_seen": "max", "float64_seen": "max",
    }  # fmt: skip

    def build_model(self, config: Mapping[str, Any]) -> Any:
        global SCALE
        cfg = self.resolve(config)
        if cfg["scale"] < 0.5:  # set for these trials only: the others read the module's 1.0
            import torch

            SCALE = float(cfg["scale"])
            torch.set_default_dtype(torch.float64)  # and built in float64, by torch's default
        return _global_scaled(int(cfg["hidden"]))

    def metrics(self, outputs: Any, targets: Any) -> dict[str, float]:
        import torch

        float64 = float(torch.get_default_dtype() == torch.float64)
        return {**super().metrics(outputs, targets), "scale_seen": SCALE, "float64_seen": float64}


@dataclass
class Settings:
    scale: float = 1.0


#: changed in place per trial by SettingsMLP.build_model; its model holds it
SETTINGS = Settings()


def _settings_scaled(hidden: int, settings: Settings) -> Any:
    import torch
    from torch import nn

    class SettingsScaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(64, hidden), nn.Linear(hidden, N_CLASSES)
            self.settings = settings

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(torch.relu(self.fc1(x)) * self.settings.scale)

    return SettingsScaled()


class SettingsMLP(_DigitsPlugin):
    """MLP that declares ``scale`` fusible yet sets it on the settings object ``SETTINGS``,
    which its model holds."""

    name = "settings-mlp"
    params: Mapping[str, Any] = {**_DigitsPlugin.params, "scale": 1.0}
    fusible = frozenset({"scale"})

    def build_model(self, config: Mapping[str, Any]) -> Any:
        cfg = self.resolve(config)
        SETTINGS.scale = float(cfg["scale"])
        return _settings_scaled(int(cfg["hidden"]), SETTINGS)


#: filled in place per trial by BufferScaledMLP.build_model; its model's buffer shares it
SCALE_ARRAY = numpy.ones(1, dtype=numpy.float32)


class BufferScaledMLP(_DigitsPlugin):
    """MLP that declares ``scale`` fusible yet fills it into the module's ``SCALE_ARRAY``,
    which its model registers as a buffer."""

    name = "buffer-scaled-mlp"
    params: Mapping[str, Any] = {**_DigitsPlugin.params, "scale": 1.0}
    fusible = frozenset({"scale"})

    def build_model(self, config: Mapping[str, Any]) -> Any:
        import torch
        from torch import nn

        cfg = self.resolve(config)
        SCALE_ARRAY[:] = float(cfg["scale"])
        hidden = int(cfg["hidden"])

        class BufferScaled(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.fc1, self.fc2 = nn.Linear(64, hidden), nn.Linear(hidden, N_CLASSES)
                self.register_buffer("scale", torch.from_numpy(SCALE_ARRAY))

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.fc2(torch.relu(self.fc1(x)) * self.scale)

        return BufferScaled()


#: set anew per trial by DictScaledMLP.build_model; its model holds it
SCALE_DICT: dict[str, float] = {"scale": 1.0}


class DictScaledMLP(_DigitsPlugin):
    """MLP that declares ``scale`` fusible yet sets it in a new dict ``SCALE_DICT`` per build,
    which its model holds."""

    name = "dict-scaled-mlp"
    params: Mapping[str, Any] = {**_DigitsPlugin.params, "scale": 1.0}
    fusible = frozenset({"scale"})

    def build_model(self, config: Mapping[str, Any]) -> Any:
        import torch
        from torch import nn

        global SCALE_DICT
        cfg = self.resolve(config)
        SCALE_DICT = {"scale": float(cfg["scale"])}
        hidden = int(cfg["hidden"])

        class DictScaled(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.fc1, self.fc2 = nn.Linear(64, hidden), nn.Linear(hidden, N_CLASSES)
                self.cfg = SCALE_DICT

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.fc2(torch.relu(self.fc1(x)) * self.cfg["scale"])

        return DictScaled()


#: filled in place per trial by TableScaledMLP.build_model; its forward reads a row
SCALE_TABLE = numpy.ones((128, 64), dtype=numpy.float32)


class TableScaledMLP(_DigitsPlugin):
    """MLP that declares ``scale`` fusible yet fills it into the module's larger array
    ``SCALE_TABLE``, which its forward reads."""

    name = "table-scaled-mlp"
    params: Mapping[str, Any] = {**_DigitsPlugin.params, "scale": 1.0}
    fusible = frozenset({"scale"})

    def build_model(self, config: Mapping[str, Any]) -> Any:
        import torch
        from torch import nn

        cfg = self.resolve(config)
        SCALE_TABLE[:] = float(cfg["scale"])
        hidden = int(cfg["hidden"])

        class TableScaled(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.fc1, self.fc2 = nn.Linear(64, hidden), nn.Linear(hidden, N_CLASSES)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                scale = torch.from_numpy(SCALE_TABLE[-1, :hidden]).to(x.device)
                return self.fc2(torch.relu(self.fc1(x)) * scale)

        return TableScaled()


class DropoutNetMLP(_DigitsPlugin):
    """MLP of its own class whose hidden layer goes through ``nn.Dropout``."""

    name = "dropout-net-mlp"
    params: Mapping[str, Any] = {**_DigitsPlugin.params, "dropout": 0.3}
    structural = frozenset({"hidden", "dropout", "batch_size", "optimizer", "nesterov"})

    def build_model(self, config: Mapping[str, Any]) -> Any:
        import torch
        from torch import nn

        cfg = self.resolve(config)
        hidden, p = int(cfg["hidden"]), float(cfg["dropout"])

        class DropoutNet(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.fc1, self.fc2 = nn.Linear(64, hidden), nn.Linear(hidden, N_CLASSES)
                self.drop = nn.Dropout(p)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.fc2(self.drop(torch.relu(self.fc1(x))))

        return DropoutNet()


class HorizonOrderMLP(_DigitsPlugin):
    """MLP whose batch order follows ``max_epochs`` as well as ``data_seed``."""

    name = "horizon-order-mlp"

    def batch_indices(self, config: Mapping[str, Any], epoch: int) -> Any:
        seed = int(config.get("data_seed", 0)) + int(config.get("max_epochs", 1))
        return super().batch_indices({**config, "data_seed": seed}, epoch)

    def build_model(self, config: Mapping[str, Any]) -> Any:
        from torch import nn

        hidden = int(self.resolve(config)["hidden"])
        return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, N_CLASSES))


class DataScaledMLP(_DigitsPlugin):
    """MLP whose ``input_scale`` is declared fusible but scales the data, not the model
    (against the contract: a parameter ``data()`` reads is structural)."""

    name = "data-scaled-mlp"
    params: Mapping[str, Any] = {**_DigitsPlugin.params, "input_scale": 1.0}
    fusible = frozenset({"input_scale"})

    def data(self, config: Mapping[str, Any], device: Any = "cpu") -> tuple[Split, Split]:
        scale = float(self.resolve(config)["input_scale"])
        train, val = digits_splits(device_name(device))
        return Split(train.x * scale, train.y), Split(val.x * scale, val.y)

    def build_model(self, config: Mapping[str, Any]) -> Any:
        from torch import nn

        hidden = int(self.resolve(config)["hidden"])
        return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, N_CLASSES))


class _Counting:
    """A model whose forward keeps a Python step counter and scales its input by it, as a
    user's warm-up might (module-level, so that every member's model is of one class)."""

    @staticmethod
    def build(hidden: int) -> Any:
        import torch
        from torch import nn

        class Counting(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.fc1, self.fc2 = nn.Linear(64, hidden), nn.Linear(hidden, N_CLASSES)
                self.steps = 0  # Python state: not a buffer, not in a state_dict

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                if self.training:
                    self.steps += 1
                    x = x * (1.0 + 4.0 / (1.0 + self.steps))
                return self.fc2(torch.relu(self.fc1(x)))

        return Counting()


class CountingMLP(_DigitsPlugin):
    """MLP whose forward keeps a step counter on its module (Python state): a trial cut at
    rungs packed and trained through them unpacked ends the same only if a resumed trial
    goes on counting from where it stopped."""

    name = "counting-mlp"

    def build_model(self, config: Mapping[str, Any]) -> Any:
        return _Counting.build(int(self.resolve(config)["hidden"]))


#: GlobalCountingMLP's training forwards, counted in a module global (a warm-up's clock)
STEPS = 0


def _global_counting(hidden: int) -> Any:
    import torch
    from torch import nn

    class GlobalCounting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(64, hidden), nn.Linear(hidden, N_CLASSES)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            global STEPS
            if self.training:
                STEPS += 1
                x = x * (1.0 + 4.0 / (1.0 + STEPS))
            return self.fc2(torch.relu(self.fc1(x)))

    return GlobalCounting()


class GlobalCountingMLP(_DigitsPlugin):
    """MLP whose forward counts its training steps in the module global ``STEPS`` and warms
    up by it: each trial's count must start from the module's 0 (not from what the process's
    earlier trials, or a memory probe's forwards, left), be its own beside others in a pack,
    and go on from where it stood when the trial resumes. ``steps_seen``: the count when the
    trial is evaluated."""

    name = "global-counting-mlp"
    reports: Mapping[str, str] | None = {"val_accuracy": "max", "steps_seen": "max"}

    def build_model(self, config: Mapping[str, Any]) -> Any:
        return _global_counting(int(self.resolve(config)["hidden"]))

    def metrics(self, outputs: Any, targets: Any) -> dict[str, float]:
        return {**super().metrics(outputs, targets), "steps_seen": float(STEPS)}


class AnnealedLossMLP(HiddenActMLP):
    """MLP whose loss anneals label smoothing by a count of its calls kept on the workload
    object: members fused in one array would share the count (k calls a step)."""

    name = "annealed-loss-mlp"

    def build_model(self, config: Mapping[str, Any]) -> Any:
        self.calls = 0
        return super().build_model(config)

    def loss(self, outputs: Any, targets: Any) -> Any:
        from torch.nn import functional as F

        self.calls += 1
        smoothing = 0.3 * max(0.0, 1.0 - self.calls / 60)
        return F.cross_entropy(outputs, targets, label_smoothing=smoothing)

    def stacked_loss(self, outputs: Any, targets: Any) -> Any:
        return None  # as the Workload base class: its loss is called for each member


#: training forwards before the late drawers below draw: past a probe's, within the first epoch
LATE = 12


class _LateDraws:
    """A model whose forward begins to draw random numbers after :data:`LATE` training
    forwards (a warm-up kept as a Python counter): torch noise on its hidden layer, or a
    Python ``random`` coin that halves it."""

    @staticmethod
    def build(hidden: int, host: bool) -> Any:
        import random

        import torch
        from torch import nn

        class LateDraws(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.fc1, self.fc2 = nn.Linear(64, hidden), nn.Linear(hidden, N_CLASSES)
                self.steps = 0

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                h = torch.relu(self.fc1(x))
                if self.training:
                    self.steps += 1
                    if self.steps > LATE:
                        if host:
                            h = h * (0.5 if random.random() < 0.5 else 1.0)
                        else:
                            h = h + 0.3 * torch.randn_like(h)
                return self.fc2(h)

        return LateDraws()


class LateNoiseMLP(_DigitsPlugin):
    """MLP whose hidden layer gets torch noise after a warm-up: its probe sees no draw."""

    name = "late-noise-mlp"

    def build_model(self, config: Mapping[str, Any]) -> Any:
        return _LateDraws.build(int(self.resolve(config)["hidden"]), host=False)


class LateCoinMLP(_DigitsPlugin):
    """MLP that flips a Python ``random`` coin per step after a warm-up."""

    name = "late-coin-mlp"

    def build_model(self, config: Mapping[str, Any]) -> Any:
        return _LateDraws.build(int(self.resolve(config)["hidden"]), host=True)


class BigBatchNoiseMLP(_DigitsPlugin):
    """MLP that adds input noise only to batches of more than 8 examples."""

    name = "big-batch-noise-mlp"

    def build_model(self, config: Mapping[str, Any]) -> Any:
        import torch
        from torch import nn

        hidden = int(self.resolve(config)["hidden"])

        class BigBatchNoise(nn.Sequential):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                if self.training and x.shape[0] > 8:
                    x = x + 0.1 * torch.randn_like(x)
                return super().forward(x)

        return BigBatchNoise(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, N_CLASSES))


class BatchNormMLP(_DigitsPlugin):
    """Linear, BatchNorm, ReLU twice, in a module of its own class (stacked through vmap);
    ``bias``: whether the Linears before the BatchNorms have one."""

    name = "batch-norm-mlp"
    params: Mapping[str, Any] = {**_DigitsPlugin.params, "bias": True}

    def build_model(self, config: Mapping[str, Any]) -> Any:
        import torch
        from torch import nn

        cfg = self.resolve(config)
        hidden, bias = int(cfg["hidden"]), bool(cfg["bias"])

        class BatchNormNet(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.net = nn.Sequential(
                    nn.Linear(64, hidden, bias=bias), nn.BatchNorm1d(hidden), nn.ReLU(),
                    nn.Linear(hidden, hidden, bias=bias), nn.BatchNorm1d(hidden), nn.ReLU(),
                    nn.Linear(hidden, N_CLASSES),
                )  # fmt: skip

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.net(x)

        return BatchNormNet()


class AttentionMLP(_DigitsPlugin):
    """The 64 pixels as 8 tokens of 8, embedded, one ``nn.MultiheadAttention`` over them, a
    mean and a head: the key's third of its ``in_proj_bias`` shifts every score of a query
    alike, which the softmax cancels, so its gradient is float rounding."""

    name = "attention-mlp"

    def build_model(self, config: Mapping[str, Any]) -> Any:
        import torch
        from torch import nn

        hidden = int(self.resolve(config)["hidden"])

        class Attention(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embed = nn.Linear(8, hidden)
                self.attn = nn.MultiheadAttention(hidden, 2, batch_first=True)
                self.head = nn.Linear(hidden, N_CLASSES)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                tokens = self.embed(x.view(-1, 8, 8))
                mixed, _ = self.attn(tokens, tokens, tokens, need_weights=False)
                return self.head((tokens + mixed).mean(1))

        return Attention()


class _Unbatchable:
    """A model whose forward reads a tensor's value (``.item()``, a branch never taken here)
    in training (``when="train"``) or in eval mode (``when="eval"``): vmap cannot batch it.
    Before the read it changes what a failed vmap attempt must not leave behind: in training
    a Python step counter and a weight shrunk in place, in eval mode a counter of its
    evaluations."""

    @staticmethod
    def build(hidden: int, when: str) -> Any:
        import torch
        from torch import nn

        class Unbatchable(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.fc1, self.fc2 = nn.Linear(64, hidden), nn.Linear(hidden, N_CLASSES)
                self.steps, self.evaluations = 0, 0

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                if self.training and when == "train":
                    self.steps += 1
                    x = x * (1.0 + 4.0 / (1.0 + self.steps))
                    with torch.no_grad():
                        self.fc1.weight.mul_(0.99)  # a decay of its own
                elif not self.training:
                    self.evaluations += 1
                out = self.fc2(torch.relu(self.fc1(x)))
                if self.training == (when == "train") and out.abs().max().item() > 1e6:
                    out = out.clamp(-1e6, 1e6)  # runaway logits capped
                return out

        return Unbatchable()


class SideEffectMLP(_DigitsPlugin):
    """MLP whose training forward counts, decays a weight in place, then calls ``.item()``."""

    name = "side-effect-mlp"

    def build_model(self, config: Mapping[str, Any]) -> Any:
        return _Unbatchable.build(int(self.resolve(config)["hidden"]), when="train")


class EvalItemMLP(_DigitsPlugin):
    """MLP whose forward calls ``.item()`` in eval mode only, after counting evaluations."""

    name = "eval-item-mlp"

    def build_model(self, config: Mapping[str, Any]) -> Any:
        return _Unbatchable.build(int(self.resolve(config)["hidden"]), when="eval")
