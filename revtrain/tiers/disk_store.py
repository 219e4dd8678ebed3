"""The disk tier's store: each layer's weights and optimizer state live in files between uses (``offload = 'disk'``).

With ``ReversibleTrainer.offload = 'disk'`` (per-layer executor) nothing of the weights or optimizer state
stays in memory between the programs that use it. Each layer's state is one file: its weight leaves, then its
optimizer state's leaves, in ``jax.tree.flatten`` order, each raw (C order) at an offset aligned to 4 KiB
(`Layout`). A step reads each layer's file ahead of the program that needs it, on a background thread,
while the layers before compute (the forward reads the weights, the backward weights and optimizer state),
the dispatching thread puts it on the device ``depth`` programs before its user, and a second thread writes
each updated layer back while the next ones compute (`revtrain.streaming`'s engine, whose store `DiskStore`
is). The engine's bound (program k waits for program k - depth) keeps resident memory at the layers in
flight: those computing, those put and read ahead, the one being written.

**Files, never rewritten.** Step ``s`` writes every layer to ``<offload_dir>/step_<s>/layer_<i>.bin``, new
files; the previous step's directory is removed only once every file of the new one is written and
``fdatasync``-ed. A file, once complete, never changes. So a checkpoint of a disk-tier state is a set of
hard links to the step's files (`revtrain.tiers.disk_links.LinksHandler`, an Orbax item ``disk_state`` beside
``meta`` and ``data``): no copy, no state in memory, milliseconds. A ``kill -9`` at any moment leaves every committed
checkpoint intact (its inodes are never written again); the resumed run reads the checkpoint's files and
writes its next step into the tier, exactly as the uninterrupted run would have (the programs are the
device tier's: bit for bit the same numbers as ``offload = False`` and ``True``). Leftover step directories
of a killed run are removed when the next run starts.

The file format and its checksums are `revtrain.tiers.disk_format`'s; a checkpoint's hard links
`revtrain.tiers.disk_links`'; the disk space a run needs and the disk's bandwidth `revtrain.tiers.disk_probes`'.

I/O: plain files with large sequential ``readinto`` / ``pwrite`` per leaf (the largest leaves are tens to
hundreds of MB), ``fdatasync`` after each layer's write and ``posix_fadvise(DONTNEED)`` after each read and
write, so the page cache (which a memory cgroup charges) does not grow with the model. Why not the others
(measured with ``scripts/bench_disk_io.py``, docs/disk.md): a ``numpy.memmap`` reads lazily, page fault by page
fault inside whatever touches it (XLA's compute threads: the read no longer overlaps the previous layer, it
stalls this one), its written pages are flushed when the kernel chooses, and its pages stay mapped (resident)
until unmapped; TensorStore adds a chunked format and its own cache to what is one sequential read per leaf,
and measured no faster here. Explicit reads on a thread of their own make the overlap and the bytes in
memory exactly what the plan counts.

The deferred update (global-norm clipping, microbatches, tied parameters: `revtrain.trainers.deferred`)
keeps its whole-step gradient buffer in files too, one per layer, read and written by the same threads
(`revtrain.streaming.DeferredStream`, whose buffers this store keeps as files); it is used up within its step,
so checkpoints never hold it.

ZeRO-Infinity (Rajbhandari et al. 2021) and Fuyou (Liao et al. 2024) keep optimizer state on NVMe in
PyTorch; this module follows the same read-ahead / write-behind idea per reversible layer.
"""

from __future__ import annotations

import os
import shutil

import jax

from revtrain.errors import ConfigError
from revtrain.streaming import Store
from revtrain.tiers import disk_format
from revtrain.tiers.disk_format import DiskLayer, DiskTierError, Layout, _fsync_dir, _remove, link_or_copy

STEP_PREFIX = "step_"


class DiskStore(Store):
    """The disk tier's store (`revtrain.streaming.Store`): the directory of a run's layer files, one
    `DiskLayer` per layer, read and written by the engine's threads: the reader reads a program's files one
    program before their puts are due, and the dispatching thread issues the puts (`revtrain.streaming`).

    Args:
      directory: ``ReversibleTrainer.offload_dir``; None until `attach` names one (the run's
        ``<workdir>/offload``).
    """

    prefix = "disk"
    threaded = True  # files read on the reader thread and written on the writer thread

    def __init__(self, directory: str | None = None):
        super().__init__()
        self.directory = os.path.abspath(directory) if directory else None
        self.workdir = None
        self._layouts: dict = {}
        self._prepared = False

    def attach(self, workdir: str) -> None:
        """Names the default directory, ``<workdir>/offload``, unless one was given (and the run's workdir,
        whose checkpoints the plan counts as space the run holds already)."""
        self.workdir = os.path.abspath(workdir)
        if self.directory is None:
            self.directory = os.path.join(os.path.abspath(workdir), "offload")

    @property
    def in_workdir(self) -> bool:
        """Whether the layer files go to the run's own ``<workdir>/offload`` (or no directory is named yet):
        the workdir's lock and checks cover it; an ``offload_dir`` elsewhere needs its own."""
        return self.directory is None or (self.workdir is not None
                                          and self.directory == os.path.join(self.workdir, "offload"))

    def _dir(self) -> str:
        if self.directory is None:
            raise ConfigError("ReversibleTrainer.offload = 'disk' needs ReversibleTrainer.offload_dir (the "
                              "train command sets it to <workdir>/offload)")
        return self.directory

    def layout(self, key, params, opt_state) -> Layout:
        """The (cached) `Layout` of trees of shapes, under ``key`` (e.g. the layer)."""
        if key not in self._layouts:
            self._layouts[key] = Layout.of(params, opt_state)
        return self._layouts[key]

    def step_dir(self, step: int) -> str:
        return os.path.join(self._dir(), f"{STEP_PREFIX}{step:08d}")

    def check_directory(self) -> None:
        """Refuses an ``offload_dir`` that is a file, or whose parent directory does not exist (a typo would
        otherwise create a whole new tree). The default, ``<workdir>/offload``, passes: the train command
        creates the workdir.

        Raises:
          ConfigError: one line naming the directory and what is wrong with it.
        """
        if self.directory is not None and os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise ConfigError(f"ReversibleTrainer.offload_dir = {self.directory!r} is a file, not a directory (name a "
                              "directory, or leave offload_dir unset for <workdir>/offload)")
        if self.in_workdir:
            return
        parent = os.path.dirname(self.directory)
        if os.path.exists(parent) and not os.path.isdir(parent):
            raise ConfigError(f"ReversibleTrainer.offload_dir = {self.directory!r}: its parent {parent} is a file, not "
                              "a directory (name a directory, or leave offload_dir unset for <workdir>/offload)")
        if not os.path.isdir(parent):
            raise ConfigError(f"ReversibleTrainer.offload_dir = {self.directory!r}: its parent directory {parent} does "
                              "not exist (create it, or leave offload_dir unset for <workdir>/offload)")

    def prepare(self, keep=()) -> None:
        """Creates the directory (its parent must exist, `check_directory`) and removes the step directories a
        killed run left there (but those holding the files of ``keep``: `DiskLayer`s still in use)."""
        if self._prepared:
            return
        root = self._dir()
        self.check_directory()
        os.makedirs(root, exist_ok=True)
        used = {os.path.dirname(os.path.abspath(r.path)) for r in keep if isinstance(r, DiskLayer) and r.path}
        for name in os.listdir(root):
            path = os.path.join(root, name)
            if name.startswith(STEP_PREFIX) and path not in used:
                shutil.rmtree(path, ignore_errors=True)
        self._prepared = True

    def write_initial(self, step: int, index: int, layout: Layout, params, opt_state) -> DiskLayer:
        """Layer ``index``'s initial state written (synchronously) as step ``step``'s file."""
        self.prepare()
        folder = self.step_dir(step)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"layer_{index:05d}.bin")
        sums = disk_format.write_layer(path, layout, jax.tree.leaves(params) + jax.tree.leaves(opt_state))
        return DiskLayer(layout, path, sums)

    def seal(self, step: int) -> None:
        """Makes the directory entries of step ``step``'s files durable."""
        _fsync_dir(self.step_dir(step))
        _fsync_dir(self._dir())

    # -- the engine's store (`revtrain.streaming.Store`) --
    def holds(self, ref) -> bool:
        return isinstance(ref, DiskLayer)

    def refs(self, params: list, opt_state: list) -> list:
        return list(params)  # (a disk-tier state's params and opt_state are the same `DiskLayer`s)

    def state(self, refs: list) -> tuple[list, list]:
        return list(refs), list(refs)

    def nbytes(self, ref, part: str | None = None) -> int:
        return ref.layout.nbytes(part)

    def load(self, ref, part: str) -> list:
        """``ref``'s ``part`` read from its file into numpy buffers, checksummed (on the reader thread)."""
        return disk_format.read_leaves(ref.path, ref.layout, part, None, ref.sums)

    def read(self, items: list, place, loaded=None) -> list:
        """The device trees of ``items`` (``(ref, part)``) from their loaded leaves (`load`; read here when
        None), each leaf's put issued by ``place`` on the dispatching thread."""
        if loaded is None:
            loaded = [self.load(ref, part) for ref, part in items]
        out = []
        for (ref, part), leaves in zip(items, loaded, strict=True):
            treedef = ref.layout.params_def if part == "params" else ref.layout.opt_def
            out.append(jax.tree.unflatten(treedef, [place(x) for x in leaves]))
        return out

    def layer_path(self, step: int, g: int) -> str:
        return os.path.join(self.step_dir(step), f"layer_{g:05d}.bin")

    def write(self, step: int, g: int, ref, update: list) -> DiskLayer:
        """Writes group ``g``'s file of step ``step`` from ``update = [params, opt_state]``, emptied here:
        the list of leaves built from it is then the only reference, and each leaf is released as soon as it
        is written (`write_layer`)."""
        path = self.layer_path(step, g)
        leaves = jax.tree.leaves(update[0]) + jax.tree.leaves(update[1])
        update.clear()
        return DiskLayer(ref.layout, path, disk_format.write_layer(path, ref.layout, leaves))

    def begin(self, step: int, refs: list) -> None:
        self.prepare(keep=refs)
        os.makedirs(self.step_dir(step), exist_ok=True)

    def unchanged(self, step: int, g: int, ref) -> DiskLayer:
        """A group the step did not update: its file linked into the new step (the same bytes)."""
        if not isinstance(ref, DiskLayer):
            raise DiskTierError(f"group {g} of a disk-tier step was neither read from a file nor written")
        path = self.layer_path(step, g)
        link_or_copy(ref.path, path)
        return DiskLayer(ref.layout, path, ref.sums)

    def end(self, step: int, refs: list) -> None:
        """Makes the new step durable and removes the previous step's files from the tier."""
        self.seal(step)
        self.remove_step([r for r in refs if isinstance(r, DiskLayer)])

    # -- the deferred update's gradient buffers (`revtrain.streaming.DeferredStream`): files too --
    def grad_dir(self, step: int) -> str:
        return os.path.join(self.step_dir(step), "grads")

    def begin_buffers(self, step: int) -> None:
        os.makedirs(self.grad_dir(step), exist_ok=True)

    def buffer_ref(self, step: int, g: int, version: int, shapes) -> DiskLayer:
        """A new buffer file ``<step dir>/grads/grad_<g>_<version>.bin`` (its checksums set by the writer,
        before it is read)."""
        return DiskLayer(self.layout(("grad", g), shapes, ()),
                         os.path.join(self.grad_dir(step), f"grad_{g:05d}_{version}.bin"))

    def write_buffer(self, ref: DiskLayer, value) -> None:
        leaves = jax.tree.leaves(value)
        del value
        ref.sums = disk_format.write_layer(ref.path, ref.layout, leaves)

    def drop_buffer(self, ref: DiskLayer) -> None:
        _remove(ref.path)

    def end_buffers(self, step: int) -> None:
        shutil.rmtree(self.grad_dir(step), ignore_errors=True)

    def remove_step(self, refs: list) -> None:
        """Removes the step directories of ``refs`` that lie inside the tier's directory (a checkpoint's
        hard links keep their bytes)."""
        root = self._dir()
        for folder in {os.path.dirname(os.path.abspath(r.path)) for r in refs if isinstance(r, DiskLayer) and r.path}:
            if os.path.dirname(folder) == root and os.path.basename(folder).startswith(STEP_PREFIX):
                shutil.rmtree(folder, ignore_errors=True)
