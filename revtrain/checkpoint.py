"""Orbax checkpoints: asynchronous saves, keep-N, exact resume (weights, optimizer state, data position).

A checkpoint ``DIR/checkpoints/<step>/`` holds three items:

* ``state``: every layer's params, optimizer state and layer state (``StandardSave`` of a pytree);
* ``data``: the Grain iterator's position (Grain's handler: one ``process_<i>-of-<n>.json`` per process), so
  a resumed run replays no batch and skips none;
* ``meta``: JSON with the step and the run's shape-relevant settings.

Orbax writes each step to a temporary directory and renames it when complete, so a checkpoint that was not
finished (killed mid-save) is never listed or used.

Multi-process (``jax.distributed``): every process constructs the `Checkpointer` and calls every method
(``save``, ``restore``, ``wait``, ``close``) at the same steps, as Orbax requires; Orbax synchronises them
through the distributed runtime (process 0 creates directories and commits the step, each process writes
the shards it owns under ``state/ocdbt.process_<i>`` and its own data-iterator file). The workdir must be
on a file system every process sees. A checkpoint written by N processes can be resumed by a different
number of processes when every process saved the same iterator position (revtrain's pipelines: each
process is at the same global batch).

The state's tier says how a checkpoint holds it (`revtrain.tiers.base.Tier.checkpoint_form`): Orbax's arrays,
or, for a tier with a form of its own, the tier's own Orbax item (`Tier.checkpoint_item`) instead of
``state``, written and read by the tier's handler (`Tier.checkpoint_handler`; the disk tier's,
`revtrain.tiers.disk_links`: a hard link to each layer's file, no bytes copied and nothing of the state in
memory). Such a checkpoint restores through the tier that wrote it (`Tier.restored`): as its own refs for a
template of that tier, into memory for the other tiers, as numpy weights alone (``optimizer_state=False``:
``revtrain check``), or as the weights' refs, read by whoever uses them and never written
(``optimizer_state=False, files=True``: ``revtrain eval``, ``sample`` and ``export`` stream them layer by
layer). A tier without a form of its own whose state holds refs of its own store (a registered tier's,
`Tier.holds_refs`) is saved as Orbax's arrays: the checkpointer's tier reads the state through its store into
host numpy for the save (`Tier.checkpoint_arrays`) and puts a restored state back into the store layer by layer
(`Tier.restore_template`, `Tier.restored_arrays`), so such a tier needs no checkpoint code of its own and its
checkpoints resume with any array tier (and back). This module names no tier: it asks the registry
(`revtrain.tiers.holder_of`, `revtrain.tiers.names`) and the checkpointer's tier.

Sharded state (``ReversibleTrainer.shard_state``): each leaf is saved with its own sharding, so every
process writes only its devices' pieces (measured with 2 processes: about half of the state in each
``ocdbt.process_<i>``; nothing is gathered through one host), and `Checkpointer.restore` reads into the
layout of its template: a checkpoint of either layout, from any number of devices or processes, restores
sharded or replicated on any other.
"""

from __future__ import annotations

import dataclasses
import errno
import gc
import glob
import json
import os
import re
import shutil
import sys
from typing import Callable

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp

from revtrain import metrics as metrics_lib
from revtrain import tiers
from revtrain.allocator import release_free_memory
from revtrain.errors import InputError, RunFailure
from revtrain.limits import ASYNC_MAX_BYTES, STAGING_BYTES
from revtrain.trainers.common import TrainState


class CheckpointError(InputError, RuntimeError):
    """A checkpoint is missing, corrupt, or does not fit the current model."""


class DamagedCheckpoint(CheckpointError):
    """The checkpoint of ``step`` exists but cannot be restored; ``reason`` says why (one line)."""

    def __init__(self, step: int, reason: str, message: str | None = None):
        super().__init__(message or f"the checkpoint at step {step} cannot be restored: {reason}")
        self.step, self.reason = step, reason


def damage_reason(e: BaseException) -> str:
    """Why a restore failed, in one line: the first line of the innermost cause (tensorstore's or the
    file system's own words, e.g. "OUT_OF_RANGE: Error reading ... Requested byte range [30272, 34083) is
    not valid for value of size 1000"), without the Python object dumps Orbax appends."""
    def below(x):  # what Python's traceback shows as its cause ("raise ... from None" shows nothing)
        return x.__cause__ if x.__cause__ is not None else (None if x.__suppress_context__ else x.__context__)

    seen, inner = set(), e
    while id(inner) not in seen and below(inner) is not None:
        seen.add(id(inner))
        inner = below(inner)
    for candidate in (inner, e):
        text = (str(candidate).strip().splitlines() or [""])[0]
        text = re.sub(r"\s*See full TensorStore details:.*", "", text)
        text = re.sub(r"<bound method [^>]*>?", "", text).strip()
        if text:
            name = type(candidate).__name__
            text = text if re.match(r"[A-Z_]+: ", text) or name in ("Exception", "ValueError") else f"{name}: {text}"
            return text if len(text) <= 300 else text[:297] + "..."
    return type(e).__name__


class CheckpointWriteError(RunFailure, OSError):
    """A checkpoint could not be written (disk full, quota, permissions, I/O error).

    ``step`` is the step whose save failed; the checkpoints written before it are untouched (Orbax only
    renames a checkpoint into place once every file of it is written, and deletes old ones after that).
    """

    def __init__(self, step: int, reason: str):
        super().__init__(f"cannot write the checkpoint at step {step}: {reason}")
        self.step = step


# errno values whose message the OS error of a failed write carries (tensorstore reports them inside a
# ValueError's text as "[os_error_code='28']").
_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EROFS, errno.EIO)


def write_failure_reason(e: BaseException) -> str:
    """A short human reason for a failed write: the OS error's message when one is found anywhere in the
    exception chain (``OSError.errno``, or tensorstore's ``os_error_code='N'``), else the first line."""
    return _os_reason(e) or f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


def _os_reason(e: BaseException | None) -> str | None:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _WRITE_ERRNOS:
            return os.strerror(e.errno)
        m = re.search(r"os_error_code='?(\d+)", str(e))
        if m:
            return os.strerror(int(m.group(1)))
        e = e.__cause__ or e.__context__
    return None


def _uncommitted_reason(directory: str) -> str:
    """Why a save that Orbax did not commit failed, as far as the file system tells."""
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        free = None
    if free is not None and free < (1 << 20):
        return os.strerror(errno.ENOSPC)
    return "Orbax did not commit it (run with --verbose for its log)"


class DataHandler(grain.checkpoint.CheckpointHandler):
    """Grain's iterator handler (one ``process_<i>-of-<n>.json`` per process) that also restores a checkpoint
    written by a different number of processes when all of them saved the same position.

    The files are Grain's: checkpoints written with Grain's own handler restore with this one and back.
    """

    def restore(self, directory, item=None, args=None):
        item = item or args.item
        index, count = jax.process_index(), jax.process_count()
        if (directory / f"process_{index}-of-{count}.json").exists():
            return super().restore(directory, item=item, args=args)
        files = sorted(directory.glob("process_*-of-*.json"))
        if not files:
            raise CheckpointError(f"no data-iterator state in {directory}")
        states = [json.loads(f.read_text()) for f in files]
        if any(state != states[0] for state in states):
            raise CheckpointError(
                f"the data-iterator state in {directory} was saved by {len(files)} processes at different "
                f"positions; resume with {len(files)} processes")
        if isinstance(item, grain.DatasetIterator):
            item.set_state(states[0])
        else:
            item.set_state(files[0].read_text().encode())
        item.start_prefetch()
        return item


@ocp.args.register_with_handler(DataHandler, for_save=True)
@dataclasses.dataclass
class DataSave(grain.checkpoint.CheckpointSave):
    """Saves a Grain iterator's position with `DataHandler`."""


@ocp.args.register_with_handler(DataHandler, for_restore=True)
@dataclasses.dataclass
class DataRestore(grain.checkpoint.CheckpointRestore):
    """Restores a Grain iterator's position (in place) with `DataHandler`."""


def _ignore_late_tensorstore_callbacks() -> None:
    """Keeps a failed restore or save to one error line.

    When one array of a restore (or save) fails, Orbax's asyncio loop ends while tensorstore reads (writes)
    of other arrays are still in flight; as each finishes, tensorstore calls ``loop.call_soon_threadsafe``
    on the closed loop and reports the resulting ``RuntimeError('Event loop is closed')`` as unraisable (``sys.unraisablehook``,
    from its own threads, at any moment, even before Orbax raises). Those errors are harmless: drop
    exactly them.
    """
    previous = sys.unraisablehook
    if getattr(previous, "_revtrain_drops_closed_loop", False):
        return

    def hook(unraisable):
        if unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed":
            return
        previous(unraisable)

    hook._revtrain_drops_closed_loop = True
    sys.unraisablehook = hook


# Bytes a save hands to tensorstore at once (Orbax's ``save_concurrent_bytes``; at 256 MiB a 309 M Llama's final
# save rose 0.3 GiB above its steps). Orbax refuses a read or write of at least its limit (``ValueError``
# "Requested more bytes than we reserved space for"; beside other reads in flight Python 3.11's asyncio may report
# it as "Lock is not acquired"), so a save's or a restore's limit is raised to just above its largest leaf where
# that is larger (`_bound_to_leaves`).
SAVE_STAGING_BYTES = 64 * 2**20


def _shard_bytes(x) -> int:
    """Bytes of the largest piece of ``x`` one process reads or writes: an array's largest addressable shard, a
    ``jax.ShapeDtypeStruct``'s shard under its sharding (the whole leaf without one)."""
    if isinstance(x, jax.Array):
        return max((sh.data.nbytes for sh in x.addressable_shards), default=0)
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None or dtype is None:
        return 0
    sharding = getattr(x, "sharding", None)
    if sharding is not None:
        shape = sharding.shard_shape(tuple(shape))
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def _bound_to_leaves(handler, tree, attribute: str, limit: int) -> None:
    """Sets ``handler``'s Orbax limit ``attribute`` (``_save_concurrent_bytes`` or ``_restore_concurrent_bytes``)
    for ``tree`` (arrays or ``jax.ShapeDtypeStruct`` leaves): ``limit``, or one byte more than the largest piece of
    a leaf (`_shard_bytes`) where that is larger."""
    inner = getattr(getattr(handler, "_impl", handler), "_handler_impl", None)
    if inner is None or not hasattr(inner, attribute):
        return
    largest = max((_shard_bytes(x) for x in jax.tree.leaves(tree)), default=0)
    setattr(inner, attribute, max(limit, largest + 1))


def _bound_staging(handler):
    """``handler`` with Orbax's staging bounded: the copy out of the arrays' buffers and a restore's reads to
    `limits.STAGING_BYTES`, a save's writes to `SAVE_STAGING_BYTES`. The public arguments count whole GB and
    leave out the copy from the arrays' buffers, so the pinned Orbax (0.12.8)'s limits are set on its inner
    PyTree handler too (the on-disk format is unchanged)."""
    inner = getattr(getattr(handler, "_impl", handler), "_handler_impl", None)
    for name, limit in (("_save_concurrent_bytes", SAVE_STAGING_BYTES), ("_restore_concurrent_bytes", STAGING_BYTES),
                        ("_save_device_host_concurrent_bytes", STAGING_BYTES)):
        if inner is not None and hasattr(inner, name):
            setattr(inner, name, limit)
    return handler


def _bounded_handler() -> ocp.StandardCheckpointHandler:
    """Orbax's standard handler with its staging bounded (`_bound_staging`)."""
    return _bound_staging(ocp.StandardCheckpointHandler(save_concurrent_gb=1, restore_concurrent_gb=1))


def state_bytes(ts: TrainState) -> int:
    """Bytes of weights, optimizer state and layer state that this process holds (every addressable shard)."""
    return sum(sh.data.nbytes for x in jax.tree.leaves(ts.held()) if isinstance(x, jax.Array)
               for sh in x.addressable_shards)


def _tree(ts: TrainState) -> dict:
    ts = ts.per_layer()  # one layout on disk, whichever executor made the state (stacked runs copied out)
    return {"params": ts.params, "opt_state": ts.opt_state, "layer_state": ts.layer_state}


class Checkpointer:
    """Saves and restores `TrainState` + data-iterator position under ``<workdir>/checkpoints``.

    A save that fails (disk full, quota, I/O error) raises `CheckpointWriteError` from ``save`` (a failure
    of the save itself, or of the previous asynchronous one), ``wait`` or ``close``, after deleting the
    failed save's temporary directory; the checkpoints written before it are kept.

    Args:
      workdir: the run directory (relative paths are made absolute: Orbax needs absolute paths).
      keep: number of newest checkpoints to keep (``None`` keeps all).
      keep_period: also keep every checkpoint whose step is a multiple of this, forever (``None``: off).
      async_save: write in a background thread while training continues, for a state of at most
        ``async_max_bytes`` (this process's bytes). A larger state is written synchronously: an asynchronous
        write holds the live buffers until it ends, so the next step cannot donate them and XLA allocates a
        second copy of the whole state (measured: +12 bytes per parameter with AdamW); written before the
        next step, it needs no copy (docs/memory.md).
      async_max_bytes: see ``async_save`` (default `limits.ASYNC_MAX_BYTES`).
      read_only: open for evaluation only (never deletes or creates anything).
      tier: the tier of the states saved and restored (`revtrain.tiers.base.Tier`: its ``checkpoint_form``
        says how a checkpoint holds them; a tier whose states hold its store's refs reads and writes them for
        Orbax's arrays form, `Tier.checkpoint_arrays`); None: each state's own (`form`; a state of such refs
        cannot be saved without its tier).
    """

    def __init__(self, workdir: str, *, keep: int | None = 3, keep_period: int | None = None,
                 async_save: bool = True, async_max_bytes: int | None = None, read_only: bool = False,
                 tier: tiers.Tier | None = None):
        self.tier = tier
        self.async_max_bytes = ASYNC_MAX_BYTES if async_max_bytes is None else async_max_bytes
        self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, keep_period=keep_period,
                                               enable_async_checkpointing=async_save, read_only=read_only,
                                               create=not read_only, cleanup_tmp_directories=not read_only)
        self._state_handler = _bounded_handler()
        handlers = {"state": self._state_handler, "meta": ocp.JsonCheckpointHandler(), "data": DataHandler()}
        # (each registered tier's own checkpoint form: its item and handler, `Tier.checkpoint_handler`)
        handlers.update({cls.checkpoint_item: cls.checkpoint_handler() for cls in tiers.own_forms()})
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        _ignore_late_tensorstore_callbacks()  # a failed save or restore: one error line
        self._in_flight: int | None = None  # step of the newest save not known to be complete
        self.failed: CheckpointWriteError | None = None

    def _write_failed(self, step: int, cause: BaseException | str) -> CheckpointWriteError:
        """Records a failed save of ``step`` and deletes its temporary directory (process 0; frees the
        space the partial checkpoint took), then re-reads the list of complete steps from disk (Orbax may
        still count the failed one). Returns the error to raise."""
        self._in_flight = None
        if jax.process_index() == 0:
            for path in glob.glob(os.path.join(self.directory, f"{step}.orbax-checkpoint-tmp*")):
                shutil.rmtree(path, ignore_errors=True)
        try:
            self._manager.reload()
        except Exception:  # noqa: BLE001 (the listing stays Orbax's; the failure is what gets reported)
            pass
        reason = cause if isinstance(cause, str) else write_failure_reason(cause)
        self.failed = CheckpointWriteError(step, reason)
        return self.failed

    def form(self, ts: TrainState) -> str:
        """How a checkpoint holds ``ts`` (a state or a restore template): its tier's ``checkpoint_form``
        (``"orbax"`` or ``"links"``; `owner`)."""
        owner = self.owner(ts)
        return owner.checkpoint_form if owner is not None else "orbax"

    def owner(self, ts: TrainState) -> type | None:
        """The tier class that checkpoints ``ts`` (a state or a restore template) in a form of its own
        (`revtrain.tiers.base.Tier.checkpoint_item`): this checkpointer's tier's when it has one, else the
        registered tier whose own refs ``ts`` holds (`revtrain.tiers.holder_of`); None: Orbax's arrays."""
        cls = type(self.tier) if self.tier is not None else tiers.holder_of(ts)
        return cls if cls is not None and cls.checkpoint_item else None

    def _written_by(self, step: int) -> type | None:
        """The registered tier class whose own item the checkpoint of ``step`` holds, or None (Orbax's arrays)."""
        for cls in tiers.own_forms():
            if os.path.isdir(os.path.join(self.directory, str(step), cls.checkpoint_item)):
                return cls
        return None

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, ascending."""
        return sorted(self._manager.all_steps())

    def chosen_step(self, step: int | None = None) -> int:
        """``step`` (default: the newest) after checking that a complete checkpoint of it exists.

        Raises:
          CheckpointError: no checkpoints at all, or none for ``step`` (the message lists those there are).
        """
        available = self.steps()
        if not available:
            raise CheckpointError(f"no checkpoints in {self.directory}")
        chosen = available[-1] if step is None else step
        if chosen not in available:
            raise CheckpointError(f"no checkpoint for step {chosen} in {self.directory} "
                                  f"(have {', '.join(map(str, available))})")
        return chosen

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, ts: TrainState, data_iterator, meta: dict, *, force: bool = False) -> bool:
        """Starts saving ``ts`` at step ``ts.step`` (asynchronously); returns whether a save started.

        Raises:
          CheckpointWriteError: this save, or the previous asynchronous one, could not be written.
        """
        self.wait()
        owner = self.owner(ts)
        if owner is not None:  # the tier's own form (e.g. hard links to its files): written at once (the tier may
            state = {owner.checkpoint_item: owner.checkpoint_save(ts)}  # release what it links after the next step)
        else:
            arrays = self._arrays(ts)  # (a state of a store's refs: read into host numpy by its tier)
            tree = _tree(arrays)
            size = state_bytes(ts) if arrays is ts else sum(x.nbytes for x in jax.tree.leaves(tree)
                                                           if isinstance(x, np.ndarray))
            _bound_to_leaves(self._state_handler, tree, "_save_concurrent_bytes", SAVE_STAGING_BYTES)
            state = {"state": ocp.args.StandardSave(tree)}
            del tree, arrays
        args = {**state, "meta": ocp.args.JsonSave({**meta, "step": ts.step})}
        if data_iterator is not None:
            args["data"] = DataSave(data_iterator)
        try:
            started = self._manager.save(ts.step, args=ocp.args.Composite(**args), force=force)
        except Exception as e:  # noqa: BLE001 (Orbax and tensorstore raise many types for a failed write)
            raise self._write_failed(ts.step, e) from e
        if started:
            self._in_flight = ts.step
            if owner is not None:
                self.wait()
            elif size > self.async_max_bytes:
                self.wait()  # synchronous: the next step may donate every buffer (see the class note)
                gc.collect()  # the write's views of the buffers sit in reference cycles: drop them now
                release_free_memory()  # tensorstore's staging buffers, freed in its threads' arenas
        return started

    def _arrays(self, ts: TrainState) -> TrainState:
        """``ts`` as Orbax's arrays form saves it: through this checkpointer's tier (`Tier.checkpoint_arrays`:
        a state of its store's refs read into host numpy), else as it is.

        Raises:
          CheckpointError: ``ts`` holds a registered tier's refs and this checkpointer has no tier (only the
            tier's store reads them).
        """
        if self.tier is not None:
            return self.tier.checkpoint_arrays(ts)
        holder = tiers.holder_of(ts)
        if holder is not None:
            raise CheckpointError(f"a state of the {holder.name} tier's refs is saved through its tier: "
                                  "Checkpointer(..., tier=trainer.residency)")
        return ts

    def restore(self, template: TrainState, step: int | None = None, data_iterator=None, *,
                optimizer_state: bool = True, files: bool = False) -> TrainState:
        """Restores the checkpoint of ``step`` (default: newest) into the shapes and placements of
        ``template`` (so offloaded weights land straight in host memory), in the per-layer layout (a
        trainer regroups it on its first step). Restores the data iterator's position in place when given.
        ``optimizer_state=False`` reads the weights and layer state alone (the optimizer state's leaves are
        Orbax placeholders in the result, never read: ``revtrain check`` needs a third of the memory).
        ``files=True`` with ``optimizer_state=False`` and a checkpoint in a tier's own form restored into a
        template of that tier: each layer's weights as the checkpoint's ref (e.g. the disk tier's file, opened
        read-only by whoever reads it: the checkpoint's inodes are never written), nothing of them read here;
        the tier's store is not touched. Otherwise ignored. A whole restore for a tier whose states hold its
        store's refs (this checkpointer's tier, `Tier.holds_refs`) reads the arrays into host numpy and puts them
        into the store layer by layer (`Tier.restored_arrays`): a template of such a tier resumes through a
        checkpointer given the tier, as `revtrain train`'s is.

        Raises:
          CheckpointError: no such step, or the checkpoint is unreadable or does not match the model.
        """
        step = self.latest_step() if step is None else step
        if step is None or step not in self._manager.all_steps():
            raise CheckpointError(f"no checkpoint for step {step} in {self.directory}")
        written_by = self._written_by(step)
        if written_by is not None:
            return self._restore_own(written_by, template, step, data_iterator, optimizer_state, files)
        owner = self.owner(template)
        if owner is not None and optimizer_state:
            arrays = [repr(cls.gin_value) for cls in map(tiers.lookup, tiers.names())
                      if not cls.checkpoint_item and cls.gin_value is not None]
            raise CheckpointError(f"the checkpoint at step {step} in {self.directory} holds its state in memory "
                                  f"tiers' format: resume it with ReversibleTrainer.offload = {' or '.join(arrays)} "
                                  f"(the {owner.name} tier resumes its own checkpoints), or start a new --workdir")
        if owner is not None:  # weights alone into memory: the shapes the tier's refs hold
            template = owner.array_template(template)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _tree(template.per_layer_shapes()))
        if not optimizer_state:
            return self._restore_weights(abstract, step)
        if self.tier is not None:  # (a tier whose states hold its store's refs: host numpy buffers)
            abstract = self.tier.restore_template(abstract)
        _bound_to_leaves(self._state_handler, abstract, "_restore_concurrent_bytes", STAGING_BYTES)
        args = {"state": ocp.args.StandardRestore(abstract), "meta": ocp.args.JsonRestore()}
        if data_iterator is not None:
            args["data"] = DataRestore(data_iterator)
        try:
            out = self._manager.restore(step, args=ocp.args.Composite(**args))
            tree = out["state"]
            ts = TrainState(int(out["meta"]["step"]), tree["params"], tree["opt_state"], tree["layer_state"])
            del out, tree  # (``ts`` holds the arrays alone: `Tier.restored_arrays` lets go of each layer's)
        except Exception as e:  # Orbax raises many types for corrupt or mismatched files
            raise DamagedCheckpoint(step, damage_reason(e)) from e
        return ts if self.tier is None else self.tier.restored_arrays(ts)  # (into its store, layer by layer)

    def _restore_own(self, owner: type, template: TrainState, step: int, data_iterator, optimizer_state: bool,
                     files: bool = False) -> TrainState:
        """`restore` of a checkpoint in the tier ``owner``'s own form (its `Tier.checkpoint_item`): the item
        read by its handler, the state made by the tier (`Tier.restored`: see `restore`); the data iterator's
        position restored only with the optimizer state (a resume)."""
        args = {owner.checkpoint_item: owner.checkpoint_restore(), "meta": ocp.args.JsonRestore()}
        if data_iterator is not None and optimizer_state:
            args["data"] = DataRestore(data_iterator)
        try:
            out = self._manager.restore(step, args=ocp.args.Composite(**args))
            ts = owner.restored(out[owner.checkpoint_item], template, optimizer_state, files)
            return TrainState(int(out["meta"]["step"]), ts.params, ts.opt_state, ts.layer_state)
        except CheckpointError:
            raise
        except Exception as e:  # a missing or short file, a garbled index
            raise DamagedCheckpoint(step, damage_reason(e)) from e

    def _restore_weights(self, abstract: dict, step: int) -> TrainState:
        """`restore` without the optimizer state: Orbax's partial restore of the weights and layer state
        from the step's ``state`` item (the standard handler cannot leave leaves out; the format is the
        same PyTree one). The result's ``opt_state`` has None for every layer."""
        item = {"params": abstract["params"], "layer_state": abstract["layer_state"]}
        handler = _bound_staging(ocp.PyTreeCheckpointHandler(restore_concurrent_gb=1))
        _bound_to_leaves(handler, item, "_restore_concurrent_bytes", STAGING_BYTES)
        try:
            meta = self.meta(step)
            with ocp.Checkpointer(handler) as reader:
                tree = reader.restore(os.path.join(self.directory, str(step), "state"), args=ocp.args.PyTreeRestore(
                    item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True))
            return TrainState(int(meta["step"]), tree["params"], [None] * len(tree["params"]), tree["layer_state"])
        except DamagedCheckpoint:
            raise
        except Exception as e:  # Orbax raises many types for corrupt or mismatched files
            raise DamagedCheckpoint(step, damage_reason(e)) from e

    def meta(self, step: int) -> dict:
        """The JSON metadata saved with ``step``.

        Raises:
          DamagedCheckpoint: it cannot be read.
        """
        try:
            meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # noqa: BLE001 (missing or garbled JSON, I/O errors)
            raise DamagedCheckpoint(step, damage_reason(e)) from e
        if not isinstance(meta, dict):
            raise DamagedCheckpoint(step, f"its metadata is {type(meta).__name__}, not a JSON object")
        return meta

    def restore_newest(self, template: TrainState, step: int | None = None, data_iterator=None,
                       accept: Callable[[int, dict], None] | None = None,
                       on_skip: Callable[[DamagedCheckpoint], None] | None = None,
                       optimizer_state: bool = True, files: bool = False) -> tuple[TrainState, int]:
        """Restores the newest checkpoint that restores (or exactly ``step``); what every reader uses.

        Without ``step``, tries the complete checkpoints newest first; one that cannot be read (a truncated
        or missing file, garbled metadata) is skipped with one line on stderr naming its step and why (or
        handed to ``on_skip``), and the next older one is tried.

        Args:
          template: shapes and placements to restore into (see `restore`).
          step: restore this step or fail (no fallback).
          data_iterator: also restore the data iterator's position (in place).
          accept: called with ``(step, meta)`` before a checkpoint is restored; raising refuses the
            checkpoint and stops the search (e.g. it was made by another model).
          on_skip: called with the `DamagedCheckpoint` of each skipped checkpoint instead of the line.
          optimizer_state: False: the weights and layer state alone (see `restore`).
          files: with ``optimizer_state=False``, the weights as the checkpoint's refs of a tier with a form of
            its own, e.g. the disk tier's files (see `restore`).

        Returns:
          ``(state, step)``.

        Raises:
          CheckpointError: no checkpoints; ``step`` missing; ``step`` (or, without it, every checkpoint)
            damaged, one line naming the step(s) and why.
        """
        if step is not None:
            self.chosen_step(step)
            try:
                if accept is not None:
                    accept(step, self.meta(step))
                return self.restore(template, step, data_iterator, optimizer_state=optimizer_state, files=files), step
            except DamagedCheckpoint as e:
                others = [s for s in self.steps() if s != step]
                hint = (f" (without --step the newest checkpoint that restores is used; others: "
                        f"{', '.join(map(str, others))})" if others else "")
                raise DamagedCheckpoint(step, e.reason, f"{e}{hint}") from e
        self.chosen_step()  # at least one checkpoint
        failures = []
        for candidate in reversed(self.steps()):
            try:
                meta = self.meta(candidate)
                if accept is not None:
                    accept(candidate, meta)
                return (self.restore(template, candidate, data_iterator, optimizer_state=optimizer_state, files=files),
                        candidate)
            except DamagedCheckpoint as e:
                failures.append(e)
                if on_skip is not None:
                    on_skip(e)
                else:
                    metrics_lib.log(f"skipping the damaged checkpoint at step {e.step}: {e.reason}")
        raise CheckpointError(f"no checkpoint in {self.directory} can be restored: "
                              + "; ".join(f"step {e.step}: {e.reason}" for e in failures))

    def set_aside(self, step: int) -> str:
        """Moves the (damaged) checkpoint of ``step`` out of the way, to
        ``<workdir>/damaged_checkpoints/<step>`` (a numbered suffix if taken), so that a resumed run can save
        that step again; nothing is deleted. Every process calls it (process 0 moves and returns the new
        path; the others return "")."""
        target = ""
        if jax.process_index() == 0:
            aside = os.path.join(os.path.dirname(self.directory), "damaged_checkpoints")
            target, n = os.path.join(aside, str(step)), 1
            while os.path.exists(target):
                n += 1
                target = os.path.join(aside, f"{step}.{n}")
            os.makedirs(aside, exist_ok=True)
            os.rename(os.path.join(self.directory, str(step)), target)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices(f"revtrain_set_aside_{step}")
        self._manager.reload()
        return target

    def wait(self) -> None:
        """Blocks until every started save is complete on disk.

        Raises:
          CheckpointWriteError: the save in flight could not be written.
        """
        try:
            self._manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            step = self._in_flight if self._in_flight is not None else getattr(self.failed, "step", -1)
            raise self._write_failed(step, e) from e
        step, self._in_flight = self._in_flight, None
        # Orbax can also give up on a save without raising: when a write fails late, it logs "Skipping
        # finalization of step checkpoint" and leaves the step in its temporary directory. A save is done
        # only when its step directory exists.
        if step is not None and not os.path.isdir(os.path.join(self.directory, str(step))):
            raise self._write_failed(step, _uncommitted_reason(self.directory))

    def close(self) -> None:
        """Waits for the save in flight and releases Orbax's threads.

        Raises:
          CheckpointWriteError: the save in flight could not be written (not raised again when a failure
            was already raised).
        """
        already = self.failed
        try:
            self.wait()
        except CheckpointWriteError:
            if already is None:
                raise
        try:
            self._manager.close()
        except Exception:  # noqa: BLE001 (a failed save is re-raised by Orbax on close; already reported)
            if self.failed is None:
                raise
