"""Orbax checkpoints: asynchronous saves, keep-N, exact resume (weights, optimizer state, data position).

A checkpoint ``DIR/checkpoints/<step>/`` holds three items:

* ``state``: every layer's params, optimizer state and layer state (``StandardSave`` of a pytree);
* ``data``: the Grain iterator's position (``grain.checkpoint.CheckpointSave``, one file per process), so
  a resumed run replays no batch and skips none;
* ``meta``: JSON with the step and the run's shape-relevant settings.

Orbax writes each step to a temporary directory and renames it when complete, so a checkpoint that was not
finished (killed mid-save) is never listed or used.
"""

from __future__ import annotations

import os

import grain
import jax
import orbax.checkpoint as ocp

from revtrain.trainers.common import TrainState


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or does not fit the current model."""


def _tree(ts: TrainState) -> dict:
    return {"params": ts.params, "opt_state": ts.opt_state, "layer_state": ts.layer_state}


class Checkpointer:
    """Saves and restores `TrainState` + data-iterator position under ``<workdir>/checkpoints``.

    Args:
      workdir: the run directory (relative paths are made absolute: Orbax needs absolute paths).
      keep: number of newest checkpoints to keep (``None`` keeps all).
      keep_period: also keep every checkpoint whose step is a multiple of this, forever (``None``: off).
      async_save: write in a background thread while training continues.
      read_only: open for evaluation only (never deletes or creates anything).
    """

    def __init__(self, workdir: str, *, keep: int | None = 3, keep_period: int | None = None,
                 async_save: bool = True, read_only: bool = False):
        self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, keep_period=keep_period,
                                               enable_async_checkpointing=async_save, read_only=read_only,
                                               create=not read_only)
        handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler(),
                    "data": grain.checkpoint.CheckpointHandler()}
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, ascending."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, ts: TrainState, data_iterator, meta: dict, *, force: bool = False) -> bool:
        """Starts saving ``ts`` at step ``ts.step`` (asynchronously); returns whether a save started."""
        args = {"state": ocp.args.StandardSave(_tree(ts)), "meta": ocp.args.JsonSave({**meta, "step": ts.step})}
        if data_iterator is not None:
            args["data"] = grain.checkpoint.CheckpointSave(data_iterator)
        return self._manager.save(ts.step, args=ocp.args.Composite(**args), force=force)

    def restore(self, template: TrainState, step: int | None = None, data_iterator=None) -> TrainState:
        """Restores the checkpoint of ``step`` (default: newest) into the shapes and placements of
        ``template`` (so offloaded weights land straight in host memory). Restores the data iterator's
        position in place when given.

        Raises:
          CheckpointError: no such step, or the checkpoint is unreadable or does not match the model.
        """
        step = self.latest_step() if step is None else step
        if step is None or step not in self._manager.all_steps():
            raise CheckpointError(f"no checkpoint for step {step} in {self.directory}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _tree(template))
        args = {"state": ocp.args.StandardRestore(abstract), "meta": ocp.args.JsonRestore()}
        if data_iterator is not None:
            args["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
        try:
            out = self._manager.restore(step, args=ocp.args.Composite(**args))
        except Exception as e:  # Orbax raises many types for corrupt or mismatched files
            raise CheckpointError(f"checkpoint at step {step} cannot be restored: {type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''}") from e
        tree = out["state"]
        return TrainState(int(out["meta"]["step"]), tree["params"], tree["opt_state"], tree["layer_state"])

    def meta(self, step: int) -> dict:
        """The JSON metadata saved with ``step``."""
        return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def wait(self) -> None:
        """Blocks until every started save is complete on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
