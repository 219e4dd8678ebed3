"""The train and eval loops: glue between task, model, trainer, checkpoints and metrics.

The loop knows nothing about reversibility: it asks the configured trainer for a state, feeds it global
batches, logs, evaluates and checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal as signal_lib
import time

import jax
import numpy as np

from revtrain import checkpoint as ckpt_lib
from revtrain import ginconfig, tiers
from revtrain.lifecycle import interrupts, lost_peer, oom
from revtrain import metrics as metrics_lib
from revtrain.lifecycle import workdir as workdir_lib
from revtrain.errors import ConfigError, RunFailure  # noqa: F401  (also revtrain.loop.ConfigError)
from revtrain.memory import MemoryMeter, device_state_bytes, host_resident, host_state_bytes
from revtrain.placement import global_batch
from revtrain.run import (EvalConfig, Run, TrainConfig, _divisible, build, build_optimizer,  # noqa: F401
                          build_task, run_signature, same_model)  # (loop.build, ...: the run's building)
from revtrain.trainers.common import NonFiniteError, TrainState


class TrainingStopped(RunFailure, FloatingPointError):
    """Training stopped on a non-finite loss or gradient (reported as one line, exit status 1)."""


class StepFailed(RunFailure, RuntimeError):
    """A periodic evaluation or sample failed; the step is saved first (one line naming the checkpoint kept,
    exit status 1)."""


class WriteFailed(RunFailure, RuntimeError):
    """Training stopped because a checkpoint or metrics file could not be written, e.g. the disk is full
    (reported as one line naming the newest checkpoint, which is kept; exit status 1)."""


def _writable(workdir: str) -> bool:
    """Creates ``workdir`` if needed; returns whether this call created it.

    Raises:
      ConfigError: it cannot be created or written.
    """
    try:
        os.makedirs(os.path.dirname(workdir), exist_ok=True)
        try:
            os.mkdir(workdir)
            created = True
        except FileExistsError:
            created = False
        if not os.access(workdir, os.W_OK | os.X_OK):
            raise PermissionError(13, "permission denied")
    except OSError as e:
        raise ConfigError(f"cannot write the workdir {workdir}: {e.strerror or e}") from None
    return created


def _check_resumable(saved: dict, current: dict, step: int, workdir: str, optimizers: tuple | None = None) -> None:
    """Refuses (`ConfigError`, one line) a checkpoint whose `run_signature` differs from the run's; a different
    optimizer state names both optimizers when ``optimizers`` (``(saved, current)``, gin text such as
    ``@optax.adamw``) tells them."""
    for key in current:
        if saved.get(key) != current[key]:
            what = {"layers": "model (layers or parameter shapes)", "optimizer_state": "optimizer",
                    "data": "data source or sequence length", "batch_size": "train.batch_size",
                    "seed": "train.seed", "trainer": "trainer"}.get(key, key)
            if key == "optimizer_state" and optimizers and optimizers[0] != optimizers[1]:
                what = f"optimizer ({optimizers[0]}; this run's is {optimizers[1]})"
            elif key == "optimizer_state" and optimizers:
                what = f"optimizer state ({optimizers[1]} with other settings)"
            raise ConfigError(f"the checkpoint at step {step} in {workdir} was made with a different {what}; "
                              "resume with the same config or start a new --workdir")


def _saved_and_current(workdir: str, run: Run, name: str) -> tuple[str, str] | None:
    """``(saved value, this run's value)`` of the operative gin binding ``name`` (e.g. ``train.optimizer``) as
    gin text, from the workdir's ``config.gin`` and the run's config; None when either cannot be read."""
    try:
        with open(os.path.join(workdir, "config.gin")) as f:
            saved = ginconfig.operative_values(f.read())
        current = ginconfig.operative_values(_run_config(run)[0])
    except (OSError, SyntaxError, ValueError):
        return None
    return saved.get(name, "(unset)"), current.get(name, "(unset)")


def _optimizer_defaults_note(before: dict, after: dict) -> str | None:
    """When ``train.optimizer`` changed between two operative configs (`ginconfig.operative_values`): the
    settings the new optimizer has under the old one's parameter names with other values (AdamW's
    ``weight_decay`` 0.01 against NAdamW's default 0.0001): a resumed run continues with those, which the
    list of changed values shows only as unrelated lines. None when the optimizer did not change or no
    shared setting differs."""
    old, new = before.get("train.optimizer"), after.get("train.optimizer")
    if not old or not new or old == new or not old.startswith("@") or not new.startswith("@"):
        return None

    def settings(ref: str, values: dict) -> dict:
        parts = ref[1:].removesuffix("()").split(".")
        for k in range(len(parts)):  # the selector as the operative config writes it (its shortest form)
            prefix = ".".join(parts[k:]) + "."
            found = {key[len(prefix):]: v for key, v in values.items() if key.startswith(prefix)
                     and "." not in key[len(prefix):]}
            if found:
                return found
        return {}

    was, now = settings(old, before), settings(new, after)
    differ = [f"{p} {was[p]} -> {now[p]}" for p in sorted(was) if p in now and was[p] != now[p]]
    if not differ:
        return None
    return (f"the optimizer changed ({old} -> {new}) and trains on with its own values of {old}'s settings: "
            + ", ".join(differ))


def _sync_metrics(metrics: dict) -> dict:
    return {k: float(np.asarray(v)) for k, v in metrics.items()}


def evaluate(run: Run, ts: TrainState, ecfg: EvalConfig | None = None) -> dict:
    """Scores ``ts`` on the configured split with the forward-only layer-by-layer pass.

    Returns:
      dict with ``loss`` (nats per token), ``accuracy`` and, for byte LMs, ``bits_per_byte``.
    """
    ecfg = ecfg or run.ecfg
    _divisible(ecfg.batch_size, run.mesh, "evaluate.batch_size")
    pc, pi = jax.process_count(), jax.process_index()
    totals = None
    counts_bytes = run.task.tokenized  # tokens that are not bytes: count the bytes they stand for
    scored_bytes = 0.0
    for batch in run.task.eval_batches(ecfg.split, ecfg.batch_size // pc, ecfg.max_batches, pi, pc):
        if counts_bytes:
            scored_bytes += run.task.target_bytes(batch)
        sums = run.trainer.eval_step(ts, global_batch(batch, run.mesh))
        totals = sums if totals is None else jax.tree.map(lambda a, b: a + b, totals, sums)
    totals = _sync_metrics(totals)
    weight = max(totals["weight"], 1.0)
    out = {"loss": totals["loss_sum"] / weight, "accuracy": totals["correct"] / weight}
    if run.model.bits_per_byte:
        if counts_bytes:
            if pc > 1:
                from jax.experimental import multihost_utils
                scored_bytes = float(np.sum(multihost_utils.process_allgather(np.float64(scored_bytes))))
            out["bits_per_byte"] = totals["loss_sum"] / max(scored_bytes, 1.0) / math.log(2)
            out["bytes_per_token"] = scored_bytes / weight
        else:
            out["bits_per_byte"] = out["loss"] / math.log(2)
    return out


def _agree_to_stop(local: bool, process_count: int) -> bool:
    """Whether any process was asked to stop (multi-host: one tiny all-gather per step, so that every
    process stops, saves and exits at the same step; a lone stop would leave the others in a collective)."""
    if process_count == 1:
        return local
    from jax.experimental import multihost_utils
    return bool(np.any(multihost_utils.process_allgather(np.int32(local))))


def _oom_knobs(run: Run, evaluation: bool = False) -> list[str]:
    """The gin settings that lower a step's memory, most effective first (those this run has)."""
    knobs = ["evaluate.batch_size" if evaluation else "train.batch_size"]
    if run.task.sequence_length is not None:
        knobs.append(f"{type(run.task).__name__}.sequence_length")
    return knobs + run.trainer.memory_knobs(evaluation) + list(run.model.memory_knobs)


def _run_config(run: Run):
    """`ginconfig.run_config` of the run: the operative config plus every ``train.*`` value it was given, less
    the model's bindings that it ignores (``Model.unused_bindings``: the sizes a checkpoint overrides)."""
    cfg = run.cfg
    return ginconfig.run_config({f"train.{f.name}": getattr(cfg, f.name) for f in dataclasses.fields(cfg)},
                                drop=run.model.unused_bindings)


def _config_changes(workdir: str, run: Run) -> str | None:
    """One line listing the operative gin values that differ from the saved ``config.gin`` of the run being
    resumed (None when nothing differs or there is nothing to compare)."""
    try:
        with open(os.path.join(workdir, "config.gin")) as f:
            saved = f.read()
        current = _run_config(run)[0]
        changes = ginconfig.config_differences(saved, current)
        note = _optimizer_defaults_note(ginconfig.operative_values(saved), ginconfig.operative_values(current))
    except (OSError, SyntaxError, ValueError):
        return None
    if not changes:
        return None
    return (f"changed since the saved config.gin ({len(changes)}): " + "; ".join(changes)
            + (f" -- it matters: {note}" if note else ""))


def train(workdir: str, cfg: TrainConfig | None = None) -> dict:
    """Trains (or resumes) the configured run in ``workdir``; returns the last logged metrics.

    Writes ``config.gin``, ``metrics/train.jsonl``, ``metrics/eval.jsonl``, ``tensorboard/`` and
    ``checkpoints/`` (process 0 writes files other than checkpoints). Resumes from the newest checkpoint
    that restores when ``checkpoints/`` has one (a damaged newer one is moved to ``damaged_checkpoints/``
    with one line saying why); a run already at ``train.steps`` does nothing. Holds the workdir's lock
    (`revtrain.lifecycle.workdir`) throughout, and SIGINT / SIGTERM follow `revtrain.lifecycle.interrupts`. A run that fails
    before writing any checkpoint or metrics record removes the workdir when it created it.

    Raises:
      ConfigError, DataError, TrainerError: bad configuration (nothing written).
      workdir_lib.WorkdirBusy: another process holds the workdir.
      ckpt_lib.CheckpointError: the checkpoints cannot be resumed (made by another config, all damaged).
      TrainingStopped, WriteFailed, StepFailed, oom.OutOfMemory: the run stopped (one line naming what is
        kept; a failed periodic evaluation or sample saves its step first).
    """
    workdir = os.path.abspath(workdir)
    began = time.time()  # (the final line gives the steps' seconds and the whole command's since here)
    with interrupts.Interrupts(log=metrics_lib.log) as guard:
        run = build(cfg, workdir, say_data=False)  # first: a configuration error leaves no trace (not even a workdir)
        if run.cfg.sample_every:
            from revtrain import generate as sample_lib
            sample_lib.check_training_sample(run)
        run.trainer.residency.check_run()  # (e.g. an offload_dir whose parent is missing): before anything is made
        for note in tiers.leftovers(workdir, run.trainer.residency):  # (files of another tier an earlier run left)
            metrics_lib.log(note)
        if run.task.data_prepared:  # (after the last configuration check)
            metrics_lib.log(run.task.data_status)
        created = _writable(workdir)
        lock = workdir_lib.acquire(workdir, "train")
        offload_lock = None
        primary = jax.process_index() == 0
        guard.workdir, guard.created, guard.lock, guard.primary = workdir, created, lock, primary
        guard.checkpoint_dir = os.path.join(workdir, "checkpoints")
        lost_peer.watch(guard.checkpoint_dir)
        try:
            offload_lock = _lock_offload_dir(run)
            from revtrain import planning
            planning.plan_budget(run, quiet=False)  # each block's mode (a memory budget's), before trainer.init
            if run.cfg.memory_plan:  # before the first large allocation (trainer.init): refuse what cannot fit
                run.plan = planning.check_everywhere(run)  # (its line follows the run's first line)
            return _train(run, workdir, guard, began)
        except BaseException:
            if created and primary and (lock is None or lock.held):
                workdir_lib.remove_if_unsaved(workdir)
            raise
        finally:
            guard.lock = None
            for held in (offload_lock, lock):
                if held is not None:
                    held.release()


def _lock_offload_dir(run: Run):
    """The lock of a disk-tier run's ``offload_dir`` outside its workdir (`workdir_lib.WorkdirLock`; the default,
    ``<workdir>/offload``, is the workdir's), or None.

    Raises:
      workdir_lib.WorkdirBusy: another run writes its layer files there.
    """
    directory = run.trainer.residency.own_directory()
    if directory is None:
        return None
    os.makedirs(directory, exist_ok=True)
    return workdir_lib.acquire(directory, "train", name="ReversibleTrainer.offload_dir",
                               instead="set another ReversibleTrainer.offload_dir")


def _train(run: Run, workdir: str, guard: interrupts.Interrupts, began: float | None = None) -> dict:
    """`train` once the workdir is held and the run planned: the run's steps, as a list of named steps (each
    one a method of `_Training`). Returns the last logged metrics ({} when there was nothing to do; the
    final evaluation's when only it was missing).

    Raises:
      TrainingStopped, WriteFailed, StepFailed, oom.OutOfMemory: as `train` says.
    """
    t = _Training(run, workdir, guard, began)
    try:
        ts, resumed = t.restore_or_init()
        if resumed is not None and ts.step >= run.cfg.steps:
            return t.finish_done_run(ts)
        t.set_aside_damaged()
        changes = _config_changes(workdir, run) if resumed is not None and t.primary else None
        t.open_metrics(resumed)
        if t.primary:
            _write_run_files(run, workdir)
        _log_start(run, ts, resumed, t.checkpointer, changes, t.saved_on)
        with oom.in_one_line(lambda: f"training step {t.ts.step + 1}", _oom_knobs(run)):
            t.run_steps()
        t.save_last()
        t.evaluate_last()
        t.writer.close()
    except NonFiniteError as e:
        raise TrainingStopped(f"{e}: training stopped, {t.kept()}; train.skip_nonfinite_steps = N "
                              "skips up to N such steps") from None
    except oom.OutOfMemory as e:
        raise oom.OutOfMemory(f"{e}; {t.kept()}") from e.__cause__
    except (ckpt_lib.CheckpointWriteError, metrics_lib.MetricsWriteError, tiers.StoreError) as e:
        if t.writer is not None:
            t.writer.abandon()  # the disk is full (or gone): drop buffered TensorBoard events
        raise WriteFailed(f"{e}; training stopped, {t.kept()}; free space (or fix the file system) "
                          "and rerun the same command to resume") from None
    except Exception as e:  # a lost peer: one line and exit 1 now, before the cleanup below waits for it
        lost_peer.exit_if_peer_lost(e)
        raise
    finally:
        t.close()
    return t.last


class _Training:
    """The state of `_train`'s run between its steps: the data iterator, checkpointer and metrics writer, the
    current `TrainState` (``ts``), the last logged metrics (``last``), the step saved last (``saved``) and the
    clocks of the logged rates. Each method is one step of `_train`."""

    def __init__(self, run: Run, workdir: str, guard: interrupts.Interrupts, began: float | None = None):
        cfg = run.cfg
        self.run, self.workdir, self.guard = run, workdir, guard
        if cfg.sample_every:
            from revtrain import generate as sample_lib
            self.sample_lib = sample_lib
        self.primary = jax.process_index() == 0
        self.pc, pi = jax.process_count(), jax.process_index()
        self.data = run.task.train_iterator(cfg.batch_size // self.pc, cfg.seed, pi, self.pc)
        self.checkpointer = ckpt_lib.Checkpointer(workdir, keep=cfg.keep_checkpoints,
                                                  keep_period=cfg.keep_checkpoint_period, tier=run.trainer.residency)
        self.writer: metrics_lib.MetricWriter | None = None
        self.meta: dict = {}  # what each checkpoint records beside the state (the run's signature, sizes)
        self.ts: TrainState | None = None
        self.metrics: dict = {}  # the last step's metrics (device scalars)
        self.last: dict = {}
        self.damaged: list = []
        self.saved_on: dict = {}  # the devices and processes the resumed checkpoint was written on
        self.meter: MemoryMeter | None = None
        self.t_start = self.t_last = 0.0  # when the steps started; when the last rate was logged
        self.began = time.time() if began is None else began  # when `train` started building the run
        self.step_last = self.resumed_or_zero = self.saved = 0  # the step of the last rate, the first, the saved
        self.skipped = 0  # non-finite steps skipped
        self.stopping = False

    def kept(self) -> str:
        """Which checkpoint a stopped run leaves (and whether the workdir it created is removed)."""
        line = _kept(self.checkpointer)
        gone = self.guard.created and self.primary and workdir_lib.saved_nothing(self.workdir)
        return line + (" (the workdir it created is removed)" if gone else "")

    def restore_or_init(self) -> tuple[TrainState, int | None]:
        """The newest checkpoint that restores (restored straight into place from a shape-only template: one
        copy; a damaged newer one is remembered for `set_aside_damaged`), else a new state; and the step
        resumed from (None for a new run)."""
        run = self.run
        signature = run_signature(run)
        self.meta = {"signature": signature, "num_params": run.model.num_params(), "devices": run.mesh.size,
                     "processes": self.pc}

        def accept(step, saved):
            _check_resumable(saved.get("signature", {}), signature, step, self.workdir,
                             _saved_and_current(self.workdir, run, "train.optimizer"))
            self.saved_on.update(devices=saved.get("devices"), processes=saved.get("processes"))

        resumed = None
        if self.checkpointer.steps():
            ts, resumed = self.checkpointer.restore_newest(run.trainer.abstract_state(), data_iterator=self.data,
                                                           on_skip=self.damaged.append, accept=accept)
        else:
            ts = run.trainer.init()
        self.ts = ts
        return ts, resumed

    def finish_done_run(self, ts: TrainState) -> dict:
        """A run resumed at or beyond ``train.steps``: runs its final evaluation when it stopped before it,
        else says there is nothing to do."""
        cfg = self.run.cfg
        where = "= train.steps" if ts.step == cfg.steps else f"beyond train.steps = {cfg.steps}"
        if ts.step == cfg.steps and not _evaluated(self.workdir, ts.step):  # stopped before its final evaluation
            metrics_lib.log(f"already at step {ts.step} {where}; its final evaluation is missing: running it")
            self.guard.idle_note = "before the final evaluation finished: rerun the same command to run it"
            self.writer = metrics_lib.MetricWriter(self.workdir, enabled=self.primary)
            result = _eval_and_write(self.run, ts, self.writer)
            self.writer.close()
            return result
        metrics_lib.log(f"already at step {ts.step} {where}; nothing to do (a larger train.steps continues "
                        "the run)")
        return {}

    def set_aside_damaged(self) -> None:
        """A resumed run saves the damaged checkpoints' steps again: their damaged copies go out of the way."""
        for e in self.damaged:
            where = self.checkpointer.set_aside(e.step)
            metrics_lib.log(f"skipping the damaged checkpoint at step {e.step} ({e.reason}); moved it to {where}")

    def open_metrics(self, resumed: int | None) -> None:
        """The metrics writer, each step recorded once: records after the resumed step are redone."""
        self.writer = metrics_lib.MetricWriter(self.workdir, enabled=self.primary)
        self.writer.restart_at(resumed or 0)

    def run_steps(self) -> None:
        """Steps up to ``train.steps`` (or a stop asked by a signal): each step, then its log record, periodic
        checkpoint, evaluation and sample when due. A non-finite step is skipped up to
        ``train.skip_nonfinite_steps`` times."""
        cfg, trainer = self.run.cfg, self.run.trainer
        self.meter = trainer.meter = MemoryMeter()
        self.t_start = self.t_last = time.time()
        self.step_last = self.resumed_or_zero = self.saved = self.ts.step
        self.skipped = 0
        while self.ts.step < cfg.steps:
            logged = (self.ts.step + 1) % cfg.log_every == 0 or self.ts.step + 1 == cfg.steps
            if not self.take_step(logged):
                continue
            step = self.ts.step
            final = step == cfg.steps
            if step == self.resumed_or_zero + 1 and not logged:
                # The first step compiled every program: leave it out of the first rate.
                self.t_last, self.step_last = time.time(), step
            self.stopping = _agree_to_stop(self.guard.signal is not None, self.pc)
            if logged or self.stopping:
                self.log_step(step)
            self.periodic(step, final)
            if self.stopping:
                who = (signal_lib.Signals(self.guard.signal).name if self.guard.signal
                       else "a signal on another process")
                metrics_lib.log(f"received {who}: saving step {step} and stopping")
                break

    def take_step(self, logged: bool) -> bool:
        """One training step on the next global batch (measuring its peak when ``logged``); False when the
        step was non-finite and skipped (its update not applied, the skip recorded).

        Raises:
          NonFiniteError: a non-finite step beyond ``train.skip_nonfinite_steps``.
        """
        cfg = self.run.cfg
        batch = global_batch(next(self.data), self.run.mesh)
        if logged:
            self.meter.start()
        try:
            self.ts, self.metrics = self.run.trainer.train_step(self.ts, batch)
        except NonFiniteError as e:
            self.meter.active = False
            if self.skipped >= cfg.skip_nonfinite_steps:
                raise
            self.skipped += 1
            self.ts = e.state
            self.writer.write("train", self.ts.step, {"skipped_nonfinite": str(e)})
            metrics_lib.log(f"{e}: skipped its update ({self.skipped} of at most {cfg.skip_nonfinite_steps})")
            return False
        self.guard.idle = False  # a finished step that is not saved yet: the first signal saves it
        lost_peer.watch(step=self.ts.step)
        return True

    def log_step(self, step: int) -> None:
        """The step's ``train.jsonl`` record (`_step_record`) and progress line; the first record of this
        process's run also holds the memory plan's figures."""
        run, cfg = self.run, self.run.cfg
        values = _sync_metrics(self.metrics)
        if self.meter.active:
            values["peak_device_bytes"] = self.meter.stop()
            values["peak_device_bytes_method"] = self.meter.method
            values["host_state_bytes"] = host_state_bytes(self.ts)
        now = time.time()
        sps = (step - self.step_last) / max(now - self.t_last, 1e-9)
        self.t_last, self.step_last = now, step
        values.update(_step_record(run, self.ts, values["loss"], sps, self.pc))
        if run.plan is not None and not self.last:  # the first record of this process's run
            values.update(run.plan.record())
        self.writer.write("train", step, values)
        eta = None  # (none from this process's first interval: its seconds are mostly compiling the programs)
        if self.last:
            eta = (cfg.steps - step) / sps if sps > 0 else float("inf")
        metrics_lib.log(metrics_lib.progress_line(
            step, cfg.steps, values, eta, "tok" if run.model.tokens_per_example > 1 else "ex"))
        self.last = values

    def periodic(self, step: int, final: bool) -> None:
        """The checkpoint, evaluation and sample due at ``step`` (a failed evaluation or sample saves the step
        first, `_keeping_the_step`); sampling time is left out of the logged rates."""
        from revtrain.schedule_free import evaluation_state
        run, cfg, ts = self.run, self.run.cfg, self.ts
        checkpointer, data, meta, kept = self.checkpointer, self.data, self.meta, self.kept
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and not final:
            _saves_within_budget(run.trainer, checkpointer, ts)
            if checkpointer.save(ts, data, meta):
                self.saved = step
        if cfg.eval_every and step % cfg.eval_every == 0 and not final and not self.stopping:
            self.saved = _keeping_the_step(checkpointer, ts, data, meta, self.saved, "evaluation", kept,
                                           lambda: _eval_and_write(run, ts, self.writer))
        if cfg.sample_every and (step % cfg.sample_every == 0 or final):
            t_sample = time.time()
            self.saved = _keeping_the_step(checkpointer, ts, data, meta, self.saved, "sample", kept,
                                           lambda: self.sample_lib.training_sample(
                                               run, evaluation_state(run.trainer, ts), self.writer))
            self.t_last += time.time() - t_sample  # sampling time is not training time

    def save_last(self) -> None:
        """Saves the last step (unless a periodic save just did) and waits for it: a failed final save is
        reported here, with the newest kept checkpoint."""
        if self.saved != self.ts.step:  # (a stop right after a periodic save has nothing more to save)
            self.checkpointer.save(self.ts, self.data, self.meta, force=True)
        self.checkpointer.wait()
        self.guard.idle, self.guard.idle_note = True, ("after the final checkpoint was saved: the final evaluation "
                                                       "is skipped (rerun the same command to run it)")

    def evaluate_last(self) -> None:
        """The final evaluation of a run that reached ``train.steps`` (skipped, with one line, when a signal
        came meanwhile)."""
        cfg, ts, guard = self.run.cfg, self.ts, self.guard
        if ts.step == cfg.steps and not self.stopping:
            if guard.signal is not None:
                metrics_lib.log(f"received {signal_lib.Signals(guard.signal).name}: step {ts.step} is saved; "
                                "the final evaluation is skipped (rerun the same command to run it)")
            else:
                _eval_and_write(self.run, ts, self.writer)
                start = self.resumed_or_zero
                what = f"{cfg.steps - start} steps" + (f" ({start} -> {cfg.steps})" if start else "")
                now = time.time()
                metrics_lib.log(f"done: {what} in {now - self.t_start:.0f} s ({now - self.began:.0f} s in all, with "
                                f"building the run, its plan and the final evaluation); workdir {self.workdir}")

    def close(self) -> None:
        """Waits for saves in flight (an exit never leaves a half-written checkpoint) and flushes the events of
        a run stopped by an error (closed already after success)."""
        self.checkpointer.close()
        try:
            if self.writer is not None:
                self.writer.flush()
        except metrics_lib.MetricsWriteError:
            pass  # an error is already on its way out; this one would only hide it


def _step_record(run: Run, ts: TrainState, loss: float, sps: float, pc: int) -> dict:
    """A logged step's rates, learning rate, bits per byte, devices, host memory and a streamed tier's store I/O
    (the parts of its ``train.jsonl`` record beyond its metrics and peak)."""
    tokens_per_step = run.cfg.batch_size * run.model.tokens_per_example
    values = {"steps_per_sec": sps, "tokens_per_sec": sps * tokens_per_step}
    values["learning_rate"] = float(run.schedule(ts.step - 1)) if run.schedule else _ready_lr(ts)
    if run.model.bits_per_byte:
        # Tokens: at the train split's mean bytes per token (an estimate for the batch).
        per_token = run.task.bytes_per_token
        values["bits_per_byte"] = loss / math.log(2) / per_token
        if run.task.tokenized:
            values["bytes_per_token"] = per_token
    values["devices"], values["processes"] = run.mesh.size, pc
    values["host_resident_bytes"], values["host_peak_bytes"] = host_resident()
    values.update(run.trainer.store_stats)  # a streamed tier's last step's I/O (`StepStream.stats`)
    return values


def _write_run_files(run: Run, workdir: str) -> None:
    """Writes the run's ``config.gin``, its tokenizer, the files its model names (`_keep_files`) and where the
    user's modules came from: eval / sample / export / check (and a resume) read these."""
    text, modules, unnamed = _run_config(run)
    with open(os.path.join(workdir, "config.gin"), "w") as f:
        f.write(text)
    run.task.save_tokenizer(workdir)  # eval / sample / export / check (and a resume) use this copy
    _keep_files(run.model, workdir)  # and these (an imported checkpoint's architecture)
    if modules:  # where the user's modules came from: eval / sample / check find them again
        with open(os.path.join(workdir, ginconfig.MODULES_FILE), "w") as f:
            json.dump(modules, f, indent=1)
    if unnamed:
        metrics_lib.log(f"config.gin cannot name {', '.join(unnamed)} (set from Python, and neither a "
                        "literal nor a gin configurable): revtrain eval / sample / check on this workdir "
                        "will use the gin default; make it a @gin.configurable to have it recorded")


def _log_start(run: Run, ts: TrainState, resumed: int | None, checkpointer, changes: str | None,
               saved_on: dict) -> None:
    """The run's first lines: what is trained on what (and where it resumed), the exact residuals' side bits,
    the memory plan, the config changed since the saved one, and devices changed since the checkpoint."""
    cfg, pc = run.cfg, jax.process_count()
    metrics_lib.log(
        (f"resumed from checkpoint at step {resumed} in {checkpointer.directory}; " if resumed is not None else "")
        + f"{run.trainer.name} trainer, {run.model.num_params():,} params, {len(run.model.layers)} layers "
        f"({sum(layer.reversible for layer in run.model.layers)} reversible), "
        f"{run.mesh.size} device(s) in {pc} process(es), global batch {cfg.batch_size}, steps {ts.step}->{cfg.steps}")
    from revtrain.layers.exact_residual import side_bits_line
    side = side_bits_line(run.model, cfg.batch_size, run.task.sequence_length)
    if side:
        metrics_lib.log(side)
    if run.plan is not None:  # made before the first allocation; said once the run has started
        metrics_lib.log(run.plan.line())
    if changes:
        metrics_lib.log(changes)
    if resumed is not None and saved_on.get("devices") is not None and (
            (saved_on["devices"], saved_on.get("processes")) != (run.mesh.size, pc)):
        metrics_lib.log(f"devices changed since the checkpoint at step {resumed}: {saved_on['devices']} device(s) in "
                        f"{saved_on.get('processes')} process(es) -> {run.mesh.size} device(s) in {pc} process(es) "
                        "(the global batch and the data order are the same)")


def _ready_lr(ts: TrainState) -> float:
    """A ready optimizer's learning rate of the last step: read from its state when it is an
    ``optax.inject_hyperparams`` optimizer (`revtrain.optim.injected_learning_rate`), else NaN (its schedule
    is inside optax, out of reach)."""
    from revtrain.optim import injected_learning_rate
    lr = injected_learning_rate(ts.stacked.opt_state if ts.stacked is not None else ts.opt_state)
    return float("nan") if lr is None else lr


def _evaluated(workdir: str, step: int) -> bool:
    """Whether ``metrics/eval.jsonl`` holds a record of ``step`` (a run's final evaluation is done)."""
    path = os.path.join(workdir, "metrics", "eval.jsonl")
    return os.path.isfile(path) and any(r.get("step") == step for r in metrics_lib.read_jsonl(path))


def _saves_within_budget(trainer, checkpointer, ts: TrainState) -> None:
    """Under a device-memory budget (`ReversibleTrainer.memory_budget`), has saves written before the next
    step where a background write would break the budget: the write holds the state's device buffers
    through the next steps, which then cannot donate them and hold a second copy of the device-resident
    state (measured on the CPU backend, docs/budget.md). Written in the background when the plan's peak
    plus that copy fits."""
    plan = trainer.budget_plan
    if plan is not None and plan.peak + device_state_bytes(ts) > plan.budget:
        checkpointer.async_max_bytes = 0


def _keeping_the_step(checkpointer, ts: TrainState, data, meta: dict, saved: int, what: str, kept, work) -> int:
    """Runs ``work`` (a periodic evaluation or sample at step ``ts.step``); returns the step saved last.

    When ``work`` fails, the step is saved first (unless it is already), so the failure loses no training,
    and the error is one line naming what failed and the checkpoint kept (an out-of-memory error keeps its
    own line, which names the checkpoint too).

    Raises:
      StepFailed: ``work`` raised (``__cause__`` is its error); oom.OutOfMemory as it was.
    """
    try:
        work()
        return saved
    except Exception as e:
        lost_peer.exit_if_peer_lost(e)  # a lost process: saving would wait for it
        if saved != ts.step:
            try:
                checkpointer.save(ts, data, meta, force=True)
                checkpointer.wait()
            except ckpt_lib.CheckpointWriteError:
                pass  # the line below names the newest checkpoint that is kept
        if isinstance(e, (oom.OutOfMemory, ckpt_lib.CheckpointWriteError, metrics_lib.MetricsWriteError)):
            raise
        first = (str(e).strip().splitlines() or [""])[0]
        raise StepFailed(f"the {what} at step {ts.step} failed ({type(e).__name__}: {first}); training stopped, "
                         f"{kept()}; rerun with --verbose for the traceback") from e


def _keep_files(model, workdir: str) -> None:
    """Copies the files the model names (``Model.keep_files``) into ``workdir`` (each written under a temporary
    name and renamed), so the workdir stands on its own when their source directory is gone.

    Raises:
      WriteFailed: a file cannot be read or written.
    """
    for name, source in model.keep_files.items():
        target = os.path.join(workdir, name)
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copyfile(source, target + ".tmp")
            os.replace(target + ".tmp", target)
        except OSError as e:
            raise WriteFailed(f"cannot keep {source} in the workdir as {name}: {e.strerror or e}") from None


def _kept(checkpointer: ckpt_lib.Checkpointer) -> str:
    """Which checkpoint a stopped run leaves (after the save in flight, if any, finished or failed)."""
    try:
        checkpointer.wait()
    except ckpt_lib.CheckpointWriteError:
        pass
    newest = checkpointer.latest_step()
    return f"the newest checkpoint (step {newest}) is kept" if newest is not None else "no checkpoint was written"


def eval_kind(split: str, run_split: str) -> str:
    """Metrics kind of a split's scores: ``eval`` (``eval.jsonl``, TensorBoard ``eval/``) for the split the
    run evaluates during training (``run_split``, its ``evaluate.split``: validation by default), and
    ``eval_<split>`` for any other (e.g. ``eval_test.jsonl`` from ``revtrain eval --split test``)."""
    return "eval" if split == run_split else f"eval_{split}"


def _eval_and_write(run: Run, ts: TrainState, writer: metrics_lib.MetricWriter) -> dict:
    result = _evaluate_or_oom(run, ts, f"evaluation at step {ts.step}")
    writer.write("eval", ts.step, result)
    writer.flush()
    metrics_lib.log(f"eval at step {ts.step} ({run.ecfg.split}): " + metrics_lib.eval_text(result))
    return result


def _evaluate_or_oom(run: Run, ts: TrainState, what: str) -> dict:
    """`evaluate` of ``ts`` (a schedule-free optimizer's: on its evaluation weights, `revtrain.schedule_free`),
    an out-of-memory error as one line naming ``what``."""
    from revtrain.schedule_free import evaluation_state
    with oom.in_one_line(lambda: what, _oom_knobs(run, evaluation=True)):
        return evaluate(run, evaluation_state(run.trainer, ts))


def eval_checkpoints(workdir: str, step: int | None = None, all_steps: bool = False,
                     kind: str = "eval") -> list[dict]:
    """Scores checkpoints of ``workdir`` (config from ``workdir/config.gin``, parsed by the caller).

    Holds the workdir's lock while it runs. Without ``step``, scores the newest checkpoint that restores
    (a damaged newer one is skipped with one line saying why).

    Args:
      step: one chosen step (default: the newest that restores).
      all_steps: every kept checkpoint that ``metrics/<kind>.jsonl`` does not have yet (t5x style);
        damaged ones are skipped, each with one line.
      kind: the metrics file and TensorBoard prefix of the scores (`eval_kind`).

    Returns:
      the records written to ``metrics/<kind>.jsonl``.

    Raises:
      workdir_lib.WorkdirBusy: another process holds the workdir.
      ckpt_lib.CheckpointError: no checkpoints, or a missing/damaged chosen step.
    """
    workdir = os.path.abspath(workdir)
    with interrupts.command_interrupts("eval", at_once=False) as guard, workdir_lib.locked(workdir, "eval"):
        return _eval_checkpoints(workdir, step, all_steps, kind, guard)


def _steps_text(steps) -> str:
    return ", ".join(str(s) for s in steps) if steps else "none"


def _eval_checkpoints(workdir: str, step: int | None, all_steps: bool, kind: str,
                      guard: interrupts.Interrupts | None = None) -> list[dict]:
    guard = guard or interrupts.Interrupts()  # (not installed: no signal handling)
    run = build(workdir=workdir)
    checkpointer = ckpt_lib.Checkpointer(workdir, read_only=True)
    writer = metrics_lib.MetricWriter(workdir, enabled=jax.process_index() == 0)
    records = []
    try:
        template = run.trainer.abstract_state()  # shapes only: each restore is the one copy
        from revtrain.schedule_free import restores_optimizer_state
        with_optimizer = restores_optimizer_state(run.trainer)  # (evaluated on its evaluation weights)
        if all_steps:
            checkpointer.chosen_step()  # at least one checkpoint
            done = {r["step"] for r in metrics_lib.read_jsonl(
                os.path.join(workdir, "metrics", f"{kind}.jsonl"))}
            todo = [s for s in checkpointer.steps() if s not in done]
        else:
            todo = [None]
        where = f"metrics/{kind}.jsonl"
        scored, left, current = [], [t for t in todo if t is not None], None

        def status() -> str:
            text = f"scored: {_steps_text(scored)} (in {where})"
            return text + (f"; not scored: {_steps_text(left)} (the same command scores them)" if left else "")

        guard.idle_note = lambda: ((f"after scoring step {scored[-1]}" if scored else "before the scoring started")
                                   + ": nothing was lost; " + status())
        guard.lost_note = lambda: f"the scoring of step {current} is lost; " + status()
        guard.first_note = lambda: (f"finishing the scoring of step {current}, then stopping; send it again to "
                                    "stop at once")
        pc = jax.process_count()
        for s in todo:
            try:
                ts, s = checkpointer.restore_newest(template, step if s is None else s,
                                                    optimizer_state=with_optimizer,  # (schedule-free: its z)
                                                    files=True,  # a tier's own refs (e.g. layer files), streamed
                                                    accept=same_model(run, workdir))
            except ckpt_lib.DamagedCheckpoint as e:
                if not all_steps:
                    raise
                metrics_lib.log(f"skipping the damaged checkpoint at step {e.step}: {e.reason}")
                left.remove(e.step)
                continue
            current, guard.idle = s, False
            result = _evaluate_or_oom(run, ts, f"evaluation of step {s}")
            writer.forget(kind, s)  # scored again: the new record replaces the old one
            writer.write(kind, s, result)
            writer.flush()
            scored.append(s)
            if s in left:
                left.remove(s)
            guard.idle = True
            label = run.ecfg.split  # and the file when `eval --name` chose one
            if kind not in ("eval", f"eval_{run.ecfg.split}"):
                label += f", metrics/{kind}.jsonl"
            metrics_lib.log(f"eval at step {s} ({label}): " + metrics_lib.eval_text(result), result=True)
            records.append({"step": s, **result})
            if _agree_to_stop(guard.signal is not None, pc) and left:
                who = signal_lib.Signals(guard.signal).name if guard.signal else "a signal on another process"
                metrics_lib.log(f"received {who}: stopped after scoring step {s}; " + status())
                break
    finally:
        checkpointer.close()
    if not todo:
        metrics_lib.log("every kept checkpoint is already in eval.jsonl")
    writer.close()
    return records
