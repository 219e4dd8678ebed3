"""revtrain/tiers/host_store.py: the host store the engine streams. In process, seconds."""

import jax
import numpy as np

from revtrain.placement import DEVICE_MEMORY, PAGEABLE_MEMORY, make_mesh, placer, replicated
from revtrain.tiers.host_store import HostLayer, HostStore


def test_the_host_store_reads_to_the_device_and_writes_back_to_host_memory():
    """refs / state are inverses; a read puts a layer's part on the device, the same values; a write puts the
    update back to the old state's host shardings and empties the list it is handed; byte counts per part."""
    mesh = make_mesh(jax.devices()[:1])
    host = replicated(mesh, PAGEABLE_MEMORY)
    params = [jax.device_put({"w": np.arange(4, dtype=np.float32)}, host)]
    opt = [jax.device_put({"m": np.zeros(4, np.float32)}, host)]
    store = HostStore(PAGEABLE_MEMORY, DEVICE_MEMORY)
    refs = store.refs(params, opt)
    assert isinstance(refs[0], HostLayer) and store.holds(refs[0]) and not store.holds(params[0])
    assert store.state(refs) == (params, opt)
    assert store.nbytes(refs[0]) == 32 and store.nbytes(refs[0], "params") == 16
    tree, = store.read([(refs[0], "params")], placer(mesh))
    assert tree["w"].sharding.memory_kind == DEVICE_MEMORY and np.array_equal(np.asarray(tree["w"]), np.arange(4))
    update = [jax.tree.map(lambda x: x + 1, tree), jax.device_put({"m": np.ones(4, np.float32)})]
    new = store.write(1, 0, refs[0], update)
    assert update == [] and new.params["w"].sharding.memory_kind == PAGEABLE_MEMORY
    assert np.array_equal(np.asarray(new.params["w"]), np.arange(4) + 1)
    buffer = store.buffer_ref(1, 0, 0, None)
    store.write_buffer(buffer, jax.device_put(np.ones(2, np.float32)))
    assert buffer.params.sharding.memory_kind == PAGEABLE_MEMORY
