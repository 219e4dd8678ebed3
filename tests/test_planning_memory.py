"""revtrain/planning/memory.py: where the plan puts each part, from shapes alone (`floor`: nothing compiled)."""

import jax
import numpy as np
import optax

from revtrain import streaming
from revtrain.models.transformer_lm import ReversibleTransformerLM
from revtrain.optstate import tree_nbytes
from revtrain.planning import memory
from revtrain.planning.setups import Setup
from revtrain.planning.shapes import layer_param_shapes
from revtrain.placement import make_mesh
from revtrain.tiers.host import HostTier

B, T = 4, 16
NO_LIMIT = {"host": (2**50, "test"), "device": (2**50, "test")}


def _spec():
    shape = jax.ShapeDtypeStruct((B, T), np.int32)
    return {"inputs": shape, "targets": shape}


def _layer_bytes(model, tx):
    """The largest layer's weights and its optimizer state (bytes)."""
    shapes = layer_param_shapes(model)
    weights = max(tree_nbytes(p) for p in shapes)
    both = max(tree_nbytes(p) + tree_nbytes(jax.eval_shape(tx.init, p)) for p in shapes)
    return weights, both - weights, tree_nbytes(shapes), sum(tree_nbytes(jax.eval_shape(tx.init, p)) for p in shapes)


def test_the_host_tier_counts_the_layers_the_engine_holds_in_flight():
    """The streaming engine puts a layer `streaming.DEPTH` (2) programs ahead on an accelerator and right before
    its program on the CPU (`streaming.CPU_DEPTH`, 0): with the layer computing and the one written back, 4
    layers are in flight on an accelerator's device and 2 on the CPU, where they are host memory."""
    model = ReversibleTransformerLM(T, num_layers=3, d_model=32, num_heads=2, dropout_rate=0.0)
    tx = optax.adamw(1e-3)
    lw, lo, weights, opt = _layer_bytes(model, tx)
    setup = Setup("reversible", tx, B, tier=HostTier(make_mesh(jax.devices()[:1])), label="s")
    assert setup.tier.memory_kind == "unpinned_host"  # (the CPU backend's pageable kind)
    assert (streaming.DEPTH, streaming.CPU_DEPTH) == (2, 0)
    tpu = memory.floor(model, setup, _spec(), 1, limits=NO_LIMIT, platform="tpu")
    assert tpu.tiers["device"]["weights"] == 4 * lw and tpu.tiers["device"]["optimizer_state"] == 4 * lo
    cpu = memory.floor(model, setup, _spec(), 1, limits=NO_LIMIT, platform="cpu")
    assert list(cpu.tiers) == ["host"]
    assert cpu.tiers["host"]["weights"] == weights + 2 * lw
    assert cpu.tiers["host"]["optimizer_state"] == opt + 2 * lo


def test_the_device_tier_holds_the_state_and_a_layers_gradient():
    """In device memory (no offload) on an accelerator: every weight and moment on the device, one layer's
    gradient (the fused update), the runtime on the host."""
    model = ReversibleTransformerLM(T, num_layers=3, d_model=32, num_heads=2, dropout_rate=0.0)
    tx = optax.adamw(1e-3)
    lw, _, weights, _ = _layer_bytes(model, tx)
    plan = memory.floor(model, Setup("reversible", tx, B, label="r"), _spec(), 1, limits=NO_LIMIT, platform="tpu")
    device, host = plan.tiers["device"], plan.tiers["host"]
    assert device["weights"] == weights and device["gradients"] == lw
    assert host["runtime"] == memory.RUNTIME_BYTES and host["weights"] == 0
    assert plan.floor and plan.method == memory.FLOOR_METHOD
