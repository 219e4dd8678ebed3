"""The model container shared by every model family."""

from __future__ import annotations

import dataclasses
from typing import Any

from revtrain.layers.base import HeadLayer, Layer


@dataclasses.dataclass(frozen=True)
class Tie:
    """One parameter used by two layers (e.g. a tied input embedding and output projection).

    Layer ``user``'s parameter at ``user_path`` *is* layer ``owner``'s parameter at ``owner_path``: the same
    array (same shape and dtype), held once (in the owner's params, with one optimizer state), its gradient
    the sum of both uses. ``Model.init`` leaves the leaf out of the user's params; the trainers put the
    owner's value back in (`Model.merge_tied`) whenever the user layer runs.

    Attributes:
      owner, user: layer indices (``owner < user``).
      owner_path, user_path: key paths into the layers' plain-dict params, e.g. ``("embedding",)``.
    """

    owner: int
    owner_path: tuple
    user: int
    user_path: tuple


def _get(tree: dict, path: tuple):
    for k in path:
        tree = tree[k]
    return tree


def _without(tree: dict, path: tuple) -> dict:
    """A copy of the nested dict ``tree`` without the leaf at ``path`` (empty dicts on the way removed)."""
    head, rest = path[0], path[1:]
    out = dict(tree)
    if rest:
        sub = _without(tree[head], rest)
        if sub:
            out[head] = sub
        else:
            del out[head]
    else:
        del out[head]
    return out


def _with(tree: dict, path: tuple, value) -> dict:
    """A copy of the nested dict ``tree`` with ``value`` at ``path``."""
    head, rest = path[0], path[1:]
    out = dict(tree)
    out[head] = _with(tree.get(head, {}), rest, value) if rest else value
    return out


@dataclasses.dataclass
class Model:
    """An ordered list of layers whose last one is a `HeadLayer` (it computes the loss).

    Attributes:
      layers: the layers in forward order; standard and reversible layers may alternate freely.
      input_key: the key of the batch dict fed to the first layer (e.g. ``"inputs"``).
      tokens_per_example: units counted by ``tokens_per_sec`` for one example (sequence length for a
        language model, 1 for an image classifier).
      bits_per_byte: True for a byte-level language model (evaluation then reports bits per byte).
      ties: parameters shared between layers (`Tie`), each held once, by its owner.
      keep_files: files a run copies into its workdir so that the workdir stands on its own (``{name inside
        the workdir: source file}``; an imported checkpoint's ``config.json``, see `revtrain.models.llama`).
      unused_bindings: gin parameters of the builder that this model ignores (a checkpoint's sizes override
        them); the run's ``config.gin`` leaves them out, so it records only what the model is.
      llama_spec, llama_form: the architecture of a Llama model (`revtrain.models.llama`: what
        `revtrain export` writes; None for other models).
      memory_knobs: the gin settings of its builder or parts that lower a step's activation memory, most
        effective first (``"attention blocking (ReversibleTransformerLM.attention_block)"``): the one-line
        out-of-memory advice names them after the batch size and the trainer's (`revtrain.loop`).

    Raises:
      ValueError: when the list is empty, the last layer is not a head, or a head appears earlier.
    """

    layers: list[Layer]
    input_key: str = "inputs"
    tokens_per_example: int = 1
    bits_per_byte: bool = False
    ties: tuple = ()
    keep_files: dict = dataclasses.field(default_factory=dict)
    unused_bindings: tuple = ()
    llama_spec: Any = None
    llama_form: str | None = None
    memory_knobs: tuple = ()

    def __post_init__(self):
        if not self.layers or not self.layers[-1].is_head:
            raise ValueError("a model must end with a HeadLayer")
        if any(layer.is_head for layer in self.layers[:-1]):
            raise ValueError("only the last layer of a model may be a HeadLayer")

    @property
    def head(self) -> HeadLayer:
        return self.layers[-1]

    def init(self):
        """Returns ``(params, state)``: two lists with one plain-dict pytree per layer (a tied leaf only in
        its owner's, see `Tie`). Every layer's initial values at once (numpy): for small models and tests;
        the trainers take them one layer at a time (`init_layer`)."""
        values = [self.init_layer(i) for i in range(len(self.layers))]
        return [v[0] for v in values], [v[1] for v in values]

    def init_layer(self, i: int) -> tuple[dict, dict]:
        """``(params, state)`` of layer ``i`` alone (numpy; a tied leaf only in its owner's)."""
        params, state = self.layers[i].initial_values()
        for t in self.ties:
            if t.user == i:
                params = _without(params, t.user_path)
        return params, state

    def param_shapes(self) -> list:
        """One ``jax.ShapeDtypeStruct`` tree per layer in the form of ``init()[0]`` (tied leaves only in their
        owners'): the model's parameters without making any."""
        shapes = [l.param_shapes for l in self.layers]
        for t in self.ties:
            shapes[t.user] = _without(shapes[t.user], t.user_path)
        return shapes

    def state_shapes(self) -> list:
        """One ``jax.ShapeDtypeStruct`` tree per layer in the form of ``init()[1]``."""
        return [l.state_shapes for l in self.layers]

    def ties_of(self, user: int) -> tuple:
        """The ties whose user is layer ``user``."""
        return tuple(t for t in self.ties if t.user == user)

    def merge_tied(self, user: int, params: dict, owners) -> dict:
        """Layer ``user``'s params with its tied leaves put back from ``owners`` (layer index -> that layer's
        params, a dict or a list): the tree the layer's module expects."""
        return self.merge_tied_leaves(user, params, self.tied_leaves(user, owners))

    def tied_leaves(self, user: int, owners) -> tuple:
        """The values of layer ``user``'s tied leaves (one per tie of ``ties_of(user)``) from their owners'
        params."""
        return tuple(_get(owners[t.owner], t.owner_path) for t in self.ties_of(user))

    def merge_tied_leaves(self, user: int, params: dict, leaves: tuple) -> dict:
        """Layer ``user``'s params with ``leaves`` (as `tied_leaves` gives them) at its tied paths."""
        for t, value in zip(self.ties_of(user), leaves):
            params = _with(params, t.user_path, value)
        return params

    def split_tied(self, user: int, grads: dict) -> tuple:
        """A gradient of layer ``user``'s merged params, split: ``(its own leaves, the tied leaves' tuple)``."""
        ties = self.ties_of(user)
        tied = tuple(_get(grads, t.user_path) for t in ties)
        for t in ties:
            grads = _without(grads, t.user_path)
        return grads, tied

    def add_tied(self, owner: int, grads: dict, tied: tuple) -> dict:
        """Layer ``owner``'s gradient plus the gradients of its leaves' other uses (``tied``: the tuple of
        the last layer's tied leaves, as `split_tied` gives it, or of ``user``'s)."""
        for t, g in zip(self.ties_of(len(self.layers) - 1), tied):
            if t.owner == owner:
                grads = _with(grads, t.owner_path, _get(grads, t.owner_path) + g)
        return grads

    def num_params(self) -> int:
        """Total number of trainable scalars."""
        import jax
        return sum(x.size for p in self.param_shapes() for x in jax.tree.leaves(p))
