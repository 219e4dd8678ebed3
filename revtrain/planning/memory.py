"""The memory plan: the peak bytes of each memory tier, estimated before anything large is allocated.

Linux without swap answers an over-commitment with SIGKILL and no message (exit 137): the plan is the only
place a user can be told that a run will not fit, and what would (docs/memory.md). It is made
from shapes alone, after the model is built and before the trainer places its state:

* **weights** and **optimizer state**: the layers' ``param_shapes`` (a tied leaf once, in its owner) and
  ``jax.eval_shape(tx.init, ...)`` of each layer's (``ReversibleTrainer`` keeps one optax state per layer,
  ``StandardTrainer`` one for the whole list: the same leaves);
* **gradients**: the whole tree for ``StandardTrainer`` (twice with microbatches: the sum and the current
  microbatch's); one layer's for the reversible trainer's fused per-layer update; a whole-model buffer
  beside one layer's when the update is deferred (clipping chains, microbatches, ties, a whole-leaf update
  under ``shard_state``: ``trainer.deferred``), held where the state lives; with optax's Hutchinson estimator
  (``sophia``: `revtrain.trainers.hessian`) the step's Hessian-vector products too, a model's size beside them
  (the reversible trainer's where its tier keeps activations);
* **activations**: ``StandardTrainer`` keeps every layer's vjp residuals until the backward (counted by
  tracing ``jax.vjp`` of each distinct layer on shapes: its residual leaves that are not inputs), or only
  each layer's input under ``scan_layers`` + ``remat_layers``; the reversible trainer keeps the saved inputs
  of its standard layers plus the current activation and its cotangent (the batch too, for both); with the
  Hutchinson estimator the reversible trainer's pass of products keeps every layer's input and its tangent
  (the more of that and the step's own), ``StandardTrainer``'s ``jvp(grad)`` program the residuals twice;
* **temporaries**: the largest ``temp_size_in_bytes`` of ``jit(...).lower(shapes).compile()
  .memory_analysis()`` over the programs of a step, compiled through the trainer's program interface
  (`revtrain.trainers.programs.LayerPrograms`, `revtrain.planning.costs`): for the run's own trainer the
  programs its step calls (its layout's groups, a scanned run's scans at their length, the head's program
  with its blocks), on the global (micro)batch, so that its first step finds them compiled; for another
  choice one forward, one backward (rebuild or recompute, vjp and optax update) and the head's program of
  each distinct layer on one device's (micro)batch (`LayerPrograms.on_mesh`). Identical layers share one
  entry.
  ``StandardTrainer`` runs one program for the whole step; compiling it for a 32-block model costs minutes on
  two CPU cores, so its temporaries are an analytic bound: the residuals and gradients counted above plus
  the largest one-layer backward program's own temporaries (`MemoryPlan.method` says so);
* **runtime**: the JAX/XLA process with its libraries, the data pipeline and the compiled programs
  (`RUNTIME_BYTES`, measured on ``revtrain train`` runs of 25 M to 309 M parameters);
* **checkpoint** and **evaluation**: what a save and an evaluation hold beyond a step's transient parts
  (`_phases`: a background save's second copy of the state and its staging beside the next step; a save
  between steps; each layer's evaluation program on the evaluation batch), so that the total is the
  peak over the phases of a run (docs/memory.md, "Accuracy").

The plan asks the setup's tier object (`Setup.tier`, `revtrain.tiers.Tier`) where the state waits
(`Tier.state_memory`) and what its own store holds (`Tier.store_parts`, `Tier.step_io`, `Tier.capacity`).
With the disk tier (``ReversibleTrainer.offload = 'disk'``, `revtrain.tiers.disk`) memory holds only the layers
in flight (the one computing, the one read ahead, the one being written: three layers' weights and optimizer
state, or two and one program's temporaries, whichever is more), and a third tier, **disk**, holds two
steps' layer files (a step writes new files beside the ones it reads) plus the kept checkpoints the tier has
moved past (`DiskTier.store_parts`), and with the deferred update two gradients' worth of buffer files
(memory: two layers' buffers in flight and a tied leaf's other use), against the free space of the offload
directory. The plan also gives the bytes a step reads and writes, the disk's sequential bandwidth
(`DiskTier.step_io`: measured once, cached) and the step time that I/O alone takes (`MemoryPlan.io`).
Where the backend has no pageable host memory (a GPU: only ``device`` and ``pinned_host``; or the CPU with the
test switch, `revtrain.pinned`), the host tier's state lives in pinned memory, and a **pinned** tier counts it:
the state, the kept inputs, the deferred update's buffers and the layer being written back, plus on a GPU what
XLA's pinned pool costs beyond them (**pool**: the whole limit where preallocated, the doubling regions where
grown, `pinned.pool_bytes`), against the pool's limit (``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``; the host limit on
the CPU, where pinned memory is ordinary RAM); the pool is host RAM too, so host counts it as well. Where the
state is pageable on an accelerator, the pinned tier holds only the transfers in flight (a layer fetched, a
layer written back, staged by the runtime). The disk tier reads into pageable memory and does not use it.

Tiers: on an accelerator, **device** (per device; against ``memory_stats()["bytes_limit"]``) and **host**
(this process; with offload the weights, optimizer state and saved inputs of every local device live
there, 1/N each with ``shard_state``). On the CPU backend device memory *is* host memory: one tier, host,
holding every local device's share. What the process may use on the host (`revtrain.limits`) is the smaller of
``MemAvailable`` (/proc/meminfo) plus its own resident bytes and, for its memory cgroup and each of its
ancestors with a limit (v1: ``memory.limit_in_bytes`` under /sys/fs/cgroup/memory; v2: ``memory.max``), the
limit less what other processes of the group hold (its anonymous memory less ours; page cache can be
reclaimed and is not counted).

**The floor.** The weights, optimizer state and gradients need no compiled program (shapes, and
``jax.eval_shape`` of the optimizer's init), the temporaries do: compiling StandardTrainer's whole step for the
1.44 B Llama took over a minute on two CPU cores. `floor` counts the parts known without compiling, a lower
bound of each tier; a run (and each alternative a refusal weighs, and each row of
``revtrain plan``) whose floor does not fit is refused from it before anything is compiled (`check_everywhere`,
`choices`).

The parts are those of the design floor: one copy of the weights and optimizer state (12 bytes a
parameter for AdamW in float32 with the fused update), as a run holds them once init, checkpoint save and
restore stop copying; docs/memory.md gives the measured peaks against the plan.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from revtrain import limits
from revtrain.errors import ConfigError
from revtrain.limits import device_limit, gib, host_limit, pinned_limit
from revtrain.optstate import tree_nbytes
from revtrain.planning.setups import Setup, rounds, takes_hvp, tier_of
from revtrain.planning.costs import PlanPrograms
from revtrain.planning.shapes import Shapes, local_batch, shapes_of, state_bytes, tied_bytes
from revtrain.trainers.modes import REBUILDS, default_mode

# The process's own constant: what a ``revtrain train`` step holds beyond the weights, optimizer state and the
# step's own parts: imports (JAX, XLA, Flax, optax, Orbax, Grain, TensorBoard), the backend, the data pipeline,
# the compiled programs. Measured on the 2-core CPU machine (Llama byte models of 25 M to 309 M parameters with
# the reversible trainer: 496-588 MiB; docs/memory.md); on an accelerator its runtime adds its own.
RUNTIME_BYTES = 520 * 2**20
# StandardTrainer's step holds about a quarter of the weights beyond its compiled step's temporaries,
# gradients and residuals (measured 0.22-0.30 of the weights, 57 M to 309 M parameters): counted with its
# temporaries.
STANDARD_EXTRA_FRACTION = 0.25
# A save written between steps in a run that restored its state holds about a quarter of the state beyond
# the staging and the largest layer's arrays (measured 0.22-0.36, 57 M to 309 M parameters; a first run's
# saves hold less): counted for every run, since most runs restore some time. It does not grow with the state:
# the 1.44 B Llama's saves (16.1 GiB of state, first run and resumed) held under 0.15 GiB beyond its steps, so
# the term is capped at SAVE_EXTRA_MAX_BYTES (docs/memory.md, Accuracy).
SAVE_STATE_FRACTION = 0.25
SAVE_EXTRA_MAX_BYTES = 2**30

PARTS = ("weights", "optimizer_state", "gradients", "activations", "temporaries", "runtime", "checkpoint",
         "evaluation")


# The table's columns: the parts, and what XLA's pinned pool costs beyond its arrays (pinned and host tiers).
TABLE_PARTS = PARTS + ("pool",)


class MemoryPlanError(ConfigError):
    """The plan does not fit the memory this process may use (one line, exit status 2)."""



# -- the plan ------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class MemoryPlan:
    """The estimated peak of each memory tier, by part, against what the process may use.

    Attributes:
      setup: the trainer choice (`Setup`).
      tiers: tier (``"host"``, and ``"device"`` on an accelerator) -> {part: bytes}; ``PARTS`` in order.
      limits: tier -> bytes the process may use (None: unknown, counted as fitting).
      sources: tier -> where the limit came from (``"MemAvailable 20.1 GiB + ..."``).
      method: how the temporaries were found (compiled per-layer programs, analytic for StandardTrainer).
      num_params: trainable scalars (a tied leaf once).
      floor: made by `floor` from shapes alone (nothing compiled): each tier's total is at most what `plan`
        says, so it is a lower bound (`shortfall` says "at least").
    """

    setup: Setup
    tiers: dict
    limits: dict
    sources: dict
    method: str
    num_params: int
    io: dict | None = None  # a store tier's step I/O (the disk's) (`_io`): bytes read, written, bandwidth, seconds
    floor: bool = False

    def total(self, tier: str) -> int:
        """Estimated peak bytes of ``tier``."""
        return sum(self.tiers[tier].values())

    def fits_tier(self, tier: str) -> bool:
        limit = self.limits.get(tier)
        return limit is None or self.total(tier) <= limit

    @property
    def fits(self) -> bool:
        """Whether every tier's estimate is within its limit."""
        return all(self.fits_tier(t) for t in self.tiers)

    def _tier_text(self, tier: str) -> str:
        parts = ", ".join(f"{k.replace('_', ' ')} {gib(v)}" for k, v in self.tiers[tier].items() if v)
        limit = self.limits.get(tier)
        of = f" of {gib(limit)} ({self.sources[tier]})" if limit is not None else f" (limit unknown: {self.sources[tier]})"
        return f"{tier} {gib(self.total(tier))}{of}: {parts}"

    def line(self, optimizer: str | None = None) -> str:
        """One log line: the choice (with ``optimizer``, how the run names its optimizer: `optimizer_text`),
        each tier's total, limit and parts, and whether it fits."""
        verdict = "fits" if self.fits else "does NOT fit"
        if self.floor:
            verdict += f" ({FLOOR_METHOD})"
        named = f", optimizer {optimizer}" if optimizer else ""
        return (f"memory plan ({self.setup.label}{named}, {self.num_params:,} params, batch {self.setup.batch_size}): "
                + "; ".join(self._tier_text(t) for t in self.tiers) + self._io_text() + f"; {verdict}")

    def _io_text(self) -> str:
        io = self.io
        if io is None:
            return ""
        text = (f"; {tier_of(self.setup).name} I/O a step: reads {gib(io['read_bytes'])}, "
                f"writes {gib(io['write_bytes'])}")
        if io["seconds"] is not None:
            text += (f" at {io['read_bandwidth'] / 1e9:.2f} / {io['write_bandwidth'] / 1e9:.2f} GB/s "
                     f"({io['bandwidth_source']}): at least {io['seconds']:.1f} s a step")
        elif io["bandwidth_source"]:  # (why no time is given: the disk's bandwidth was not measured)
            text += f" (bandwidth {io['bandwidth_source']})"
        return text

    def record(self) -> dict:
        """A flat dict for the first ``train.jsonl`` record: ``plan_<tier>_bytes``, ``plan_<tier>_<part>_bytes``,
        ``<tier>_limit_bytes``, ``plan_fits``, ``plan_method``."""
        out = {"plan_fits": self.fits, "plan_method": self.method}
        for tier, parts in self.tiers.items():
            out[f"plan_{tier}_bytes"] = self.total(tier)
            for part, v in parts.items():
                out[f"plan_{tier}_{part}_bytes"] = int(v)
            if self.limits.get(tier) is not None:
                out[f"{tier}_limit_bytes"] = int(self.limits[tier])
        for k, v in (self.io or {}).items():
            out[f"plan_io_{k}"] = v
        return out

    def shortfall(self) -> str:
        """The tiers over their limits: ``"host needs 23.10 GiB of 20.00 GiB (MemAvailable ...)"`` (``"needs
        at least"`` for a `floor`)."""
        needs = "needs at least" if self.floor else "needs"
        return "; ".join(f"{t} {needs} {gib(self.total(t))} of {gib(self.limits[t])} ({self.sources[t]})"
                         for t in self.tiers if not self.fits_tier(t))


def plan(model, setup: Setup, batch_spec: dict, num_devices: int, *, limits: dict | None = None,
         programs: PlanPrograms | None = None, platform: str | None = None, whole_step: bool = True,
         global_devices: int | None = None, eval_spec: dict | None = None, store: dict | None = None) -> MemoryPlan:
    """The memory plan of ``model`` trained with ``setup``, from shapes (nothing large is allocated).

    Args:
      model: a `revtrain.models.Model` (its layers' ``param_shapes``; ``init_params`` is never read).
      setup: the trainer choice.
      batch_spec: ``{key: jax.ShapeDtypeStruct}`` of a batch (any leading size: one device's
        (micro)batch replaces it).
      num_devices: local devices of this process (the global batch is split over all devices; a
        single-process run's local devices are all of them).
      limits: ``{tier: (bytes or None, source)}`` (default: `host_limit`, `device_limit`).
      programs: a cache of compiled programs shared between plans of one model.
      platform: the backend (default: the first local device's).
      whole_step: compile `StandardTrainer`'s whole step for its temporaries (False: the analytic bound).
      global_devices: devices of every process (default ``num_devices``): the batch is split over them.
      eval_spec: ``{key: jax.ShapeDtypeStruct}`` of a global evaluation batch (None: no evaluation counted).
      store: for a tier with a store of its own (`Tier.store_parts`), ``{"keep", "every", "checkpoints"}``
        (``train.keep_checkpoints``, ``train.checkpoint_every``, the checkpoints' directory: space the run holds
        already; default 3, 0, none); the store's directory is the tier's.

    Returns:
      a `MemoryPlan`.
    """
    programs = programs or PlanPrograms()
    platform = platform or jax.local_devices()[0].platform
    n = max(num_devices, 1)
    one_tier = platform == "cpu"  # (the CPU backend: device memory is host memory)
    shapes = shapes_of(model, setup, batch_spec, n, global_devices)
    walk = _shared_walk(model, setup, shapes, programs, global_devices or n)
    state = state_bytes(setup, shapes.pshapes, shapes.oshapes, n)
    if setup.trainer == "standard":
        step = _standard_step(model, setup, shapes, walk, state, programs, whole_step)
    else:
        step = _reversible_step(setup, walk, state, shapes)
    tiers = _place(model, setup, step, state, n, one_tier)
    where = tier_of(setup).state_memory
    _phases(tiers, state_bytes=0 if where is None else (state[0] + state[1]) * n, largest_layer=max(state[3]), n=n,
            state_tier="host" if one_tier or where == "host" else "device",
            evaluation=_evaluation_bytes(model, setup, programs, eval_spec, n, global_devices) if eval_spec else 0)
    io = None
    if where is None:
        io = _store_tier_and_io(model, setup, shapes, state, tiers, store)
    elif where == "host":
        _host_tier_pinned(setup, tiers, state, step, n, platform, one_tier)
    return _against_limits(setup, tiers, limits, one_tier, store, step.method, shapes.pshapes, io=io)


def _host_tier_pinned(setup: Setup, tiers: dict, state: tuple, step: "_Step", n: int, platform: str,
                      one_tier: bool) -> None:
    """The pinned host memory of a tier whose state waits in host memory: the whole state where it lives there
    (its `Tier.memory_kind` pinned: `_pinned_state_tier`), else on an accelerator only the transfers in flight
    (`_pinned_tier`)."""
    from revtrain import pinned
    if (tier_of(setup).memory_kind or pinned.state_kind(platform)) == pinned.PINNED:
        _pinned_state_tier(tiers, state, step, n, platform, one_tier)
    elif not one_tier:
        _pinned_tier(setup, tiers, state)


def _pinned_state_tier(tiers: dict, state: tuple, step: "_Step", n: int, platform: str, one_tier: bool) -> None:
    """Adds the **pinned** tier of a state that lives in pinned host memory: every local device's share of the
    weights and optimizer state, the kept inputs (`HostResidency.keep`), the deferred update's buffers and the
    layer being written back beside its old copy (`revtrain.tiers.host_store.HostStore.write`); on a GPU the pool beyond them
    (`pinned.pool_bytes`: the limit where preallocated, the doubling regions where grown). The pool and the
    layer written back are host RAM too (added to host; the rest is there already)."""
    from revtrain import pinned
    weights, opt, layer_bytes, layer_state = state
    lw, lo = max(layer_bytes), max(layer_state) - max(layer_bytes)
    part = {"weights": weights * n + lw, "optimizer_state": opt * n + lo,
            "gradients": max(0, step.grads - lw) * n, "activations": step.saved_std * n}
    need = sum(part.values())
    part["pool"] = max(0, pinned.pool_bytes(need) - need) if platform == "gpu" else 0
    tiers["pinned"] = part
    if not one_tier:  # (on the CPU the layer being written back is among the device parts counted in host)
        tiers["host"]["weights"] += lw
        tiers["host"]["optimizer_state"] += lo
    tiers["host"]["pool"] = part["pool"]


def _pinned_tier(setup: Setup, tiers: dict, state: tuple) -> None:
    """Adds XLA's pinned host pool (an accelerator's host tier) to ``tiers``: the streaming engine's
    transfers in flight (the state is pageable), a layer fetched and a layer written back, staged there by the
    runtime (pinned memory is host RAM too: counted in both)."""
    lw, ls = max(state[2]), max(state[3])
    tiers["pinned"] = {"weights": 2 * lw, "optimizer_state": 2 * (ls - lw)}
    for k in ("weights", "optimizer_state"):
        tiers["host"][k] += tiers["pinned"][k]


@dataclasses.dataclass
class _Walk:
    """What `_walk_programs` finds layer by layer: every layer's input (``inputs``), the saved inputs of the
    reversible trainer's standard layers (``saved_std``, bytes), the residuals backprop keeps
    (``residuals``, bytes) and the compiled programs' temporaries (``temps``, bytes, 0 first)."""

    inputs: list
    saved_std: int
    residuals: int
    temps: list


def _walk_programs(model, setup: Setup, shapes: Shapes, programs: PlanPrograms, global_devices: int) -> _Walk:
    """Per layer: input shapes, saved bytes, program temporaries (identical layers hit the caches). The run's own
    trainer's temporaries are those of the programs its step runs, compiled as it calls them (its layout, its
    blocks' modes, the global (micro)batch: `PlanPrograms.own_temporaries`); another choice's are its layers'
    programs on one device's (micro)batch (`LayerPrograms.on_mesh`)."""
    tx, keys, batch = setup.optimizer, shapes.keys, shapes.batch
    reversible = setup.trainer == "reversible"
    own = reversible and programs.is_own(setup)
    layer_programs = None if own else programs.layer_programs(
        model, tx, setup.rebuild if reversible else "exact")
    x = batch[model.input_key]
    walk = _Walk([], 0, 0, [0])
    for layer in model.layers:
        walk.inputs.append(x)
        p, s = layer.param_shapes, layer.state_shapes  # a tied leaf in both (what the layer computes on)
        o = jax.eval_shape(tx.init, p)
        if layer.is_head:
            if not own:
                walk.temps.append(programs.head(layer_programs, layer, p, o, s, x, batch))
            walk.residuals += tree_nbytes(x)
            break
        y = programs.output(layer, p, s, x, keys)
        if reversible:
            if not layer.reversible:
                walk.saved_std += tree_nbytes(x)
            if not own:
                mode = default_mode(layer, REBUILDS[setup.rebuild])  # (the trainer's default)
                walk.temps.append(programs.forward(layer_programs, layer, p, s, x, mode))
                walk.temps.append(programs.backward(layer_programs, layer, p, o, s, x, y, mode))
        else:
            walk.residuals += tree_nbytes(x) if setup.remat else programs.residuals(layer, p, s, x, keys)
            walk.temps.append(programs.backward(layer_programs, layer, p, o, s, x, y,
                                                default_mode(layer, REBUILDS["exact"])))
        x = y
    if own:
        walk.temps += programs.own_temporaries(local_batch(batch, shapes.b * global_devices))
    return walk


def _shared_walk(model, setup: Setup, shapes: Shapes, programs: PlanPrograms, global_devices: int) -> _Walk:
    """`_walk_programs`, or, where ``programs.shared_walks`` is a dict, the walk of an earlier plan of the same
    choice on another tier (the programs are the same; ``offload = 'auto'`` compiles them once)."""
    walks = programs.shared_walks
    if walks is None:
        return _walk_programs(model, setup, shapes, programs, global_devices)
    key = (id(model), dataclasses.replace(setup, tier=None, label="", settings=()))
    if key not in walks:
        walks[key] = _walk_programs(model, setup, shapes, programs, global_devices)
    return walks[key]


@dataclasses.dataclass
class _Step:
    """A step's transient parts (bytes: one device's gradients, activations, temporaries), how the
    temporaries were found (``method``) and the saved inputs among the activations (``saved_std``); where the
    state lives is the setup's tier's (`tier_of`)."""

    grads: int
    acts: int
    temp: int
    method: str
    saved_std: int = 0
    products: int = 0  # optax's Hutchinson estimator's Hessian-vector products among ``grads`` (reversible)


def _standard_step(model, setup: Setup, shapes: Shapes, walk: _Walk, state: tuple, programs: PlanPrograms,
                   whole_step: bool) -> _Step:
    """`StandardTrainer`'s step: the whole tree's gradients (twice with microbatches), every layer's residuals
    and the batch; its compiled whole step's temporaries beyond those (``whole_step``), else the analytic
    bound."""
    weights, m, pshapes = state[0], setup.microbatches, shapes.pshapes
    grads = tree_nbytes(pshapes) * (2 if m > 1 else 1)
    batch_bytes = tree_nbytes(shapes.batch)
    acts = walk.residuals + batch_bytes
    whole = programs.whole_step(model, setup, pshapes, jax.eval_shape(setup.optimizer.init, pshapes),
                                [layer.state_shapes for layer in model.layers],
                                local_batch(shapes.batch, shapes.b * m)) if whole_step else -1
    if whole >= 0:  # the compiled step holds the gradients and residuals among its temporaries: split them
        grads = min(grads, whole)
        acts = min(walk.residuals, whole - grads) + batch_bytes
        temp = whole - grads - (acts - batch_bytes) + int(STANDARD_EXTRA_FRACTION * weights)
        method = "StandardTrainer's whole step compiled (temporaries beyond the gradients and residuals)"
    else:
        temp = max(walk.temps) + int(STANDARD_EXTRA_FRACTION * weights)
        method = ("analytic bound for StandardTrainer's whole step: residuals + gradients + the largest "
                  "one-layer backward program's temporaries (compiled)")
    if takes_hvp(setup.optimizer, pshapes):  # the products (a model's size) and the jvp(grad) program's tangent residuals
        grads += tree_nbytes(pshapes)
        acts += walk.residuals
        method += "; optax's Hutchinson estimator: its products and the jvp(grad) program's residuals twice"
    return _Step(grads, acts, temp, method)


def _reversible_step(setup: Setup, walk: _Walk, state: tuple, shapes: Shapes) -> _Step:
    """The reversible trainer's step: one layer's gradient (and the deferred update's whole-model buffer), the
    saved inputs, the current activation and its cotangent, the batch, and the largest compiled one-layer
    program's temporaries (the memory budget's planned peak as a floor under them)."""
    weights, opt, layer_bytes = state[0], state[1], state[2]
    grads = max(layer_bytes) + (weights if setup.deferred else 0)  # deferred: a buffer of the (local) weights' size
    acts = walk.saved_std + 2 * max(tree_nbytes(a) for a in walk.inputs) + tree_nbytes(shapes.batch)
    temp = max(walk.temps)
    method = "compiled one-layer programs (forward, backward, head)"
    if setup.budget_peak:  # the budget plan's step (backprop residuals, kept inputs) as a floor
        on_host = tier_of(setup).state_memory == "host"
        on_device = ((0 if on_host else weights + opt + grads) + acts - (walk.saved_std if on_host else 0))
        temp = max(temp, setup.budget_peak - on_device)
        method += "; the memory budget's plan of the step (revtrain.planning.budget) as a floor"
    saved, products = walk.saved_std, 0
    if takes_hvp(setup.optimizer, shapes.pshapes):
        # optax's Hutchinson estimator (`revtrain.trainers.hessian`): the products, a buffer of the (local)
        # weights' size held to the update pass, and the products' pass keeping every layer's input and its
        # tangent where the tier keeps activations (the more of that and the step's own kept inputs)
        grads, products = grads + weights, weights
        kept = 2 * sum(tree_nbytes(a) for a in walk.inputs)
        acts, saved = acts - saved + max(saved, kept), max(saved, kept)
        method += "; optax's Hutchinson estimator: its products and their pass's kept inputs and tangents"
    return _Step(grads, acts, temp, method, saved, products)


def _place(model, setup: Setup, step: _Step, state: tuple, n: int, one_tier: bool) -> dict:
    """The tiers (``{"device": parts, "host": parts}``, or only ``"host"`` on the CPU backend, where the device
    parts are in host RAM too, once per local device) with the state and the step's parts where the trainer
    holds them (`PARTS`; what a save and an evaluation add is `_phases`')."""
    weights, opt, layer_bytes, layer_state = state
    one_layer, acts, temp = max(layer_bytes), step.acts, step.temp
    device = dict.fromkeys(PARTS, 0)
    host = dict.fromkeys(PARTS, 0)
    host["runtime"] = RUNTIME_BYTES
    where = tier_of(setup).state_memory if setup.trainer == "reversible" else "device"
    if where is None:
        # The layers in flight: the one computing and the one read ahead (on the device), the one being written
        # (its host copy). The saved inputs and the current activation stay on the device. A layer is read
        # only once the program before it has run (`streaming.StepStream`), so a program's temporaries (its
        # gradient among them: compiled) and the layer read ahead are never live together: in flight is the
        # more of three layers and two layers plus the temporaries.
        lw, lo = max(layer_bytes), max(layer_state) - max(layer_bytes)
        if setup.shard_state:  # each device holds its piece of a layer read (`revtrain.placement.placer`)
            lw, lo = -(-lw // n), -(-lo // n)
        device["weights"], device["optimizer_state"] = 2 * lw, 2 * lo
        host["weights"], host["optimizer_state"] = lw, lo
        if setup.deferred:  # the deferred update's buffers: in files, in flight beside their layers' weights
            device["gradients"] = 2 * lw + tied_bytes(model)  # (and the tied leaves' other use, held all step)
            host["gradients"] = lw  # (being written)
        device["gradients"] += step.products  # (the Hutchinson estimator's, kept where activations are: here)
        device["activations"] = acts
        temp = max(0, temp - max(layer_state))
    elif where == "host":
        # Host: every local device's share of the state (one copy with shard_state), saved inputs, and the
        # deferred gradient buffer (it lives where the state lives). Device: the layers in flight, one
        # layer's gradient (two buffers of the deferred update), the current activation, temporaries.
        host["weights"], host["optimizer_state"] = weights * n, opt * n
        host["activations"] = step.saved_std * n
        host["gradients"] = (step.grads - one_layer) * n
        # The layer computing, those fetched ahead and the one being written back: the streaming engine puts a
        # program's layer `streaming.DEPTH` programs ahead on an accelerator, right before it on the CPU
        # (`streaming.CPU_DEPTH`), so 4 layers are in flight there and 2 here.
        from revtrain.streaming import CPU_DEPTH, DEPTH
        lw, lo = max(layer_bytes), max(layer_state) - max(layer_bytes)
        if setup.shard_state:
            lw, lo = -(-lw // n), -(-lo // n)
        flight = 2 + (CPU_DEPTH if one_tier else DEPTH)
        device["weights"], device["optimizer_state"] = flight * lw, flight * lo
        # A deferred update's buffers live in the store too: two in flight beside their layers' weights (and
        # the tied leaves' other use, held all step); else one layer's gradient.
        device["gradients"] = 2 * lw + tied_bytes(model) if setup.deferred else one_layer
        device["activations"] = acts - step.saved_std
    else:
        device.update(weights=weights, optimizer_state=opt, gradients=step.grads, activations=acts)
    device["temporaries"] = temp
    if one_tier:  # the device parts are in host RAM too, once per local device
        for k in ("weights", "optimizer_state", "gradients", "activations", "temporaries"):
            host[k] += device[k] * n
        return {"host": host}
    return {"device": {k: v for k, v in device.items() if k != "runtime"}, "host": host}


def _store_tier(setup: Setup, shapes: Shapes, state: tuple, tiers: dict, store: dict | None) -> tuple:
    """Adds the tier's own store to ``tiers`` (under its name), from shapes alone (the plan's and the floor's
    alike): what `Tier.store_parts` says it holds for whole layers. Returns ``(weights, optimizer state,
    per-layer bytes)`` of the store."""
    spec, tier = store or {}, tier_of(setup)
    weights, opt, layer_bytes = state[0], state[1], state[2]
    if setup.shard_state:  # the store holds whole layers
        weights, opt = tree_nbytes(shapes.pshapes), tree_nbytes(shapes.oshapes)
    tiers[tier.name] = tier.store_parts(weights, opt, spec.get("keep", 3), spec.get("every", 0), setup.deferred)
    return weights, opt, layer_bytes


def _store_tier_and_io(model, setup: Setup, shapes: Shapes, state: tuple, tiers: dict, store: dict | None) -> dict:
    """Adds the tier's own store to ``tiers`` (`_store_tier`) and returns the step's reads and writes
    (`Tier.step_io`)."""
    weights, opt, layer_bytes = _store_tier(setup, shapes, state, tiers, store)
    deferred = None
    if setup.deferred:
        owned = sum(layer_bytes[o] for o in {t.owner for t in model.ties})
        deferred = (owned, setup.microbatches, rounds(setup.optimizer, model) + 1)
    return tier_of(setup).step_io(weights, opt, layer_bytes[-1], deferred)


def _against_limits(setup: Setup, tiers: dict, limits: dict | None, one_tier: bool, store: dict | None, method: str,
                    pshapes: list, io: dict | None = None, floor: bool = False) -> MemoryPlan:
    """The `MemoryPlan` of ``tiers`` against ``limits`` (default: the process's host limit, the device's, the
    free space of the tier's own store (`Tier.capacity`), the pinned host pool)."""
    if limits is None:
        limits = {"host": host_limit()}
        if not one_tier:
            limits["device"] = device_limit()
    limits = dict(limits)
    own = tier_of(setup).name  # (the tier's own store, counted under its name)
    if own in tiers and own not in limits:
        held = [d for d in ((store or {}).get("checkpoints"),) if d]
        limits[own] = tier_of(setup).capacity(held)
    if "pinned" in tiers and "pinned" not in limits:
        limits["pinned"] = ((limits["host"][0], "pinned host memory is host RAM on the CPU backend") if one_tier
                            else pinned_limit())
    num_params = sum(int(np.prod(x.shape, dtype=np.int64)) for x in jax.tree.leaves(pshapes))
    return MemoryPlan(setup, tiers, {t: limits[t][0] for t in tiers}, {t: limits[t][1] for t in tiers}, method,
                      num_params, io, floor=floor)


# -- the floor: shapes alone ---------------------------------------------------------------------------------

FLOOR_METHOD = "from shapes alone, nothing compiled"


def floor(model, setup: Setup, batch_spec: dict, num_devices: int, *, limits: dict | None = None,
          programs: PlanPrograms | None = None, platform: str | None = None, global_devices: int | None = None,
          store: dict | None = None) -> MemoryPlan:
    """The least `plan` says for ``setup``, from shapes alone: no program is compiled (a second or less).

    Each tier gets, in the places `plan` puts them (the host with offload, the layers in flight and the disk
    with the disk tier, one device's share with ``shard_state``), the parts `plan` finds without compiling:

    * **weights** (the layers' ``param_shapes``, a tied leaf once) and **optimizer state**
      (``jax.eval_shape(tx.init, ...)`` of each layer's);
    * **gradients**: `StandardTrainer`'s whole tree (once, even with microbatches); the reversible trainer's
      one layer, plus the deferred update's whole-model buffer where the setup has one;
    * **activations**: the reversible trainer's as `plan` counts them (the saved inputs of its standard
      layers, the current activation and its cotangent, the batch: the layers' output shapes, traced with
      ``jax.eval_shape`` by `PlanPrograms.output`, cached in ``programs`` for a later `plan`); none of
      `StandardTrainer`'s, since `plan` takes its residuals from the compiled step (XLA keeps fewer than the
      vjp's residuals at many shapes: 0.70-0.80 of them at d_model 128-768);
    * **temporaries**: only `StandardTrainer`'s fixed share of the weights (`STANDARD_EXTRA_FRACTION`), no
      compiled program's;
    * **runtime** on the host (`RUNTIME_BYTES`); what a save or an evaluation holds beyond a step: 0;
    * the **disk** tier whole, as `plan` counts it (its layer files and kept checkpoints are shapes alone).

    Every part left out is a size `plan` adds to these, and its compiled figure of `StandardTrainer`'s whole
    step holds the gradient tree (twice or more of it at every size measured), so each tier's total is at most
    `plan`'s: a floor that does not fit means the plan does not fit either, and the run can be refused before
    any program is compiled (docs/memory.md: the 1.44 B `StandardTrainer` refusal).

    Args:
      model, setup, batch_spec, num_devices, limits, programs, platform, global_devices, store: as for `plan`.

    Returns:
      a `MemoryPlan` with ``floor=True`` and ``method`` `FLOOR_METHOD` (no ``io``).
    """
    programs = programs or PlanPrograms()
    platform = platform or jax.local_devices()[0].platform
    n = max(num_devices, 1)
    one_tier = platform == "cpu"
    reversible = setup.trainer == "reversible"
    shapes = shapes_of(model, setup, batch_spec, n, global_devices)
    state = state_bytes(setup, shapes.pshapes, shapes.oshapes, n)
    if reversible:  # its activations, as `plan` counts them (traced)
        saved_std, largest = _traced_inputs(model, shapes, programs)
        step = _Step(max(state[2]) + (state[0] if setup.deferred else 0),
                     saved_std + 2 * largest + tree_nbytes(shapes.batch), 0, FLOOR_METHOD, saved_std)
    else:
        step = _Step(tree_nbytes(shapes.pshapes), 0, int(STANDARD_EXTRA_FRACTION * state[0]), FLOOR_METHOD)
    tiers = _place(model, setup, step, state, n, one_tier)
    where = tier_of(setup).state_memory if reversible else "device"
    if where is None:  # the plan's store whole: it needs shapes only
        _store_tier(setup, shapes, state, tiers, store)
    elif where == "host":
        _host_tier_pinned(setup, tiers, state, step, n, platform, one_tier)
    return _against_limits(setup, tiers, limits, one_tier, store, FLOOR_METHOD, shapes.pshapes, floor=True)


def _traced_inputs(model, shapes: Shapes, programs: PlanPrograms) -> tuple[int, int]:
    """The reversible trainer's saved inputs of its standard layers and its largest layer input (bytes), from
    the layers' output shapes (traced with ``jax.eval_shape`` by `PlanPrograms.output`, nothing compiled)."""
    x, inputs, saved_std = shapes.batch[model.input_key], [], 0
    for layer in model.layers:
        inputs.append(x)
        if layer.is_head:
            break
        if not layer.reversible:
            saved_std += tree_nbytes(x)
        x = programs.output(layer, layer.param_shapes, layer.state_shapes, x, shapes.keys)
    return saved_std, max(tree_nbytes(a) for a in inputs)


def _evaluation_bytes(model, setup: Setup, programs: PlanPrograms, spec: dict, n: int,
                      global_devices: int | None) -> int:
    """Bytes one device holds beyond the state while it evaluates (layer by layer, in evaluation mode): the
    largest compiled evaluation program's temporaries, the largest layer's input and output, and one device's
    evaluation batch (``spec``: the global evaluation batch's shapes). The run's own reversible trainer's
    programs are those its evaluation calls (`PlanPrograms.own_eval_temporaries`: its layout on the global
    batch, found compiled by the run's first evaluation); another choice's are each layer's on one device."""
    lead = jax.tree.leaves(spec)[0].shape[0]
    batch = local_batch(spec, max(lead // max(global_devices or n, 1), 1))
    keys = jax.ShapeDtypeStruct((jax.tree.leaves(batch)[0].shape[0], 2), jnp.uint32)
    if setup.trainer == "reversible" and programs.is_own(setup):
        temps, acts = zip(*programs.own_eval_temporaries(spec))
        return max(temps) + max(acts) + tree_nbytes(batch)
    x, temps, acts = batch[model.input_key], [0], [0]
    for layer in model.layers:
        p, s = layer.param_shapes, layer.state_shapes
        if layer.is_head:
            temps.append(programs.eval_head(layer, p, s, x, batch))
            acts.append(tree_nbytes(x))
            break
        temps.append(programs.eval_forward(layer, p, s, x))
        y = programs.output(layer, p, s, x, keys)
        acts.append(tree_nbytes(x) + tree_nbytes(y))
        x = y
    return max(temps) + max(acts) + tree_nbytes(batch)


def _phases(tiers: dict, *, state_bytes: int, largest_layer: int, n: int, state_tier: str, evaluation: int) -> None:
    """Adds to ``tiers`` (in place) what a checkpoint save and an evaluation hold beyond a step's peak.

    A step's own transient parts are its gradients, activations and temporaries. A save of a state of at
    most ``limits.ASYNC_MAX_BYTES`` (``state_bytes``: this process's weights and optimizer state) is
    written in the background while the next step runs: that step cannot donate the buffers the write
    still reads, so XLA allocates a second copy of the state where it lives (``state_tier``), and the write
    stages up to ``limits.STAGING_BYTES`` in host memory; both add to the step's peak. A larger state
    is written between steps (the step's transient parts are free then): the bounded staging, the largest
    layer's arrays copied out (``largest_layer``, bytes) and `SAVE_STATE_FRACTION` of the state (at most
    `SAVE_EXTRA_MAX_BYTES`), counted
    where they exceed the step's. An evaluation (``evaluation``: bytes per device, `_evaluation_bytes`) runs after the final
    save, on the device tier (host on the CPU, once per local device): counted where it exceeds the rest.
    """
    step = {t: parts["gradients"] + parts["activations"] + parts["temporaries"] for t, parts in tiers.items()}
    host = tiers["host"]
    if state_bytes <= limits.ASYNC_MAX_BYTES:
        tiers[state_tier]["checkpoint"] += state_bytes if state_tier == "host" else state_bytes // max(n, 1)
        host["checkpoint"] += min(state_bytes, limits.STAGING_BYTES)
    else:
        save = (limits.STAGING_BYTES + largest_layer
                + min(int(SAVE_STATE_FRACTION * state_bytes), SAVE_EXTRA_MAX_BYTES))
        host["checkpoint"] = max(0, save - step["host"])
    tier = "host" if len(tiers) == 1 else "device"
    per_tier = evaluation * (n if tier == "host" else 1)
    tiers[tier]["evaluation"] = max(0, per_tier - step[tier] - tiers[tier]["checkpoint"])
