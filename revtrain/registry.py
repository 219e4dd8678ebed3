"""Registers every gin configurable revtrain offers, including optax optimizers and schedules.

Importing this module is enough: ``ReversibleTrainer``, ``StandardTrainer``, ``ReversibleTransformerLM``,
``ComposedModel`` with its specs and revtrain's parts (`revtrain.layers.parts`, `revtrain.layers.modern`,
`revtrain.layers.vision`),
``ByteLMTask``, ``train``, ``evaluate`` and optax's whole catalogue under its own names (``optax.<name>``,
``optax.contrib.<name>``: `OPTAX_CATALOGUE`, found by introspection). `parse_gin` parses
config files and bindings against them (the CLI's and `revtrain.logits`' one parse, errors as one line).
"""

import difflib
import inspect
import re

import gin
import optax

from revtrain import ginconfig
from revtrain.errors import UsageError
from revtrain import run  # noqa: F401  (train, evaluate)
from revtrain.data import fashion_mnist  # noqa: F401  (FashionMNISTTask)
from revtrain import optim  # noqa: F401  (decay_mask, optax.inject_hyperparams)
from revtrain.data import tasks  # noqa: F401
from revtrain.layers import parts  # noqa: F401  (ByteEmbedding, CausalSelfAttention, ... as parts)
from revtrain.layers import modern, vision  # noqa: F401  (RMSNorm, GroupedQueryAttention, SwiGLU, ... RevViT parts)
from revtrain.models import compose  # noqa: F401  (ComposedModel, Standard, Coupling, Repeat, Head)
from revtrain.models import llama  # noqa: F401  (LlamaModel)
from revtrain.models import revnet  # noqa: F401  (RevNet)
from revtrain.models import transformer_lm  # noqa: F401
from revtrain.trainers import reversible, standard  # noqa: F401

def _optax_catalogue(module) -> dict[str, object]:
    """The public callables of an optax module (``optax`` or ``optax.contrib``) by name, as that optax release
    exports them: functions (optimizers, transformations, wrappers, schedules, and the rest of optax's public
    functions) and classes that are not states. Skipped: private names, submodules, non-callables, typing
    aliases (``optax.Params``, ``optax.Schedule``), protocols, ``GradientTransformation`` itself, the
    state types (named tuples whose name ends in ``State``) and other named tuples optax fills itself (those
    without a default for every field); named tuples of settings (``optax.contrib.MuonDimensionNumbers``)
    are kept.
    """
    found = {}
    for name in sorted(dir(module)):
        if name.startswith("_"):
            continue
        obj = getattr(module, name)
        if inspect.ismodule(obj) or not callable(obj):
            continue
        if type(obj).__module__ in ("typing", "collections.abc"):
            continue  # a type alias (Union[...] or Callable[...]), not a function
        if isinstance(obj, type):
            if (name.endswith("State") or issubclass(obj, optax.GradientTransformation)
                    or getattr(obj, "_is_protocol", False)):
                continue
            fields = getattr(obj, "_fields", None)
            if issubclass(obj, tuple) and not (fields and len(getattr(obj, "_field_defaults", {})) == len(fields)):
                continue  # a named tuple optax fills (ApplyEvery, MaskedNode, LookaheadParams): not configured
        found[name] = obj
    return found


def _varargs_name(fn) -> str | None:
    """The name of ``fn``'s ``*args`` parameter, or None (also when it has no readable signature)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    return next((p.name for p in params if p.kind is p.VAR_POSITIONAL), None)


def _positional_wrapper(fn, qualified: str, parameter: str):
    """``fn(*values)`` for gin, which cannot bind ``*args``: one keyword parameter ``parameter`` (a list)."""
    def call(**kwargs):
        values = kwargs.pop(parameter, ())
        return fn(*values, **kwargs)
    call.__name__ = qualified.rsplit(".", 1)[1]
    call.__qualname__ = call.__name__
    call.__doc__ = (f"``{qualified}(*{parameter})`` for gin, which cannot bind ``*args``: "
                    f"``{qualified}.{parameter} = [...]``.\n\n" + (fn.__doc__ or ""))
    params = [inspect.Parameter(parameter, inspect.Parameter.KEYWORD_ONLY, default=())]
    try:
        params += [p for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY]
    except (TypeError, ValueError):
        pass
    call.__signature__ = inspect.Signature(params)
    return call


def _class_wrapper(cls, qualified: str):
    """A function that builds ``cls`` (gin would subclass the class itself, which a named tuple or a class
    optax checks by type does not survive); ``optax.MultiSteps`` gives its ``gradient_transformation()``, the
    ``GradientTransformation`` a trainer takes."""
    multi = hasattr(cls, "gradient_transformation")

    def build(*args, **kwargs):
        made = cls(*args, **kwargs)
        return made.gradient_transformation() if multi else made
    build.__name__ = qualified.rsplit(".", 1)[1]
    build.__qualname__ = build.__name__
    build.__doc__ = ((f"``{qualified}(...).gradient_transformation()`` for gin.\n\n" if multi
                      else f"``{qualified}(...)`` for gin.\n\n") + (cls.__doc__ or ""))
    try:
        build.__signature__ = inspect.signature(cls)
    except (TypeError, ValueError):
        pass
    return build


def _register_optax() -> dict[str, str]:
    """Registers optax's catalogue in gin under optax's own names: ``optax.<name>`` for every public callable
    of ``optax`` and ``optax.contrib.<name>`` for ``optax.contrib``'s (`_optax_catalogue`), found by
    introspection so a new optax release's names come without a list to edit. Functions with ``*args``
    (``optax.chain``, ``optax.named_chain``) take them as one list, ``transforms`` for the chains, else the
    ``*args`` parameter's own name; classes are built by a function (``optax.MultiSteps`` gives its gradient
    transformation). Names revtrain registers itself (``optax.inject_hyperparams``, `revtrain.optim`) are
    kept.

    Returns:
      ``{"optax.adamw": "function", "optax.contrib.muon": "function", "optax.MultiSteps": "class", ...}``:
      every name registered (or already registered by revtrain), by kind.
    """
    import optax.contrib  # noqa: F401  (a submodule optax does not always import itself)
    registered = {}
    for module_name, module in (("optax", optax), ("optax.contrib", optax.contrib)):
        for name, obj in _optax_catalogue(module).items():
            qualified = f"{module_name}.{name}"
            kind = "class" if isinstance(obj, type) else "function"
            if qualified in gin.config._REGISTRY:  # noqa: SLF001 (revtrain's own wrapper, optax.inject_hyperparams)
                registered[qualified] = kind
                continue
            if isinstance(obj, type):
                target = _class_wrapper(obj, qualified)
            elif (varargs := _varargs_name(obj)) is not None:
                target = _positional_wrapper(obj, qualified,
                                             "transforms" if name.endswith("chain") else varargs)
            else:
                target = obj
            try:
                gin.external_configurable(target, name=name, module=module_name)
            except (TypeError, ValueError):
                continue  # a callable gin cannot wrap (no signature): not nameable, not listed
            registered[qualified] = kind
    return registered


OPTAX_CATALOGUE = _register_optax()
"""Every ``optax.<name>`` and ``optax.contrib.<name>`` a gin config can name (this optax release's), by kind."""

OPTAX_NAMES = tuple(q.split(".", 1)[1] for q in OPTAX_CATALOGUE if q.count(".") == 1)
"""The names of ``optax``'s own catalogue (without ``optax.contrib``'s), kept for code that read the old list."""


def parse_gin(configs: list[str], bindings: list[str], workdir: str | None = None) -> None:
    """Parses config files (and their includes, see `ginconfig.include_search_path`), then bindings; with
    ``workdir``, the Python modules its run imported are looked up where the run found them first, and a run
    that imported a checkpoint rebuilds its model from the architecture kept in the workdir
    (`revtrain.models.llama.workdir_bindings`, before ``bindings``, which win).

    Raises:
      UsageError: a missing file or include, or a bad binding or value (one line).
    """
    gin.clear_config()  # a fresh configuration per command (main() may run several times in one process)
    if workdir:
        from revtrain.models import llama
        bindings = llama.workdir_bindings(workdir) + list(bindings)
    try:
        remembered = ginconfig.remembered_modules(workdir) if workdir else None
        with ginconfig.include_search_path(remembered):
            gin.parse_config_files_and_bindings([ginconfig.find_config(c) for c in configs], bindings,
                                                finalize_config=False)
    except ginconfig.IncludeNotFound as e:
        raise UsageError(str(e).strip().splitlines()[0]) from e
    except (ValueError, SyntaxError, TypeError, KeyError, NameError) as e:
        raise UsageError(_gin_error_line(e)) from e


def _gin_names() -> list[str]:
    """Every configurable's short name and ``name.parameter`` (for 'did you mean' suggestions)."""
    names = []
    for selector, configurable in gin.config._REGISTRY.items():  # noqa: SLF001 (gin has no public listing)
        names.append(configurable.name)
        if isinstance(selector, str) and selector != configurable.name:
            names.append(selector)  # module.Name
        try:
            wrapped = configurable.wrapped  # a class: its __init__ (NNX modules' own signature is *args)
            params = inspect.signature(wrapped.__init__ if isinstance(wrapped, type) else wrapped).parameters
        except (TypeError, ValueError):
            continue
        for prefix in {configurable.name, selector if isinstance(selector, str) else configurable.name}:
            names.extend(f"{prefix}.{p}" for p in params if p not in ("self", "args", "kwargs"))
    return names


def _gin_error_line(e: Exception) -> str:
    """One line for a gin parse error, with the nearest configurable name when gin found none."""
    line = ginconfig.value_error_line(e) if isinstance(e, SyntaxError) else None
    if line:
        return line
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    m = re.search(r"No configurable matching (?:reference )?'@?([^']+)'", msg) or re.search(
        r"Configurable '([^']+)' doesn't have a parameter named '([^']+)'", msg)
    if m and m.lastindex == 1 and m.group(1).startswith("optax."):
        # an optax name this optax does not have: say so, suggesting only a close optax name
        import optax
        wanted = m.group(1).removesuffix("()")
        line = f"bad gin configuration: '{wanted}' is not an optax name (of optax {optax.__version__})"
        close = difflib.get_close_matches(wanted, list(OPTAX_CATALOGUE), n=1, cutoff=0.8)
        return line + (f" (did you mean '{close[0]}'?)" if close else "")
    if m:
        wanted = m.group(1) if m.lastindex == 1 else f"{m.group(1)}.{m.group(2)}"
        close = difflib.get_close_matches(wanted, _gin_names(), n=1, cutoff=0.6)
        if close:
            msg += f" (did you mean '{close[0]}'?)"
    return f"bad gin configuration: {msg}"
