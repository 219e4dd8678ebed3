"""The host tier's store: each layer's weights and optimizer state as JAX arrays in host memory.

`HostStore` is the `revtrain.streaming.Store` of the host tier (`revtrain.tiers.host.HostTier`,
``ReversibleTrainer.offload = True``), the peer of the disk tier's `revtrain.tiers.disk_store.DiskStore`: the
streaming engine (`revtrain.streaming.StepStream`) asks it for a program's layers (``read``: one batched
``jax.device_put`` to the device) and hands it each updated layer (``write``: one ``jax.device_put`` back to the
layer's host shardings), both issued on the dispatching thread and never waited for.
"""

from __future__ import annotations

import jax

from revtrain import optstate
from revtrain.streaming import Store, _kind


class HostLayer:
    """One group's weights and optimizer state in host memory (`HostStore`'s ref): trees of JAX arrays in a
    host memory kind, with the shardings they had when placed (``shard_state`` splits survive a fetch)."""

    __slots__ = ("params", "opt_state")

    def __init__(self, params, opt_state):
        self.params, self.opt_state = params, opt_state

    def part(self, part: str):
        return self.params if part == "params" else self.opt_state


_nbytes = optstate.tree_nbytes  # bytes of a tree (typed PRNG keys too)


class HostStore(Store):
    """The host tier's store (``offload = True``): each group's state as JAX arrays in host memory
    (`HostLayer`). A program's layers come to the device in one ``jax.device_put`` of their trees, and an
    updated layer goes back in one ``jax.device_put`` to its host shardings, both issued on the dispatching
    thread and never waited for (see the module note)."""

    prefix = "host"

    def __init__(self, memory_kind: str | None, device_kind: str):
        super().__init__()
        self.memory_kind = memory_kind  # where a gradient buffer is kept (`write_buffer`)
        self.device_kind = device_kind  # the memory kind a fetch moves a layer to (`placement.DEVICE_MEMORY`)

    def holds(self, ref) -> bool:
        return isinstance(ref, HostLayer)

    def refs(self, params: list, opt_state: list) -> list:
        return [HostLayer(p, o) for p, o in zip(params, opt_state, strict=True)]

    def state(self, refs: list) -> tuple[list, list]:
        return [r.params for r in refs], [r.opt_state for r in refs]

    def nbytes(self, ref, part: str | None = None) -> int:
        if part is None:
            return _nbytes(ref.params) + _nbytes(ref.opt_state)
        return _nbytes(ref.part(part))

    def read(self, items: list, place, loaded=None) -> list:
        trees = [ref.part(part) for ref, part in items]
        if all(isinstance(x, jax.Array) for x in jax.tree.leaves(trees)):
            return jax.device_put(trees, _kind(trees, self.device_kind))  # one batched put, never waited for
        # (numpy leaves: a checkpoint of another tier restored for reading, e.g. an evaluation's)
        return jax.tree.map(
            lambda x: jax.device_put(x, x.sharding.with_memory_kind(self.device_kind)) if isinstance(x, jax.Array)
            else place(x), trees)

    def write(self, step: int, g: int, ref, update: list):
        trees = (update[0], update[1])
        update.clear()
        # One put of the layer's weights and optimizer state to their host shardings (those of the state it
        # replaces), issued and not waited for.
        return HostLayer(*jax.device_put(trees, jax.tree.map(lambda x: x.sharding, (ref.params, ref.opt_state))))

    def buffer_ref(self, step: int, g: int, version: int, shapes):
        return HostLayer(shapes, ())  # (its params, shapes until `write_buffer` puts the values there)

    def write_buffer(self, ref, value) -> None:
        ref.params = jax.device_put(value, _kind(value, self.memory_kind))
