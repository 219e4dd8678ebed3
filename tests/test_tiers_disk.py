"""revtrain/tiers/disk.py: the disk tier's answers (placement in files, run hooks, plan terms, checkpoint and
sampling forms). In process, about a second."""

import os
import types

import jax
import numpy as np
import pytest

from revtrain.errors import ConfigError
from revtrain.placement import make_mesh, placer
from revtrain.tiers import DiskTier
from revtrain.tiers.disk_format import DamagedFile, DiskLayer
from revtrain.trainers.common import TrainState
from revtrain.tiers.disk_probes import disk_need


@pytest.fixture()
def tier(tmp_path):
    return DiskTier(make_mesh(jax.devices()[:1]), directory=str(tmp_path / "tier"))


def test_a_layer_is_one_file_fetched_and_sampled_from_it(tier):
    """`put_layer` writes step 0's file, the same `DiskLayer` for both parts; its template has no file; `fetch`
    and the sampling reader (`sample_layers`) read the weights onto the device; a state of such layers is the
    disk tier's (its checkpoint form: links)."""
    params = {"w": np.arange(6, dtype=np.float32)}
    p, o = tier.put_layer(0, params, {"m": np.zeros(6, np.float32)})
    tier.end_init()
    assert p is o and isinstance(p, DiskLayer) and os.path.exists(p.path)
    tp, to = tier.layer_template(0, {"w": jax.ShapeDtypeStruct((6,), np.float32)},
                                 {"m": jax.ShapeDtypeStruct((6,), np.float32)})
    assert tp is to and tp.path is None and tp.layout == p.layout
    assert np.array_equal(np.asarray(tier.fetch(p)["w"]), params["w"])
    reader = tier.sample_layers([p, p], placer(tier.mesh))
    try:
        assert np.array_equal(np.asarray(reader.get(0)["w"]), params["w"])
        assert np.array_equal(np.asarray(reader.get(1)["w"]), params["w"])
    finally:
        reader.close()
    # The weights only, each layer read once; after layer 1 the reader has started reading layer 0 ahead (the
    # cycle's next), which `close` lets finish or cancels: 2 or 3 reads (4 had layer 1 not come from the read ahead).
    assert reader.read_bytes in (2 * 24, 3 * 24), reader.read_bytes
    state = types.SimpleNamespace(held=lambda: ([p], [o]))
    assert DiskTier.holds_state(state) and tier.checkpoint_form == "links"
    assert not DiskTier.holds_state(types.SimpleNamespace(held=lambda: ([params], [None])))


def test_sampling_and_export_ask_the_tier_what_its_files_hold(tier):
    """What holding the weights adds is a file's weight bytes (an array in memory: its own); a streamed sample's
    line names the files; the export's view reads each layer's weights from its file, checked, when asked (a
    layer held in memory as numpy)."""
    params = {"w": np.arange(6, dtype=np.float32)}
    p, _ = tier.put_layer(0, params, {"m": np.zeros(6, np.float32)})
    tier.end_init()
    assert tier.outside_bytes(p) == 24 and tier.outside_bytes({"x": np.ones(2, np.float32)}) == 8
    assert tier.sample_words() == ("from their files", "reads {} from disk")
    weights = tier.layer_weights([p, {"x": np.ones(2, np.float32)}])
    assert len(weights) == 2 and np.array_equal(weights[0]["w"], params["w"])
    assert isinstance(weights[0]["w"], np.ndarray) and np.array_equal(weights[1]["x"], [1, 1])
    with open(p.path, "r+b") as f:  # one byte of the weight flipped: the read names the file
        f.seek(p.layout.offsets[0] + 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(DamagedFile, match="does not match"):
        weights[0]


def test_a_disk_tier_template_restores_an_orbax_checkpoints_weights_as_arrays(tier):
    """The disk tier's checkpoint form is its own Orbax item (hard links); for a checkpoint of arrays its
    template becomes the weights' shapes (no optimizer state)."""
    assert DiskTier.checkpoint_item == "disk_state" and DiskTier.checkpoint_handler() is not None
    shapes = {"w": jax.ShapeDtypeStruct((6,), np.float32)}
    ref, _ = tier.layer_template(0, shapes, {"m": jax.ShapeDtypeStruct((6,), np.float32)})
    template = TrainState(0, [ref], [ref], [{}])
    arrays = DiskTier.array_template(template)
    assert arrays.params[0]["w"].shape == (6,) and arrays.opt_state == [None] and arrays.layer_state == [{}]
    plain = TrainState(0, [shapes], [None], [{}])
    assert DiskTier.array_template(plain) is plain


def test_the_disk_tiers_words_hooks_and_plan_terms(tier, tmp_path):
    assert (tier.name, tier.gin_value, tier.uses_directory) == ("disk", "disk", True)
    assert tier.describe() == f"layer files in {tmp_path / 'tier'}, replicated"
    label = tier.trainer_label("ReversibleTrainer", " + shard_state")
    assert label == "ReversibleTrainer + shard_state + offload='disk'"
    assert (tier.state_memory, tier.keeps_on_host) == (None, False)  # (in its files: layers in flight only)
    beyond = disk_need(100 + 200, 3, 1)[1]
    assert tier.store_parts(100, 200, 3, 1, False) == {"weights": 200, "optimizer_state": 400, "checkpoint": beyond}
    assert tier.store_parts(100, 200, 3, 1, True)["gradients"] == 200  # (the deferred update's buffer files)
    assert tier.layers_in_flight() == 2 and tier.io_per_step(100, 200, 10) == (390, 300)
    assert tier.space_need(100, 3, 1) == disk_need(100, 3, 1)
    assert tier.capacity()[0] > 0 and tier.own_directory() == str(tmp_path / "tier")
    tier.attach(str(tmp_path / "run"))  # (an offload_dir given: kept)
    assert tier.store.directory == str(tmp_path / "tier")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        DiskTier(tier.mesh, directory=str(tmp_path / "file")).check_run()


def test_leftover_files_of_an_earlier_disk_run_are_named(tmp_path):
    assert DiskTier.leftovers(str(tmp_path)) is None
    (tmp_path / "offload" / "step_00000002").mkdir(parents=True)
    (tmp_path / "offload" / "step_00000002" / "layer_00000.bin").write_bytes(b"x" * (1 << 20))
    assert "holds 1 step(s) of an earlier disk-tier state (1 MiB)" in DiskTier.leftovers(str(tmp_path))
