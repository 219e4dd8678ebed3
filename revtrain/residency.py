"""The tiers' older names (`Residency`, `HostResidency`, `DiskResidency`, `for_offload`): the tiers are
`revtrain.tiers` now. Kept for the callers not yet moved (the planners, scripts and tests); new code imports
`revtrain.tiers`.
"""

from revtrain.tiers import HostStack, from_gin
from revtrain.tiers.device import DeviceTier as Residency
from revtrain.tiers.disk import DiskTier as DiskResidency
from revtrain.tiers.host import HostTier as HostResidency

TIERS = ("device", "host", "disk")


def for_offload(mesh, offload, sharded: bool = False, directory: str | None = None):
    """`revtrain.tiers.from_gin` with the older argument order (the mesh first).

    Raises:
      ValueError: ``offload`` selects no tier.
    """
    return from_gin(offload, mesh, sharded, directory)

__all__ = ["TIERS", "DiskResidency", "HostResidency", "HostStack", "Residency", "for_offload"]
