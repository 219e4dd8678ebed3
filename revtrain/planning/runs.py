"""The plans of a built run (`revtrain.run.build`): its own plan and floor, the choices a table lists, the
check ``revtrain train`` runs before placing the state, and the memory budget's plan as ``train`` makes it."""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np

from revtrain.limits import device_limit, gib, host_limit
from revtrain.tiers.registry import BUILTIN
from revtrain.planning.setups import Setup, alternatives, setup_of
from revtrain.planning.costs import PlanPrograms
from revtrain.planning.memory import MemoryPlan, MemoryPlanError, floor, plan
from revtrain.planning.report import refusal, short_tier

def _host_memory_supported(mesh) -> bool:
    from revtrain.placement import host_memory_supported
    return host_memory_supported(mesh)


def plan_budget(run, quiet: bool = True):
    """The run's memory budget plan (`revtrain.planning.budget.BudgetPlan`) when its trainer has
    ``memory_budget``, else None: the trainer's own planner on the run's batch shapes, as ``revtrain train``
    runs it before placing the state (the blocks' modes are set on the trainer, so `plan_run` then counts the
    plan's expected peak: `Setup.budget_peak`). ``quiet``: its log line is left to the caller (``revtrain
    plan``); else logged (``revtrain train``). None also for a task without ``input_spec`` (the trainer then
    plans at its first step, from the batch).

    Raises:
      TrainerError: the budget is below the least any plan needs (one line naming that least budget).
    """
    if run.trainer.memory_budget is None:
        return None
    spec = run.task.input_spec(run.cfg.batch_size)
    if spec is None:
        return None
    if not quiet:
        return run.trainer.plan_budget(spec)
    from revtrain import metrics as metrics_lib
    with metrics_lib.silenced():
        return run.trainer.plan_budget(spec)


def programs_of(run) -> PlanPrograms:
    """The programs a plan of ``run`` compiles: its own trainer's for its own choice (the run then finds them
    compiled), one device's for the others (`PlanPrograms`)."""
    return PlanPrograms(run.trainer, setup_of(run.trainer, run.cfg.batch_size))


def plan_run(run, limits: dict | None = None, programs: PlanPrograms | None = None) -> MemoryPlan:
    """The plan of a built run (`revtrain.run.build`): its model, trainer and batch."""
    local = _local_devices(run.mesh)
    spec = run.task.input_spec(run.cfg.batch_size)
    if spec is None:
        raise MemoryPlanError(f"{type(run.task).__name__} has no input_spec: the memory plan needs the batch's "
                              "shapes (train.memory_plan = False skips it)")
    return plan(run.model, setup_of(run.trainer, run.cfg.batch_size), spec, local, limits=limits,
                programs=programs if programs is not None else programs_of(run), global_devices=run.mesh.size,
                eval_spec=_eval_spec(run), store=_store_spec(run))


def _store_spec(run) -> dict:
    """What a tier with a store of its own counts beyond its files (`Tier.store_parts`, `Tier.capacity`): the
    run's kept checkpoints, checkpoint period and checkpoints' directory (under the workdir its tier was
    attached to; space the run holds already)."""
    workdir = run.trainer.residency.workdir
    return {"keep": run.cfg.keep_checkpoints, "every": run.cfg.checkpoint_every,
            "checkpoints": os.path.join(os.path.abspath(workdir), "checkpoints") if workdir else None}


def _eval_spec(run) -> dict | None:
    """The shapes of the run's global evaluation batch (``evaluate.batch_size``) as `Task.eval_batches` gives
    it: ``input_spec`` and its ``weights`` (float32, shaped like ``targets``: 0 for padding), or None without
    them."""
    ecfg = getattr(run, "ecfg", None)
    spec = run.task.input_spec(ecfg.batch_size) if ecfg is not None else None
    if spec is not None and "targets" in spec and "weights" not in spec:
        spec = {**spec, "weights": jax.ShapeDtypeStruct(spec["targets"].shape, np.float32)}
    return spec


def _local_devices(mesh) -> int:
    return len([d for d in mesh.devices.flat if d.process_index == jax.process_index()])


def choices(run, limits: dict | None = None, programs: PlanPrograms | None = None,
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
    programs = programs or programs_of(run)
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
                            global_devices=run.mesh.size, store=_store_spec(run))
        planned[i] = shapes_only if not shapes_only.fits else plan(
            run.model, s, spec, local, limits=limits, programs=programs, global_devices=run.mesh.size,
            eval_spec=_eval_spec(run), store=_store_spec(run))
    return [own] + [planned[i] for i in sorted(planned)]


def _limits() -> dict:
    limits = {"host": host_limit()}
    device = device_limit()
    if device[0] is not None or jax.local_devices()[0].platform != "cpu":
        limits["device"] = device
    return limits


def floor_run(run, limits: dict | None = None, programs: PlanPrograms | None = None) -> MemoryPlan:
    """The `floor` of a built run (`revtrain.run.build`): its model, trainer and batch."""
    spec = run.task.input_spec(run.cfg.batch_size)
    if spec is None:  # (`plan_run` says why there is no plan)
        return plan_run(run, limits, programs)
    return floor(run.model, setup_of(run.trainer, run.cfg.batch_size), spec,
                 _local_devices(run.mesh), limits=limits, programs=programs, global_devices=run.mesh.size,
                 store=_store_spec(run))


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
    limits, programs = limits or _limits(), programs_of(run)
    own = floor_run(run, limits, programs)
    if own.fits:
        own = plan_run(run, limits, programs)
    fits = [own.fits]
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        fits = [bool(f) for f in np.asarray(multihost_utils.process_allgather(np.int32(own.fits))).reshape(-1)]
    if not own.fits:
        store = run.trainer.residency  # (its own store too small: no other trainer choice is planned)
        short = store.state_memory is None and short_tier(own) == store.name
        others = [] if short else choices(run, limits, programs, own, least=True)[1:]
        raise MemoryPlanError(refusal(own, others))
    if not all(fits):
        bad = ", ".join(str(i) for i, f in enumerate(fits) if not f)
        raise MemoryPlanError(f"the memory plan does not fit on process(es) {bad} (their line says by how much); "
                              "train.memory_plan = False skips this check")
    if log is not None:
        log(own.line())
    return own


# ``ReversibleTrainer.offload = 'auto'``: the tiers it weighs, fastest first.
# The registry's built-in tiers, in its order (device, host, disk); a tier registered later is chosen by its name.
AUTO_ORDER = tuple(name for name, _module, _cls in BUILTIN)


def choose_tier(run, limits: dict | None = None) -> str:
    """Chooses the tier of a run whose trainer has ``offload = 'auto'`` (`TrainerBase.auto_tier`): the first of
    `AUTO_ORDER` (device, host, disk: fastest first) whose memory plan fits this machine, made the trainer's
    (`ReversibleTrainer.use_tier`) before its state is placed. Returns the one line that says which and why
    (``"offload = 'auto': host tier (device tier: host needs at least 9.10 GiB of 8.00 GiB (...))"``).

    Each tier is planned from shapes first (`floor`, nothing compiled) and only a tier whose floor fits with
    compiled programs (`plan`); the programs are walked once, for the first tier planned, and every later
    tier's plan reuses that walk (``PlanPrograms.shared_walks``: the tiers differ in where the state lives, not
    in the programs), so choosing costs about one fixed tier's plan. The device tier's plan is the run's own:
    its programs are those the run then calls. A tier that cannot run here (`Tier.refusal`, the host tier on a
    backend without host memory) is passed over with its reason.

    Args:
      run: a built run (`revtrain.run.build`) whose trainer has ``auto_tier``.
      limits: ``{tier: (bytes or None, source)}`` instead of the process's own (`host_limit`, `device_limit`).

    Raises:
      MemoryPlanError: no tier fits (one line: each tier and what it needs), or the task cannot say its batch's
        shapes.
    """
    trainer = run.trainer
    spec = run.task.input_spec(run.cfg.batch_size)
    if spec is None:
        raise MemoryPlanError(f"ReversibleTrainer.offload = 'auto' plans the tiers from the batch's shapes, and "
                              f"{type(run.task).__name__} has no input_spec: set ReversibleTrainer.offload")
    limits, local = limits or _limits(), _local_devices(run.mesh)
    programs = programs_of(run)
    programs.shared_walks = {}
    own, base = programs.own, trainer.residency
    passed = []
    for name in AUTO_ORDER:
        tier = base if name == base.name else base.peer(name)
        why = tier.refusal()
        if tier.state_memory == "host" and not _host_memory_supported(run.mesh):
            why = why or "the backend has no host memory space"
        if why:
            passed.append(f"{name} tier: {why}")
            continue
        setup = own if tier is base else dataclasses.replace(
            own, tier=tier, label=tier.trainer_label("ReversibleTrainer", " + shard_state" if own.shard_state else ""))
        kw = dict(limits=limits, programs=programs, global_devices=run.mesh.size, store=_store_spec(run))
        made = floor(run.model, setup, spec, local, **kw)
        if made.fits:
            made = plan(run.model, setup, spec, local, eval_spec=_eval_spec(run), **kw)
        if made.fits:
            if tier is not base:
                trainer.use_tier(tier)
            trainer.auto_tier = False
            fits = ", ".join(f"{t} {gib(made.total(t))} of {gib(made.limits[t])}" for t in made.tiers
                             if made.limits.get(t) is not None)
            why = "; ".join(passed) if passed else f"its plan fits: {fits}"
            return f"ReversibleTrainer.offload = 'auto': {name} tier ({why})"
        passed.append(f"{name} tier: {made.shortfall()}")
    raise MemoryPlanError("ReversibleTrainer.offload = 'auto': no tier fits this machine (" + "; ".join(passed)
                          + "); a smaller model or batch would (revtrain plan lists the choices)")
