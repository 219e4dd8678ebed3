"""Models composed in gin from parts: standard layers, reversible couplings of an F and a G, repeated runs
of a block, and a head.

A composed model is a list of layer *specs*; `ComposedModel` turns it into a `revtrain.models.Model`::

    D_MODEL = 128
    NUM_LAYERS = 6
    train.model = @ComposedModel
    ComposedModel.d_model = %D_MODEL
    ComposedModel.layers = [@embedding/Standard(), @block/Repeat(), @head/Head()]
    embedding/Standard.module = @ByteEmbedding
    block/Repeat.count = %NUM_LAYERS
    block/Repeat.layer = @Coupling()
    Coupling.f = @CausalSelfAttention
    Coupling.g = @FeedForward
    head/Head.module = @LanguageModelHead

The specs (`Standard`, `Coupling`, `Repeat`, `Head`) are called by gin (``@Spec()``, with parentheses) and
hold *parts*: gin-configurable Flax NNX module classes handed over without parentheses (``@ByteEmbedding``),
which the composer constructs itself, so that it can pass each one its random stream and the model's sizes.
The contract a part keeps (constructor arguments, call signature, randomness, layer state, decoding) is
documented in ``docs/models.md``; `revtrain.models.contract` checks it at start-up.

Per-layer seeds: layer ``i`` of the flattened model (standard, reversible or head) is constructed from
``nnx.Rngs(params=fold_in(PRNGKey(seed), i))``; a coupling constructs F and then G from the same Rngs. This
is how the hand-written builders (`ReversibleTransformerLM`, `RevNet`) always seeded their layers, so the
same layers written as a composition get the same initial weights bit for bit, and a layer's weights do not
depend on the depth of the model.

Layer by layer: the composer constructs every part once on shapes only (``nnx.eval_shape``: nothing is
allocated, on the device or in host memory), which is where the contract checks run and the ties are found;
each layer's values are made by its factory when a trainer places that layer (`revtrain.layers.Layer.lazy`),
under the gin bindings of the build, and dropped once placed, so no model is ever built whole (with offload
the device holds one layer's values at a time during init).

Design: a model is a flat list of layers, as in Trax's serial combinators (``tl.Serial``,
``tl.ReversibleSerial``) and in the reversible layer lists of memcnn / RevLib; configuration is by gin
references to classes, as in t5x / flaxformer configs.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import gin
import jax
import jax.numpy as jnp
from flax import nnx

from revtrain.errors import InputError
from revtrain.layers.base import HeadLayer, Layer, ReversibleCoupling, ReversibleLayer
from revtrain.models.base import Model, Tie
from revtrain.models.contract import ContractError, check_coupling, check_part

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class CompositionError(InputError, ValueError):
    """A composed model that cannot be built (a bad spec, a part that cannot be constructed); reported as
    one line, exit status 2."""


def _scope_name() -> str | None:
    """The innermost gin scope the current call runs in (``embedding`` for ``@embedding/Standard()``)."""
    scope = gin.current_scope()
    return scope[-1] if scope else None


def _part_name(part) -> str:
    while isinstance(part, functools.partial):
        part = part.func
    return getattr(part, "__name__", None) or type(part).__name__


def _check_part_callable(part, what: str) -> None:
    if part is None or part is gin.REQUIRED:
        raise CompositionError(f"{what} is not set")
    if isinstance(part, nnx.Module):
        raise CompositionError(f"{what} is a constructed module ({type(part).__name__}); hand over the class "
                               f"(write @{type(part).__name__} without parentheses): revtrain constructs each "
                               "part itself so that it can give it its random stream and sizes")
    if not callable(part):
        raise CompositionError(f"{what} must be an NNX module class (@Name), got {part!r}")


class Standard:
    """A standard (non-reversible) layer: one part, whose input the reversible trainer saves.

    Args:
      module: the part, an NNX module class (``@ByteEmbedding``) or any callable returning an NNX module;
        constructed by the composer (see `ComposedModel`). Its ``__call__(x, *, keys, train)`` may change
        shapes freely (e.g. token ids to two residual streams).
      name: the layer's name in logs, checkpoints' signature and ``revtrain check`` (default: the gin
        scope it is called in, e.g. ``embedding`` for ``@embedding/Standard()``, else ``layer``).
    """

    kind = "standard"

    def __init__(self, module: Callable = gin.REQUIRED, name: str | None = None):
        _check_part_callable(module, "Standard.module")
        self.module = module
        self.name = name or _scope_name() or "layer"
        self.scope = gin.current_scope()


class Head:
    """The last layer: a part whose module also has ``loss(x, batch, *, keys, train) -> (loss_sum, stats)``.

    Args:
      module: the part (``@LanguageModelHead``), constructed by the composer.
      name: the layer's name (default: the gin scope, else ``head``).
    """

    kind = "head"

    def __init__(self, module: Callable = gin.REQUIRED, name: str | None = None):
        _check_part_callable(module, "Head.module")
        self.module = module
        self.name = name or _scope_name() or "head"
        self.scope = gin.current_scope()


class Coupling:
    """A reversible additive coupling of two streams: ``y1 = x1 + F(x2)``, ``y2 = x2 + G(y1)`` (RevNet,
    Gomez et al. 2017; Reformer, Kitaev et al. 2020), via `revtrain.layers.base.ReversibleCoupling`.

    Args:
      f, g: the parts (``@CausalSelfAttention``, ``@FeedForward``), each mapping ``[B, T, D] -> [B, T, D]``
        (shape and dtype of its input); constructed by the composer from the same Rngs, F first.
      name: the layer's name (default: the gin scope, else ``block``); inside a `Repeat` the run's index
        is appended (``block_0``, ``block_1``, ...).

    The outputs of F and G are rounded to ``ComposedModel.grid_bits`` (``snap_to_grid``) so the rebuild is
    exact in float32.
    """

    kind = "coupling"

    def __init__(self, f: Callable = gin.REQUIRED, g: Callable = gin.REQUIRED, name: str | None = None):
        _check_part_callable(f, "Coupling.f")
        _check_part_callable(g, "Coupling.g")
        self.f, self.g = f, g
        self.name = name or _scope_name() or "block"
        self.scope = gin.current_scope()


class Repeat:
    """``count`` copies of a layer spec (or of a list of specs, in order), each constructed on its own
    (its own weights, from its own layer seed).

    Args:
      layer: a spec (``@Coupling()``) or a list of specs.
      count: how many times (0 allowed: none).
      name: prefix of the layers' names (default: the inner spec's own name); copy ``i`` of a spec named
        ``block`` is ``block_i`` (with several inner specs, each keeps its name and gets the index).
    """

    kind = "repeat"

    def __init__(self, layer: Any = gin.REQUIRED, count: int = gin.REQUIRED, name: str | None = None):
        if layer is gin.REQUIRED:
            raise CompositionError("Repeat.layer is not set")
        if count is gin.REQUIRED:
            raise CompositionError("Repeat.count is not set")
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise CompositionError(f"Repeat.count must be a non-negative integer, got {count!r}")
        self.layers = list(layer) if isinstance(layer, (list, tuple)) else [layer]
        self.count = count
        self.name = name


# The specs as gin configurables (``@Standard()``): gin subclasses, so that Python code constructing the
# classes above (the hand-written builders) is not affected by gin bindings.
for _spec_class in (Standard, Head, Coupling, Repeat):
    gin.external_configurable(_spec_class, module="revtrain")


def flatten(specs: Sequence[Any]) -> list[tuple[Any, str]]:
    """``[(spec, name)]``: the model's layers in order, each `Repeat` unrolled and names made unique.

    Raises:
      CompositionError: an item that is no spec (a module class given directly, a bare value).
    """
    out: list[tuple[Any, str]] = []

    def visit(item, suffix: str = "", prefix: str | None = None):
        kind = getattr(item, "kind", None)
        if kind == "repeat":
            for i in range(item.count):
                for inner in item.layers:
                    visit(inner, f"{suffix}_{i}", item.name or prefix)
        elif kind in ("standard", "coupling", "head"):
            out.append((item, (prefix or item.name) + suffix))
        else:
            raise CompositionError(
                f"ComposedModel.layers: {item!r} is not a layer spec; write @Standard(), @Coupling(), @Repeat() "
                "or @Head() (with parentheses), each holding its part: e.g. Standard.module = @ByteEmbedding")

    for item in specs:
        visit(item)
    counts: dict[str, int] = {}
    for _, name in out:
        counts[name] = counts.get(name, 0) + 1
    seen: dict[str, int] = {}
    unique = []
    for spec, name in out:
        if counts[name] > 1:
            k = seen[name] = seen.get(name, -1) + 1
            name = f"{name}_{k}"
        unique.append((spec, name))
    return unique


def parameters(part) -> dict:
    """The constructor parameters of a part (a class: its ``__init__`` without ``self``, which also sees
    through gin's configurable subclasses; a function or ``functools.partial``: its own)."""
    try:
        if inspect.isclass(part):
            params = list(inspect.signature(part.__init__).parameters.values())[1:]
        else:
            params = list(inspect.signature(part).parameters.values())
    except (TypeError, ValueError):
        return {}
    return {p.name: p for p in params}


def construct(part: Callable, rngs: nnx.Rngs, context: dict, where: str) -> nnx.Module:
    """Constructs one part: ``part(rngs=rngs, **values)`` where ``values`` are the entries of ``context``
    the constructor's signature names (every other argument comes from gin or its default).

    Raises:
      CompositionError: the signature takes no ``rngs``, the constructor raised, or it returned no NNX
        module (one line naming the part and the layer).
    """
    name = _part_name(part)
    params = parameters(part)
    if "rngs" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        raise CompositionError(f"{name} ({where}) cannot be a part: its constructor takes no `rngs` keyword "
                               "(revtrain passes an nnx.Rngs with a 'params' stream to initialise its weights)")
    kwargs = {k: v for k, v in context.items() if k in params and v is not None}
    try:
        module = part(rngs=rngs, **kwargs)
    except Exception as e:  # noqa: BLE001 (a user's constructor may raise anything: one line naming it)
        first = (str(e).strip().strip('"').splitlines() or [type(e).__name__])[0]
        if "RngStream" in first:  # nnx.Dropout(rngs=...), rngs.dropout(), rngs.noise() (KeyError, AttributeError)
            raise ContractError(f"{name} ({where}) asks its rngs for a random stream of its own ({first}): the rngs "
                                "revtrain passes has only a 'params' stream: draw initial weights with "
                                "rngs.params() (or rngs()), and training randomness such as dropout from the keys "
                                "the layer is called with (revtrain.layers.base.dropout(x, rate, keys, train))") from e
        raise CompositionError(f"cannot construct {name} ({where}): {first}") from e
    if not isinstance(module, nnx.Module):
        raise CompositionError(f"{name} ({where}) returned {type(module).__name__}, not a Flax NNX module")
    return module


class _GinAsBuilt:
    """The gin bindings in force when a model was composed, for its layers' factories: a part reads its gin
    bindings when it is constructed, and a lazy layer's part is constructed again when a trainer makes its
    values, maybe after the caller has cleared or changed the configuration (a benchmark building several
    models from several configs). ``active()`` makes those bindings the configuration for the duration of a
    construction when they are no longer it (the text of ``gin.config_str()``, parsed again; the caller's
    configuration restored after), so a layer's values never depend on when they are made."""

    def __init__(self):
        self.text = gin.config_str()

    @contextlib.contextmanager
    def active(self):
        now = gin.config_str()
        if now == self.text:
            yield
            return
        gin.clear_config()
        try:
            try:
                gin.parse_config(self.text)
            except Exception as e:  # noqa: BLE001 (a value bound from Python that has no gin text)
                raise CompositionError("the gin configuration changed since the model was composed, and the one it "
                                       f"was composed with cannot be restored ({e}); build the model again") from e
            yield
        finally:
            gin.clear_config()
            try:
                gin.parse_config(now)
            except Exception as e:  # noqa: BLE001
                raise CompositionError(f"the caller's gin configuration cannot be restored after making a layer: {e}"
                                       ) from e


def compose(specs: Sequence[Any], *, seed: int = 0, context: dict | None = None, grid_bits: int | None = None,
            input_key: str = "inputs", tokens_per_example: int = 1, bits_per_byte: bool = False,
            memory_knobs: tuple | None = None) -> Model:
    """Builds a `Model` from layer specs (the Python side of `ComposedModel`; `ReversibleTransformerLM`
    and `RevNet` call it too).

    Args:
      specs: `Standard`, `Coupling`, `Repeat` and `Head` specs in forward order; the last layer must be a
        `Head`.
      seed: layer ``i`` is constructed from ``nnx.Rngs(params=fold_in(PRNGKey(seed), i))``.
      context: values passed to every part whose constructor names them (``d_model``, ``max_len`` ...);
        ``num_layers`` (the number of couplings) is added.
      grid_bits: the couplings' ``snap_to_grid`` resolution (None: no rounding).
      input_key, tokens_per_example, bits_per_byte: as in `Model`.
      memory_knobs: as in `Model`; None: those the parts of the couplings' F declare (a part class's
        ``memory_knob``, e.g. `CausalSelfAttention`'s attention blocking).

    A part may share a weight with an earlier layer's (a tied output projection holding the embedding's
    ``nnx.Param`` itself; the first layer's module is in ``context`` as ``embedding`` for parts that ask for
    it): the model then holds it once (`Model.ties`, found by `find_ties`).

    Raises:
      CompositionError: bad specs or parts; ContractError: a part breaks the contract (its own random
        stream, F and G sharing a variable, a variable shared across layers that cannot be one parameter).
    """
    flat = flatten(specs)
    if not flat or flat[-1][0].kind != "head":
        raise CompositionError("ComposedModel.layers must end with a @Head() (the layer that computes the loss)")
    if any(spec.kind == "head" for spec, _ in flat[:-1]):
        raise CompositionError("only the last layer of ComposedModel.layers may be a @Head()")
    context = dict(context or {})
    context["num_layers"] = sum(spec.kind == "coupling" for spec, _ in flat)
    if grid_bits is not None:
        context.setdefault("grid_bits", grid_bits)
    base = jax.random.PRNGKey(seed)

    def module(i: int, ctx: dict) -> nnx.Module:
        """Layer ``i``'s module, from its own seed ``fold_in(seed, i)``, the spec's gin scope applied to its
        parts and the contract checked (`_build_module`)."""
        spec, name = flat[i]
        rngs = nnx.Rngs(params=jax.random.fold_in(base, i))
        with gin.config_scope(list(getattr(spec, "scope", []))):  # the spec's gin scope applies to its parts
            return _build_module(spec, name, rngs, ctx, grid_bits)

    def every_module() -> list:
        ctx, out = dict(context), []
        for i in range(len(flat)):
            out.append(module(i, ctx))
            if i == 0:
                ctx["embedding"] = out[0]  # for a part that ties a weight to the embedding's
        return out

    as_built = _GinAsBuilt()

    def made(i: int) -> nnx.Module:
        """Layer ``i``'s module with its initial values (the `Layer` factory), under the gin bindings the model
        was built with: only this layer's, plus the first layer's when one of its parts names ``embedding`` (a
        tied weight: its value is the owner's)."""
        with as_built.active():
            ctx = dict(context)
            if i and any("embedding" in parameters(part) for part in _parts(flat[i][0])):
                ctx["embedding"] = made(0)
            return module(i, ctx)

    # Every module at once on shapes only (nnx.eval_shape: nothing allocated): the contract checks, the
    # layers' shapes and the ties (one nnx.Param object held by two modules) are read from these. Each layer's
    # values are made by its factory when a trainer places it, one layer at a time (`Layer.lazy`), so the
    # model is never built whole, on the device or anywhere (docs/memory.md).
    modules = nnx.eval_shape(every_module)
    layers: list[Layer] = []
    for i, (spec, name) in enumerate(flat):
        cls = {"coupling": ReversibleLayer, "head": HeadLayer}.get(spec.kind, Layer)
        layers.append(cls(modules[i], name, factory=functools.partial(made, i)))
    if memory_knobs is None:
        memory_knobs = tuple(dict.fromkeys(
            knob for module, (spec, _) in zip(modules, flat) if spec.kind == "coupling"
            for knob in (getattr(type(module.f), "memory_knob", None),) if knob))
    return Model(layers, input_key=input_key, tokens_per_example=tokens_per_example, bits_per_byte=bits_per_byte,
                 ties=find_ties(modules, layers), memory_knobs=memory_knobs)


def find_ties(modules: list, layers: list) -> tuple:
    """The parameters shared between layers: every ``nnx.Param`` object that two layers' modules hold (a
    tied embedding and output projection), as `Tie` s whose owner is the first layer holding it.

    Raises:
      ContractError: a shared variable that is not a parameter (layer state written by two layers), or a
        parameter held by more than two layers.
    """
    seen: dict[int, tuple] = {}
    ties = []
    for i, module in enumerate(modules):
        for path, node in nnx.iter_graph(module):
            if not isinstance(node, nnx.Variable):
                continue
            if id(node) not in seen:
                seen[id(node)] = (i, tuple(path))
                continue
            owner, owner_path = seen[id(node)]
            if owner == i:
                continue
            where = (f"layers {layers[owner].name} ('{'.'.join(map(str, owner_path))}') and {layers[i].name} "
                     f"('{'.'.join(map(str, path))}')")
            if not isinstance(node, nnx.Param):
                raise ContractError(f"{where} share the variable {type(node).__name__}: layer state written by two "
                                    "layers cannot be replayed by the rebuild; give each layer its own")
            if any(t.owner_path == owner_path and t.owner == owner for t in ties):
                raise ContractError(f"{where} share a parameter that a third layer uses too: a parameter may be "
                                    "shared by two layers")
            ties.append(Tie(owner, owner_path, i, tuple(path)))
    return tuple(ties)


def _parts(spec) -> tuple:
    """The parts a spec constructs (F and G of a coupling, else its module)."""
    return (spec.f, spec.g) if spec.kind == "coupling" else (spec.module,)


def _build_module(spec, name: str, rngs: nnx.Rngs, context: dict, grid_bits: int | None) -> nnx.Module:
    """The layer's module (a `ReversibleCoupling` of F and G for a coupling), its parts constructed with
    ``rngs`` (F first) and checked against the contract (`check_part`, `check_coupling`, a head's ``loss``).
    Called on shapes (under ``nnx.eval_shape``) and again for each layer's values, with the same results."""
    if spec.kind == "coupling":
        f = construct(spec.f, rngs, context, f"layer {name}, F")
        g = construct(spec.g, rngs, context, f"layer {name}, G")
        check_part(f, spec.f, f"layer {name}, F")
        check_part(g, spec.g, f"layer {name}, G")
        check_coupling(f, g, spec.f, spec.g, name)
        return ReversibleCoupling(f, g, grid_bits=grid_bits)
    module = construct(spec.module, rngs, context, f"layer {name}")
    check_part(module, spec.module, f"layer {name}")
    if spec.kind == "head" and not callable(getattr(module, "loss", None)):
        raise CompositionError(f"{_part_name(spec.module)} (layer {name}) cannot be a head: it has no "
                               "loss(x, batch, *, keys, train) method")
    return module


@gin.configurable
def ComposedModel(layers: Sequence[Any] = gin.REQUIRED, *, seed: int = 0, d_model: int | None = None,
                  grid_bits: int | None = 18, compute_dtype: str = "float32", sequence_length: int | None = None,
                  num_classes: int | None = None, vocab_size: int = 256, input_key: str | None = None) -> Model:
    """A model composed in gin from layer specs (``train.model = @ComposedModel``).

    Args:
      layers: the specs, in forward order, ending with a `Head`: ``[@embedding/Standard(), @block/Repeat(),
        @head/Head()]``.
      seed: initialisation seed (``train.seed``, passed by the loop); layer ``i`` from ``fold_in(seed, i)``.
      d_model: width of each residual stream; passed to every part whose constructor names ``d_model``.
      grid_bits: F / G outputs of every coupling (and parts naming ``grid_bits``, e.g. the embedding) are
        rounded to multiples of ``2**-grid_bits`` so the rebuild is exact in float32 while the streams stay
        below ``2**(24 - grid_bits)``; None: no rounding. See ``revtrain.layers.snap_to_grid``.
      compute_dtype: "float32" or "bfloat16", passed (as a JAX dtype) to parts naming ``compute_dtype``.
      sequence_length: the task's sequence length (the loop passes it for a byte LM); parts get it as
        ``max_len``.
      num_classes: the task's number of classes (the loop passes it for a classifier).
      vocab_size: passed to parts naming ``vocab_size`` (256 for bytes).
      input_key: the batch entry fed to the first layer (default ``inputs`` for a sequence task, ``image``
        for a classifier).

    Context values passed to a part when its constructor names them: ``rngs`` (always), ``d_model``,
    ``num_layers`` (couplings in the model), ``max_len`` (and ``sequence_length``), ``vocab_size``,
    ``num_classes``, ``grid_bits``, ``compute_dtype``. They win over gin bindings of the same parameter.

    Raises:
      CompositionError: bad specs, sizes or parts (one line); ContractError: a part breaks the contract.
    """
    if layers is gin.REQUIRED:
        raise CompositionError("ComposedModel.layers is not set (e.g. [@embedding/Standard(), @block/Repeat(), "
                               "@head/Head()])")
    if compute_dtype not in _DTYPES:
        raise CompositionError(f"ComposedModel.compute_dtype must be one of {sorted(_DTYPES)}, got {compute_dtype!r}")
    if grid_bits is not None and not (isinstance(grid_bits, int) and 1 <= grid_bits <= 60):
        raise CompositionError(f"ComposedModel.grid_bits must be an integer in [1, 60] or None, got {grid_bits!r}")
    if d_model is not None and (not isinstance(d_model, int) or d_model < 1):
        raise CompositionError(f"ComposedModel.d_model must be a positive integer, got {d_model!r}")
    context = {"d_model": d_model, "max_len": sequence_length, "sequence_length": sequence_length,
               "vocab_size": vocab_size, "num_classes": num_classes, "compute_dtype": _DTYPES[compute_dtype]}
    language = sequence_length is not None
    return compose(layers, seed=seed, context=context, grid_bits=grid_bits,
                   input_key=input_key or ("inputs" if language else "image"),
                   tokens_per_example=sequence_length if language else 1, bits_per_byte=language)


__all__ = ["ComposedModel", "Coupling", "Head", "Repeat", "Standard", "compose", "CompositionError",
           "ContractError"]
