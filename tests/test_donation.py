"""The reversible trainer's programs donate only buffers they can use (docs/memory.md, item 9).

pyproject's pytest filter hides JAX's "Some donated buffers were not usable" warning; these tests record
warnings themselves, with every filter reset, while a fresh trainer compiles and runs its programs.
"""

import warnings

import jax
import numpy as np
import optax
import pytest

from revtrain.models import ReversibleTransformerLM
from revtrain.placement import global_batch, make_mesh
from revtrain.trainers import ReversibleTrainer


@pytest.mark.parametrize("kwargs", [{}, {"offload": True, "microbatches": 2}])
def test_a_reversible_step_donates_no_unusable_buffer(kwargs):
    """A step of a small LM (its recomputed token embedding has no input cotangent for the output
    cotangent's buffer to become): no donation warning, and the embedding's program donates its weights and
    optimizer state only."""
    mesh = make_mesh(jax.devices()[:1])
    model = ReversibleTransformerLM(128, num_layers=2, d_model=32, num_heads=4, dropout_rate=0.0)
    trainer = ReversibleTrainer(model, optax.adamw(1e-3), mesh, **kwargs)
    rng = np.random.default_rng(0)
    batch = {k: rng.integers(0, 256, (4, 128)).astype(np.int32) for k in ("inputs", "targets")}
    ts = trainer.init()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ts, metrics = trainer.train_step(ts, global_batch(batch, mesh))
        assert np.isfinite(float(metrics["loss"]))
    unusable = [str(w.message).splitlines()[0] for w in caught if "donated buffers were not usable" in str(w.message)]
    assert unusable == []
    kind = "recompute_acc" if kwargs.get("microbatches", 1) > 1 else "recompute"
    program = trainer._cache[(kind, model.layers[0])]  # the embedding's backward program
    assert set(program._decided.values()) == {(0, 1) if kind == "recompute" else (1,)}
