"""The disk tier: each layer's weights and optimizer state live in files between uses (``offload = 'disk'``).

With ``ReversibleTrainer.offload = 'disk'`` (per-layer executor) nothing of the weights or optimizer state
stays in memory between the programs that use it. Each layer's state is one file: its weight leaves, then its
optimizer state's leaves, in ``jax.tree.flatten`` order, each raw (C order) at an offset aligned to 4 KiB
(`Layout`). A step reads each layer's file ahead of the program that needs it, on a background thread,
while the layers before compute (the forward reads the weights, the backward weights and optimizer state),
the dispatching thread puts it on the device ``depth`` programs before its user, and a second thread writes
each updated layer back while the next ones compute (`revtrain.streaming`'s engine, whose store `DiskTier`
is). The engine's bound (program k waits for program k - depth) keeps resident memory at the layers in
flight: those computing, those put and read ahead, the one being written.

**Files, never rewritten.** Step ``s`` writes every layer to ``<offload_dir>/step_<s>/layer_<i>.bin``, new
files; the previous step's directory is removed only once every file of the new one is written and
``fdatasync``-ed. A file, once complete, never changes. So a checkpoint of a disk-tier state is a set of
hard links to the step's files (`DiskStateHandler`, an Orbax item ``disk_state`` beside ``meta`` and
``data``): no copy, no state in memory, milliseconds. A ``kill -9`` at any moment leaves every committed
checkpoint intact (its inodes are never written again); the resumed run reads the checkpoint's files and
writes its next step into the tier, exactly as the uninterrupted run would have (the programs are the
device tier's: bit for bit the same numbers as ``offload = False`` and ``True``). Leftover step directories
of a killed run are removed when the next run starts.

**Checksums.** Each leaf's bytes are hashed (xxHash's XXH3, 64 bits) as they are written; the digests travel
with the file's `DiskLayer` and into a checkpoint's ``index.json`` beside the leaves' offsets and shapes. Every
read checks the leaves it reads, and a checkpoint's files are checked whole when it is restored (`load_links`),
so a flipped byte is one line naming the file (`DamagedFile`); a resumed run sets the checkpoint aside, as a
truncated one, and resumes from the one before. A checkpoint written before checksums is read unverified, with
a note.

Disk space (`disk_need`): two steps' files during a step (the step being written beside the one it reads),
plus each kept checkpoint whose step the tier has moved past (a checkpoint of the live step shares its
files). Checked by the memory plan at start-up (`revtrain.planning`).

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

import dataclasses
import json
import os
import shutil
import time

import jax
import numpy as np
import xxhash

from revtrain.errors import ConfigError, RunFailure
from revtrain.streaming import Store

ALIGN = 4096
STEP_PREFIX = "step_"


class DiskTierError(RunFailure, OSError):
    """A layer file cannot be read or written (one line: the path and the OS's reason)."""


class DamagedFile(DiskTierError):
    """A layer file's bytes differ from the checksum recorded when it was written (one line naming the file)."""


# -- checksums ---------------------------------------------------------------------------------------

CHECKSUM = "xxh3_64"  # the name stored in a checkpoint's index.json beside the digests
_CHUNK = 1 << 20  # bytes a whole-file check reads at a time


def _hasher():
    """A new streaming hash of one leaf's bytes (XXH3 64-bit, xxHash; it releases the GIL while it hashes,
    about 30 GB/s on one core here: far above the disk's bandwidth)."""
    return xxhash.xxh3_64()


def _mismatch(path: str, layout, i: int) -> DamagedFile:
    part = "weight" if i < layout.num_params_leaves else "optimizer-state"
    return DamagedFile(f"{path}: {part} leaf {i} does not match its {CHECKSUM} checksum (the file is damaged)")


def verify_file(path: str, layout, sums) -> None:
    """Checks every leaf of the file ``path`` (``layout``) against ``sums`` (per leaf, as `write_layer`
    returned them), reading it in 1 MiB pieces (memory: one piece) and dropping it from the page cache.

    Raises:
      DamagedFile: a leaf's bytes do not match.
      DiskTierError: the file is missing, short or unreadable.
    """
    if len(sums) != len(layout.shapes):
        raise DamagedFile(f"{path}: {len(sums)} checksums for a layout of {len(layout.shapes)} leaves")
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    try:
        with open(path, "rb", buffering=0) as f:
            for i, want in enumerate(sums):
                h, left = _hasher(), _nbytes(layout.shapes[i], layout.dtypes[i])
                f.seek(layout.offsets[i])
                while left:
                    n = f.readinto(view[:min(left, _CHUNK)])
                    if not n:
                        raise DiskTierError(f"{path} is shorter than its layout ({layout.size} bytes)")
                    h.update(view[:n])
                    left -= n
                if h.intdigest() != int(want):
                    raise _mismatch(path, layout, i)
            _drop_cache(f.fileno())
    except DiskTierError:
        raise
    except OSError as e:
        raise DiskTierError(f"cannot read {path}: {e.strerror or e}") from None


# -- the file layout --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each leaf of one layer's ``(params, opt_state)`` lies in its file.

    Attributes:
      params_def, opt_def: the trees' structures (``jax.tree.structure``).
      shapes, dtypes: per leaf, params' leaves first.
      offsets: byte offset of each leaf (multiples of `ALIGN`).
      num_params_leaves: how many of the leaves are weights.
      size: the file's size in bytes.
    """

    params_def: object
    opt_def: object
    shapes: tuple
    dtypes: tuple
    offsets: tuple
    num_params_leaves: int
    size: int

    @classmethod
    def of(cls, params, opt_state) -> "Layout":
        """The layout of trees of arrays or ``jax.ShapeDtypeStruct``."""
        p_leaves, p_def = jax.tree.flatten(params)
        o_leaves, o_def = jax.tree.flatten(opt_state)
        shapes, dtypes, offsets, at = [], [], [], 0
        for x in p_leaves + o_leaves:
            shapes.append(tuple(np.shape(x)))
            dtypes.append(np.dtype(x.dtype))
            offsets.append(at)
            at += -(-_nbytes(shapes[-1], dtypes[-1]) // ALIGN) * ALIGN
        return cls(p_def, o_def, tuple(shapes), tuple(dtypes), tuple(offsets), len(p_leaves), at)

    def region(self, part: str) -> range:
        """Leaf indices of ``part`` (``"params"`` or ``"opt"``)."""
        n = self.num_params_leaves
        return range(n) if part == "params" else range(n, len(self.shapes))

    def nbytes(self, part: str | None = None) -> int:
        """Bytes of the leaves of ``part`` (both parts: None)."""
        idx = range(len(self.shapes)) if part is None else self.region(part)
        return sum(_nbytes(self.shapes[i], self.dtypes[i]) for i in idx)

    def describe(self) -> list:
        """JSON form (shapes, dtypes, offsets) saved beside a checkpoint's files."""
        return [[list(s), str(d), o] for s, d, o in zip(self.shapes, self.dtypes, self.offsets)]


def _nbytes(shape, dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


class DiskLayer:
    """One layer's weights and optimizer state in a file (a `TrainState` leaf of a disk-tier state: the
    same object is the layer's ``params`` and ``opt_state``). ``path`` None: a template (shapes only).
    ``sums``: each leaf's checksum (`write_layer`), checked on every read; None: not known (a file of a
    checkpoint written before checksums, or one being written: its writer sets them)."""

    def __init__(self, layout: Layout, path: str | None = None, sums: tuple | None = None):
        self.layout, self.path, self.sums = layout, path, sums

    def __repr__(self) -> str:
        return f"DiskLayer({self.path or 'template'}, {self.layout.size} bytes)"


def on_disk(ts) -> bool:
    """Whether a `TrainState` keeps its layers in files (its first layer's params is a `DiskLayer`)."""
    params = ts.held()[0]
    return bool(params) and isinstance(params[0], DiskLayer)


# -- reading and writing one file -------------------------------------------------------------------

def _drop_cache(fd: int) -> None:
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):
        pass


def read_leaves(path: str, layout: Layout, part: str, place=None, sums=None) -> list:
    """The leaves of ``part`` read from ``path``, each into a fresh numpy buffer (one ``readinto`` per
    leaf), passed through ``place`` (e.g. ``jax.device_put``) as soon as it is read, so at most one leaf
    exists twice. With ``sums`` (every leaf's checksum, `write_layer`'s) each leaf read is checked first.

    Raises:
      DamagedFile: a leaf does not match its checksum.
      DiskTierError: the file is missing, short or unreadable.
    """
    out = []
    try:
        with open(path, "rb", buffering=0) as f:
            for i in layout.region(part):
                buf = np.empty(layout.shapes[i], layout.dtypes[i])
                view = memoryview(buf.reshape(-1).view(np.uint8))
                f.seek(layout.offsets[i])
                got = 0
                while got < len(view):
                    n = f.readinto(view[got:])
                    if not n:
                        raise DiskTierError(f"{path} is shorter than its layout ({layout.size} bytes)")
                    got += n
                if sums is not None:
                    h = _hasher()
                    h.update(view)
                    if h.intdigest() != int(sums[i]):
                        raise _mismatch(path, layout, i)
                out.append(place(buf) if place is not None else buf)
                del buf, view
            _drop_cache(f.fileno())
    except DiskTierError:
        raise
    except OSError as e:
        raise DiskTierError(f"cannot read {path}: {e.strerror or e}") from None
    return out


def read_tree(path: str, layout: Layout, part: str, place=None, sums=None):
    """`read_leaves` as the tree of ``part``."""
    treedef = layout.params_def if part == "params" else layout.opt_def
    return jax.tree.unflatten(treedef, read_leaves(path, layout, part, place, sums))


def write_layer(path: str, layout: Layout, leaves: list) -> tuple:
    """Writes a layer's leaves (its params' then its optimizer state's, in ``jax.tree.leaves`` order; numpy or
    jax arrays, a jax array waited for here) to a new file ``path``, one ``pwrite`` per leaf, then
    ``fdatasync``: when this returns the file is complete on disk. ``leaves`` is consumed: each entry is set
    to None once written, so a leaf the caller holds nowhere else is released then (a layer being written
    shrinks leaf by leaf instead of staying whole until its last byte). Each leaf's bytes are hashed as
    they are written (`_hasher`, no second pass): returns the checksums, one int per leaf.

    Raises:
      DiskTierError: the write failed (e.g. the disk is full); the partial file is removed.
    """
    if len(leaves) != len(layout.shapes):
        raise ValueError(f"{len(leaves)} leaves for a layout of {len(layout.shapes)}")
    fd, sums = None, []
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(fd, layout.size)
        for i, leaf in enumerate(leaves):
            data = np.asarray(leaf, order="C")
            if data.shape != layout.shapes[i] or data.dtype != layout.dtypes[i]:
                raise ValueError(f"leaf {i}: {data.shape} {data.dtype}, layout {layout.shapes[i]} {layout.dtypes[i]}")
            view, done, h = memoryview(data.reshape(-1).view(np.uint8)), 0, _hasher()
            while done < len(view):
                n = os.pwrite(fd, view[done:], layout.offsets[i] + done)
                h.update(view[done:done + n])
                done += n
            sums.append(h.intdigest())
            del data, view
            leaves[i] = None  # the device buffer can go as soon as it is written
        os.fdatasync(fd)
        _drop_cache(fd)
    except OSError as e:
        if fd is not None:
            os.close(fd)
            fd = None
            _remove(path)
        raise DiskTierError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        if fd is not None:
            os.close(fd)
    return tuple(sums)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def link_or_copy(source: str, target: str) -> None:
    """``target`` as a hard link to ``source`` (the same inode: no bytes written), or a copy where the file
    system has no hard links or the two are on different file systems."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


# -- the tier -------------------------------------------------------------------------------------

class DiskTier(Store):
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
        sums = write_layer(path, layout, jax.tree.leaves(params) + jax.tree.leaves(opt_state))
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
        return read_leaves(ref.path, ref.layout, part, None, ref.sums)

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
        return DiskLayer(ref.layout, path, write_layer(path, ref.layout, leaves))

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
        ref.sums = write_layer(ref.path, ref.layout, leaves)

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


def deferred_io(weights: int, opt: int, head_weights: int, owner_weights: int, microbatches: int,
                passes: int, held: int = 0) -> tuple[int, int]:
    """``(bytes read, bytes written)`` by one deferred-update step of the disk tier (`deferred_schedule`
    with no blocks inside the head's program): per microbatch every layer's weights twice but the head's
    once, the tied owners' once more, every buffer but in the first microbatch, every buffer written;
    each pass reads weights, optimizer state and buffer; the new weights and optimizer state written once.
    ``held``: the bytes of the buffer the engine keeps on the device from the last backward to the first
    statistics program right after it (the first layer's, at ``Store.depth`` 1 or more: `DeferredStream`),
    neither written nor read back once (0 counts it as moved: an upper bound)."""
    per_microbatch = 2 * weights - head_weights + owner_weights
    read = microbatches * per_microbatch + (microbatches - 1) * weights + passes * (2 * weights + opt)
    return read - held, microbatches * weights + weights + opt - held


class LayerWeights:
    """A list-like view of a state's layers whose ``[i]`` is layer ``i``'s weights as numpy arrays, read from
    its file at that moment (a layer held in memory: its arrays as numpy), never cached: a reader that visits
    the layers in turn and drops each (``revtrain export``'s shards) holds one layer, not the model.

    Args:
      refs: one entry per layer, a `DiskLayer` or a tree of arrays.

    Raises (on ``[i]``):
      DiskTierError: the file is missing, short or unreadable.
    """

    def __init__(self, refs: list):
        self.refs = list(refs)

    def __len__(self) -> int:
        return len(self.refs)

    def __getitem__(self, i: int):
        ref = self.refs[i]
        if isinstance(ref, DiskLayer):
            return read_tree(ref.path, ref.layout, "params", sums=ref.sums)
        return jax.tree.map(np.asarray, ref)


# -- checkpoints: hard links to a step's files -------------------------------------------------------

INDEX = "index.json"


def save_links(directory: str, refs: list, layer_state: list, step: int) -> None:
    """Writes a checkpoint item of a disk-tier state into ``directory``: a hard link per layer file, the
    layouts and each file's leaf checksums (``index.json``) and the small layer state (``layer_state.npz``)."""
    os.makedirs(directory, exist_ok=True)
    index = {"step": step, "layers": []}
    for g, ref in enumerate(refs):
        name = f"layer_{g:05d}.bin"
        link_or_copy(ref.path, os.path.join(directory, name))
        index["layers"].append({"file": name, "size": ref.layout.size, "leaves": ref.layout.describe(),
                                "params_leaves": ref.layout.num_params_leaves})
        if ref.sums is not None:
            index["layers"][-1][CHECKSUM] = [f"{x:016x}" for x in ref.sums]
    arrays = {f"l{g}_{k}": np.asarray(x) for g, s in enumerate(layer_state) for k, x in enumerate(jax.tree.leaves(s))}
    with open(os.path.join(directory, "layer_state.npz"), "wb") as f:
        np.savez(f, **arrays)
    with open(os.path.join(directory, INDEX), "w") as f:
        json.dump(index, f)
    _fsync_dir(directory)


def load_links(directory: str) -> dict:
    """The item `save_links` wrote: ``{"directory", "index", "layer_state": {name: array}, "note"}``. Every
    file is checked whole against its leaves' checksums (`verify_file`: one read of the checkpoint's state); a
    checkpoint written before checksums is read unverified, and ``note`` says so (one line for the log;
    None otherwise).

    Raises:
      ValueError: the index is missing or garbled, or a file is missing or of the wrong size.
      DamagedFile: a file's bytes do not match its checksums.
    """
    with open(os.path.join(directory, INDEX)) as f:
        index = json.load(f)
    for entry in index["layers"]:
        path = os.path.join(directory, entry["file"])
        size = os.path.getsize(path)
        if size != entry["size"]:
            raise ValueError(f"{path} holds {size} bytes, its layout {entry['size']}")
    unverified = [e["file"] for e in index["layers"] if CHECKSUM not in e]
    for entry in index["layers"]:
        if CHECKSUM in entry:
            verify_file(os.path.join(directory, entry["file"]), _saved_layout(entry),
                        [int(x, 16) for x in entry[CHECKSUM]])
    note = None
    if unverified:
        note = (f"the disk-tier checkpoint at step {index.get('step')} ({directory}) has no checksums for "
                f"{len(unverified)} of its {len(index['layers'])} layer files (written before they existed): those "
                "are read unverified")
    with np.load(os.path.join(directory, "layer_state.npz")) as z:
        layer_state = {k: z[k] for k in z.files}
    return {"directory": str(directory), "index": index, "layer_state": layer_state, "note": note}


def _saved_layout(entry: dict) -> Layout:
    """The `Layout` (shapes, dtypes, offsets; no tree structures) of an ``index.json`` layer entry."""
    leaves = entry["leaves"]
    return Layout(None, None, tuple(tuple(s) for s, _, _ in leaves), tuple(np.dtype(d) for _, d, _ in leaves),
                  tuple(o for _, _, o in leaves), entry["params_leaves"], entry["size"])


def check_layout(saved: dict, layout: Layout, g: int) -> None:
    """Raises ValueError when layer ``g``'s saved layout is not ``layout`` (another model or optimizer)."""
    if saved["leaves"] != layout.describe() or saved["params_leaves"] != layout.num_params_leaves:
        raise ValueError(f"layer {g}'s file does not match the model's shapes")


# -- disk space and bandwidth ----------------------------------------------------------------------

def disk_need(state_bytes: int, keep: int | None, every: int) -> tuple[int, int]:
    """``(live bytes, checkpoint bytes)`` on disk at a disk-tier run's peak: two steps' files during a step,
    plus each kept checkpoint the tier has moved past (``keep`` newest, None: all counted as 100 ...; with
    ``every == 1`` the newest is the live step's files, shared)."""
    kept = 100 if keep is None else max(int(keep), 1)
    beyond = kept - 1 if every == 1 else kept
    return 2 * state_bytes, beyond * state_bytes


def disk_free(directory: str, held=()) -> tuple[int, str]:
    """The bytes a disk-tier run may occupy: free space on the file system of ``directory`` (its nearest
    existing parent) plus what the run holds there already (each file once, hard links counted once): its
    layer files in ``directory`` and the other directories in ``held`` (its checkpoints, which the plan's
    need includes). ``(bytes, description)``."""
    probe = os.path.abspath(directory)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    free = shutil.disk_usage(probe).free
    owned, seen = 0, set()
    for top in (directory, *held):
        for root, _, files in os.walk(top):
            for f in files:
                try:
                    st = os.stat(os.path.join(root, f))
                except OSError:
                    continue
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    owned += st.st_blocks * 512
    return free + owned, f"free on {probe}" + (f" + {owned / 2**30:.2f} GiB the run holds" if owned >= 2**20 else "")


BANDWIDTH_BYTES = 128 * 2**20
_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "revtrain", "disk_bandwidth.json")


def bandwidth(directory: str, cache: str | None = _CACHE, nbytes: int = BANDWIDTH_BYTES) -> dict:
    """The sequential bandwidth of the disk holding ``directory``: ``{"read": B/s, "write": B/s, "source"}``.
    Measured once (write ``nbytes`` with ``fdatasync``, drop it from the page cache, read it back) and cached
    per file system (``st_dev``) in ``cache`` (None: always measure); not measured (None, None) where the file
    system has less than twice ``nbytes`` free: the probe would crowd the disk it is asked about."""
    probe = os.path.abspath(directory)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    key = str(os.stat(probe).st_dev)
    cached = {}
    if cache:
        try:
            with open(cache) as f:
                cached = json.load(f)
            if key in cached:
                return dict(cached[key], source="cached")
        except (OSError, ValueError):
            cached = {}
    if shutil.disk_usage(probe).free < 2 * nbytes:
        return {"read": None, "write": None, "source": "not measured: too little free space"}
    path = os.path.join(probe, f".revtrain-bandwidth-{os.getpid()}")
    data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    try:
        start = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            done = 0
            while done < nbytes:
                done += os.write(fd, memoryview(data)[done:])
            os.fdatasync(fd)
            _drop_cache(fd)
        finally:
            os.close(fd)
        write = nbytes / (time.perf_counter() - start)
        start = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            buf, got = bytearray(nbytes), 0
            view = memoryview(buf)
            while got < nbytes:
                n = f.readinto(view[got:])
                if not n:
                    break
                got += n
            _drop_cache(f.fileno())
        read = nbytes / (time.perf_counter() - start)
    except OSError:
        return {"read": None, "write": None, "source": "not measured"}
    finally:
        _remove(path)
    result = {"read": read, "write": write}
    if cache:
        try:
            os.makedirs(os.path.dirname(cache), exist_ok=True)
            cached[key] = result
            with open(cache + ".tmp", "w") as f:
                json.dump(cached, f)
            os.replace(cache + ".tmp", cache)
        except OSError:
            pass
    return dict(result, source=f"measured ({nbytes >> 20} MiB)")


# -- the reversible trainer's hooks (`revtrain.trainers.reversible`) ----------------------------------

def refusal(trainer) -> str | None:
    """Why ``trainer`` (a `ReversibleTrainer` asked for ``offload = 'disk'``) cannot run the disk tier, in one
    line, or None."""
    if jax.process_count() > 1:
        return "ReversibleTrainer.offload = 'disk' runs in one process only (yet)"
    return None


def layer_layout(trainer, i: int) -> Layout:
    """The `Layout` of layer ``i``'s (params, optimizer state) under ``trainer``'s optimizer."""
    layer = trainer.model.layers[i]
    tier = trainer.residency.disk
    key = ("layout", layer)
    if key not in tier._layouts:
        shapes = trainer.model.param_shapes()[i]  # (a tied leaf only in its owner's file)
        tier._layouts[key] = Layout.of(shapes, jax.eval_shape(trainer.tx.init, shapes))
    return tier._layouts[key]


def init_layers(trainer) -> tuple[list, list]:
    """Every layer's initial state written to step 0's files one layer at a time (the values are made,
    written and dropped): returns ``(refs, layer states)``; the refs are each layer's params and opt_state."""
    tier, refs, states = trainer.residency.disk, [], []
    for i in range(len(trainer.model.layers)):
        p, s = trainer.model.init_layer(i)
        opt = jax.tree.map(np.asarray, trainer.tx.init(p))
        refs.append(tier.write_initial(0, i, layer_layout(trainer, i), jax.tree.map(np.asarray, p), opt))
        states.append(trainer.replicate(s))
        del p, s, opt
    tier.seal(0)
    return refs, states


def template_layers(trainer) -> list:
    """A `DiskLayer` template (no file) per layer: what `revtrain.checkpoint` restores a disk state into."""
    return [DiskLayer(layer_layout(trainer, i)) for i in range(len(trainer.model.layers))]
