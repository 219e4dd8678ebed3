"""``StandardTrainer.remat_offload``: scan + ``jax.checkpoint`` with each layer's saved input offloaded to
host memory computes what the standard trainer computes, and its bad values are refused."""

import jax
import numpy as np
import optax
import pytest

from revtrain.models import ReversibleTransformerLM
from revtrain.placement import global_batch, make_mesh
from revtrain.trainers import StandardTrainer, TrainerError


@pytest.mark.slow  # 189 s on the loaded 2-core machine (three trainers compiled); not timed idle
def test_remat_offload_gives_the_standard_trainers_losses():
    """Depth 4, dropout 0.1, 3 Adam steps on random tokens: the same losses as the unrolled standard trainer
    and as remat without offload (1e-6 relative), and the same parameters (1e-5)."""
    mesh = make_mesh(jax.devices()[:1])
    r = np.random.default_rng(0)
    batches = [global_batch({"inputs": r.integers(0, 256, (4, 32)).astype(np.int32),
                             "targets": r.integers(0, 256, (4, 32)).astype(np.int32)}, mesh) for _ in range(3)]
    losses, params = {}, {}
    for name, kwargs in (("standard", {}), ("remat", {"scan_layers": True, "remat_layers": True}),
                         ("offload", {"scan_layers": True, "remat_layers": True, "remat_offload": True})):
        model = ReversibleTransformerLM(32, num_layers=4, d_model=32, num_heads=2, dropout_rate=0.1)
        trainer = StandardTrainer(model, optax.adam(1e-3), mesh, **kwargs)
        ts = trainer.init()
        losses[name] = []
        for b in batches:
            ts, m = trainer.train_step(ts, b)
            losses[name].append(float(m["loss"]))
        params[name] = ts.params
    np.testing.assert_allclose(losses["offload"], losses["standard"], rtol=1e-6)
    np.testing.assert_allclose(losses["offload"], losses["remat"], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(params["offload"]), jax.tree.leaves(params["standard"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kwargs, message", [
    ({"remat_offload": "yes"}, "StandardTrainer.remat_offload must be True or False"),
    ({"remat_offload": True}, "remat_offload needs scan_layers = True and remat_layers = True"),
    ({"remat_offload": True, "scan_layers": True}, "remat_offload needs scan_layers = True and remat_layers"),
])
def test_bad_remat_offload_is_refused(kwargs, message):
    model = ReversibleTransformerLM(16, num_layers=2, d_model=16, num_heads=2)
    with pytest.raises(TrainerError, match=message):
        StandardTrainer(model, optax.adam(1e-3), make_mesh(jax.devices()[:1]), **kwargs)
