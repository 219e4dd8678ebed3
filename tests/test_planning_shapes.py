"""revtrain/planning/shapes.py: the shapes and byte counts a plan is made from (no program compiled)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from revtrain.models.transformer_lm import ReversibleTransformerLM
from revtrain.optstate import tree_nbytes
from revtrain.planning import shapes
from revtrain.planning.setups import Setup

T, D = 16, 32


def _model():
    return ReversibleTransformerLM(T, num_layers=2, d_model=D, num_heads=2, dropout_rate=0.0)


def _modern(tie: bool):
    """configs/enwik_modern.gin's model at depth 2, d_model 32, its head's embedding tied or not."""
    import gin

    import revtrain.registry  # noqa: F401  (the gin names)
    from revtrain.models.compose import ComposedModel
    from helpers import REPO
    gin.clear_config()
    gin.add_config_file_search_path(str(REPO / "configs"))
    gin.parse_config_files_and_bindings([str(REPO / "configs" / "enwik_modern.gin")],
                                        ["NUM_LAYERS = 2", "D_MODEL = 32",
                                         f"RMSNormLanguageModelHead.tie_embedding = {tie}"])
    try:
        return ComposedModel(seed=0, d_model=D, input_key="inputs", sequence_length=T)
    finally:
        gin.clear_config()


def test_a_tied_leaf_is_counted_once_in_its_owner():
    """The head's tied embedding is in the owner's shapes only: the tied model's head holds no output matrix
    of its own (only the untied one does), the embedding stays in its owner, and the deferred update's
    other-use gradient is the embedding (256 x D float32)."""
    untied, tied = _modern(False), _modern(True)
    a, b = shapes.layer_param_shapes(untied), shapes.layer_param_shapes(tied)
    assert tree_nbytes(a) - tree_nbytes(b) == tree_nbytes(a[-1]) - tree_nbytes(b[-1]) > 0
    assert a[:-1] == b[:-1]  # (the owner keeps it)
    assert shapes.tied_bytes(tied) == 256 * D * 4 and shapes.tied_bytes(untied) == 0


def test_local_batch_sets_the_leading_axis_only():
    spec = {"inputs": jax.ShapeDtypeStruct((32, T), np.int32), "mask": jax.ShapeDtypeStruct((32, T, 2), jnp.bool_)}
    local = shapes.local_batch(spec, 4)
    assert local["inputs"].shape == (4, T) and local["mask"].shape == (4, T, 2) and local["mask"].dtype == jnp.bool_


def test_state_bytes_split_over_devices_with_shard_state():
    """``shard_state`` on 2 devices: the weights and moments of the large leaves are halved, the rest (biases,
    norms, the step counts) whole; the per-layer lists stay whole."""
    model = _model()
    tx = optax.adamw(1e-3)
    pshapes = shapes.layer_param_shapes(model)
    oshapes = [jax.eval_shape(tx.init, p) for p in pshapes]
    whole = shapes.state_bytes(Setup("reversible", tx, 8), pshapes, oshapes, 2)
    split = shapes.state_bytes(Setup("reversible", tx, 8, shard_state=True), pshapes, oshapes, 2)
    assert whole[0] == tree_nbytes(pshapes) and whole[1] == tree_nbytes(oshapes)
    assert whole[0] / 2 <= split[0] < whole[0] and whole[1] / 2 <= split[1] < whole[1]
    assert split[2] == whole[2] and split[3] == whole[3]
    assert whole[3] == [tree_nbytes(p) + tree_nbytes(o) for p, o in zip(pshapes, oshapes)]


def test_shapes_of_gives_one_devices_microbatch():
    """A global batch of 32 over 2 devices and 4 microbatches: each plan shape holds 4 examples."""
    tx = optax.sgd(0.1)
    spec = {"inputs": jax.ShapeDtypeStruct((32, T), np.int32), "targets": jax.ShapeDtypeStruct((32, T), np.int32)}
    got = shapes.shapes_of(_model(), Setup("reversible", tx, 32, microbatches=4), spec, 2, None)
    assert got.b == 4 and got.batch["inputs"].shape == (4, T) and got.keys.shape == (4, 2)
    assert shapes.tied_bytes(_model()) == 0
