"""revtrain/tiers/disk_store.py: the disk store the engine streams (a step's files, never rewritten). In
process, about a second."""

import os

import jax
import numpy as np
import pytest

from revtrain.errors import ConfigError
from revtrain.placement import make_mesh, placer
from revtrain.tiers.disk_format import DiskLayer
from revtrain.tiers.disk_store import DiskStore


def test_a_step_writes_new_files_links_the_unchanged_and_removes_the_old(tmp_path):
    """Step 0's file; step 1 writes layer 0 anew, links layer 1 (the same inode), and its end removes step 0's
    directory; reads give the written values on the device; leftover steps go when the store is prepared."""
    (tmp_path / "tier" / "step_00000099").mkdir(parents=True)  # a killed run's
    store = DiskStore(str(tmp_path / "tier"))
    params, opt = {"w": np.arange(8, dtype=np.float32)}, {"m": np.zeros(8, np.float32)}
    layout = store.layout(("layer", 0), params, opt)
    refs = [store.write_initial(0, g, layout, params, opt) for g in range(2)]
    store.seal(0)
    assert not (tmp_path / "tier" / "step_00000099").exists()
    assert store.holds(refs[0]) and store.refs(refs, refs) == refs and store.state(refs) == (refs, refs)
    assert store.nbytes(refs[0], "params") == 32 and store.nbytes(refs[0]) == 64
    mesh = make_mesh(jax.devices()[:1])
    tree, = store.read([(refs[0], "params")], placer(mesh), [store.load(refs[0], "params")])
    assert np.array_equal(np.asarray(tree["w"]), params["w"])
    store.begin(1, refs)
    update = [{"w": params["w"] + 1}, opt]
    new = [store.write(1, 0, refs[0], update), store.unchanged(1, 1, refs[1])]
    assert update == [] and os.stat(new[1].path).st_ino == os.stat(refs[1].path).st_ino
    store.end(1, refs)
    assert sorted(os.listdir(tmp_path / "tier")) == ["step_00000001"]
    assert np.array_equal(store.load(new[0], "params")[0], params["w"] + 1)


def test_the_directory_is_checked_and_named_by_the_workdir(tmp_path):
    store = DiskStore()
    with pytest.raises(ConfigError, match="needs ReversibleTrainer.offload_dir"):
        store.step_dir(0)
    store.attach(str(tmp_path / "run"))
    assert store.directory == str(tmp_path / "run" / "offload") and store.in_workdir
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        DiskStore(str(tmp_path / "file")).check_directory()
    with pytest.raises(ConfigError, match="does not exist"):
        DiskStore(str(tmp_path / "missing" / "offload")).check_directory()


def test_gradient_buffers_are_files_of_their_step(tmp_path):
    store = DiskStore(str(tmp_path / "tier"))
    store.begin(3, [])
    store.begin_buffers(3)
    ref = store.buffer_ref(3, 0, 1, {"w": jax.ShapeDtypeStruct((4,), np.float32)})
    assert isinstance(ref, DiskLayer) and ref.path.endswith("grads/grad_00000_1.bin")
    store.write_buffer(ref, {"w": np.ones(4, np.float32)})
    assert np.array_equal(store.load(ref, "params")[0], np.ones(4))
    store.end_buffers(3)
    assert not os.path.exists(store.grad_dir(3))
