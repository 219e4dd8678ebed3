"""Residency (`revtrain.tiers`): where a layer's weights and optimizer state live between uses, one class
per tier. What each says (streamed, offloaded, memory kind, label, its words), the specs of a replicated and a
sharded state, placing a layer and its shape-only restore template in each tier, fetching a layer and keeping
an activation, `HostStack`, the errors, and which tier the reversible trainer picks for each ``offload``.

One CPU device (its memory spaces: ``device``, ``pinned_host``, ``unpinned_host``).
"""

import os
import types

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from revtrain.tiers.disk_store import DiskStore as DiskTier
from revtrain.models import ReversibleTransformerLM
from revtrain.placement import DATA_AXIS, HOST_MEMORY, PAGEABLE_MEMORY, host_memory_supported, make_mesh
from revtrain.tiers import HostStack, from_gin, names
from revtrain.tiers.device import DeviceTier as Residency
from revtrain.tiers.disk import DiskTier as DiskResidency
from revtrain.tiers.host import HostTier as HostResidency
from revtrain.tiers.host_store import HostStore
from revtrain.trainers import ReversibleTrainer, StandardTrainer, TrainerError


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(jax.devices()[:1])


def test_each_tier_says_where_the_state_lives(mesh, tmp_path):
    """device: no memory kind, not offloaded, no store; host: its own `HostStore` in the pageable
    ``unpinned_host`` (where every device has that space, as the CPU does), streamed; disk: the `DiskTier` is
    its store and its disk, no memory kind."""
    assert names()[:3] == ("device", "host", "disk")
    assert host_memory_supported(mesh, PAGEABLE_MEMORY)
    device = Residency(mesh)
    host = HostResidency(mesh)
    disk = DiskResidency(mesh, store=DiskTier(str(tmp_path / "offload")))
    assert [r.tier for r in (device, host, disk)] == ["device", "host", "disk"]
    assert [r.memory_kind for r in (device, host, disk)] == [None, PAGEABLE_MEMORY, None]
    assert [r.offloaded for r in (device, host, disk)] == [False, True, True]
    assert [r.streamed for r in (device, host, disk)] == [False, True, True]
    assert device.store is None and isinstance(host.store, HostStore) and host.store.memory_kind == PAGEABLE_MEMORY
    assert [r.state_memory for r in (device, host, disk)] == ["device", "host", None]  # (what the plans ask)
    assert [r.label for r in (device, host, disk)] == ["", " + offload", " + offload='disk'"]
    assert [r.releases for r in (device, host, disk)] == [False, True, False]
    assert device.describe() == "device memory, replicated"
    assert host.describe() == "host memory (unpinned_host), replicated"
    assert disk.describe() == f"layer files in {tmp_path / 'offload'}, replicated"
    assert Residency(mesh, sharded=True).describe() == "device memory, split over the devices"


def test_from_gin_picks_the_tier_and_refuses_others(mesh, tmp_path):
    assert type(from_gin(False, mesh)) is Residency
    assert type(from_gin(True, mesh, sharded=True)) is HostResidency and from_gin(True, mesh, True).sharded
    disk = from_gin("disk", mesh, directory=str(tmp_path / "layers"))
    assert type(disk) is DiskResidency and disk.store.directory == str(tmp_path / "layers")
    with pytest.raises(ValueError, match="ReversibleTrainer.offload must be False, True or 'disk', got 'ssd'"):
        from_gin("ssd", mesh)


def test_specs_replicate_or_split_the_large_leaves(mesh):
    """Replicated: ``P()`` for every leaf. Sharded: `placement.shard_spec` of each leaf over the mesh's devices
    (a leaf of at least 4096 elements split along its largest axis that the device count divides; a small one
    replicated; one device splits nothing), never along the ``leading`` stacked axes. (`specs` reads only the
    mesh's size: four devices are a stand-in here; tests/test_shard.py trains on four.)"""
    shapes = {"w": jax.ShapeDtypeStruct((64, 128), np.float32), "b": jax.ShapeDtypeStruct((128,), np.float32)}
    assert Residency(mesh).specs(shapes) == {"w": P(), "b": P()}
    assert Residency(mesh, sharded=True).specs(shapes) == {"w": P(), "b": P()}
    four = Residency(types.SimpleNamespace(size=4), sharded=True)
    assert four.specs(shapes) == {"w": P(None, DATA_AXIS), "b": P()}
    stacked = {"w": jax.ShapeDtypeStruct((4, 64, 128), np.float32)}
    assert four.specs(stacked, leading=1) == {"w": P(None, None, DATA_AXIS)}
    assert four.specs({"w": jax.ShapeDtypeStruct((64, 127), np.float32)}) == {"w": P(DATA_AXIS, None)}


@pytest.mark.parametrize("tier", ["device", "host"])
def test_place_and_abstract_use_the_tiers_memory_kind(mesh, tier):
    """`place_tree` puts each numpy leaf with its spec in the tier's memory kind, values unchanged; `abstract`
    is the same shapes, dtypes and shardings as ``ShapeDtypeStruct`` leaves (a restore template)."""
    residency = Residency(mesh) if tier == "device" else HostResidency(mesh)
    want_kind = {"device": "device", "host": PAGEABLE_MEMORY}[tier]
    tree = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "n": np.array(7, np.int32)}
    placed = residency.place_tree(tree)
    for key, value in tree.items():
        assert placed[key].sharding.memory_kind == want_kind
        assert placed[key].dtype == value.dtype and np.array_equal(np.asarray(placed[key]), value)
    template = residency.abstract(tree)
    for key, value in tree.items():
        assert isinstance(template[key], jax.ShapeDtypeStruct)
        assert (template[key].shape, template[key].dtype) == (value.shape, value.dtype)
        assert template[key].sharding == placed[key].sharding


@pytest.mark.parametrize("tier", ["device", "host", "disk"])
def test_each_tier_puts_a_layer_and_gives_it_back_on_the_device(mesh, tier, tmp_path):
    """`put_layer` puts a layer's initial state where the tier keeps it (the disk tier: one file, its
    `DiskLayer` for both parts, sealed by `end_init`); `layer_template` is the same as a restore template; `fetch`
    gives the weights on the device, the same values; `keep` / `bring` move an activation out and back (host
    memory for the host tier, untouched elsewhere)."""
    residency = {"device": lambda: Residency(mesh), "host": lambda: HostResidency(mesh),
                 "disk": lambda: DiskResidency(mesh, store=DiskTier(str(tmp_path / "layers")))}[tier]()
    params = {"w": np.arange(12, dtype=np.float32).reshape(3, 4)}
    opt = {"m": np.ones((3, 4), np.float32), "n": np.array(1, np.int32)}
    p, o = residency.put_layer(0, params, opt)
    residency.end_init()
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, opt))
    tp, to = residency.layer_template(0, *shapes)
    if tier == "disk":
        assert p is o and os.path.exists(p.path) and tp.layout == p.layout and tp.path is None
    else:
        assert {x.sharding.memory_kind for x in jax.tree.leaves((p, o))} == {residency.memory_kind or "device"}
        assert jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding), (tp, to)) == \
            jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding), (p, o))
    fetched = residency.fetch(p)
    assert fetched["w"].sharding.memory_kind == "device" and np.array_equal(np.asarray(fetched["w"]), params["w"])
    x = jax.device_put(np.ones((2, 3), np.float32))
    kept = residency.keep(x)
    assert kept.sharding.memory_kind == (HOST_MEMORY if tier == "host" else "device")
    assert residency.bring(kept).sharding.memory_kind == "device"


def test_a_host_stack_is_placed_leaf_by_leaf_and_released(mesh):
    """`HostStack` stacks three layers' trees on a new leading axis; `Residency.place_stacked` places them and
    drops each host buffer once placed. A layer of another structure is refused."""
    stack = HostStack(3)
    for j in range(3):
        stack.put(j, {"w": np.full((2, 4), j, np.float32), "b": np.full((4,), 10 + j, np.float32)})
    with pytest.raises(ValueError, match="layer 1's tree differs from the first layer's"):
        stack.put(1, {"w": np.zeros((2, 4), np.float32)})
    placed = Residency(mesh).place_stacked(stack, None)
    assert stack.buffers == [None, None]
    assert placed["w"].shape == (3, 2, 4) and placed["w"].sharding.memory_kind == "device"
    np.testing.assert_array_equal(np.asarray(placed["w"])[:, 0, 0], [0.0, 1.0, 2.0])
    np.testing.assert_array_equal(np.asarray(placed["b"])[:, 0], [10.0, 11.0, 12.0])


def test_the_reversible_trainer_picks_its_residency_from_offload(mesh, tmp_path):
    """``offload``: False on the device (the scanned executor stacks its runs); True in a streamed `HostStore`
    (pageable) under every executor and update (a scanned or deferred configuration runs per layer); ``'disk'``
    in a `DiskTier`, also with the default ``scan_layers``; anything else one line. The StandardTrainer keeps
    its state on the device."""
    model = ReversibleTransformerLM(16, num_layers=4, d_model=32, num_heads=2, dropout_rate=0.0)

    def trainer(tx=optax.adam(1e-3), **kwargs):
        return ReversibleTrainer(model, tx, mesh, seed=0, **kwargs)

    device = trainer()
    assert (device.residency.tier, device.residency.store) == ("device", None)
    assert any(count > 1 for _, count in device.groups)  # (the scanned executor's stacked run)
    clip = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    for host in (trainer(offload=True, scan_layers=False), trainer(offload=True), trainer(clip, offload=True)):
        assert isinstance(host.residency.store, HostStore) and host.residency.memory_kind == PAGEABLE_MEMORY
        assert all(count == 1 for _, count in host.groups)
    disk = trainer(offload="disk", offload_dir=str(tmp_path / "layers"))
    assert disk.residency.tier == "disk" and isinstance(disk.residency.store, DiskTier) and disk.residency.streamed
    assert all(count == 1 for _, count in disk.groups)
    assert StandardTrainer(model, optax.adam(1e-3), mesh, seed=0).residency.tier == "device"
    with pytest.raises(TrainerError, match="ReversibleTrainer.offload must be False, True or 'disk', got 'nvme'"):
        trainer(offload="nvme")
