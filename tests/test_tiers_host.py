"""revtrain/tiers/host.py: the host tier's answers. In process, seconds."""

import jax
import numpy as np

from revtrain.placement import HOST_MEMORY, PAGEABLE_MEMORY, make_mesh
from revtrain.tiers import HostTier
from revtrain.tiers.host_store import HostStore


def test_the_host_tier_keeps_the_state_in_pageable_host_memory_and_streams_it():
    """On the CPU backend: the pageable kind, its `HostStore`, the state placed there, fetched to the device,
    kept inputs in host memory; its words put ``+ offload`` before the sharding's; the plan terms: the layer
    computing, the one written back and those read ahead in flight, the memory plan's ``offload``."""
    mesh = make_mesh(jax.devices()[:1])
    tier = HostTier(mesh)
    assert (tier.name, tier.gin_value, tier.memory_kind, tier.releases, tier.host_pool) == (
        "host", True, PAGEABLE_MEMORY, True, True)
    assert isinstance(tier.store, HostStore) and tier.streamed and tier.offloaded and tier.refusal() is None
    assert tier.trainer_label("ReversibleTrainer", " + shard_state") == "ReversibleTrainer + offload + shard_state"
    params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    p, o = tier.put_layer(0, params, {"m": np.zeros((2, 3), np.float32)})
    assert p["w"].sharding.memory_kind == PAGEABLE_MEMORY
    fetched = tier.fetch(p)
    assert fetched["w"].sharding.memory_kind == "device" and np.array_equal(np.asarray(fetched["w"]), params["w"])
    kept = tier.keep(jax.device_put(np.ones(3, np.float32)))
    assert kept.sharding.memory_kind == HOST_MEMORY and tier.bring(kept).sharding.memory_kind == "device"
    assert tier.layers_in_flight() == 2 + tier.store.read_ahead
    assert (tier.state_memory, tier.keeps_on_host, tier.memory_kind) == ("host", True, PAGEABLE_MEMORY)
    assert tier.store_parts(100, 200, 3, 1, False) is None and tier.step_io(100, 200, 10) is None
    assert tier.io_per_step(100, 200, 10) == (390, 300) and tier.capacity() is None


def test_the_pageable_switch_makes_the_state_pinned():
    tier = HostTier(make_mesh(jax.devices()[:1]), pageable=False)
    assert tier.memory_kind == "pinned_host" and tier.state_memory == "host"
