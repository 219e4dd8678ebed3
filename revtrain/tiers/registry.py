"""The tier registry: a tier's name to its class, and the tier object built from the gin ``offload`` value.

`register` adds a tier (one line beside its class); `from_gin` builds the tier of
``ReversibleTrainer.offload``: ``False`` the device tier, ``True`` the host tier, ``'disk'`` the disk tier, or
any registered tier's name. Nothing outside this package reads the ``offload`` value: the trainer holds the
object, and everything else asks it (`revtrain.tiers.base.Tier`).
"""

from __future__ import annotations

import importlib

from revtrain import metrics as metrics_lib
from revtrain.tiers.base import Tier

# The built-in tiers, imported on the registry's first use (so importing the package, as every trainer does,
# does not import the disk tier's modules; the package's import depth stays that of its interface).
BUILTIN = (("device", "revtrain.tiers.device", "DeviceTier"), ("host", "revtrain.tiers.host", "HostTier"),
           ("disk", "revtrain.tiers.disk", "DiskTier"))
_TIERS: dict[str, type] = {}  # name -> class, in registration order


def _tiers() -> dict[str, type]:
    """The registered tiers, the built-in three first (imported and registered on the first call)."""
    if not _TIERS:
        for name, module, attr in BUILTIN:
            _TIERS[name] = getattr(importlib.import_module(module), attr)
    return _TIERS


def register(name: str, cls: type) -> type:
    """Registers the tier class ``cls`` under ``name`` (``ReversibleTrainer.offload = '<name>'`` selects it);
    returns ``cls``, so it can decorate the class.

    Raises:
      TypeError: ``cls`` is not a `Tier` subclass.
      ValueError: ``name`` is taken by another class.
    """
    if not (isinstance(cls, type) and issubclass(cls, Tier)):
        raise TypeError(f"a tier is a subclass of revtrain.tiers.Tier, got {cls!r}")
    tiers = _tiers()
    if tiers.get(name, cls) is not cls:
        raise ValueError(f"the tier name {name!r} is taken by {tiers[name].__name__}")
    tiers[name] = cls
    return cls


def names() -> tuple[str, ...]:
    """The registered tiers' names, in registration order (the built-in three first)."""
    return tuple(_tiers())


def own_forms() -> tuple[type, ...]:
    """The registered tier classes whose checkpoints hold the state in a form of their own (an Orbax item of
    their own, `Tier.checkpoint_item`), in registration order: what `revtrain.checkpoint` registers and looks
    for."""
    return tuple(cls for cls in _tiers().values() if cls.checkpoint_item)


def lookup(value) -> type:
    """The tier class of a ``ReversibleTrainer.offload`` value (a class's `Tier.gin_value` or a name).

    Raises:
      ValueError: no tier has that value (one line listing the accepted values).
    """
    tiers = _tiers()
    for cls in tiers.values():  # (a gin value of None: selected by its name alone)
        gin = cls.gin_value
        if gin is not None and (value is gin or (isinstance(value, str) and value == gin)):
            return cls
    if isinstance(value, str) and value in tiers:
        return tiers[value]
    builtin = [repr(c.gin_value) for c in tiers.values() if c.gin_value is not None][:3]
    others = [n for n, c in tiers.items() if repr(c.gin_value) not in builtin]
    more = f" (or a registered tier: {', '.join(map(repr, others))})" if others else ""
    raise ValueError(f"ReversibleTrainer.offload must be {', '.join(builtin[:-1])} or {builtin[-1]}, got {value!r}"
                     + more)


def from_gin(value, mesh, sharded: bool = False, directory: str | None = None) -> Tier:
    """The tier object of ``ReversibleTrainer.offload = value`` on ``mesh`` (``sharded``: ``shard_state``),
    its files in ``directory`` (``ReversibleTrainer.offload_dir``) for a tier that keeps files (None: named
    later by the train command, `Tier.attach`; given to another tier, a note says it is not used).

    Raises:
      ValueError: ``value`` selects no registered tier.
    """
    cls = lookup(value)
    if not cls.uses_directory:
        if directory is not None:
            metrics_lib.log(f"ReversibleTrainer.offload_dir = {directory!r} is not used: it is the directory of "
                            "offload = 'disk'")
        return cls(mesh, sharded)
    return cls(mesh, sharded, directory=directory)


def holder_of(ts) -> type | None:
    """The registered tier class whose own refs the `TrainState` ``ts`` holds (`Tier.holds_state`), or None
    for a state of arrays (any array tier's): how a checkpoint written without its trainer finds its form."""
    for cls in _tiers().values():
        if cls.holds_state(ts):
            return cls
    return None


def leftovers(workdir: str, tier: Tier) -> list[str]:
    """The notes of every registered tier but ``tier``'s own on files an earlier run left in ``workdir``
    (`Tier.leftovers`)."""
    return [note for cls in _tiers().values() if not isinstance(tier, cls) and (note := cls.leftovers(workdir))]
