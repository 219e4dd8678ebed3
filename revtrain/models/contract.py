"""The contract a part of a composed model keeps, checked at start-up (and by ``revtrain check``).

A reversible trainer rebuilds each coupling's input from its output by running F and G again; the rebuild
is exact only when F and G compute the same thing the second time. The classic bug is fresh randomness in
the rebuild (dropout masks drawn again from a stream the module keeps: memcnn issue 46, RevTorch issue 3),
which makes the rebuilt activations, and so the gradients, silently wrong. The checks here find the
violations that can be seen without running the model (construction time) or from shapes alone
(``jax.eval_shape``, no compilation), and report each as one line (`ContractError`, exit status 2) naming
the module and what to change:

* **own randomness**: the part keeps an ``nnx.Rngs`` / ``nnx.RngStream`` (random state variables), or
  holds an ``nnx.Dropout``: dropout must be drawn from the per-example ``keys`` the layer is called with
  (``revtrain.layers.base.dropout(x, rate, keys, train)``), which the rebuild passes again;
* **shape**: F or G does not map ``[B, T, D] -> [B, T, D]`` with its input's shape and dtype (the coupling
  adds its output to the other stream);
* **layer state**: a part that creates state variables in its forward (``sow``, a new attribute), whose
  state changes shape or dtype, or whose F and G share a variable (the rebuild runs G before F, so a
  state F writes for G cannot be replayed).

See ``docs/models.md`` for the contract itself.
"""

from __future__ import annotations

import functools

import jax
from flax import nnx

from revtrain.errors import InputError


class ContractError(InputError, ValueError):
    """A part that breaks the composition contract (one line naming it and the fix; exit status 2)."""


def _name(part) -> str:
    while isinstance(part, functools.partial):
        part = part.func
    return getattr(part, "__name__", None) or type(part).__name__


def _path(path) -> str:
    return ".".join(str(p) for p in path) or "(the module itself)"


def check_part(module: nnx.Module, part, where: str) -> None:
    """Refuses a constructed part that keeps its own random stream or holds an ``nnx.Dropout``.

    Raises:
      ContractError: naming the part, the attribute path and the change to make.
    """
    for path, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Dropout):
            raise ContractError(
                f"{_name(part)} ({where}) uses nnx.Dropout at '{_path(path)}', whose masks come from a random "
                "stream the rebuild would draw again; use revtrain.layers.base.dropout(x, rate, keys, train) "
                "with the keys the layer is called with")
        if isinstance(node, (nnx.Rngs, nnx.RngStream)) or isinstance(node, nnx.RngState):
            raise ContractError(
                f"{_name(part)} ({where}) keeps its own random stream at '{_path(path)}' (an nnx.Rngs kept "
                "after construction): the rebuild would draw different numbers; use the rngs argument only in "
                "__init__ and draw training randomness from the per-example keys (revtrain.layers.base.dropout "
                "or jax.random with keys[b])")


def _variables(module: nnx.Module) -> dict[int, str]:
    return {id(node): _path(path) for path, node in nnx.iter_graph(module) if isinstance(node, nnx.Variable)}


def check_coupling(f: nnx.Module, g: nnx.Module, f_part, g_part, name: str) -> None:
    """Refuses F and G that share a variable (the same module or weight used in both).

    Raises:
      ContractError: naming the shared attribute.
    """
    fv, gv = _variables(f), _variables(g)
    shared = [k for k in fv if k in gv]
    if shared:
        raise ContractError(
            f"{_name(f_part)} (layer {name}, F) and {_name(g_part)} (layer {name}, G) share the variable "
            f"'{fv[shared[0]]}': the rebuild runs G before F, so what one writes for the other cannot be "
            "replayed and shared weights get one gradient per use; give F and G their own modules")


def _spec(tree):
    return jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), tree)


def _describe(tree) -> str:
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: hasattr(x, "shape"))
    return ", ".join(f"{x.dtype}{list(x.shape)}" for x in leaves)


def check_shapes(model, batch_spec: dict, mesh) -> None:
    """Traces the model's forward on shapes only (``jax.eval_shape``: no compilation) and checks every
    coupling's F and G keep their input's shape and dtype, and every layer's state keeps its structure.

    Args:
      model: a `revtrain.models.Model`.
      batch_spec: ``{key: jax.ShapeDtypeStruct}`` of a global batch with one example per device (at least
        the model's ``input_key``).
      mesh: the trainers' mesh (layers may average over its ``data`` axis, e.g. batch norm).

    Raises:
      ContractError: naming the layer, the part and what it returned.
    """
    from jax.sharding import PartitionSpec as P

    from revtrain.layers.base import ReversibleCoupling, split_keys
    from revtrain.placement import DATA_AXIS

    x = batch_spec[model.input_key]
    seen: dict = {}  # structurally equal layers on equal input shapes are traced once (deep stacks)
    for layer in model.layers[:-1]:
        key = (layer, str(_spec(x)))
        if key in seen:
            x = seen[key]
            continue
        module = layer.abstract_module()
        coupling = getattr(layer, "reversible", False) and isinstance(module, ReversibleCoupling)

        def forward(params, state, x, layer=layer, coupling=coupling):
            keys = jax.random.key_data(jax.random.split(jax.random.key(0), jax.tree.leaves(x)[0].shape[0]))
            if coupling:  # F and G on their own first: a wrong shape is named before the coupling adds it
                m = layer.merge(params, state)
                x1, x2 = x
                for which, fn, inp, k in (("F", m.f, x2, 0), ("G", m.g, x1, 1)):
                    out = fn(inp, keys=split_keys(keys, k), train=True)
                    if not hasattr(out, "shape") or (out.shape, out.dtype) != (inp.shape, inp.dtype):
                        got = _describe(out) if jax.tree.leaves(out) else repr(out)
                        raise ContractError(
                            f"{type(fn).__name__} (layer {layer.name}, {which}) returns {got} for an input of "
                            f"{_describe(inp)}: F and G must return their input's shape and dtype (project back "
                            "to the stream width, cast with .astype(x.dtype))")
            return layer.apply(params, state, x, keys, True)

        sharded = jax.shard_map(forward, mesh=mesh, in_specs=(P(), P(), P(DATA_AXIS)),
                                out_specs=(P(DATA_AXIS), P()), check_vma=False)
        try:
            y, new_state = jax.eval_shape(sharded, layer.param_shapes, layer.state_shapes, x)
        except ContractError:
            raise
        except Exception as e:  # noqa: BLE001 (the user's module may raise anything while tracing)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            if coupling:
                raise ContractError(f"layer {layer.name} ({type(module.f).__name__} as F, {type(module.g).__name__} "
                                    f"as G) fails on streams of {_describe(x)}: {first}") from e
            raise ContractError(f"layer {layer.name} ({type(module).__name__}) fails on an input of "
                                f"{_describe(x)}: {first}") from e
        if _spec(new_state) != _spec(layer.state_shapes):
            raise ContractError(
                f"layer {layer.name} ({type(module).__name__}) changes the structure of its state in the forward "
                "(a new variable, e.g. from sow, or one of another shape or dtype): declare every state variable "
                "in __init__ with its final shape and dtype")
        seen[key] = x = y
