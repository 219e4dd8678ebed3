"""The disk tier's file format: one file per layer, its leaves raw at 4 KiB-aligned offsets, each checksummed.

A layer's weights and optimizer state are one file (`Layout`): its weight leaves, then its optimizer state's
leaves, in ``jax.tree.flatten`` order, each raw (C order) at an offset aligned to 4 KiB. `write_layer` writes a
new file with one ``pwrite`` per leaf and ``fdatasync``; `read_leaves` reads the leaves of one part with one
``readinto`` per leaf. Both drop the file from the page cache (``posix_fadvise(DONTNEED)``), which a memory
cgroup charges. A file, once complete, never changes: a checkpoint holds hard links to it
(`revtrain.tiers.disk_links`).

**Checksums.** Each leaf's bytes are hashed (xxHash's XXH3, 64 bits) as they are written; the digests travel
with the file's `DiskLayer` and into a checkpoint's ``index.json``. Every read checks the leaves it reads, and
`verify_file` checks a file whole, so a flipped byte is one line naming the file (`DamagedFile`).

The export reads a state's layers one at a time through the store (`revtrain.tiers.base.LayerWeights`,
checked as every read is), never caching: one layer in memory at a time.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import jax
import numpy as np
import xxhash

from revtrain.tiers.base import StoreError

ALIGN = 4096


class DiskTierError(StoreError):
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
