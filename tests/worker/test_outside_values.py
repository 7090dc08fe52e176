"""How a value kept outside the model is held and put back (:mod:`worker.outside_values`):
by value even where it is changed in place, and put back into the object that is there, so
that whoever else holds that object sees it."""

from __future__ import annotations

import collections
import enum
import functools
import random
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from worker.module_state import Snapshot, same_value
from worker.outside_state import resumed_value, saved_value
from worker.outside_values import MAX_FIELDS, Fields, RandomState, Same, hold, put


@dataclass
class Settings:
    scale: float = 1.0
    sizes: list[int] = field(default_factory=lambda: [8, 16])


def own(cls: type) -> bool:
    return cls.__module__ == __name__


def test_a_settings_object_changed_in_place_is_held_by_value_and_put_back_in_place() -> None:
    settings = Settings()
    before = hold(settings, own)
    settings.scale = 2.0
    settings.sizes.append(32)
    after = hold(settings, own)
    assert isinstance(before, Fields) and before.obj is settings
    assert not same_value(before, after)
    assert same_value(after, hold(settings, own))
    sizes = settings.sizes  # held by the model too
    assert put(settings, before) is settings
    assert settings.scale == 1.0 and settings.sizes == [8, 16] and settings.sizes is sizes
    settings.extra = 3  # type: ignore[attr-defined]  # set since: gone again
    put(settings, before)
    assert not hasattr(settings, "extra")


def test_a_dict_is_put_back_into_the_dict_that_is_there() -> None:
    config: dict[str, Any] = {"scale": 1.0, "inner": {"depth": 2}}
    inner = config["inner"]
    held = hold(config, own)
    assert held is not config and held == config  # a plain dict: a copy
    config["scale"] = 5.0
    config["inner"]["depth"] = 7
    config["new"] = 1
    assert put(config, held) is config
    assert config == {"scale": 1.0, "inner": {"depth": 2}} and config["inner"] is inner


def test_a_dict_of_tensors_and_a_small_tensor() -> None:
    small, large = torch.ones(3), torch.zeros(MAX_FIELDS * 10)
    parts: dict[str, Any] = {"scale": small, "data": large}
    held = hold(parts, own)
    assert isinstance(held, Fields) and isinstance(held.fields["scale"], Snapshot)
    assert held.fields["data"] is large  # data, by identity
    small.fill_(4.0)
    parts["data"] = torch.zeros(2)
    assert not same_value(held, hold(parts, own))
    put(parts, held)
    assert parts["scale"] is small and torch.equal(small, torch.ones(3))
    assert parts["data"] is large


def test_what_is_not_settings_is_held_as_itself() -> None:
    big = list(range(MAX_FIELDS + 1)) + [object()]
    assert isinstance(held := hold(big, own), Same) and held.obj is big
    module = nn.Linear(2, 2)
    assert hold(module, own) is module
    assert hold(types, own) is types

    class Foreign:  # not the user's class: by identity
        pass

    foreign = Foreign()
    assert hold(foreign, lambda cls: False) is foreign
    assert isinstance(hold(types.SimpleNamespace(a=1), lambda cls: False), Fields)


def test_a_value_set_anew_is_put_back_as_a_copy() -> None:
    held = hold([1, 2], own)
    assert put(("another", "type"), held) == [1, 2]
    assert put(3, hold(1.5, own)) == 1.5


def test_a_generator_is_held_by_its_state_and_resumed_from_a_checkpoints() -> None:
    gen = torch.Generator().manual_seed(3)
    held = hold(gen, own)
    assert isinstance(held, RandomState) and same_value(held, hold(gen, own))
    first = torch.rand(4, generator=gen)
    assert not same_value(held, hold(gen, own))
    assert put(gen, held) is gen and torch.equal(torch.rand(4, generator=gen), first)
    saved = hold(gen, own).saved()  # where the draws stood, as a checkpoint holds it
    later = torch.rand(4, generator=gen)
    put(gen, held.resumed(saved))
    assert torch.equal(torch.rand(4, generator=gen), later)


def test_a_large_container_is_data_held_as_itself() -> None:
    files = [f"image-{i}.png" for i in range(MAX_FIELDS + 1)]
    assert isinstance(held := hold(files, own), Same) and held.obj is files  # not copied
    assert hold(files[:MAX_FIELDS], own) == files[:MAX_FIELDS]


def test_a_container_held_as_itself_is_set_back_not_filled() -> None:
    """A vocabulary built per trial (more entries than settings have): putting member A's
    back rebinds A's, and leaves B's as it is; a large set inside a settings dict is not
    emptied by putting the dict back."""
    mine = {f"w{i}": i for i in range(MAX_FIELDS + 1)}
    theirs = {f"v{i}": -i for i in range(MAX_FIELDS + 1)}
    held = hold(mine, own)
    assert put(theirs, held) is mine
    assert theirs == {f"v{i}": -i for i in range(MAX_FIELDS + 1)}
    vocab = set(range(MAX_FIELDS + 1))
    settings = {"vocab": vocab, "act": torch.relu, "scale": 1.0}
    held = hold(settings, own)
    settings["scale"] = 2.0
    put(settings, held)
    assert settings["vocab"] is vocab and len(vocab) == MAX_FIELDS + 1
    assert settings["scale"] == 1.0


@dataclass(frozen=True)
class Frozen:
    heads: int = 4
    width: int = 64

    @functools.cached_property
    def head_width(self) -> int:
        return self.width // self.heads


def test_a_frozen_settings_object_is_put_back_through_its_dict() -> None:
    """A cached_property computed since the object was held (by a forward) is no field of
    it: put back, it is dropped (computed again), not a FrozenInstanceError."""
    config = Frozen()
    held = hold(config, own)
    assert config.head_width == 16
    assert put(config, held) is config
    assert "head_width" not in vars(config) and config.head_width == 16


def test_values_a_checkpoint_cannot_read_back_are_not_saved(tmp_path: Path) -> None:
    """torch.load(weights_only=True) refuses a NumPy float, an Enum member and a
    defaultdict: saved, they failed the resumed trial."""
    import numpy

    class Kind(enum.StrEnum):
        A = "a"

    for value in (numpy.float64(2.0), Kind.A, collections.defaultdict(int, a=1)):
        assert saved_value(hold(value, own)) is None, value
    entries = {
        name: saved_value(hold(value, own))
        for name, value in {
            "scale": 0.5, "sizes": [8, 16], "factor": torch.ones(3),
            "settings": Settings(), "gen": torch.Generator().manual_seed(1),
            "coin": random.Random(2),
        }.items()
    }  # fmt: skip
    torch.save(entries, tmp_path / "c.pt")
    loaded = torch.load(tmp_path / "c.pt", weights_only=True)
    assert loaded["settings"] == {"fields": {"scale": 1.0, "sizes": [8, 16]}}
    assert loaded["scale"] == {"value": 0.5}


def test_a_generator_without_state_is_held_as_itself() -> None:
    system = random.SystemRandom()
    assert hold(system, own) is system


def test_numpy_generators_are_resumed_from_a_checkpoints(tmp_path: Path) -> None:
    import numpy

    for gen in (numpy.random.RandomState(5), numpy.random.default_rng(5)):
        held = hold(gen, own)
        draw = gen.random_sample if isinstance(gen, numpy.random.RandomState) else gen.random
        draw(3)
        entry = saved_value(hold(gen, own))
        assert entry is not None
        torch.save(entry, tmp_path / "g.pt")
        later = draw(3)
        loaded = torch.load(tmp_path / "g.pt", weights_only=True)
        assert isinstance(held, RandomState)
        put(gen, held.resumed(loaded["rng"]))
        assert (draw(3) == later).all(), type(gen)


@dataclass(frozen=True, slots=True)
class FrozenSlots:
    scale: float = 1.0
    sizes: list[int] = field(default_factory=lambda: [8, 16])


def test_a_slotted_settings_object_is_held_by_value_and_put_back_in_place() -> None:
    """``@dataclass(slots=True)``: no ``__dict__``; a frozen one is put back all the same."""
    settings = FrozenSlots()
    sizes = settings.sizes
    before = hold(settings, own)
    object.__setattr__(settings, "scale", 2.0)
    settings.sizes.append(32)
    after = hold(settings, own)
    assert isinstance(before, Fields) and before.obj is settings
    assert not same_value(before, after)
    assert put(settings, before) is settings
    assert settings.scale == 1.0 and settings.sizes == [8, 16] and settings.sizes is sizes


def test_a_small_numpy_array_is_held_by_value_and_resumed_from_a_checkpoint(
    tmp_path: Path,
) -> None:
    import numpy

    factors = numpy.array([1.0, 2.0, numpy.nan])
    held = hold(factors, own)
    assert same_value(held, factors)  # NaN included
    factors[0] = 5.0
    assert not same_value(held, factors)
    assert put(factors, held) is factors and factors[0] == 1.0  # in place
    other = numpy.zeros(2)  # set there since (a model built since may hold it): not filled
    assert put(other, held) is factors and (other == 0).all()
    assert hold(numpy.array(["a"]), own).__class__ is numpy.ndarray  # not numbers: itself
    factors[1] = 7.0
    entry = saved_value(hold(factors, own))
    assert entry is not None
    torch.save(entry, tmp_path / "a.pt")
    loaded = torch.load(tmp_path / "a.pt", weights_only=True)
    factors[1] = 0.0
    put(factors, resumed_value(held, loaded))
    assert factors[1] == 7.0 and factors.dtype == numpy.float64
