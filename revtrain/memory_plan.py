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
  under ``shard_state``: ``trainer.deferred``), held where the state lives;
* **activations**: ``StandardTrainer`` keeps every layer's vjp residuals until the backward (counted by
  tracing ``jax.vjp`` of each distinct layer on shapes: its residual leaves that are not inputs), or only
  each layer's input under ``scan_layers`` + ``remat_layers``; the reversible trainer keeps the saved inputs
  of its standard layers plus the current activation and its cotangent (the batch too, for both);
* **temporaries**: the largest ``temp_size_in_bytes`` of ``jit(...).lower(shapes).compile()
  .memory_analysis()`` over one forward, one backward (rebuild or recompute, vjp and optax update) and the
  head's program of each distinct layer, on one device's (micro)batch: the trainer's own code (its backward
  modes' ``forward`` and ``grads``, ``LayerPrograms.head_grads``, `guarded_update`). Identical layers
  share one entry.
  ``StandardTrainer`` runs one program for the whole step; compiling it for a 32-block model costs minutes on
  two CPU cores, so its temporaries are an analytic bound: the residuals and gradients counted above plus
  the largest one-layer backward program's own temporaries (`MemoryPlan.method` says so);
* **runtime**: the JAX/XLA process with its libraries, the data pipeline and the compiled programs
  (`RUNTIME_BYTES`, measured on ``revtrain train`` runs of 25 M to 309 M parameters);
* **checkpoint** and **evaluation**: what a save and an evaluation hold beyond a step's transient parts
  (`_phases`: a background save's second copy of the state and its staging beside the next step; a save
  between steps; each layer's evaluation program on the evaluation batch), so that the total is the
  peak over the phases of a run (docs/memory.md, "Accuracy").

With the disk tier (``ReversibleTrainer.offload = 'disk'``, `revtrain.disk_tier`) memory holds only the layers
in flight (the one computing, the one read ahead, the one being written: three layers' weights and optimizer
state, or two and one program's temporaries, whichever is more), and a third tier, **disk**, holds two
steps' layer files (a step writes new files beside the ones it reads) plus the kept checkpoints the tier has
moved past (`disk_tier.disk_need`), and with the deferred update two gradients' worth of buffer files
(memory: two layers' buffers in flight and a tied leaf's other use), against the free space of the offload
directory. The plan also gives the bytes a step reads and writes, the disk's sequential bandwidth
(`disk_tier.bandwidth`: measured once, cached) and the step time that I/O alone takes (`MemoryPlan.io`).
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
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from revtrain import limits, optstate
from revtrain.errors import ConfigError
from revtrain.limits import device_limit, gib, host_limit, pinned_limit
from revtrain.trainers.common import TrainerBase
from revtrain.trainers.layerwise import guarded_update
from revtrain.trainers.modes import REBUILDS, REMAT
from revtrain.trainers.programs import LayerPrograms

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


_nbytes = optstate.tree_nbytes  # bytes of a tree (typed PRNG keys too)


# -- the trainer choices -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Setup:
    """The settings a plan depends on (one trainer choice).

    Attributes:
      trainer: ``"standard"`` or ``"reversible"``.
      optimizer: the optax ``GradientTransformation`` (its state's shapes).
      batch_size: the global batch, in examples.
      microbatches: M (each device's share runs as M microbatches).
      offload: reversible: weights, optimizer state and saved inputs in host memory (pageable, moved by the
        streaming engine, `revtrain.streaming`).
      disk: reversible: weights and optimizer state in layer files (``offload = 'disk'``).
      shard_state: reversible: large leaves split over the devices (1/N each).
      deferred: reversible: the deferred update (a whole-model gradient buffer).
      remat: standard: ``scan_layers`` and ``remat_layers`` (only each layer's input is kept).
      rebuild: reversible: a rebuild flavour's name (`revtrain.trainers.modes.REBUILDS`: the backward program
        compiled).
      label: how a table names it (``"ReversibleTrainer + offload"``).
      settings: the gin bindings that select it, beyond the run's own.
      budget_peak: reversible with ``memory_budget``: the budget plan's expected peak device bytes of a step
        (`revtrain.trainers.budget`; 0: none), a floor under the device parts of the step.
      host_kind: with ``offload``, the memory kind of the host tier's state (``"pinned_host"`` or
        ``"unpinned_host"``; ``""``: as the platform has it, `pinned.state_kind`: pinned on a GPU).
    """

    trainer: str
    optimizer: Any
    batch_size: int
    microbatches: int = 1
    offload: bool = False
    disk: bool = False
    shard_state: bool = False
    deferred: bool = False
    remat: bool = False
    rebuild: str = "exact"
    label: str = ""
    settings: tuple = ()
    budget_peak: int = 0
    host_kind: str = ""


def setup_of(trainer, batch_size: int) -> Setup:
    """The `Setup` of a built trainer (``run.trainer``) for a global batch of ``batch_size``: the trainer
    describes itself (`TrainerBase.memory_setup`)."""
    return Setup(optimizer=trainer.tx, batch_size=batch_size, microbatches=trainer.microbatches,
                 **trainer.memory_setup())


def _factored(tx) -> bool:
    """Whether ``tx``'s state holds a factored second moment (``optax.FactoredState``: Adafactor, alone or in a
    chain or wrapper), read from its abstract state on a small matrix."""
    try:
        state = jax.eval_shape(tx.init, {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32)})
    except Exception:  # noqa: BLE001  (an optimizer that cannot init on a lone matrix: not known to be Adafactor)
        return False
    found = []
    jax.tree.leaves(state, is_leaf=lambda n: found.append(isinstance(n, optax.FactoredState)) or False)
    return any(found)


def optimizer_text(cfg) -> str:
    """How the run names its optimizer, as gin text (``@optax.adamw``, ``@optax.contrib.muon()``), from
    ``train.optimizer`` (``cfg``: the run's `revtrain.run.TrainConfig`); "a ready optimizer" when gin cannot
    say it (one built in Python)."""
    import gin

    from revtrain import ginconfig
    configurable = ginconfig._configurable(cfg.optimizer)  # noqa: SLF001  (a factory: its configurable)
    if configurable is not None:
        return f"@{configurable.selector}"
    try:
        ref = gin.query_parameter("train.optimizer")
        return f"@{ref.selector}()" if getattr(ref, "evaluate", False) else f"@{ref.selector}"
    except (ValueError, AttributeError):
        return "a ready optimizer"


def _separable(tx, model) -> bool:
    """Whether ``tx`` keeps the reversible trainer's fused per-layer update (no cross-layer equation)."""
    from revtrain.trainers.layerwise import CoupledUpdateError, LayerwiseUpdate
    try:
        return LayerwiseUpdate(tx, layer_param_shapes(model)).separable
    except CoupledUpdateError:
        return False


def _rounds(tx, model) -> int:
    """The deferred update's statistics passes under ``tx`` (`LayerwiseUpdate.rounds`, at least one)."""
    from revtrain.trainers.layerwise import CoupledUpdateError, LayerwiseUpdate
    try:
        return max(LayerwiseUpdate(tx, layer_param_shapes(model)).rounds, 1)
    except CoupledUpdateError:
        return 1


def _tied_bytes(model) -> int:
    """Bytes of the tied leaves' other-use gradients (the deferred update keeps them through a step)."""
    shapes = layer_param_shapes(model)
    users = {t.user for t in model.ties}
    return sum(_nbytes(model.tied_leaves(u, {t.owner: shapes[t.owner] for t in model.ties_of(u)})) for u in users)


def alternatives(setup: Setup, model, num_devices: int, host_offload: bool) -> list[Setup]:
    """The trainer choices a table compares with ``setup`` and a refusal may name: the reversible trainer,
    with offload (``host_offload``: the backend has host memory), Adafactor, microbatches, ``shard_state``
    (several devices), half the batch. Each carries the gin bindings that select it (``settings``)."""
    out, rev = [], setup.trainer == "reversible"
    base_rev = setup if rev else dataclasses.replace(
        setup, trainer="reversible", remat=False, label="ReversibleTrainer",
        settings=("train.trainer = @ReversibleTrainer",),
        deferred=setup.microbatches > 1 or bool(model.ties) or not _separable(setup.optimizer, model))
    out.append(base_rev)
    if host_offload and not base_rev.offload:
        label = "ReversibleTrainer + offload" if base_rev.disk else base_rev.label + " + offload"
        out.append(dataclasses.replace(base_rev, offload=True, disk=False, label=label,
                                       settings=base_rev.settings + ("ReversibleTrainer.offload = True",)))
    head = out[-1]  # the leanest so far: the next choices add to it
    if not base_rev.disk and not base_rev.shard_state:  # the disk tier
        out.append(dataclasses.replace(base_rev, offload=False, disk=True, label="ReversibleTrainer + offload='disk'",
                                       settings=base_rev.settings + ("ReversibleTrainer.offload = 'disk'",)))
    if not _factored(setup.optimizer):  # (an Adafactor run is offered no "+ Adafactor")
        ada = optax.adafactor(1e-3)
        out.append(dataclasses.replace(head, optimizer=ada, label=head.label + " + Adafactor",
                                       deferred=head.deferred or head.shard_state,
                                       settings=head.settings + ("train.optimizer = @optax.adafactor",)))
    local = setup.batch_size // max(num_devices, 1)
    if local % (2 * setup.microbatches) == 0:
        m = 2 * setup.microbatches
        out.append(dataclasses.replace(head, microbatches=m, deferred=True, label=head.label + f" + {m} microbatches",
                                       settings=head.settings + (f"train.microbatches = {m}",)))
    if num_devices > 1 and not head.shard_state:
        out.append(dataclasses.replace(head, shard_state=True, label=head.label + " + shard_state",
                                       settings=head.settings + ("ReversibleTrainer.shard_state = True",)))
    if setup.batch_size // 2 >= num_devices and (setup.batch_size // 2) % num_devices == 0:
        half = setup.batch_size // 2
        for s in (setup, head):
            if (half // num_devices) % s.microbatches == 0:
                out.append(dataclasses.replace(s, batch_size=half, label=s.label + f", batch {half}",
                                               settings=s.settings + (f"train.batch_size = {half}",)))
    seen, unique = set(), []
    for s in out:
        key = (s.label, s.settings)
        if key not in seen and s != setup:
            seen.add(key)
            unique.append(dataclasses.replace(s, budget_peak=0))  # (the budget is the run's own)
    return unique


# -- shapes ------------------------------------------------------------------------------------------------

def layer_param_shapes(model) -> list:
    """Every layer's ``param_shapes``, a tied leaf only in its owner's (as ``Model.init`` holds them)."""
    from revtrain.models.base import _without
    shapes = [layer.param_shapes for layer in model.layers]
    for t in model.ties:
        shapes[t.user] = _without(shapes[t.user], t.user_path)
    return shapes


def _shard_bytes(tree, n: int) -> int:
    """Bytes one device holds of ``tree`` when its large leaves are split over ``n`` devices."""
    from revtrain.placement import shard_axis
    total = 0
    for x in jax.tree.leaves(tree):
        b = _nbytes(x)
        total += b // n if shard_axis(x.shape, n) is not None else b
    return total


def _spec(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def _key(tree) -> str:
    return str(jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), tree))


@functools.lru_cache(maxsize=1)
def _mesh1() -> Mesh:
    return Mesh(np.asarray(jax.local_devices()[:1]), ("data",))


def _local(tree, b: int):
    """A batch tree's shapes with the leading axis set to ``b`` (one device's (micro)batch)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((b,) + tuple(x.shape[1:]), x.dtype), tree)


def _is_float(tree) -> bool:
    return all(jnp.issubdtype(x.dtype, jnp.inexact) for x in jax.tree.leaves(tree))


class _Programs:
    """One layer's programs on one device's (micro)batch, compiled on shapes; results cached per distinct
    (layer, input shapes, optimizer, kind). Each compile runs once per process."""

    def __init__(self):
        self.cache: dict = {}

    def _compile(self, key, fn, args, donate=()) -> int:
        """``temp_size_in_bytes`` of ``fn(*args)`` compiled on one device (inside ``shard_map`` over a
        one-device ``"data"`` mesh, so that layers averaging over it trace as in the trainers)."""
        if key not in self.cache:
            from revtrain.trainers.common import XLA_OPTIONS
            n = len(args)
            mapped = jax.shard_map(fn, mesh=_mesh1(), in_specs=(P(),) * n, out_specs=P(), check_vma=False)
            try:
                compiled = jax.jit(mapped, donate_argnums=donate, compiler_options=XLA_OPTIONS).lower(*args).compile()
                self.cache[key] = int(compiled.memory_analysis().temp_size_in_bytes)
            except Exception:  # noqa: BLE001 (a backend without memory analysis: no temporaries known)
                self.cache[key] = 0
        return self.cache[key]

    def forward(self, layer, params, state, x, keys, mode) -> int:
        """The forward program of a layer below the head in the reversible trainer: its backward mode's
        (`BackwardMode.forward`: a rebuild flavour's for a reversible layer, `modes.Remat`'s for a standard
        one; the fenced flavour's outputs its residuals too)."""
        def fn(p, s, x, k):
            return mode.forward(layer, p, s, x, k)
        return self._compile(("fwd", layer, _key(x), mode.name), fn, (params, state, x, keys))

    def backward(self, layer, params, opt, state, x, y, keys, tx, mode) -> int:
        """The reverse-and-update program of a layer below the head as the reversible trainer runs it: its
        backward mode's reverse-and-grad (`BackwardMode.grads`: from its output ``y`` for a rebuild, from its
        input ``x`` for `modes.Remat`), then `guarded_update` (a conditional on every tier), donating what the trainer's program donates (its `modes.ProgramSpec`)."""
        start = y if mode.rebuilds else x

        def fn(p, o, s, start, dy, k):
            x, dx, grads = mode.grads(layer, p, s, start, dy, k)
            return (x, dx) + guarded_update(tx, grads, o, p)
        donate = LayerPrograms._PER_LAYER[mode.program_kinds[1]].donate
        return self._compile(("bwd", layer, _key(x), id(tx), mode.name), fn,
                             (params, opt, state, start, y, keys), donate)

    def head(self, layer, params, opt, state, x, batch, keys, tx) -> int:
        """The head's program: the trainer's loss and vjp (`programs.LayerPrograms.head_grads`), then
        `guarded_update` (skipped unless the loss is finite too)."""
        def fn(p, o, s, x, batch, k):
            obj, grads, dx, _, _, _ = LayerPrograms.head_grads(layer, p, s, x, batch, k)
            new_p, new_o, finite = guarded_update(tx, grads, o, p, ok=jnp.isfinite(obj))
            return dx, new_p, new_o, finite
        return self._compile(("head", layer, _key(x), id(tx)), fn, (params, opt, state, x, batch, keys), (0, 1))

    def whole_step(self, model, setup: "Setup", params, opt, states, batch) -> int:
        """``temp_size_in_bytes`` of `StandardTrainer`'s whole step compiled for one device (on a 1.44 B
        Llama of 32 blocks: 12 s on two CPU cores); -1 when it does not compile."""
        from revtrain.trainers.standard import StandardTrainer
        key = ("step", id(model), _key(batch), id(setup.optimizer), setup.remat, setup.microbatches)
        if key not in self.cache:
            from revtrain.trainers.common import XLA_OPTIONS
            try:
                trainer = StandardTrainer(model, setup.optimizer, _mesh1(), scan_layers=setup.remat,
                                          remat_layers=setup.remat, microbatches=setup.microbatches)
                mapped = jax.shard_map(trainer._step, mesh=_mesh1(), in_specs=(P(), P(), P(), P("data"), P()),
                                       out_specs=(P(),) * 5)
                compiled = jax.jit(mapped, donate_argnums=(0, 1), compiler_options=XLA_OPTIONS).lower(
                    params, opt, states, batch, jax.ShapeDtypeStruct((2,), jnp.uint32)).compile()
                self.cache[key] = int(compiled.memory_analysis().temp_size_in_bytes)
            except Exception:  # noqa: BLE001 (fall back to the analytic bound)
                self.cache[key] = -1
        return self.cache[key]

    def eval_forward(self, layer, params, state, x) -> int:
        """``temp_size_in_bytes`` of ``layer``'s evaluation program at ``x`` (the trainers',
        `TrainerBase.eval_forward`)."""
        return self._compile(("eval", layer, _key(x)), functools.partial(TrainerBase.eval_forward, layer),
                             (params, state, x))

    def eval_head(self, layer, params, state, x, batch) -> int:
        """``temp_size_in_bytes`` of the head's evaluation program (its loss sums) at ``x`` (the trainers',
        `TrainerBase.eval_loss`)."""
        return self._compile(("eval_head", layer, _key(x)), functools.partial(TrainerBase.eval_loss, layer),
                             (params, state, x, batch))

    def residuals(self, layer, params, state, x, keys) -> int:
        """Bytes of the vjp residuals of ``layer`` at ``x`` (leaves of the pullback that are not inputs):
        what backprop keeps of this layer until its backward."""
        key = ("res", layer, _key(x))
        if key not in self.cache:
            found = []

            def fn(p, s, x, k):
                if _is_float(x):
                    _, vjp = jax.vjp(lambda p, x: layer.apply(p, s, x, k, True)[0], p, x)
                else:
                    _, vjp = jax.vjp(lambda p: layer.apply(p, s, x, k, True)[0], p)
                given = {id(a) for a in jax.tree.leaves((p, s, x, k))}
                found.append(sum(_nbytes(a) for a in jax.tree.leaves(vjp) if id(a) not in given))
                return jnp.zeros(())

            mapped = jax.shard_map(fn, mesh=_mesh1(), in_specs=(P(),) * 4, out_specs=P(), check_vma=False)
            jax.eval_shape(mapped, params, state, x, keys)
            self.cache[key] = found[0]
        return self.cache[key]

    def output(self, layer, params, state, x, keys):
        """The shapes of ``layer``'s output at ``x`` (training mode)."""
        key = ("out", layer, _key(x))
        if key not in self.cache:
            fn = jax.shard_map(lambda p, s, x, k: layer.apply(p, s, x, k, True)[0], mesh=_mesh1(),
                               in_specs=(P(),) * 4, out_specs=P(), check_vma=False)
            self.cache[key] = jax.eval_shape(fn, params, state, x, keys)
        return self.cache[key]


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
    io: dict | None = None  # the disk tier's step I/O (`_io`): bytes read, written, bandwidth, seconds
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
        text = f"; disk I/O a step: reads {gib(io['read_bytes'])}, writes {gib(io['write_bytes'])}"
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


def _state_bytes(setup: "Setup", pshapes: list, oshapes: list, n: int) -> tuple[int, int, list, list]:
    """``(weights, optimizer state, each layer's weights, each layer's weights + optimizer state)`` in bytes:
    the first two one device's share (split over ``n`` devices with ``shard_state``), the lists whole."""
    if setup.shard_state:
        weights = sum(_shard_bytes(p, n) for p in pshapes)
        opt = sum(_shard_bytes(o, n) for o in oshapes)
    else:
        weights, opt = _nbytes(pshapes), _nbytes(oshapes)
    layer_bytes = [_nbytes(p) for p in pshapes]
    return weights, opt, layer_bytes, [lb + _nbytes(o) for lb, o in zip(layer_bytes, oshapes)]


def plan(model, setup: Setup, batch_spec: dict, num_devices: int, *, limits: dict | None = None,
         programs: _Programs | None = None, platform: str | None = None, whole_step: bool = True,
         global_devices: int | None = None, eval_spec: dict | None = None, disk: dict | None = None) -> MemoryPlan:
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
      disk: the disk tier's ``{"directory", "keep", "every", "checkpoints"}`` (offload directory,
        ``train.keep_checkpoints``, ``train.checkpoint_every``, the checkpoints' directory: space the run holds
        already) for a ``setup.disk`` plan (default: ``./offload``, 3, 0, none).

    Returns:
      a `MemoryPlan`.
    """
    programs = programs or _Programs()
    platform = platform or jax.local_devices()[0].platform
    n = max(num_devices, 1)
    one_tier = platform == "cpu"  # (the CPU backend: device memory is host memory)
    shapes = _shapes_of(model, setup, batch_spec, n, global_devices)
    walk = _walk_programs(model, setup, shapes, programs)
    state = _state_bytes(setup, shapes.pshapes, shapes.oshapes, n)
    if setup.trainer == "standard":
        step = _standard_step(model, setup, shapes, walk, state, programs, whole_step)
    else:
        step = _reversible_step(setup, walk, state, shapes)
    tiers = _place(model, setup, step, state, n, one_tier)
    _phases(tiers, state_bytes=0 if step.on_disk else (state[0] + state[1]) * n, largest_layer=max(state[3]), n=n,
            state_tier="host" if one_tier or step.offload else "device",
            evaluation=_evaluation_bytes(model, programs, eval_spec, n, global_devices) if eval_spec else 0)
    io = None
    if step.on_disk:
        io = _disk_tier_and_io(model, setup, shapes, state, tiers, disk)
    elif step.offload:
        _host_tier_pinned(setup, tiers, state, step, n, platform, one_tier)
    return _against_limits(setup, tiers, limits, one_tier, disk, step.method, shapes.pshapes, io=io)


def _host_tier_pinned(setup: Setup, tiers: dict, state: tuple, step: "_Step", n: int, platform: str,
                      one_tier: bool) -> None:
    """The pinned host memory of the host tier (``offload``): the whole state where it lives there
    (`_pinned_state_tier`), else on an accelerator only the transfers in flight (`_pinned_tier`)."""
    from revtrain import pinned
    if (setup.host_kind or pinned.state_kind(platform)) == pinned.PINNED:
        _pinned_state_tier(tiers, state, step, n, platform, one_tier)
    elif not one_tier:
        _pinned_tier(setup, tiers, state)


def _pinned_state_tier(tiers: dict, state: tuple, step: "_Step", n: int, platform: str, one_tier: bool) -> None:
    """Adds the **pinned** tier of a state that lives in pinned host memory: every local device's share of the
    weights and optimizer state, the kept inputs (`HostResidency.keep`), the deferred update's buffers and the
    layer being written back beside its old copy (`streaming.HostStore.write`); on a GPU the pool beyond them
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
class _Shapes:
    """The shapes a plan is made from: one device's (micro)batch of ``b`` examples (``batch``, and its
    dropout ``keys``), each layer's weights (a tied leaf only in its owner, `layer_param_shapes`) and
    optimizer state."""

    b: int
    pshapes: list
    oshapes: list
    batch: dict
    keys: Any


def _shapes_of(model, setup: Setup, batch_spec: dict, n: int, global_devices: int | None) -> _Shapes:
    b = max(setup.batch_size // max(global_devices or n, 1) // setup.microbatches, 1)
    pshapes = layer_param_shapes(model)
    return _Shapes(b, pshapes, [jax.eval_shape(setup.optimizer.init, p) for p in pshapes], _local(batch_spec, b),
                   jax.ShapeDtypeStruct((b, 2), jnp.uint32))


@dataclasses.dataclass
class _Walk:
    """What `_walk_programs` finds layer by layer: every layer's input (``inputs``), the saved inputs of the
    reversible trainer's standard layers (``saved_std``, bytes), the residuals backprop keeps
    (``residuals``, bytes) and the compiled programs' temporaries (``temps``, bytes, 0 first)."""

    inputs: list
    saved_std: int
    residuals: int
    temps: list


def _walk_programs(model, setup: Setup, shapes: _Shapes, programs: _Programs) -> _Walk:
    """Per layer: input shapes, saved bytes, program temporaries (identical layers hit the caches)."""
    tx, keys, batch = setup.optimizer, shapes.keys, shapes.batch
    x = batch[model.input_key]
    walk = _Walk([], 0, 0, [0])
    for layer in model.layers:
        walk.inputs.append(x)
        p, s = layer.param_shapes, layer.state_shapes  # a tied leaf in both (what the layer computes on)
        o = jax.eval_shape(tx.init, p)
        if layer.is_head:
            walk.temps.append(programs.head(layer, p, o, s, x, batch, keys, tx))
            walk.residuals += _nbytes(x)
            break
        y = programs.output(layer, p, s, x, keys)
        if setup.trainer == "reversible":
            mode = REBUILDS[setup.rebuild] if layer.reversible else REMAT  # (the trainer's `rebuild_mode`)
            if not layer.reversible:
                walk.saved_std += _nbytes(x)
            walk.temps.append(programs.forward(layer, p, s, x, keys, mode))
            walk.temps.append(programs.backward(layer, p, o, s, x, y, keys, tx, mode))
        else:
            walk.residuals += _nbytes(x) if setup.remat else programs.residuals(layer, p, s, x, keys)
            mode = REBUILDS["exact"] if layer.reversible else REMAT
            walk.temps.append(programs.backward(layer, p, o, s, x, y, keys, tx, mode))
        x = y
    return walk


@dataclasses.dataclass
class _Step:
    """A step's transient parts (bytes: one device's gradients, activations, temporaries), how the
    temporaries were found (``method``), the saved inputs among the activations (``saved_std``) and where
    the state lives (``offload``: host memory; ``on_disk``: layer files)."""

    grads: int
    acts: int
    temp: int
    method: str
    saved_std: int = 0
    offload: bool = False
    on_disk: bool = False


def _standard_step(model, setup: Setup, shapes: _Shapes, walk: _Walk, state: tuple, programs: _Programs,
                   whole_step: bool) -> _Step:
    """`StandardTrainer`'s step: the whole tree's gradients (twice with microbatches), every layer's residuals
    and the batch; its compiled whole step's temporaries beyond those (``whole_step``), else the analytic
    bound."""
    weights, m, pshapes = state[0], setup.microbatches, shapes.pshapes
    grads = _nbytes(pshapes) * (2 if m > 1 else 1)
    batch_bytes = _nbytes(shapes.batch)
    acts = walk.residuals + batch_bytes
    whole = programs.whole_step(model, setup, pshapes, jax.eval_shape(setup.optimizer.init, pshapes),
                                [layer.state_shapes for layer in model.layers],
                                _local(shapes.batch, shapes.b * m)) if whole_step else -1
    if whole >= 0:  # the compiled step holds the gradients and residuals among its temporaries: split them
        grads = min(grads, whole)
        acts = min(walk.residuals, whole - grads) + batch_bytes
        temp = whole - grads - (acts - batch_bytes) + int(STANDARD_EXTRA_FRACTION * weights)
        method = "StandardTrainer's whole step compiled (temporaries beyond the gradients and residuals)"
    else:
        temp = max(walk.temps) + int(STANDARD_EXTRA_FRACTION * weights)
        method = ("analytic bound for StandardTrainer's whole step: residuals + gradients + the largest "
                  "one-layer backward program's temporaries (compiled)")
    return _Step(grads, acts, temp, method)


def _reversible_step(setup: Setup, walk: _Walk, state: tuple, shapes: _Shapes) -> _Step:
    """The reversible trainer's step: one layer's gradient (and the deferred update's whole-model buffer), the
    saved inputs, the current activation and its cotangent, the batch, and the largest compiled one-layer
    program's temporaries (the memory budget's planned peak as a floor under them)."""
    weights, opt, layer_bytes = state[0], state[1], state[2]
    grads = max(layer_bytes) + (weights if setup.deferred else 0)  # deferred: a buffer of the (local) weights' size
    acts = walk.saved_std + 2 * max(_nbytes(a) for a in walk.inputs) + _nbytes(shapes.batch)
    temp = max(walk.temps)
    method = "compiled one-layer programs (forward, backward, head)"
    if setup.budget_peak:  # the budget plan's step (backprop residuals, kept inputs) as a floor
        on_device = ((0 if setup.offload else weights + opt + grads) + acts
                     - (walk.saved_std if setup.offload else 0))
        temp = max(temp, setup.budget_peak - on_device)
        method += "; the memory budget's plan of the step (revtrain.trainers.budget) as a floor"
    return _Step(grads, acts, temp, method, walk.saved_std, setup.offload, setup.disk)


def _place(model, setup: Setup, step: _Step, state: tuple, n: int, one_tier: bool) -> dict:
    """The tiers (``{"device": parts, "host": parts}``, or only ``"host"`` on the CPU backend, where the device
    parts are in host RAM too, once per local device) with the state and the step's parts where the trainer
    holds them (`PARTS`; what a save and an evaluation add is `_phases`')."""
    weights, opt, layer_bytes, layer_state = state
    one_layer, acts, temp = max(layer_bytes), step.acts, step.temp
    device = dict.fromkeys(PARTS, 0)
    host = dict.fromkeys(PARTS, 0)
    host["runtime"] = RUNTIME_BYTES
    if step.on_disk:
        # The layers in flight: the one computing and the one read ahead (on the device), the one being written
        # (its host copy). The saved inputs and the current activation stay on the device. A layer is read
        # only once the program before it has run (`streaming.StepStream`), so a program's temporaries (its
        # gradient among them: compiled) and the layer read ahead are never live together: in flight is the
        # more of three layers and two layers plus the temporaries.
        lw, lo = max(layer_bytes), max(layer_state) - max(layer_bytes)
        if setup.shard_state:  # each device holds its piece of a layer read (`disk_tier.placer`)
            lw, lo = -(-lw // n), -(-lo // n)
        device["weights"], device["optimizer_state"] = 2 * lw, 2 * lo
        host["weights"], host["optimizer_state"] = lw, lo
        if setup.deferred:  # the deferred update's buffers: in files, in flight beside their layers' weights
            device["gradients"] = 2 * lw + _tied_bytes(model)  # (and the tied leaves' other use, held all step)
            host["gradients"] = lw  # (being written)
        device["activations"] = acts
        temp = max(0, temp - max(layer_state))
    elif step.offload:
        # Host: every local device's share of the state (one copy with shard_state), saved inputs, and the
        # deferred gradient buffer (it lives where the state lives). Device: the layers in flight, one
        # layer's gradient (two buffers of the deferred update), the current activation, temporaries.
        host["weights"], host["optimizer_state"] = weights * n, opt * n
        host["activations"] = step.saved_std * n
        host["gradients"] = (step.grads - one_layer) * n
        # The layer computing, those fetched ahead and the one being written back (`revtrain.streaming`).
        from revtrain.streaming import HostStore
        lw, lo = max(layer_bytes), max(layer_state) - max(layer_bytes)
        if setup.shard_state:
            lw, lo = -(-lw // n), -(-lo // n)
        flight = 2 + HostStore.read_ahead
        device["weights"], device["optimizer_state"] = flight * lw, flight * lo
        # A deferred update's buffers live in the store too: two in flight beside their layers' weights (and
        # the tied leaves' other use, held all step); else one layer's gradient.
        device["gradients"] = 2 * lw + _tied_bytes(model) if setup.deferred else one_layer
        device["activations"] = acts - step.saved_std
    else:
        device.update(weights=weights, optimizer_state=opt, gradients=step.grads, activations=acts)
    device["temporaries"] = temp
    if one_tier:  # the device parts are in host RAM too, once per local device
        for k in ("weights", "optimizer_state", "gradients", "activations", "temporaries"):
            host[k] += device[k] * n
        return {"host": host}
    return {"device": {k: v for k, v in device.items() if k != "runtime"}, "host": host}


def _disk_directory(disk: dict | None) -> tuple[dict, str]:
    """The disk tier's spec (`plan`'s ``disk``; {} when None) and offload directory (default ``./offload``)."""
    spec = disk or {}
    return spec, spec.get("directory") or os.path.join(os.getcwd(), "offload")


def _disk_tier(setup: Setup, shapes: _Shapes, state: tuple, tiers: dict, disk: dict | None) -> tuple:
    """Adds the disk tier to ``tiers``, from shapes alone (the plan's and the floor's alike): two steps' layer
    files (whole layers), the kept checkpoints beyond them and the deferred update's buffer files (a layer's old
    and new file at most, per microbatch). Returns ``(weights, optimizer state, per-layer bytes)`` of the
    files."""
    from revtrain import disk_tier
    spec, _ = _disk_directory(disk)
    weights, opt, layer_bytes = state[0], state[1], state[2]
    if setup.shard_state:  # the files hold whole layers
        weights, opt = _nbytes(shapes.pshapes), _nbytes(shapes.oshapes)
    _, beyond = disk_tier.disk_need(weights + opt, spec.get("keep", 3), spec.get("every", 0))
    tiers["disk"] = {"weights": 2 * weights, "optimizer_state": 2 * opt, "checkpoint": beyond}
    if setup.deferred:
        tiers["disk"]["gradients"] = 2 * weights
    return weights, opt, layer_bytes


def _disk_tier_and_io(model, setup: Setup, shapes: _Shapes, state: tuple, tiers: dict, disk: dict | None) -> dict:
    """Adds the disk tier to ``tiers`` (two steps' layer files, the kept checkpoints beyond them, the deferred
    update's buffer files) and returns the step's reads and writes (`_io`)."""
    from revtrain import disk_tier
    _, directory = _disk_directory(disk)
    weights, opt, layer_bytes = _disk_tier(setup, shapes, state, tiers, disk)
    if setup.deferred:
        owned = sum(layer_bytes[o] for o in {t.owner for t in model.ties})
        read, write = disk_tier.deferred_io(weights, opt, layer_bytes[-1], owned, setup.microbatches,
                                            _rounds(setup.optimizer, model) + 1)
        return _io(read, write, disk_tier.bandwidth(directory))
    # Reads: every layer's weights in the forward (but the head's), every layer's state in the backward.
    return _io(2 * weights + opt - layer_bytes[-1], weights + opt, disk_tier.bandwidth(directory))


def _against_limits(setup: Setup, tiers: dict, limits: dict | None, one_tier: bool, disk: dict | None, method: str,
                    pshapes: list, io: dict | None = None, floor: bool = False) -> MemoryPlan:
    """The `MemoryPlan` of ``tiers`` against ``limits`` (default: the process's host limit, the device's, the
    disk tier's free space, the pinned host pool)."""
    if limits is None:
        limits = {"host": host_limit()}
        if not one_tier:
            limits["device"] = device_limit()
    limits = dict(limits)
    if "disk" in tiers and "disk" not in limits:
        from revtrain import disk_tier
        spec, directory = _disk_directory(disk)
        limits["disk"] = disk_tier.disk_free(directory, [d for d in (spec.get("checkpoints"),) if d])
    if "pinned" in tiers and "pinned" not in limits:
        limits["pinned"] = ((limits["host"][0], "pinned host memory is host RAM on the CPU backend") if one_tier
                            else pinned_limit())
    num_params = sum(int(np.prod(x.shape, dtype=np.int64)) for x in jax.tree.leaves(pshapes))
    return MemoryPlan(setup, tiers, {t: limits[t][0] for t in tiers}, {t: limits[t][1] for t in tiers}, method,
                      num_params, io, floor=floor)


def _io(read: int, write: int, bandwidth: dict) -> dict:
    """A disk-tier step's I/O: bytes read and written, the disk's bandwidth, the seconds I/O alone takes."""
    r, w = bandwidth.get("read"), bandwidth.get("write")
    seconds = read / r + write / w if r and w else None
    return {"read_bytes": read, "write_bytes": write, "read_bandwidth": r, "write_bandwidth": w,
            "seconds": seconds, "bandwidth_source": bandwidth.get("source", "")}


# -- the floor: shapes alone ---------------------------------------------------------------------------------

FLOOR_METHOD = "from shapes alone, nothing compiled"


def floor(model, setup: Setup, batch_spec: dict, num_devices: int, *, limits: dict | None = None,
          programs: _Programs | None = None, platform: str | None = None, global_devices: int | None = None,
          disk: dict | None = None) -> MemoryPlan:
    """The least `plan` says for ``setup``, from shapes alone: no program is compiled (a second or less).

    Each tier gets, in the places `plan` puts them (the host with offload, the layers in flight and the disk
    with the disk tier, one device's share with ``shard_state``), the parts `plan` finds without compiling:

    * **weights** (the layers' ``param_shapes``, a tied leaf once) and **optimizer state**
      (``jax.eval_shape(tx.init, ...)`` of each layer's);
    * **gradients**: `StandardTrainer`'s whole tree (once, even with microbatches); the reversible trainer's
      one layer, plus the deferred update's whole-model buffer where the setup has one;
    * **activations**: the reversible trainer's as `plan` counts them (the saved inputs of its standard
      layers, the current activation and its cotangent, the batch: the layers' output shapes, traced with
      ``jax.eval_shape`` by `_Programs.output`, cached in ``programs`` for a later `plan`); none of
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
      model, setup, batch_spec, num_devices, limits, programs, platform, global_devices, disk: as for `plan`.

    Returns:
      a `MemoryPlan` with ``floor=True`` and ``method`` `FLOOR_METHOD` (no ``io``).
    """
    programs = programs or _Programs()
    platform = platform or jax.local_devices()[0].platform
    n = max(num_devices, 1)
    one_tier = platform == "cpu"
    reversible = setup.trainer == "reversible"
    shapes = _shapes_of(model, setup, batch_spec, n, global_devices)
    state = _state_bytes(setup, shapes.pshapes, shapes.oshapes, n)
    if reversible:  # its activations, as `plan` counts them (traced)
        saved_std, largest = _traced_inputs(model, shapes, programs)
        step = _Step(max(state[2]) + (state[0] if setup.deferred else 0),
                     saved_std + 2 * largest + _nbytes(shapes.batch), 0, FLOOR_METHOD, saved_std, setup.offload,
                     setup.disk)
    else:
        step = _Step(_nbytes(shapes.pshapes), 0, int(STANDARD_EXTRA_FRACTION * state[0]), FLOOR_METHOD)
    tiers = _place(model, setup, step, state, n, one_tier)
    if step.on_disk:  # the plan's disk tier whole: it needs shapes only
        _disk_tier(setup, shapes, state, tiers, disk)
    elif step.offload:
        _host_tier_pinned(setup, tiers, state, step, n, platform, one_tier)
    return _against_limits(setup, tiers, limits, one_tier, disk, FLOOR_METHOD, shapes.pshapes, floor=True)


def _traced_inputs(model, shapes: _Shapes, programs: _Programs) -> tuple[int, int]:
    """The reversible trainer's saved inputs of its standard layers and its largest layer input (bytes), from
    the layers' output shapes (traced with ``jax.eval_shape`` by `_Programs.output`, nothing compiled)."""
    x, inputs, saved_std = shapes.batch[model.input_key], [], 0
    for layer in model.layers:
        inputs.append(x)
        if layer.is_head:
            break
        if not layer.reversible:
            saved_std += _nbytes(x)
        x = programs.output(layer, layer.param_shapes, layer.state_shapes, x, shapes.keys)
    return saved_std, max(_nbytes(a) for a in inputs)


def floor_run(run, limits: dict | None = None, programs: _Programs | None = None) -> MemoryPlan:
    """The `floor` of a built run (`revtrain.run.build`): its model, trainer and batch."""
    spec = run.task.input_spec(run.cfg.batch_size)
    if spec is None:  # (`plan_run` says why there is no plan)
        return plan_run(run, limits, programs)
    return floor(run.model, setup_of(run.trainer, run.cfg.batch_size), spec,
                 _local_devices(run.mesh), limits=limits, programs=programs, global_devices=run.mesh.size,
                 disk=_disk_spec(run))


def _evaluation_bytes(model, programs: _Programs, spec: dict, n: int, global_devices: int | None) -> int:
    """Bytes one device holds beyond the state while it evaluates (layer by layer, in evaluation mode): the
    largest compiled per-layer evaluation program's temporaries, its input and output, and one device's
    evaluation batch (``spec``: the global evaluation batch's shapes)."""
    lead = jax.tree.leaves(spec)[0].shape[0]
    batch = _local(spec, max(lead // max(global_devices or n, 1), 1))
    keys = jax.ShapeDtypeStruct((jax.tree.leaves(batch)[0].shape[0], 2), jnp.uint32)
    x, temps, acts = batch[model.input_key], [0], [0]
    for layer in model.layers:
        p, s = layer.param_shapes, layer.state_shapes
        if layer.is_head:
            temps.append(programs.eval_head(layer, p, s, x, batch))
            acts.append(_nbytes(x))
            break
        temps.append(programs.eval_forward(layer, p, s, x))
        y = programs.output(layer, p, s, x, keys)
        acts.append(_nbytes(x) + _nbytes(y))
        x = y
    return max(temps) + max(acts) + _nbytes(batch)


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


def _host_memory_supported(mesh) -> bool:
    from revtrain.placement import host_memory_supported
    return host_memory_supported(mesh)


def plan_budget(run):
    """The run's memory budget plan (`revtrain.trainers.budget.BudgetPlan`) when its trainer has
    ``memory_budget``, else None: the trainer's own planner on the run's batch shapes, as ``revtrain train``
    runs it before placing the state (the blocks' modes are set on the trainer, so `plan_run` then counts the
    plan's expected peak: `Setup.budget_peak`). Its log line is left to the caller. None also for a task
    without ``input_spec`` (``train`` then plans at its first step).

    Raises:
      TrainerError: the budget is below the least any plan needs (one line naming that least budget).
    """
    if run.trainer.memory_budget is None:
        return None
    spec = run.task.input_spec(run.cfg.batch_size)
    if spec is None:
        return None
    from revtrain import metrics as metrics_lib
    with metrics_lib.silenced():
        return run.trainer.plan_budget(spec)


def plan_run(run, limits: dict | None = None, programs: _Programs | None = None) -> MemoryPlan:
    """The plan of a built run (`revtrain.run.build`): its model, trainer and batch."""
    local = _local_devices(run.mesh)
    spec = run.task.input_spec(run.cfg.batch_size)
    if spec is None:
        raise MemoryPlanError(f"{type(run.task).__name__} has no input_spec: the memory plan needs the batch's "
                              "shapes (train.memory_plan = False skips it)")
    return plan(run.model, setup_of(run.trainer, run.cfg.batch_size), spec, local, limits=limits,
                programs=programs, global_devices=run.mesh.size, eval_spec=_eval_spec(run), disk=_disk_spec(run))


def _disk_spec(run) -> dict:
    """The disk tier's directory (the trainer's, else ``./offload``), kept checkpoints and checkpoint period."""
    tier = run.trainer.residency.disk  # (None: no disk tier)
    directory = (tier.directory if tier is not None else None) or os.path.join(os.getcwd(), "offload")
    workdir = tier.workdir if tier is not None else None
    return {"directory": directory, "keep": run.cfg.keep_checkpoints, "every": run.cfg.checkpoint_every,
            "checkpoints": os.path.join(workdir, "checkpoints") if workdir else None}


def _eval_spec(run) -> dict | None:
    """The shapes of the run's evaluation batch (``evaluate.batch_size``), or None without them."""
    ecfg = getattr(run, "ecfg", None)
    return run.task.input_spec(ecfg.batch_size) if ecfg is not None else None


def _local_devices(mesh) -> int:
    return len([d for d in mesh.devices.flat if d.process_index == jax.process_index()])


def choices(run, limits: dict | None = None, programs: _Programs | None = None,
            own: MemoryPlan | None = None, with_standard: bool = False, least: bool = False) -> list[MemoryPlan]:
    """The run's own plan first, then each alternative of `alternatives` (one compile cache for all).

    Each choice is first planned from shapes (`floor`, nothing compiled): one whose floor exceeds a limit is
    that floor in the list (it does not fit; no program is compiled for it), and only the others are planned
    with compiled programs (`plan`, all sharing ``programs``). A floor is never more than the plan, so the
    choices marked as fitting are exactly those the compiled plans would mark: the list may omit none that fits.
    The run's own plan (when ``own`` is not given) is made the same way.

    ``with_standard``: a run of the reversible trainer also gets a StandardTrainer row (same optimizer, batch
    and microbatches; `revtrain plan`'s table). A refusal never names it, since it needs more than the
    reversible trainer: its plan compiles the whole step, which takes seconds on a large model.

    ``least``: only what `refusal` names (it names the least settings that fit): a choice whose settings add
    to those of a choice that fits is neither planned nor listed (choices are planned fewest settings first),
    so `refusal` of the shorter list says the same line.
    """
    programs = programs or _Programs()
    limits = limits or _limits()
    if own is None:
        own = floor_run(run, limits, programs)
        if own.fits:
            own = plan_run(run, limits, programs)
    local = _local_devices(run.mesh)
    spec = run.task.input_spec(run.cfg.batch_size)
    setups = alternatives(own.setup, run.model, local, _host_memory_supported(run.mesh))
    if with_standard and own.setup.trainer == "reversible":
        setups.insert(0, Setup("standard", own.setup.optimizer, own.setup.batch_size, own.setup.microbatches,
                               label="StandardTrainer", settings=("train.trainer = @StandardTrainer",)))
    planned: dict[int, MemoryPlan] = {}
    for i in sorted(range(len(setups)), key=lambda i: len(setups[i].settings)):
        s = setups[i]
        if least and any(p.fits and set(p.setup.settings) < set(s.settings) for p in planned.values()):
            continue
        shapes_only = floor(run.model, s, spec, local, limits=limits, programs=programs,
                            global_devices=run.mesh.size, disk=_disk_spec(run))
        planned[i] = shapes_only if not shapes_only.fits else plan(
            run.model, s, spec, local, limits=limits, programs=programs, global_devices=run.mesh.size,
            eval_spec=_eval_spec(run), disk=_disk_spec(run))
    return [own] + [planned[i] for i in sorted(planned)]


def _limits() -> dict:
    limits = {"host": host_limit()}
    device = device_limit()
    if device[0] is not None or jax.local_devices()[0].platform != "cpu":
        limits["device"] = device
    return limits


def _short_tier(own: MemoryPlan) -> str:
    """The first tier of ``own`` that does not fit (the one its refusal names)."""
    return next(t for t in own.tiers if not own.fits_tier(t))


def refusal(own: MemoryPlan, others: list[MemoryPlan]) -> str:
    """The one-line refusal: what does not fit, by how much, its parts, and the settings that would fit."""
    tier = _short_tier(own)
    parts = ", ".join(f"{k.replace('_', ' ')} {gib(v)}" for k, v in own.tiers[tier].items() if v)
    if tier == "disk":
        return (f"the memory plan does not fit: {own.setup.label} {own.shortfall()} ({parts}: two steps' layer "
                "files and the kept checkpoints beyond them); free disk space, lower train.keep_checkpoints, set "
                "train.checkpoint_every = 1 (the newest checkpoint then shares the live files) or put "
                "ReversibleTrainer.offload_dir on a larger disk; train.memory_plan = False skips this check")
    if tier == "pinned" and "pool" in own.tiers["pinned"]:  # the state in XLA's pinned pool (a GPU)
        from revtrain import pinned
        need = sum(v for k, v in own.tiers["pinned"].items() if k != "pool")
        return (f"the memory plan does not fit: {own.setup.label} {own.shortfall()} ({parts}); set "
                f"{pinned.LIMIT_ENV}={pinned.limit_gb_for(need)} (revtrain train sizes the pool from the state "
                "alone: kept inputs and deferred buffers come on top), or use ReversibleTrainer.offload = 'disk'; "
                "train.memory_plan = False skips this check")
    fitting = [p for p in others if p.fits]
    # The least that fits: a choice that adds settings to one that fits already is left out.
    fitting = [p for p in fitting if not any(q is not p and set(q.setup.settings) < set(p.setup.settings)
                                             for q in fitting)]
    if fitting:
        ways = "; ".join(f"{', '.join(p.setup.settings)} ({gib(p.total(tier) if tier in p.tiers else 0)})"
                         for p in fitting[:4])
        hint = f"these settings would fit: {ways}"
    elif own.limits.get("host") is not None and own.limits["host"] <= RUNTIME_BYTES * 5 // 4:
        # The runtime alone (imports, backend, data pipeline) takes 80% of the limit or more: no model fits.
        hint = (f"this process's runtime alone takes about {gib(RUNTIME_BYTES)}: raise the memory limit (a "
                "smaller model would not fit either)")
    else:
        hint = "none of the trainer choices fits here (revtrain plan --config ... shows them); use a smaller model"
    return (f"the memory plan does not fit: {own.setup.label} {own.shortfall()} ({parts}); {hint}; "
            "train.memory_plan = False skips this check")


def table(plans: list[MemoryPlan]) -> str:
    """A table of plans (one row per trainer choice, one column per part of each tier, GiB)."""
    tiers = list(dict.fromkeys(t for pl in plans for t in pl.tiers))
    head = ["choice"]
    for t in tiers:
        head += [f"{t}:{p}" for p in TABLE_PARTS if any(pl.tiers.get(t, {}).get(p) for pl in plans)] + [f"{t}:total"]
    head += ["fits"]
    rows = []
    for pl in plans:
        row = [pl.setup.label]
        for t in tiers:
            row += [f"{pl.tiers.get(t, {}).get(p, 0) / 2**30:.3f}" for p in TABLE_PARTS
                    if any(q.tiers.get(t, {}).get(p) for q in plans)]
            row += [f"{pl.total(t) / 2**30:.3f}" if t in pl.tiers else "-"]
        row += ["yes" if pl.fits else "no"]
        rows.append(row)
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in [head] + rows]
    def limit_of(t):
        pl = next(q for q in plans if t in q.tiers)
        return (f"{t} limit {gib(pl.limits[t])} ({pl.sources[t]})" if pl.limits[t] is not None
                else f"{t} limit unknown ({pl.sources[t]})")
    limit = "; ".join(limit_of(t) for t in tiers)
    compiled = [pl for pl in plans if not pl.floor]
    note = f"temporaries: {(compiled or plans)[0].method}"
    if any(pl.floor for pl in plans):
        note += "; " + ", ".join(pl.setup.label for pl in plans if pl.floor) + f": {FLOOR_METHOD} (a lower bound)"
    return "\n".join(lines + [f"(GiB; {limit}; {note})"])


def check_everywhere(run, log=None, limits: dict | None = None) -> MemoryPlan | None:
    """Plans ``run`` on every process; returns this process's plan when every process's fits (``log``
    gets its line then), None for a task without ``input_spec`` (nothing to plan from).

    The run is first planned from shapes (`floor`): when its weights, optimizer state and gradients alone
    exceed a limit it is refused from them, before any program is compiled (seconds instead of the
    minutes StandardTrainer's whole step takes to compile on a large model), and the refusal's alternatives
    are planned as `choices` does with ``least=True``. ``limits``: ``{tier: (bytes, source)}`` instead of
    the process's own (`host_limit`, `device_limit`).

    Raises:
      MemoryPlanError: this process's plan does not fit (one line with the figures and the settings that
        would fit), or another process's does not.
    """
    if run.task.input_spec(run.cfg.batch_size) is None:  # a task that cannot say its batch's shapes: no plan
        if log is not None:
            log(f"memory plan: skipped ({type(run.task).__name__} has no input_spec)")
        return None
    limits, programs = limits or _limits(), _Programs()
    own = floor_run(run, limits, programs)
    if own.fits:
        own = plan_run(run, limits, programs)
    fits = [own.fits]
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        fits = [bool(f) for f in np.asarray(multihost_utils.process_allgather(np.int32(own.fits))).reshape(-1)]
    if not own.fits:  # (a disk that is too small names no other trainer choice: none is planned)
        others = [] if _short_tier(own) == "disk" else choices(run, limits, programs, own, least=True)[1:]
        raise MemoryPlanError(refusal(own, others))
    if not all(fits):
        bad = ", ".join(str(i) for i, f in enumerate(fits) if not f)
        raise MemoryPlanError(f"the memory plan does not fit on process(es) {bad} (their line says by how much); "
                              "train.memory_plan = False skips this check")
    if log is not None:
        log(own.line())
    return own
