"""revtrain/tiers/disk_links.py: a disk-tier checkpoint as hard links to the layer files. In process,
milliseconds."""

import json
import os

import numpy as np
import pytest

from revtrain.tiers import disk_format, disk_links
from revtrain.tiers.disk_format import DamagedFile, DiskLayer, Layout


def _files(tmp_path, n=2):
    refs = []
    for g in range(n):
        params, opt = {"w": np.full((4, 4), g, np.float32)}, {"m": np.zeros((4, 4), np.float32)}
        layout = Layout.of(params, opt)
        path = str(tmp_path / f"live_{g}.bin")
        refs.append(DiskLayer(layout, path, disk_format.write_layer(path, layout, [params["w"], opt["m"]])))
    return refs


def test_links_share_the_inodes_and_restore_checked(tmp_path):
    """`save_links`: one hard link per layer file (no byte copied), the layouts and checksums in ``index.json``,
    the layer state beside; `load_links` gives them back, checked whole; a damaged link is `DamagedFile`."""
    refs = _files(tmp_path)
    item = tmp_path / "ckpt"
    disk_links.save_links(str(item), refs, [{"s": np.arange(3)}, {"s": np.arange(3) + 1}], step=5)
    assert all(os.stat(item / f"layer_{g:05d}.bin").st_ino == os.stat(r.path).st_ino for g, r in enumerate(refs))
    loaded = disk_links.load_links(str(item))
    assert loaded["index"]["step"] == 5 and loaded["note"] is None
    assert np.array_equal(loaded["layer_state"]["l1_0"], [1, 2, 3])
    disk_links.check_layout(loaded["index"]["layers"][0], refs[0].layout, 0)
    with pytest.raises(ValueError, match="does not match the model's shapes"):
        disk_links.check_layout(loaded["index"]["layers"][0], Layout.of({"w": np.zeros(3)}, ()), 0)
    with open(item / "layer_00001.bin", "r+b") as f:
        f.write(b"\xff")
    with pytest.raises(DamagedFile):
        disk_links.load_links(str(item))


def test_a_checkpoint_without_checksums_restores_with_a_note(tmp_path):
    refs = _files(tmp_path, 1)
    item = tmp_path / "ckpt"
    disk_links.save_links(str(item), refs, [{}], step=1)
    index = json.loads((item / disk_links.INDEX).read_text())
    del index["layers"][0][disk_format.CHECKSUM]
    (item / disk_links.INDEX).write_text(json.dumps(index))
    assert "read unverified" in disk_links.load_links(str(item))["note"]
