"""revtrain/tiers/disk_format.py: one layer's file (layout, write, read, checksums). In
process, milliseconds."""

import os

import numpy as np
import pytest

from revtrain.tiers import disk_format
from revtrain.tiers.disk_format import ALIGN, DamagedFile, DiskLayer, DiskTierError, Layout


def _layer():
    params = {"b": np.arange(3, dtype=np.float32), "w": np.arange(1000, dtype=np.float32).reshape(10, 100)}
    opt = (np.full((10, 100), 2, np.float16), np.array(7, np.int32))
    return params, opt


def test_the_layout_puts_each_leaf_at_an_aligned_offset():
    params, opt = _layer()
    layout = Layout.of(params, opt)
    assert layout.offsets == (0, ALIGN, 2 * ALIGN, 3 * ALIGN) and layout.size == 4 * ALIGN
    assert layout.num_params_leaves == 2 and list(layout.region("opt")) == [2, 3]
    assert layout.nbytes("params") == 12 + 4000 and layout.nbytes("opt") == 2000 + 4 and layout.nbytes() == 6016


def test_a_written_file_reads_back_with_its_checksums_and_a_flipped_byte_is_named(tmp_path):
    """`write_layer` consumes the leaves and returns one checksum per leaf; `read_tree` gives the same trees;
    a flipped byte is `DamagedFile` naming the file and the leaf; a short file is `DiskTierError`."""
    params, opt = _layer()
    layout = Layout.of(params, opt)
    path = str(tmp_path / "layer.bin")
    leaves = [params["b"], params["w"], *opt]
    sums = disk_format.write_layer(path, layout, leaves)
    assert leaves == [None] * 4 and len(sums) == 4 and os.path.getsize(path) == layout.size
    got = disk_format.read_tree(path, layout, "params", sums=sums)
    assert all(np.array_equal(got[k], params[k]) for k in params)
    disk_format.verify_file(path, layout, sums)
    with open(path, "r+b") as f:
        f.seek(ALIGN + 8)
        byte = f.read(1)
        f.seek(ALIGN + 8)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(DamagedFile, match="weight leaf 1 does not match"):
        disk_format.read_leaves(path, layout, "params", sums=sums)
    assert np.array_equal(disk_format.read_leaves(path, layout, "opt", sums=sums)[0], opt[0])  # the others intact
    os.truncate(path, 100)
    with pytest.raises(DiskTierError, match="shorter than its layout"):
        disk_format.read_leaves(path, layout, "params")
