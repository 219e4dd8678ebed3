"""revtrain/tiers/base.py: the declared interface's defaults (a minimal tier of arrays, one with a store) and
`HostStack`. In process, seconds."""

import jax
import numpy as np
import pytest

from revtrain import streaming
from revtrain.placement import make_mesh
from revtrain.tiers.base import HostStack, StoreError, Tier


class _Plain(Tier):
    name = "plain"

    def describe_place(self) -> str:
        return "somewhere"


class _Streamed(_Plain):
    def __init__(self, mesh, sharded=False):
        super().__init__(mesh, sharded)
        self.store = streaming.Store()


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(jax.devices()[:1])


def test_a_tier_must_say_where_its_state_lives(mesh):
    """`Tier` is abstract: a subclass without `describe_place` cannot be made."""
    with pytest.raises(TypeError, match="describe_place"):
        type("Nowhere", (Tier,), {})(mesh)


def test_the_defaults_are_an_unstreamed_tier_of_arrays(mesh):
    """Without a store: not streamed or offloaded, no layers in flight, no I/O, no store of its own, checkpointed
    by Orbax, fetched and sampled as the trainer does, the memory plan's words both False."""
    tier = _Plain(mesh)
    assert (tier.tier, tier.streamed, tier.offloaded, tier.memory_kind) == ("plain", False, False, None)
    assert tier.describe() == "somewhere, replicated"
    assert _Plain(mesh, True).describe() == "somewhere, split over the devices"
    assert tier.trainer_label("ReversibleTrainer", " + shard_state") == "ReversibleTrainer + shard_state"
    assert tier.layers_in_flight() == 0 and tier.io_per_step(100, 200, 10) == (0, 0)
    assert tier.capacity() is None and tier.space_need(100, 3, 1) == (0, 0) and tier.bandwidth() is None
    assert tier.refusal() is None and tier.own_directory() is None and _Plain.leftovers("/nonexistent") is None
    assert (tier.state_memory, tier.keeps_on_host) == ("device", False)
    assert tier.store_parts(100, 200, 3, 1, True) is None and tier.step_io(100, 200, 10) is None
    peer = tier.peer("host")  # (another tier on the same mesh and sharding)
    assert (peer.name, peer.mesh, peer.sharded, peer.state_memory, peer.keeps_on_host) == ("host", mesh, False,
                                                                                           "host", True)
    assert tier.checkpoint_form == "orbax" and not _Plain.holds_state(None)
    assert tier.checkpoint_item is None and _Plain.checkpoint_handler() is None
    with pytest.raises(NotImplementedError):
        _Plain.checkpoint_save(None)
    template = object()
    assert _Plain.array_template(template) is template
    # Orbax's arrays form: a state of arrays is saved and restored as it is (no store reads or writes).
    assert not tier.holds_refs
    assert tier.checkpoint_arrays(template) is template and tier.restored_arrays(template) is template
    assert tier.restore_template(template) is template
    assert tier.sample_layers([], None) is None
    x = np.ones(3, np.float32)
    assert tier.keep(x) is x and tier.bring(x) is x and tier.fetch(x) is x
    # Sampling and export: numpy and host arrays count as held outside the device; the export's view copies.
    assert tier.outside_bytes({"a": x, "b": np.ones(2, np.float16)}) == 12 + 4
    assert tier.outside_bytes({"a": jax.device_put(x)}) == 0
    assert tier.sample_words() == ("from the plain tier's store", "moves {} to the device")
    weights = tier.layer_weights([{"a": jax.device_put(x)}])
    assert len(weights) == 1 and isinstance(weights[0]["a"], np.ndarray) and np.array_equal(weights[0]["a"], x)


def test_a_streamed_tier_moves_each_layer_once_per_pass(mesh):
    """With a store: streamed and offloaded; a fused step reads every layer's weights in the forward but the
    head's, weights and optimizer state in the backward, and writes each layer once."""
    tier = _Streamed(mesh)
    assert tier.streamed and tier.offloaded
    assert tier.holds_refs  # (no memory kind of its own: its states hold the store's refs, not arrays)
    assert tier.io_per_step(100, 200, 10) == (2 * 100 + 200 - 10, 100 + 200)


def test_a_host_stack_stacks_layers_and_refuses_another_structure():
    stack = HostStack(2)
    stack.put(0, {"w": np.zeros((2,), np.float32)})
    stack.put(1, {"w": np.ones((2,), np.float32)})
    assert np.array_equal(stack.tree()["w"], [[0, 0], [1, 1]])
    with pytest.raises(ValueError, match="differs"):
        stack.put(1, [np.zeros(2)])


def test_a_store_error_is_a_run_failure_and_an_os_error():
    from revtrain.errors import RunFailure
    assert issubclass(StoreError, RunFailure) and issubclass(StoreError, OSError)
