"""revtrain/tiers/registry.py: the tier of each gin ``offload`` value, and registering one. In process,
milliseconds."""

import types

import jax
import numpy as np
import pytest

from revtrain import tiers
from revtrain.placement import make_mesh


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(jax.devices()[:1])


def test_each_gin_value_builds_its_tier(mesh, tmp_path):
    assert type(tiers.from_gin(False, mesh)) is tiers.DeviceTier
    assert type(tiers.from_gin(True, mesh, sharded=True)) is tiers.HostTier and tiers.from_gin(True, mesh, True).sharded
    disk = tiers.from_gin("disk", mesh, directory=str(tmp_path / "layers"))
    assert type(disk) is tiers.DiskTier and disk.store.directory == str(tmp_path / "layers")
    assert tiers.lookup("host") is tiers.HostTier and tiers.lookup("device") is tiers.DeviceTier
    assert tiers.names()[:3] == ("device", "host", "disk")
    for bad in ("ssd", 0, 1, None):
        with pytest.raises(ValueError, match=r"ReversibleTrainer.offload must be False, True or 'disk', got"):
            tiers.lookup(bad)


def test_a_directory_given_to_a_tier_without_one_is_noted(mesh, tmp_path, capsys):
    tiers.from_gin(True, mesh, directory=str(tmp_path))
    assert "ReversibleTrainer.offload_dir" in capsys.readouterr().err + capsys.readouterr().out


def test_register_refuses_what_is_not_a_tier_and_a_taken_name():
    with pytest.raises(TypeError, match="subclass of revtrain.tiers.Tier"):
        tiers.register("x", object)
    with pytest.raises(ValueError, match="taken by DiskTier"):
        tiers.register("disk", tiers.HostTier)
    assert tiers.register("disk", tiers.DiskTier) is tiers.DiskTier  # (the same class again: nothing changes)


def test_the_holder_of_a_state_and_the_leftovers_of_other_tiers(mesh, tmp_path):
    arrays = types.SimpleNamespace(held=lambda: ([{"w": np.zeros(2)}], [None]))
    assert tiers.holder_of(arrays) is None
    (tmp_path / "offload" / "step_00000001").mkdir(parents=True)
    assert len(tiers.leftovers(str(tmp_path), tiers.from_gin(False, mesh))) == 1
    assert tiers.leftovers(str(tmp_path), tiers.from_gin("disk", mesh, directory=str(tmp_path / "o"))) == []
