"""Shards of a model larger than its device (Hydra's spilling), as plain arithmetic.

A model that is a chain of layers trains on a device too small for it by cutting the chain
into *shards* of consecutive layers: the shards live in host memory, and a training step
moves them to the device one at a time (forward in order, backward in reverse), the next
shard's copy overlapping the current one's compute. So a shard must fit half the device's
budget: the other half holds the shard being copied in. Several spilled trials on one
device alternate instead (Hydra's shard alternation): each has its share of the device and
one shard in it, copied in while another trial's shard computes. :func:`plan_shards` cuts
the chain into the fewest such shards; the worker (``worker.spill``) measures the layers'
costs.
"""

from __future__ import annotations

from collections.abc import Sequence


class Unspillable(ValueError):
    """The model cannot be spilled onto the budget: one layer alone is too large."""


def plan_shards(
    costs: Sequence[int],
    budget: int,
    reserved: int = 0,
    names: Sequence[str] | None = None,
    buffers: int = 2,
) -> list[range]:
    """The fewest runs of consecutive layers whose ``costs`` (device bytes each: weights,
    gradients, what its backward keeps) sum to at most ``(budget - reserved) // buffers``:
    2 when the next shard is copied in while the current one computes (one spilled stack
    alone on its device), 1 when the stack alternates with another on the device (the
    other's shard computes while this one's is copied, each in its own share of it).

    ``reserved``: bytes the step keeps on the device throughout (the batch and the
    activations kept at the shards' boundaries). Greedy, which is optimal for cutting a
    sequence into the fewest runs under a bound on each run's sum. ``names``: what the
    error calls each layer (``layer i`` by default).

    Raises:
        Unspillable: a layer that exceeds the bound alone (or nothing left of the budget).

    Example:
        >>> plan_shards([4, 4, 4, 4], budget=16)
        [range(0, 2), range(2, 4)]
    """
    if not costs:
        raise ValueError("a model needs at least one layer to be spilled")
    if any(c < 0 for c in costs):
        raise ValueError(f"layer costs must be >= 0, got {list(costs)}")
    if buffers < 1:
        raise ValueError(f"buffers must be >= 1, got {buffers}")
    limit = (budget - reserved) // buffers
    shards: list[range] = []
    start, total = 0, 0
    for i, cost in enumerate(costs):
        if cost > limit:
            raise Unspillable(
                f"{names[i] if names else f'layer {i}'} would take {cost:,} bytes of the "
                f"device, more than the {max(limit, 0):,} a shard may take ("
                f"{'half of ' if buffers == 2 else ''}what the batch and the kept activations, "
                f"{reserved:,} bytes, leave of the budget of {budget:,}): it cannot be spilled"
            )
        if total + cost > limit:
            shards.append(range(start, i))
            start, total = i, 0
        total += cost
    shards.append(range(start, len(costs)))
    return shards
