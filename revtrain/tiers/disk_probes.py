"""The disk tier's plan terms: the disk space a run needs, the space it may use, the disk's bandwidth and the
bytes one step reads and writes.

Disk space (`disk_need`): two steps' files during a step (the step being written beside the one it reads),
plus each kept checkpoint whose step the tier has moved past (a checkpoint of the live step shares its
files); what the run may occupy (`disk_free`): the free space plus what it holds there already. The memory
plan checks both at start-up, with the I/O of one step (`deferred_io` for the deferred update) over the
disk's measured sequential bandwidth (`bandwidth`: measured once per file system, cached). The disk tier's
object asks these (`revtrain.tiers.disk.DiskTier`).
"""

from __future__ import annotations

import json
import os
import shutil
import time

import numpy as np

from revtrain.tiers.disk_format import _drop_cache, _remove


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
