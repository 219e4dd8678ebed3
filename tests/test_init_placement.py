"""No model is built whole on the device: every model family's build allocates no device memory for its
parameters, and a trainer with offload (host, disk) initializes it one layer at a time, each layer's values
made, placed where they live and dropped before the next is made (docs/memory.md).

The device-kind bytes alive (``jax.live_arrays`` in the default ``device`` memory kind, as the memory meter
counts them: `revtrain.memory`) are sampled inside the per-layer init: at every ``nnx.Variable`` made (a
layer's module being constructed), after each optimizer-state init and after each leaf's placement. Their
maximum above the bytes alive before must stay within one layer's bytes plus a small slack.
"""

import functools
import gc

import gin
import jax
import numpy as np
import optax
import pytest
from flax import nnx

from revtrain import registry  # noqa: F401  (the gin configurables)
from revtrain.memory import _bytes_on
from revtrain.models import ReversibleTransformerLM, compose
from revtrain.models.llama import LlamaModel
from revtrain.models.revnet import RevNet
from revtrain.placement import make_mesh
from revtrain.tiers.device import DeviceTier as Residency
from revtrain.trainers import ReversibleTrainer

SLACK = 64 * 1024  # PRNG keys, step counters, a batch-norm layer's statistics


class DeviceBytes:
    """The maximum of the device-kind bytes alive, over samples taken while ``active``."""

    def __init__(self):
        self.device = jax.local_devices()[0]
        self.active, self.peak, self.samples, self.held, self.before = False, 0, 0, [], set()

    def now(self) -> int:
        """Device bytes of the arrays alive now that were not alive at ``__enter__``."""
        return sum(_bytes_on(x, self.device) for x in jax.live_arrays()
                   if id(x) not in self.before and not x.is_deleted())

    def sample(self):
        if self.active:
            self.samples += 1
            self.peak = max(self.peak, self.now())

    def __enter__(self):
        # The arrays alive before (an earlier test's, in this process) are held until __exit__, so none is freed
        # while the meter runs (which would lower a base subtracted from every sample) and no new array takes
        # the id of one of them.
        gc.collect()
        self.held = list(jax.live_arrays())
        self.before = {id(x) for x in self.held}
        self.peak, self.samples, self.active = 0, 0, True
        return self

    def __exit__(self, *exc):
        self.active, self.held, self.before = False, [], set()


@pytest.fixture
def meter(monkeypatch):
    """A `DeviceBytes` sampled at every variable made and every leaf placed."""
    meter = DeviceBytes()
    made = nnx.Variable.__init__
    place = Residency.place

    def variable_init(self, *args, **kwargs):
        made(self, *args, **kwargs)
        meter.sample()

    def placed(self, *args, **kwargs):
        out = place(self, *args, **kwargs)
        meter.sample()
        return out

    monkeypatch.setattr(nnx.Variable, "__init__", variable_init)
    monkeypatch.setattr(Residency, "place", placed)
    return meter


def sampled(tx, meter):
    """``tx`` whose ``init`` samples the meter once the layer's optimizer state exists."""
    def init(params):
        state = tx.init(params)
        meter.sample()
        return state
    return optax.GradientTransformation(init, tx.update)


def nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _gin_model(text, **kwargs):
    gin.clear_config()
    gin.parse_config(text)
    try:
        return compose.ComposedModel(**kwargs)
    finally:
        gin.clear_config()


# The families: each builder at a size where one layer is a small part of the whole model.
MODERN_TIED = """
ComposedModel.layers = [@embedding/Standard(), @block/Repeat(), @head/Head()]
embedding/Standard.module = @TokenEmbedding
block/Repeat.count = 6
block/Repeat.layer = @Coupling()
Coupling.f = @GroupedQueryAttention
Coupling.g = @SwiGLU
GroupedQueryAttention.num_heads = 4
GroupedQueryAttention.num_kv_heads = 2
SwiGLU.d_ff = 256
head/Head.module = @RMSNormLanguageModelHead
RMSNormLanguageModelHead.tie_embedding = True
"""
VIT = """
ComposedModel.layers = [@patches/Standard(), @block/Repeat(), @head/Head()]
patches/Standard.module = @PatchEmbedding
PatchEmbedding.patch_size = 7
block/Repeat.count = 6
block/Repeat.layer = @Coupling()
Coupling.f = @BidirectionalAttention
Coupling.g = @MLP
BidirectionalAttention.num_heads = 4
MLP.d_ff = 256
head/Head.module = @MeanPoolClassifierHead
"""
FAMILIES = {
    "ReversibleTransformerLM": lambda: ReversibleTransformerLM(32, num_layers=6, d_model=64, num_heads=4,
                                                              dropout_rate=0.0),
    "gin-composed (modern, tied head)": lambda: _gin_model(MODERN_TIED, d_model=64, sequence_length=32),
    "RevNet": lambda: RevNet(10, widths=(32, 64), blocks=(3, 3)),
    "Llama": lambda: LlamaModel(None, sequence_length=32, d_model=64, num_layers=6, num_heads=4, num_kv_heads=2,
                                d_ff=192),
    "ViT": lambda: _gin_model(VIT, d_model=64, num_classes=10),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_build_makes_no_parameter_on_the_device(family, meter):
    with meter:
        model = FAMILIES[family]()
    assert meter.samples > 0  # the modules were traced (on shapes)
    assert meter.peak <= 1024, f"{family}: {meter.peak} device bytes alive while building"
    # and every layer's values are made on demand: nothing is kept by the model
    assert all(layer._factory is not None for layer in model.layers)


@pytest.mark.parametrize("family, offload, tx", [
    ("ReversibleTransformerLM", True, "sgd"), ("ReversibleTransformerLM", "disk", "adam"),
    ("gin-composed (modern, tied head)", True, "sgd"),
    pytest.param("RevNet", True, "sgd", marks=pytest.mark.slow),  # (make test-all; make test: the other families)
    ("Llama", True, "sgd"),
    ("Llama", "disk", "sgd"), ("ViT", True, "adam")])
def test_offloaded_init_holds_one_layer_on_the_device(family, offload, tx, meter, tmp_path):
    model = FAMILIES[family]()
    base = optax.sgd(0.1) if tx == "sgd" else optax.adam(1e-3)
    trainer = ReversibleTrainer(model, sampled(base, meter), make_mesh(), offload=offload,
                                scan_layers=offload != "disk", offload_dir=str(tmp_path) if offload == "disk" else None)
    shapes = [layer.param_shapes for layer in model.layers]
    # one layer's bytes: its parameters and the optimizer state made from them (none for plain SGD)
    layer = max(nbytes(p) + nbytes(jax.eval_shape(base.init, p)) for p in shapes)
    whole = sum(nbytes(p) for p in shapes)
    states = sum(nbytes(s) for s in model.state_shapes())  # layer state (batch norm) is kept on the device
    with meter:
        ts = trainer.init()
    jax.block_until_ready(ts.held())
    assert meter.samples >= len(model.layers)
    assert whole > 2 * layer  # the bound below tells one layer from the whole model
    assert meter.peak <= layer + states + SLACK, (
        f"{family}: {meter.peak} device bytes alive during init; one layer's are {layer}, the model's {whole}")
    assert meter.peak >= nbytes(shapes[1]) // 2  # the samples did see a layer being made


def test_a_composed_layer_made_after_its_gin_configuration_is_gone_is_the_same():
    """A lazy layer's parts are constructed again when its values are made; a caller that cleared (or
    changed) the gin configuration since the build gets the layer of the build's bindings (here the tied head
    and SwiGLU.d_ff), and its own configuration back."""
    gin.clear_config()
    gin.parse_config(MODERN_TIED)
    try:
        model = compose.ComposedModel(d_model=64, sequence_length=32)
        alive = jax.tree.leaves(model.init())
    finally:
        gin.clear_config()
    gin.parse_config("SwiGLU.d_ff = 8")
    try:
        cleared = jax.tree.leaves(model.init())
        assert gin.query_parameter("SwiGLU.d_ff") == 8 and "tie_embedding" not in gin.config_str()
    finally:
        gin.clear_config()
    assert len(alive) == len(cleared) and all(np.array_equal(a, b) for a, b in zip(alive, cleared))
