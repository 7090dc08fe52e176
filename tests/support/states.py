"""Comparing trained members: equal to float rounding, weights to optimizer state."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

#: float64 sums reassociated differ by ~1e-10 after some Adam steps
RTOL, ATOL = 1e-6, 1e-8


def assert_member_states_close(want: Mapping[str, Any], got: Mapping[str, Any]) -> None:
    """Two exported member states (``FusedArray.member_state``) agree: parameters, buffers
    (BatchNorm statistics), the optimizer's state and its step count."""
    for part in ("params", "buffers"):
        for name, t in want[part].items():
            torch.testing.assert_close(got[part][name], t, rtol=RTOL, atol=ATOL)
    for name, slots in want["optimizer"]["state"].items():
        for slot, t in slots.items():
            torch.testing.assert_close(got["optimizer"]["state"][name][slot], t,
                                       rtol=RTOL, atol=ATOL)  # fmt: skip
    assert got["optimizer"]["step"] == want["optimizer"]["step"]
