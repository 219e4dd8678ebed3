"""revtrain/tiers/device.py: the device tier's answers. In process, seconds."""

import jax
import numpy as np

from revtrain.placement import make_mesh
from revtrain.tiers import DeviceTier


def test_the_device_tier_keeps_the_state_in_device_memory():
    """Its name and gin value, its words, the state placed in device memory with the same values, a template of
    the same shardings, nothing streamed or planned beyond the device."""
    mesh = make_mesh(jax.devices()[:1])
    tier = DeviceTier(mesh)
    assert (tier.name, tier.gin_value, tier.label, tier.store) == ("device", False, "", None)
    assert tier.describe() == "device memory, replicated"
    assert tier.trainer_label("ReversibleTrainer", " + shard_state") == "ReversibleTrainer + shard_state"
    params, opt = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, {"m": np.zeros((2, 3), np.float32)}
    p, o = tier.put_layer(0, params, opt)
    assert p["w"].sharding.memory_kind == "device" and np.array_equal(np.asarray(p["w"]), params["w"])
    tp, _ = tier.layer_template(0, *jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, opt)))
    assert tp["w"].sharding == p["w"].sharding
    assert (tier.state_memory, tier.keeps_on_host, tier.store_parts(1, 2, 3, 1, False)) == ("device", False, None)
    assert tier.layers_in_flight() == 0 and tier.io_per_step(10, 20, 1) == (0, 0) and not tier.host_pool
