"""The tiers: where a layer's weights and optimizer state live between uses, one object end to end.

A *tier* is one class behind one declared interface (`Tier`, revtrain/tiers/base.py): its name, placement
(where a layer's state goes and how it comes to the device), its store and the streaming engine's hooks, its
plan terms (layers in flight, I/O per step, capacity, refusal), its checkpoint form (Orbax's arrays, or hard
links to files) and its sampling form. The trainer builds its tier once from the gin value
(``ReversibleTrainer.offload``, `from_gin`) and everything else asks the object.

The package, one job per module:

* ``base``: the `Tier` interface and the placement every array tier shares (`HostStack` too);
* ``device``, ``host``, ``disk``: the three tiers (`DeviceTier`, `HostTier`, `DiskTier`);
* ``host_store``, ``disk_store``: their stores, the streaming engine's peers (`HostStore`, `DiskStore`;
  the engine itself, the scheduling of puts, dispatches and waits, is `revtrain.streaming`);
* ``disk_format``: the disk tier's file format and checksums; ``disk_links``: its checkpoint form (hard
  links, and the Orbax handler that writes them); ``disk_probes``: its plan terms (space needed and free,
  bandwidth, a deferred step's I/O);
* ``cycle``: the sampling form of a tier whose store reads on its own thread (each layer read as generation
  reaches it, the next ahead; the disk tier's, a registered tier's);
* ``registry``: `register`, `from_gin`, `lookup`, `names`, `holder_of`, `own_forms`, `leftovers` (the
  built-in three registered on first use).

A new tier is one module with one `Tier` subclass and one line, ``revtrain.tiers.register("name", Class)``;
``ReversibleTrainer.offload = 'name'`` then selects it (tests/test_tiers_plugin.py adds one that way).
"""

from revtrain.tiers.base import HostStack, StoreError, Tier
from revtrain.tiers.registry import BUILTIN, from_gin, holder_of, leftovers, lookup, names, own_forms, register

_CLASSES = {attr: module for _, module, attr in BUILTIN}


def __getattr__(name: str):
    """The built-in tier classes (`DeviceTier`, `HostTier`, `DiskTier`), imported when first named (the package
    itself imports only the interface and the registry)."""
    if name in _CLASSES:
        import importlib
        return getattr(importlib.import_module(_CLASSES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DeviceTier", "DiskTier", "HostStack", "HostTier", "StoreError", "Tier", "from_gin", "holder_of",
           "leftovers", "lookup", "names", "own_forms", "register"]
