"""The machine's limits and the save's constants: what this process may hold, read before it allocates.

The floor under the memory plan (`revtrain.planning`), the checkpoint (`revtrain.checkpoint`) and sampling
from an offloaded state (`revtrain.generate_weights`): each asks here, none asks the others. What the process
may use on the host (`host_limit`) is the smaller of ``MemAvailable`` (/proc/meminfo) plus its own resident
bytes and, for its memory cgroup and each of its ancestors with a limit (v1: ``memory.limit_in_bytes`` under
/sys/fs/cgroup/memory; v2: ``memory.max``), the limit less what other processes of the group hold (their
anonymous memory; page cache can be reclaimed and is not counted). A device's is its backend's
``memory_stats()["bytes_limit"]`` (`device_limit`; none on the CPU, where device memory is host memory); a
GPU's pinned host pool is ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` (`pinned_limit`). A checkpoint save of a state
up to `ASYNC_MAX_BYTES` runs in the background and Orbax stages at most `STAGING_BYTES` at a time: the
checkpoint uses both, and the plan counts what they hold (docs/memory.md).
"""

from __future__ import annotations

import os

import jax

# The largest state (bytes held by this process) saved asynchronously; larger ones are written before the next
# step (see `checkpoint.Checkpointer`).
ASYNC_MAX_BYTES = 512 * 2**20


# Orbax stages at most this many bytes of array data in host memory at a time while it copies arrays out of their
# buffers, writes or reads a checkpoint. Its defaults (96 GB each, no bound on the copy out) let a save stage the
# whole state: a 2 GiB state saved with +1.53 GiB resident at the peak; with 256 MiB, +0.29 GiB in the same time
# (5.2 s against 7.3 s here; docs/memory.md).
STAGING_BYTES = 256 * 2**20

_UNLIMITED = 2**62  # cgroup v1 writes 9223372036854771712 for "no limit"


def gib(nbytes: float) -> str:
    """``nbytes`` as GiB with two decimals (``"1.25 GiB"``), or MiB below 1 GiB."""
    if abs(nbytes) < 2**30:
        return f"{nbytes / 2**20:.0f} MiB"
    return f"{nbytes / 2**30:.2f} GiB"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _meminfo(key: str) -> int | None:
    text = _read("/proc/meminfo") or ""
    for line in text.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return None


def _stat(text: str | None, *keys: str) -> int | None:
    for key in keys:
        for line in (text or "").splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    return None


def _cgroup_headroom(own_rss: int, proc_cgroup: str = "/proc/self/cgroup",
                     root: str = "/sys/fs/cgroup") -> tuple[int, str] | None:
    """The tightest memory cgroup limit over this process's group and its ancestors, less what other
    processes of each group hold: ``(bytes, description)``, or None when no group has a limit."""
    text = _read(proc_cgroup) or ""
    best = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if "memory" in controllers.split(","):  # v1
            base, limit_file, usage_keys = os.path.join(root, "memory"), "memory.limit_in_bytes", ("total_rss", "rss")
        elif controllers == "" and os.path.exists(os.path.join(root, "cgroup.controllers")):  # v2 (unified)
            base, limit_file, usage_keys = root, "memory.max", ("anon",)
        else:
            continue
        rel = path.strip("/")
        while True:
            group = os.path.join(base, rel) if rel else base
            raw = _read(os.path.join(group, limit_file))
            if raw is not None and raw != "max" and raw.isdigit() and int(raw) < _UNLIMITED:
                held = _stat(_read(os.path.join(group, "memory.stat")), *usage_keys) or 0
                room = int(raw) - max(0, held - own_rss)
                where = f"memory cgroup {'/' + rel} limit {gib(int(raw))}"
                if held > own_rss:
                    where += f", {gib(held - own_rss)} held by other processes"
                if best is None or room < best[0]:
                    best = (room, where)
            if not rel:
                break
            rel = os.path.dirname(rel)
    return best


def host_limit() -> tuple[int, str]:
    """What this process may hold in host memory at its peak: ``(bytes, where the figure came from)``.

    The smaller of ``MemAvailable`` plus the process's own resident bytes, and the headroom of its memory
    cgroup (v1 or v2, this group and its ancestors: the limit less other processes' anonymous memory).
    """
    from revtrain.memory import host_resident
    rss = host_resident()[0]
    available = _meminfo("MemAvailable")
    best = (available + rss, f"MemAvailable {gib(available)} + this process's {gib(rss)}") if available else None
    group = _cgroup_headroom(rss)
    if group is not None and (best is None or group[0] < best[0]):
        best = group
    if best is None:
        return _UNLIMITED, "unknown (no /proc/meminfo, no memory cgroup)"
    return best


def device_limit(device=None) -> tuple[int | None, str]:
    """A device's memory, ``(bytes, where from)``: ``memory_stats()["bytes_limit"]`` where the backend has
    it; ``(None, reason)`` on the CPU (device memory is host memory there: one tier) or without stats."""
    device = device or jax.local_devices()[0]
    if device.platform == "cpu":
        return None, "the CPU backend: device memory is host memory (one tier)"
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 (a backend without memory stats)
        stats = {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]), f"{device.platform} bytes_limit"
    return None, f"{device.platform}: no bytes_limit in memory_stats()"


# XLA's pinned host pool on a GPU (``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``, GiB; its default when it grows).
PINNED_DEFAULT_GB = 64


def pinned_limit() -> tuple[int, str]:
    """The size of XLA's pinned host pool on a GPU: ``(bytes, where from)``, read as XLA reads it
    (`revtrain.pinned.limit`: an integer GiB; 64 by default, 16 when preallocated without a limit)."""
    from revtrain import pinned
    return pinned.limit()
