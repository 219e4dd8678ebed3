"""The disk tier's I/O, three ways (docs/disk.md): plain files (`revtrain.tiers.disk_format`: one ``pwrite`` / ``readinto``
per leaf, ``fdatasync``, page cache dropped), ``numpy.memmap``, and TensorStore (its ``zarr`` driver, one chunk
per leaf). For each: write and read one layer-sized set of leaves, the bandwidth, and how much the process's
resident set grows while reading (what a memory cgroup and the plan count).

  .venv/bin/python scripts/bench_disk_io.py [--mib 512] [--dir DIR]
"""

import argparse
import os
import resource
import shutil
import tempfile
import time

import numpy as np


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def leaves(mib: int):
    rng = np.random.default_rng(0)
    n = mib * 2**20 // 4 // 3
    return [rng.standard_normal(n, dtype=np.float32) for _ in range(3)]


def plain(directory, data):
    from revtrain.tiers import disk_format
    layout = disk_format.Layout.of(data, [])
    path = os.path.join(directory, "layer.bin")
    t = time.perf_counter()
    disk_format.write_layer(path, layout, list(data))
    w = time.perf_counter() - t
    before, t = rss(), time.perf_counter()
    out = disk_format.read_leaves(path, layout, "params")
    r = time.perf_counter() - t
    grown = rss() - before
    assert all(np.array_equal(a, b) for a, b in zip(out, data))
    return w, r, grown


def memmap(directory, data):
    paths = [os.path.join(directory, f"leaf{i}.npy") for i in range(len(data))]
    t = time.perf_counter()
    for p, x in zip(paths, data):
        m = np.lib.format.open_memmap(p, "w+", x.dtype, x.shape)
        m[:] = x
        m.flush()
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        del m
    w = time.perf_counter() - t
    before, t = rss(), time.perf_counter()
    maps = [np.load(p, mmap_mode="r") for p in paths]
    total = sum(float(m[:: 1024].sum()) for m in maps)  # touch every page: what a program reading it does
    total += sum(float(np.asarray(m).sum()) for m in maps)
    r = time.perf_counter() - t
    grown = rss() - before
    del maps
    return w, r, grown


def tensorstore(directory, data):
    import tensorstore as ts
    stores = []
    t = time.perf_counter()
    for i, x in enumerate(data):
        spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": os.path.join(directory, f"leaf{i}")},
                "metadata": {"shape": list(x.shape), "chunks": list(x.shape), "dtype": "<f4", "compressor": None}}
        store = ts.open(spec, create=True, delete_existing=True).result()
        store.write(x).result()
        stores.append(spec)
    os.sync()
    w = time.perf_counter() - t
    for root, _, files in os.walk(directory):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    before, t = rss(), time.perf_counter()
    out = [ts.open(s).result().read().result() for s in stores]
    r = time.perf_counter() - t
    grown = rss() - before
    assert all(np.array_equal(a, b) for a, b in zip(out, data))
    return w, r, grown


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    data = leaves(args.mib)
    nbytes = sum(x.nbytes for x in data)
    print(f"one layer of {nbytes / 2**20:.0f} MiB in {len(data)} leaves")
    print(f"{'method':<12} {'write GB/s':>10} {'read GB/s':>10} {'RSS growth while reading (MiB)':>32}")
    for name, fn in (("plain files", plain), ("np.memmap", memmap), ("tensorstore", tensorstore)):
        directory = tempfile.mkdtemp(dir=args.dir)
        try:
            w, r, grown = fn(directory, data)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        print(f"{name:<12} {nbytes / w / 1e9:>10.2f} {nbytes / r / 1e9:>10.2f} {grown / 2**20:>32.0f}")


if __name__ == "__main__":
    main()
