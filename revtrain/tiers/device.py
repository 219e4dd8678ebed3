"""The device tier (``ReversibleTrainer.offload = False``, the default): the state in device memory.

On a CPU that is host RAM. Nothing is streamed: the programs compute on the state where it lies, and a
checkpoint is Orbax's arrays. Every placement question has `revtrain.tiers.base.Tier`'s answer.
"""

from __future__ import annotations

from revtrain.tiers.base import Tier


class DeviceTier(Tier):
    """The device tier: weights and optimizer state in device memory, replicated on every device or, with
    ``sharded``, each large leaf split over the ``"data"`` devices (ZeRO-3; `placement.shard_spec`).

    Args:
      mesh, sharded: see `revtrain.tiers.base.Tier`.
    """

    name = "device"
    gin_value = False

    def describe_place(self) -> str:
        return "device memory"
