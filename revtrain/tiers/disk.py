"""The disk tier (``ReversibleTrainer.offload = 'disk'``): one file per layer, streamed to the device.

Nothing of the weights or optimizer state stays in memory between the programs that use it: each layer is one
file (`revtrain.tiers.disk_format`) in the store's directory (`revtrain.tiers.disk_store.DiskStore`, which the
streaming engine reads ahead and writes behind), a checkpoint holds hard links to a step's files
(`revtrain.tiers.disk_links`), a sample that streams the weights reads each layer's file with the next read
ahead on the store's reader thread (`revtrain.tiers.cycle`, as for any threaded store) and an export reads
each file when it reaches the layer (`revtrain.tiers.base.LayerWeights`), and the plan asks the disk's space
and bandwidth (`revtrain.tiers.disk_probes`). A state's params and optimizer state are the same `DiskLayer` per
layer.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import Mesh

from revtrain.placement import placer
from revtrain.tiers import disk_probes
from revtrain.tiers.base import Tier
from revtrain.tiers.disk_format import DiskLayer, read_tree
from revtrain.tiers.disk_store import STEP_PREFIX, DiskStore


class DiskTier(Tier):
    """The disk tier: one file per layer, its `DiskStore` the store the engine streams.

    Args:
      mesh, sharded: see `revtrain.tiers.base.Tier`.
      store: the `DiskStore` (its directory: ``ReversibleTrainer.offload_dir``; default: one named later by
        `attach`).
    """

    name = "disk"
    gin_value = "disk"
    label = " + offload='disk'"
    checkpoint_form = "links"
    checkpoint_item = "disk_state"  # (`revtrain.tiers.disk_links.ITEM`)
    state_memory = None  # (in its files: the layers in flight only)
    uses_directory = True

    def __init__(self, mesh: Mesh, sharded: bool = False, store: DiskStore | None = None,
                 directory: str | None = None):
        super().__init__(mesh, sharded)
        self.store = store if store is not None else DiskStore(directory)

    def describe_place(self) -> str:
        return f"layer files in {self.store.directory or 'the offload directory'}"

    def refusal(self) -> str | None:
        if jax.process_count() > 1:
            return "ReversibleTrainer.offload = 'disk' runs in one process only (yet)"
        return None

    # -- placement --
    def put_layer(self, index: int, params, opt_state, pspec=None, ospec=None) -> tuple:
        """Writes layer ``index``'s initial state as step 0's file (synchronously): its `DiskLayer`, twice."""
        params, opt_state = jax.tree.map(np.asarray, (params, opt_state))
        layout = self.store.layout(("layer", index), params, opt_state)
        ref = self.store.write_initial(0, index, layout, params, opt_state)
        return ref, ref

    def end_init(self) -> None:
        self.store.seal(0)

    def layer_template(self, index: int, shapes, opt_shapes, pspec=None, ospec=None) -> tuple:
        """A `DiskLayer` with no file: what `revtrain.checkpoint` restores a disk state into."""
        ref = DiskLayer(self.store.layout(("layer", index), shapes, opt_shapes))
        return ref, ref

    def fetch(self, tree):
        if isinstance(tree, DiskLayer):  # the weights read from the layer's file
            return read_tree(tree.path, tree.layout, "params", placer(self.mesh))
        return super().fetch(tree)

    # -- the run's hooks --
    def attach(self, workdir: str) -> None:
        super().attach(workdir)
        self.store.attach(workdir)

    def check_run(self) -> None:
        """Refuses an ``offload_dir`` that is a file or whose parent is missing (`DiskStore.check_directory`)."""
        self.store.check_directory()

    def own_directory(self) -> str | None:
        return None if self.store.in_workdir else self.store.directory

    @classmethod
    def leftovers(cls, workdir: str) -> str | None:
        """One line when ``<workdir>/offload`` holds a disk-tier state that a run of another tier will not use
        (left by an earlier run with ``offload = 'disk'``): its steps and size, and that removing it loses
        nothing (a disk-tier checkpoint holds hard links of its own)."""
        folder = os.path.join(workdir, "offload")
        steps = sorted(n for n in os.listdir(folder) if n.startswith(STEP_PREFIX)) if os.path.isdir(folder) else []
        if not steps:
            return None
        size = sum(e.stat().st_size for n in steps for e in os.scandir(os.path.join(folder, n)) if e.is_file())
        return (f"{folder} holds {len(steps)} step(s) of an earlier disk-tier state ({size / 2**20:,.0f} MiB) that "
                "this run does not use: the checkpoints keep links of their own, so removing it frees the space and "
                "loses nothing")

    # -- plan terms --
    def layers_in_flight(self) -> int:
        """The layer computing and the one read ahead (on the device; the one being written is a host copy)."""
        return 2

    def capacity(self, held=()) -> tuple[int, str]:
        return disk_probes.disk_free(self._directory(), held)

    def space_need(self, state_bytes: int, keep: int | None, every: int) -> tuple[int, int]:
        return disk_probes.disk_need(state_bytes, keep, every)

    def bandwidth(self) -> dict:
        return disk_probes.bandwidth(self._directory())

    def _directory(self) -> str:
        return self.store.directory or os.path.join(os.getcwd(), "offload")

    def store_parts(self, weights: int, opt: int, keep: int | None, every: int, deferred: bool) -> dict:
        """Two steps' layer files (a step writes its new files beside the ones it reads), the kept checkpoints
        the tier has moved past (`disk_probes.disk_need`) and, with the deferred update, two gradients' worth of
        buffer files (a layer's old and new file at most)."""
        _, beyond = disk_probes.disk_need(weights + opt, keep, every)
        parts = {"weights": 2 * weights, "optimizer_state": 2 * opt, "checkpoint": beyond}
        if deferred:
            parts["gradients"] = 2 * weights
        return parts

    def store_advice(self) -> tuple[str, str]:
        return ("two steps' layer files and the kept checkpoints beyond them",
                "free disk space, lower train.keep_checkpoints, set train.checkpoint_every = 1 (the newest checkpoint "
                "then shares the live files) or put ReversibleTrainer.offload_dir on a larger disk")

    def step_io(self, weights: int, opt: int, head_weights: int, deferred: tuple | None = None) -> dict:
        """The layer files a step reads and writes (`io_per_step`; a deferred update's `disk_probes.deferred_io`)
        against the directory's sequential bandwidth (`disk_probes.bandwidth`: measured once, cached)."""
        if deferred is not None:
            read, write = disk_probes.deferred_io(weights, opt, head_weights, *deferred)
        else:
            read, write = self.io_per_step(weights, opt, head_weights)
        bandwidth = self.bandwidth()
        r, w = bandwidth.get("read"), bandwidth.get("write")
        return {"read_bytes": read, "write_bytes": write, "read_bandwidth": r, "write_bandwidth": w,
                "seconds": read / r + write / w if r and w else None, "bandwidth_source": bandwidth.get("source", "")}

    # -- checkpoint and sampling forms --
    @classmethod
    def holds_state(cls, ts) -> bool:
        """Whether ``ts``'s first layer's params is a `DiskLayer` (its layers are files)."""
        params = ts.held()[0]
        return bool(params) and isinstance(params[0], DiskLayer)

    @classmethod
    def checkpoint_handler(cls):
        """`revtrain.tiers.disk_links.LinksHandler`: hard links to the layer files."""
        from revtrain.tiers import disk_links
        return disk_links.LinksHandler()

    @classmethod
    def checkpoint_save(cls, ts):
        from revtrain.tiers import disk_links
        return disk_links.LinksSave(list(ts.params), list(ts.layer_state), ts.step)

    @classmethod
    def checkpoint_restore(cls):
        from revtrain.tiers import disk_links
        return disk_links.LinksRestore()

    @classmethod
    def restored(cls, item, template, optimizer_state: bool = True, files: bool = False):
        """`revtrain.tiers.disk_links.restore_state`: the checkpoint's files for a disk-tier template, else its
        files read into the template's arrays."""
        from revtrain.tiers import disk_links
        return disk_links.restore_state(item, template, optimizer_state, files)

    @classmethod
    def array_template(cls, template):
        """Each layer's weights' shapes from its `DiskLayer`'s layout, no optimizer state."""
        from revtrain.tiers import disk_links
        if not cls.holds_state(template):
            return template
        return type(template)(template.step, [disk_links.weights_shapes(r.layout) for r in template.params],
                              [None] * len(template.params), template.layer_state)

    def sample_words(self) -> tuple[str, str]:
        return "from their files", "reads {} from disk"
