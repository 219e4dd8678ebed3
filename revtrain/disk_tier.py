"""The disk tier's older module: its jobs are `revtrain.tiers` modules now (the file format and checksums
`revtrain.tiers.disk_format`, the store `revtrain.tiers.disk_store.DiskStore`, here still named `DiskTier`,
checkpoint links `revtrain.tiers.disk_links`, disk probes `revtrain.tiers.disk_probes`, the tier object
`revtrain.tiers.disk.DiskTier`). Kept for the callers not yet moved (the planners, scripts and tests); new code
imports `revtrain.tiers`.
"""

import shutil  # noqa: F401  (tests patch ``disk_tier.shutil.disk_usage``)

from revtrain.tiers.disk_format import (ALIGN, CHECKSUM, DamagedFile, DiskLayer, DiskTierError,  # noqa: F401
                                        LayerWeights, Layout, link_or_copy, read_leaves, read_tree, verify_file,
                                        write_layer)
from revtrain.tiers.disk_links import INDEX, _saved_layout, check_layout, load_links, save_links  # noqa: F401
from revtrain.tiers.disk_probes import BANDWIDTH_BYTES, bandwidth, deferred_io, disk_free, disk_need  # noqa: F401
from revtrain.tiers.disk_store import STEP_PREFIX  # noqa: F401
from revtrain.tiers.disk_store import DiskStore as DiskTier  # noqa: F401
