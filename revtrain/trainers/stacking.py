"""Runs of identical layers held stacked (a leading layer axis), and conversions to and from one layer each.

A scanned executor (``ReversibleTrainer.scan_layers``, ``StandardTrainer.scan_layers``; docs/design.md section 9)
runs each maximal run of consecutive, structurally identical layers as one ``lax.scan``. For that the
reversible trainer keeps those layers' weights, optimizer states and layer states stacked: one array per
leaf with a leading axis over the layers of the run, ``[count, ...]``. A model is then a sequence of
**groups** ``(first layer index, count)`` covering every layer in order: single layers (count 1, held as
they are) and stacked runs (count >= 2).

Checkpoints, ``revtrain check`` and anything else that reads a `TrainState` layer by layer see the per-layer
layout (``TrainState.per_layer()``); the stacked layout is the reversible trainer's working form only.
Conversions go through host memory (one numpy copy of each leaf), keep each leaf's sharding and memory
kind (``pinned_host`` stays in host memory), and are done at start-up, at checkpoints and when a state
made by one executor is handed to the other, never in a training step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

Group = tuple[int, int]  # (index of the first layer, number of layers)


def find_runs(layers: Sequence, eligible: Callable = lambda layer: layer.reversible,
              min_count: int = 2) -> list[Group]:
    """Maximal runs of consecutive layers that are ``eligible`` and structurally identical.

    Args:
      layers: the model's layers (``revtrain.layers.base.Layer``; equal layers have the same module graph
        and parameter shapes).
      eligible: which layers may be stacked (default: reversible ones). The last layer (the head) never is.
      min_count: shortest run worth a scan.

    Returns:
      ``[(start, count), ...]`` in layer order, each ``count >= min_count``.
    """
    runs, i, n = [], 0, len(layers) - 1  # the head is never part of a run
    while i < n:
        j = i + 1
        if eligible(layers[i]):
            while j < n and eligible(layers[j]) and layers[j] == layers[i]:
                j += 1
            if j - i >= min_count:
                runs.append((i, j - i))
        i = j
    return runs


def groups_of(num_layers: int, runs: Sequence[Group]) -> tuple[Group, ...]:
    """Every layer in order as groups: the given runs, and each other layer alone ``(i, 1)``."""
    starts = dict(runs)
    groups, i = [], 0
    while i < num_layers:
        count = starts.get(i, 1)
        groups.append((i, count))
        i += count
    return tuple(groups)


def _split(x) -> bool:
    """True for a ``jax.Array`` split over its devices (sharded state), not replicated."""
    return isinstance(x, jax.Array) and not x.sharding.is_fully_replicated


def _key(index) -> tuple:
    """A hashable form of a shard's index (a tuple of slices)."""
    return tuple((s.start, s.stop, s.step) for s in index)


def _with_lead(sharding, lead: bool):
    """``sharding`` (a ``NamedSharding``) for the stacked array (``lead``: one more leading, unsplit axis) or
    for one slice of it (the leading axis dropped)."""
    spec = tuple(sharding.spec)
    spec = (None, *spec) if lead else spec[1:]
    return NamedSharding(sharding.mesh, P(*spec), memory_kind=sharding.memory_kind)


def _stack_split(column):
    """`stack` of split arrays: each process stacks its own devices' pieces (nothing is gathered)."""
    first = column[0]
    pieces = [{_key(sh.index): sh.data for sh in x.addressable_shards} for x in column]
    sharding = _with_lead(first.sharding, True)

    def piece(index):
        return np.stack([np.asarray(p[_key(index[1:])]) for p in pieces])

    return jax.make_array_from_callback((len(column), *first.shape), sharding, piece)


def _unstack_split(x, count: int) -> list:
    """`unstack` of a split array: each slice built from this process's pieces."""
    pieces = {_key(sh.index[1:]): sh.data for sh in x.addressable_shards}
    sharding = _with_lead(x.sharding, False)
    shape = tuple(x.shape[1:])
    return [jax.make_array_from_callback(shape, sharding, lambda index, i=i: np.array(pieces[_key(index)][i]))
            for i in range(count)]


def _local(x) -> np.ndarray:
    """This process's full copy of a replicated leaf, as numpy (host and device memory kinds alike)."""
    if isinstance(x, jax.Array):
        return np.asarray(x.addressable_data(0))
    return np.asarray(x)


def _place_like(value: np.ndarray, like):
    """``value`` with the sharding (and memory kind) of ``like``; numpy stays numpy."""
    if isinstance(like, jax.Array):
        return jax.device_put(value, like.sharding)
    return value


def _delete(x) -> None:
    if isinstance(x, jax.Array) and not x.is_deleted():
        x.delete()


def stack(trees: Sequence, consume: bool = False):
    """One tree whose leaves are the given trees' leaves stacked on a new leading axis.

    Args:
      trees: ``count`` pytrees of the same structure; leaves numpy arrays or ``jax.Array`` s, replicated or
        split over devices alike (sharded state: each process stacks its own pieces).
      consume: delete each input leaf once it is copied (the caller gives them up), so that at most one
        stacked leaf exists twice at a time.

    Returns:
      The stacked tree; a ``jax.Array`` leaf gets the sharding and memory kind of the first tree's leaf.
    """
    flat = [jax.tree.leaves(t) for t in trees]
    treedef = jax.tree.structure(trees[0])
    out = []
    for k in range(treedef.num_leaves):
        column = [f[k] for f in flat]
        if _split(column[0]):
            out.append(_stack_split(column))
        else:
            out.append(_place_like(np.stack([_local(x) for x in column]), column[0]))
        if consume:
            for x in column:
                _delete(x)
    return jax.tree.unflatten(treedef, out)


def unstack(tree, count: int) -> list:
    """The inverse of `stack`: ``count`` trees, each with one slice of every leaf (copies, same placement)."""
    leaves, treedef = jax.tree.flatten(tree)
    columns = []
    for x in leaves:
        if _split(x):
            if x.shape[:1] != (count,):
                raise ValueError(f"a stacked leaf has shape {x.shape}, expected a leading axis of {count}")
            columns.append(_unstack_split(x, count))
            continue
        value = _local(x)
        if value.shape[:1] != (count,):
            raise ValueError(f"a stacked leaf has shape {value.shape}, expected a leading axis of {count}")
        columns.append([_place_like(np.array(value[i]), x) for i in range(count)])
    return [jax.tree.unflatten(treedef, [c[i] for c in columns]) for i in range(count)]


def unstack_shapes(tree, count: int):
    """The per-layer ``jax.ShapeDtypeStruct`` (with sharding) of one slice of a stacked tree."""
    def one(x):
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding) and len(sharding.spec):  # split: the slice's own spec
            sharding = _with_lead(sharding, False)
        return jax.ShapeDtypeStruct(tuple(x.shape[1:]), x.dtype, sharding=sharding)
    return jax.tree.map(one, tree)


@dataclasses.dataclass
class Stacked:
    """A train state in the grouped layout (see the module note).

    Attributes:
      groups: ``((start, count), ...)`` covering every layer in order.
      params, opt_state, layer_state: one entry per group; a group with ``count > 1`` holds trees whose
        leaves have a leading axis of size ``count`` (layer ``start + j`` is slice ``j``).
    """

    groups: tuple[Group, ...]
    params: list
    opt_state: list
    layer_state: list

    def per_layer(self) -> tuple[list, list, list]:
        """``(params, opt_state, layer_state)``, one entry per layer (stacked groups copied out slice by
        slice; single layers are the same objects)."""
        out = ([], [], [])
        for g, (_, count) in enumerate(self.groups):
            for dst, src in zip(out, (self.params, self.opt_state, self.layer_state)):
                dst.extend([src[g]] if count == 1 else unstack(src[g], count))
        return out

    def per_layer_shapes(self) -> tuple[list, list, list]:
        """Like `per_layer`, as ``jax.ShapeDtypeStruct`` s (nothing is copied)."""
        def shapes(tree):
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                                tree)
        out = ([], [], [])
        for g, (_, count) in enumerate(self.groups):
            for dst, src in zip(out, (self.params, self.opt_state, self.layer_state)):
                dst.extend([shapes(src[g])] if count == 1 else [unstack_shapes(src[g], count)] * count)
        return out

    @classmethod
    def from_per_layer(cls, groups: Sequence[Group], params: list, opt_state: list, layer_state: list,
                       consume: bool = False) -> "Stacked":
        """Groups per-layer lists (see `stack`; ``consume`` deletes the per-layer copies as it goes)."""
        lists = ([], [], [])
        for start, count in groups:
            for dst, src in zip(lists, (params, opt_state, layer_state)):
                dst.append(src[start] if count == 1 else stack(src[start:start + count], consume=consume))
        return cls(tuple(groups), *lists)


def slice_of(stacks, j):
    """Inside a program: slice ``j`` (a traced index) of stacked trees (a leading layer axis)."""
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, j, keepdims=False), stacks)


def kept_loop_index(j):
    """The loop index ``j`` (int32 scalar) of a ``lax.scan`` body, passed through a two-element sort: the
    same value, through an operation that keeps XLA:CPU from compiling the whole loop as one kernel.

    Why: XLA:CPU's small-while-loop pass (``SmallWhileLoopHoistingPass``, in the JAX 0.10 and 0.12 builds)
    outlines a ``while`` loop its cost analysis judges small into a call compiled as one LLVM function,
    whose fusions another emitter writes than the per-fusion kernels of every other program. XLA:CPU lets
    LLVM contract a multiply and an add into a fused multiply-add, and where an add has two products,
    ``a * b + c * d`` (optax's moment update ``(1 - b1) * g + b1 * mu``), the two emitters contract
    different ones. On JAX 0.12.0.1 the pass took the deferred update of a stacked run of two d_model-32
    blocks (on 0.10.2 only far smaller loops): Adam's first moment after a clip came out as
    ``fma(mu, b1, (1 - b1) * g)`` there and ``fma(g, 1 - b1, b1 * mu)`` in StandardTrainer's whole-model
    update, one ulp apart in some elements (docs/recipe.md, "JAX versions checked"). The pass leaves a loop
    alone when it holds a sort (the one-function emitter has none), so a body that reads and writes its
    stacks at this index runs fusion by fusion like the whole-model program. The cost: one sort of two
    int32 per iteration.
    """
    return lax.sort(jnp.stack([j, j]))[0]
