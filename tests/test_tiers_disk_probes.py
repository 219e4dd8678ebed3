"""revtrain/tiers/disk_probes.py: the disk tier's plan terms. In process, about a second (a 1 MiB probe)."""

import json
import os

from revtrain.tiers import disk_probes


def test_disk_need_counts_two_steps_and_the_checkpoints_moved_past():
    assert disk_probes.disk_need(100, 3, 10) == (200, 300)
    assert disk_probes.disk_need(100, 3, 1) == (200, 200)  # the newest shares the live step's files
    assert disk_probes.disk_need(100, None, 10) == (200, 100 * 100)


def test_disk_free_counts_what_the_run_holds_once(tmp_path, monkeypatch):
    """The free space plus the run's own files, a hard link counted once."""
    real = disk_probes.shutil.disk_usage
    monkeypatch.setattr(disk_probes.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    (tmp_path / "offload").mkdir()
    (tmp_path / "offload" / "a").write_bytes(b"x" * (4 << 20))
    os.link(tmp_path / "offload" / "a", tmp_path / "offload" / "b")
    space, words = disk_probes.disk_free(str(tmp_path / "offload"))
    assert 1000 + (4 << 20) <= space < 1000 + (5 << 20)
    assert words == f"free on {tmp_path / 'offload'} + 0.00 GiB the run holds"


def test_bandwidth_is_measured_once_then_cached(tmp_path):
    cache = str(tmp_path / "bw.json")
    first = disk_probes.bandwidth(str(tmp_path), cache=cache, nbytes=1 << 20)
    assert first["read"] > 0 and first["write"] > 0 and first["source"].startswith("measured")
    again = disk_probes.bandwidth(str(tmp_path), cache=cache, nbytes=1 << 20)
    assert again["source"] == "cached" and again["read"] == first["read"]
    assert list(json.load(open(cache)).values())[0]["write"] == first["write"]


def test_deferred_io_counts_each_pass():
    """Two microbatches, one pass, no tied owner, nothing held: every layer's weights twice per microbatch but
    the head's once, the buffers read back in the second, each pass reads weights, optimizer state and buffer."""
    read, written = disk_probes.deferred_io(100, 200, 10, 0, 2, 1)
    assert read == 2 * (200 - 10) + 100 + (200 + 200) and written == 2 * 100 + 100 + 200
