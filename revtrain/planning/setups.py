"""The trainer choices a memory plan compares: `Setup` (the settings a plan depends on), the run's own
(`setup_of`, from the trainer's `memory_setup`) and the `alternatives` a table lists and a refusal names."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from revtrain import optstate
from revtrain.planning.shapes import layer_param_shapes

# -- the trainer choices -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Setup:
    """The settings a plan depends on (one trainer choice).

    Attributes:
      trainer: ``"standard"`` or ``"reversible"``.
      optimizer: the optax ``GradientTransformation`` (its state's shapes).
      batch_size: the global batch, in examples.
      microbatches: M (each device's share runs as M microbatches).
      tier: where weights and optimizer state live between uses: the tier object (`revtrain.tiers.Tier`; the
        trainer's ``residency``), which the plan asks (`Tier.state_memory`, `Tier.store_parts`, ...). None:
        the device tier on this process's devices (`tier_of`).
      shard_state: reversible: large leaves split over the devices (1/N each).
      deferred: reversible: the deferred update (a whole-model gradient buffer).
      remat: standard: ``scan_layers`` and ``remat_layers`` (only each layer's input is kept).
      rebuild: reversible: a rebuild flavour's name (`revtrain.trainers.modes.REBUILDS`: the backward program
        compiled).
      label: how a table names it (``"ReversibleTrainer + offload"``).
      settings: the gin bindings that select it, beyond the run's own.
      budget_peak: reversible with ``memory_budget``: the budget plan's expected peak device bytes of a step
        (`revtrain.planning.budget`; 0: none), a floor under the device parts of the step.
    """

    trainer: str
    optimizer: Any
    batch_size: int
    microbatches: int = 1
    tier: Any = None
    shard_state: bool = False
    deferred: bool = False
    remat: bool = False
    rebuild: str = "exact"
    label: str = ""
    settings: tuple = ()
    budget_peak: int = 0


_DEVICE: list = []  # the device tier of a `Setup` that names none (made once)


def tier_of(setup: Setup):
    """The tier object ``setup`` plans (`Setup.tier`; the device tier on this process's devices when None)."""
    if setup.tier is not None:
        return setup.tier
    if not _DEVICE:
        from revtrain.placement import make_mesh
        from revtrain.tiers import lookup
        _DEVICE.append(lookup(False)(make_mesh(jax.local_devices())))
    return _DEVICE[0]


def store_tiers() -> list:
    """The registered tier classes whose state waits in a store of their own, not in memory
    (`revtrain.tiers.base.Tier.state_memory` None; the disk tier among the built-in ones), in registration
    order: the planners ask the registry for them instead of naming one."""
    from revtrain import tiers
    return [cls for cls in map(tiers.lookup, tiers.names()) if cls.state_memory is None]


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


def rounds(tx, model) -> int:
    """The deferred update's statistics passes under ``tx`` (`LayerwiseUpdate.rounds`, at least one)."""
    from revtrain.trainers.layerwise import CoupledUpdateError, LayerwiseUpdate
    try:
        return max(LayerwiseUpdate(tx, layer_param_shapes(model)).rounds, 1)
    except CoupledUpdateError:
        return 1


_HVP: dict = {}  # `takes_hvp`'s answers, by optimizer and parameter shapes


def takes_hvp(optimizer, pshapes) -> bool:
    """Whether ``optimizer`` reads Hessian-vector products (optax's Hutchinson estimator: sophia;
    `revtrain.optstate.takes_hvp`) on parameters shaped ``pshapes`` (one tree per layer), traced once per
    optimizer and shapes."""
    key = (id(optimizer), jax.tree.structure(pshapes), tuple(x.shape for x in jax.tree.leaves(pshapes)))
    if key not in _HVP:
        _HVP[key] = optstate.takes_hvp(optstate.keep_states(optimizer), pshapes)
    return _HVP[key]


def alternatives(setup: Setup, model, num_devices: int, host_offload: bool) -> list[Setup]:
    """The trainer choices a table compares with ``setup`` and a refusal may name: the reversible trainer,
    with offload (``host_offload``: the backend has host memory), Adafactor, microbatches, ``shard_state``
    (several devices), half the batch. Each carries the gin bindings that select it (``settings``)."""
    out, rev = [], setup.trainer == "reversible"
    hvp = takes_hvp(setup.optimizer, layer_param_shapes(model))
    if hvp and not rev and model.ties:
        # (Sophia's products: the reversible trainer refuses tied layers, so no choice of it is offered)
        return _unique([h for h in [_halved(setup, num_devices)] if h is not None], setup)
    base_rev = setup if rev else dataclasses.replace(
        setup, trainer="reversible", remat=False, label="ReversibleTrainer",
        settings=("train.trainer = @ReversibleTrainer",),
        deferred=setup.microbatches > 1 or bool(model.ties) or not _separable(setup.optimizer, model))
    if hvp and base_rev.microbatches > 1:  # (Sophia's products: the reversible trainer takes one batch a step)
        base_rev = dataclasses.replace(base_rev, microbatches=1, label=base_rev.label + " (1 microbatch)",
                                       settings=base_rev.settings + ("train.microbatches = 1",))
    out.append(base_rev)
    tier = tier_of(base_rev)
    # The other tiers (`Tier.peer`): the host's where the backend has host memory, then the first registered one
    # with a store of its own (`store_tiers`: the disk's), which holds whole layers (no shard_state).
    if host_offload and tier.state_memory != "host":
        host = tier.peer("host")
        label = ("ReversibleTrainer" if tier.state_memory is None else base_rev.label) + host.label
        out.append(dataclasses.replace(base_rev, tier=host, label=label,
                                       settings=base_rev.settings + (f"ReversibleTrainer.offload = {host.gin_value!r}",)))
    head = out[-1]  # the leanest so far: the next choices add to it
    stores = store_tiers()
    if tier.state_memory is not None and not base_rev.shard_state and stores:
        store = tier.peer(stores[0].name)
        out.append(dataclasses.replace(base_rev, tier=store, label="ReversibleTrainer" + store.label,
                                       settings=base_rev.settings + (f"ReversibleTrainer.offload = {store.gin_value!r}",)))
    if not _factored(setup.optimizer):  # (an Adafactor run is offered no "+ Adafactor")
        ada = optax.adafactor(1e-3)
        out.append(dataclasses.replace(head, optimizer=ada, label=head.label + " + Adafactor",
                                       deferred=head.deferred or head.shard_state,
                                       settings=head.settings + ("train.optimizer = @optax.adafactor",)))
    local = setup.batch_size // max(num_devices, 1)
    # (no microbatches with the Hutchinson estimator's products: the reversible trainer refuses them)
    if local % (2 * setup.microbatches) == 0 and not hvp:
        m = 2 * setup.microbatches
        out.append(dataclasses.replace(head, microbatches=m, deferred=True, label=head.label + f" + {m} microbatches",
                                       settings=head.settings + (f"train.microbatches = {m}",)))
    if num_devices > 1 and not head.shard_state:
        out.append(dataclasses.replace(head, shard_state=True, label=head.label + " + shard_state",
                                       settings=head.settings + ("ReversibleTrainer.shard_state = True",)))
    out += [h for h in (_halved(setup, num_devices), _halved(head, num_devices)) if h is not None]
    return _unique(out, setup)


def _halved(setup: Setup, num_devices: int) -> Setup | None:
    """``setup`` with half its batch, or None where half no longer splits over the devices and microbatches."""
    half = setup.batch_size // 2
    if half < num_devices or half % num_devices or (half // num_devices) % setup.microbatches:
        return None
    return dataclasses.replace(setup, batch_size=half, label=setup.label + f", batch {half}",
                               settings=setup.settings + (f"train.batch_size = {half}",))


def _unique(out: list, setup: Setup) -> list:
    """``out`` without repeats and without ``setup`` itself, each without the run's own budget plan."""
    seen, unique = set(), []
    for s in out:
        key = (s.label, s.settings)
        if key not in seen and s != setup:
            seen.add(key)
            unique.append(dataclasses.replace(s, budget_peak=0))  # (the budget is the run's own)
    return unique
