"""Gin files for revtrain: where ``include`` finds files, clear value errors, and what changed on resume.

* Include search path (t5x style): a relative ``include 'base.gin'`` resolves next to the file that
  includes it first, then in the current directory, then in its ``configs/``, then among the configs shipped
  with revtrain (`shipped_config_dirs`: inside the installed package, or a checkout's ``configs/`` and
  ``examples/``); a top-level ``--config FILE`` the same way, without the first step. A missing file is one
  `IncludeNotFound` naming it and every directory searched. `shipped_configs` lists the shipped files.
* `value_error_line`: a value gin cannot parse (``--gin.train.steps=abc``) named with its binding and a hint
  to quote strings, instead of Python's "malformed node or string" text.
* `call_error_line`: an error raised inside a call gin makes for a binding (``@optax.warmup_cosine_decay_
  schedule()`` with ``decay_steps`` below ``warmup_steps``) as one line naming the configurable and its
  bindings, with the values of the macros they use (``decay_steps = %STEPS = 30``), instead of the
  library's message alone.
* `config_differences`: the operative values (macros resolved) that differ between two operative configs,
  e.g. a run's saved ``config.gin`` and the configuration resuming it.
* The user's own Python modules: ``import my_blocks`` in a gin file is looked up next to the including
  file first, then in the current directory (as includes are), then on the Python path; a module found in
  none is one `ModuleNotFound` naming the directories searched. A run records where its modules came from
  (`run_config`: ``modules.json`` beside ``config.gin``), so ``revtrain eval`` / ``sample`` / ``check`` on
  its workdir find them again without ``PYTHONPATH`` (`remembered_modules`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import sys
from typing import Any

import gin
from gin import config_parser

from revtrain.errors import InputError, UsageError

_PACKAGE = os.path.dirname(os.path.abspath(__file__))
# The configs an installed package holds (setup.py maps configs/ and examples/<name>/ there), and the
# checkout's own directories they are built from (an editable install or PYTHONPATH reads these).
PACKAGE_CONFIGS = os.path.join(_PACKAGE, "configs")
PROJECT_CONFIGS = os.path.join(os.path.dirname(_PACKAGE), "configs")
PROJECT_EXAMPLES = os.path.join(os.path.dirname(_PACKAGE), "examples")


class IncludeNotFound(InputError, OSError):
    """A gin file (``--config`` or ``include``) found in none of the directories searched."""


class ModuleNotFound(IncludeNotFound):
    """A Python module a gin file imports, found in none of the directories searched nor on the path."""


MODULES_FILE = "modules.json"  # beside a run's config.gin: {"module": "directory it was imported from"}


def _module_dir(name: str, dirs: list[str]) -> str | None:
    top = name.split(".")[0]
    for d in dirs:
        if os.path.isfile(os.path.join(d, top + ".py")) or os.path.isfile(os.path.join(d, top, "__init__.py")):
            return d
    return None


def resolve_import(module: str, including_file: str | None, remembered: dict[str, str] | None = None) -> None:
    """Makes ``import module`` of a gin file find the user's module: its top-level name is looked up in the
    directory a run remembered for it (``remembered``), next to ``including_file``, then in the current
    directory; the first directory holding ``name.py`` or ``name/__init__.py`` goes to the front of
    ``sys.path``. A module in none of them is left to the Python path.

    Raises:
      ModuleNotFound: the module is in none of those directories and not importable (the message names
        the gin file and every directory searched).
    """
    top = module.split(".")[0]
    remembered = remembered or {}
    dirs = [remembered[top]] if top in remembered else []
    if including_file:
        dirs.append(os.path.dirname(os.path.abspath(including_file)))
    dirs.append(os.getcwd())
    dirs = list(dict.fromkeys(dirs))
    found = _module_dir(top, dirs)
    if found is not None:
        if found not in sys.path:
            sys.path.insert(0, found)
        importlib.invalidate_caches()
        return
    if top in sys.modules or importlib.util.find_spec(top) is not None:
        return
    where = f"the gin file {including_file}" if including_file else "a gin binding"
    gone = (f"; the run imported it from {remembered[top]}, which no longer holds it" if top in remembered else "")
    raise ModuleNotFound(f"{where} imports {module}: found neither {top}.py nor {top}/ in {', '.join(dirs)}, nor on "
                         f"the Python path{gone}")


def remembered_modules(workdir: str) -> dict[str, str]:
    """``{module: directory}`` a run recorded in ``workdir/modules.json`` (empty when there is none)."""
    try:
        with open(os.path.join(workdir, MODULES_FILE)) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def shipped_config_dirs() -> list[str]:
    """The directories of the configs shipped with revtrain: the installed package's ``revtrain/configs/``
    (the checkout's ``configs/*.gin``, and each ``examples/<name>/`` as ``<name>/``), else, run from a
    checkout, its ``configs/`` and ``examples/`` (the same files under the same names)."""
    if os.path.isdir(PACKAGE_CONFIGS):
        return [PACKAGE_CONFIGS]
    return [d for d in (PROJECT_CONFIGS, PROJECT_EXAMPLES) if os.path.isdir(d)]


def shipped_configs() -> dict[str, str]:
    """``{name: path}`` of every shipped config, sorted by name: ``NAME.gin`` for the files of ``configs/``,
    ``EXAMPLE/NAME.gin`` for an example's (``own_block/train.gin``); each name is what ``--config`` and
    ``include`` take."""
    found: dict[str, str] = {}
    for d in shipped_config_dirs():
        for root, dirs, files in os.walk(d):
            dirs[:] = sorted(x for x in dirs if not x.startswith((".", "__")))
            depth = os.path.relpath(root, d).count(os.sep) + (root != d)
            if depth > 1:
                continue
            for f in files:
                if f.endswith(".gin"):
                    name = os.path.relpath(os.path.join(root, f), d).replace(os.sep, "/")
                    found.setdefault(name, os.path.join(root, f))
    return dict(sorted(found.items()))


def search_dirs(including_file: str | None) -> list[str]:
    """Directories a relative gin path is looked up in, in order: the including file's directory (when
    there is one), the current directory, its ``configs/`` (when it exists: a checkout), then the configs
    shipped with revtrain (`shipped_config_dirs`)."""
    dirs = [os.path.dirname(os.path.abspath(including_file))] if including_file else []
    dirs.append(os.getcwd())
    if os.path.isdir(os.path.join(os.getcwd(), "configs")):
        dirs.append(os.path.join(os.getcwd(), "configs"))
    dirs.extend(shipped_config_dirs())
    return list(dict.fromkeys(dirs))


def find_config(path: str, including_file: str | None = None) -> str:
    """The file a gin path names (see `search_dirs`).

    Raises:
      IncludeNotFound: no such file in any directory searched (the message names them).
    """
    path = os.path.expanduser(path)
    if os.path.isabs(path):
        if os.path.isfile(path):
            return path
        dirs = []
    else:
        dirs = search_dirs(including_file)
        for d in dirs:
            if os.path.isfile(os.path.join(d, path)):
                return os.path.join(d, path)
    notes = ([f"included by {including_file}"] if including_file else []) + (
        [f"searched {', '.join(dirs)}"] if dirs else [])
    raise IncludeNotFound(f"config file not found: {path}" + (f" ({'; '.join(notes)})" if notes else ""))


@contextlib.contextmanager
def include_search_path(remembered: dict[str, str] | None = None):
    """Within this context, gin resolves config files and their includes with `find_config`, and the
    Python modules they import with `resolve_import` (``remembered``: a run's `remembered_modules`).

    gin 0.5 looks a relative ``include`` up only in its global search path (the current directory by
    default; ``gin.add_config_file_search_path`` appends more), whatever file includes it, and then tries a
    Python-package reader that logs an ``ERROR:root:`` line. Here gin's search path is the file itself
    (``''``) and its only reader resolves the path relative to the file being parsed, which the reader
    tracks as gin opens and closes files (nested includes included).
    """
    gin_config = gin.config
    stack: list[str] = []  # the files being parsed, innermost last

    def exists(path: str) -> bool:
        find_config(path, stack[-1] if stack else None)  # raises IncludeNotFound
        return True

    @contextlib.contextmanager
    def reader(path: str):
        resolved = find_config(path, stack[-1] if stack else None)
        stack.append(resolved)
        try:
            with open(resolved) as f:
                yield f
        finally:
            stack.pop()

    context_class = gin_config.ParseContext
    process_import = context_class.process_import

    def resolving_import(context, statement):
        if not statement.module.startswith("__gin__"):
            resolve_import(statement.module, stack[-1] if stack else None, remembered)
        return process_import(context, statement)

    prefixes, readers = gin_config._LOCATION_PREFIXES, gin_config._FILE_READERS  # noqa: SLF001 (see above)
    saved = list(prefixes), list(readers)
    prefixes[:], readers[:] = [""], [(reader, exists)]
    context_class.process_import = resolving_import
    try:
        yield
    finally:
        prefixes[:], readers[:] = saved
        context_class.process_import = process_import


def value_error_line(e: SyntaxError) -> str | None:
    """One line for a gin value that is not a Python literal (``train.steps = abc``), naming the binding,
    the value and where it came from, with the fix for the usual cause (an unquoted string). None for
    other syntax errors."""
    m = re.search(r"Failed to parse token '(.*)'", str(e.msg or ""))
    if not m:
        return None
    token, text = m.group(1), (e.text or "").strip()
    name = text.split("=", 1)[0].strip() if "=" in text else ""
    where = f" ({e.filename} line {e.lineno})" if e.filename else ""
    binding = f"gin binding '{text}'" if text else "gin binding"
    quoted = f"{name} = '{token}'" if name else f"'{token}'"
    return (f"bad value in the {binding}{where}: {token} is not a number, string, list or other Python "
            f"literal; quote a string (\"{quoted}\"), write @name for a configurable and %NAME for a macro")


class _Reference:
    def __init__(self, name: str, evaluate: bool):
        self.text = "@" + name + ("()" if evaluate else "")


class _Macro:
    def __init__(self, name: str):
        self.name = name


class _Delegate(config_parser.ParserDelegate):
    """Parses references and macros into plain placeholders (nothing is looked up or evaluated)."""

    def configurable_reference(self, scoped_configurable_name, evaluate):
        return _Reference(scoped_configurable_name, evaluate)

    def macro(self, macro_name):
        return _Macro(macro_name)


_CALL = re.compile(r"In call to configurable '([^']+)'")
_MACRO = re.compile(r"%([A-Za-z_][\w.]*)")


def call_error_line(e: Exception) -> str:
    """One line for ``e``, raised in a call that gin made for a binding (gin appends "In call to
    configurable 'NAME'" to such errors): the error's first line, then NAME's bindings in the parsed
    config, each macro followed by its value. Errors from elsewhere give their first line only."""
    text = str(e)
    first = text.splitlines()[0] if text else type(e).__name__
    match = _CALL.search(text)
    if not match:
        return first
    name, bindings = match.group(1), []
    for line in gin.config_str().splitlines():
        selector, _, value = line.partition(" = ")
        if not value or selector.rsplit("/", 1)[-1].rsplit(".", 1)[0].rsplit(".", 1)[-1] != name:
            continue
        for macro in dict.fromkeys(_MACRO.findall(value)):
            try:
                value += f" = {gin.query_parameter('%' + macro)!r}"
            except (ValueError, KeyError):
                pass
        bindings.append(f"{selector.rsplit('.', 1)[-1]} = {value}")
    where = f"{name}: {', '.join(bindings)}" if bindings else name
    hint = next((h for pattern, h in _CALL_HINTS if pattern in first), "").replace("{name}", name)
    return f"{first} (in {where}){hint}"


# Fixes for the errors of common misconfigurations gin calls hit (substring of the error, hint).
_CALL_HINTS = [
    ("requires positive decay_steps", "; the schedule's decay_steps must exceed its warmup_steps: raise STEPS "
                                      "or lower WARMUP (STEPS must exceed WARMUP; WARMUP = 0 is no warmup)"),
    ("required positional argument: 'learning_rate'",
     "; written with parentheses ({name}()) it is a ready optimizer: bind its own learning rate "
     "({name}.learning_rate = 1e-3) and train.learning_rate = None, or write it without parentheses to take "
     "train.learning_rate"),
]


def operative_values(text: str) -> dict[str, str]:
    """``{'scope/Configurable.parameter': value}`` of a gin config text, every macro (``%STEPS``) replaced by
    its value and each value rendered as gin text (``0.1``, ``'gensim_enwiki'``, ``@optax.adamw``).

    Raises:
      SyntaxError: the text is not valid gin.
    """
    macros: dict[str, Any] = {}
    bindings: dict[str, Any] = {}
    for statement in config_parser.ConfigParser(text, _Delegate()):
        if not isinstance(statement, config_parser.BindingStatement):
            continue  # imports and includes: an operative config has none that change values
        scoped = f"{statement.scope}/{statement.selector}" if statement.scope else statement.selector
        if statement.arg_name:
            bindings[f"{scoped}.{statement.arg_name}"] = statement.value
        else:
            macros[scoped] = statement.value

    def render(value, depth=0) -> str:
        if isinstance(value, _Macro):
            if value.name in macros and depth < 20:
                return render(macros[value.name], depth + 1)
            return f"%{value.name}"
        if isinstance(value, _Reference):
            return value.text
        if isinstance(value, list):
            return "[" + ", ".join(render(v, depth) for v in value) + "]"
        if isinstance(value, tuple):
            inner = ", ".join(render(v, depth) for v in value)
            return f"({inner},)" if len(value) == 1 else f"({inner})"
        if isinstance(value, dict):
            return "{" + ", ".join(f"{render(k, depth)}: {render(v, depth)}" for k, v in value.items()) + "}"
        return repr(value)

    return {name: render(value) for name, value in bindings.items()}


def config_differences(old: str, new: str) -> list[str]:
    """``['name old -> new', ...]``: every operative value (macros resolved) that differs between two
    operative gin configs, sorted by name; a value only one side has shows ``(unset)`` on the other.

    Raises:
      SyntaxError: either text is not valid gin.
    """
    before, after = operative_values(old), operative_values(new)
    changes = []
    for name in sorted(before.keys() | after.keys(), key=str.lower):
        a, b = before.get(name, "(unset)"), after.get(name, "(unset)")
        if a != b:
            changes.append(f"{name} {a} -> {b}")
    return changes


_LIBRARIES = {"revtrain", "gin", "optax", "jax", "jaxlib", "flax", "numpy", "builtins", "functools"}


def _configurable(obj):
    try:
        return gin.config._inverse_lookup(obj)  # noqa: SLF001 (gin has no public reverse lookup)
    except TypeError:  # unhashable values
        return None


def _reference(obj) -> str | None:
    """``@name`` of a gin configurable (its shortest unambiguous selector), else None."""
    configurable = _configurable(obj)
    if configurable is None:
        return None
    return "@" + gin.config._REGISTRY.minimal_selector(configurable.selector)  # noqa: SLF001


def _render_value(value) -> str | None:
    """Gin text for a Python value: literals as themselves, configurables as ``@name``; None when gin
    cannot say it (an object built in Python)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        items = [_render_value(v) for v in value]
        if any(i is None for i in items):
            return None
        inner = ", ".join(items)
        return f"[{inner}]" if isinstance(value, list) else (f"({inner},)" if len(items) == 1 else f"({inner})")
    return _reference(value)


def _module_of(reference: str) -> str | None:
    name = reference.lstrip("@").removesuffix("()").rsplit("/", 1)[-1]
    try:
        configurable = gin.config._REGISTRY.get_match(name)  # noqa: SLF001
    except (KeyError, ValueError):
        return None
    if configurable is None:
        return None
    module = getattr(configurable.wrapped, "__module__", None)
    return None if not module or module.split(".")[0] in _LIBRARIES else module


def drop_bindings(text: str, names) -> str:
    """An operative config ``text`` without the bindings of ``names`` (``'Configurable.parameter'``, in any
    scope), continuation lines of a multi-line value included; a section left without bindings loses its
    ``# Parameters for ...`` heading."""
    names = set(names)
    if not names:
        return text
    out, skipping = [], False
    for line in text.splitlines(keepends=True):
        if skipping and line[:1] in (" ", "\t"):
            continue
        selector = line.split(" = ", 1)[0].strip() if " = " in line and not line.startswith("#") else None
        skipping = selector is not None and selector.rsplit("/", 1)[-1] in names
        if not skipping:
            out.append(line)
    # Headings whose section is now empty: a '# Parameters for X:' and its rule followed by nothing but blanks.
    lines, kept = out, []
    i = 0
    while i < len(lines):
        if lines[i].startswith("# Parameters for ") and i + 1 < len(lines) and lines[i + 1].startswith("# ="):
            j = i + 2
            while j < len(lines) and not lines[j].strip():
                j += 1
            if j == len(lines) or lines[j].startswith("# Parameters for "):
                i = j
                continue
        kept.append(lines[i])
        i += 1
    return "".join(kept)


def run_config(values: dict[str, Any], drop=()) -> tuple[str, dict[str, str], list[str]]:
    """The ``config.gin`` of a run, its ``modules.json`` and the values gin cannot name.

    ``drop``: bindings (``'Configurable.parameter'``) left out of the text, e.g. the sizes of a model that a
    checkpoint overrides (`drop_bindings`).

    The text is gin's operative config plus a binding for each entry of ``values``
    (``{'train.model': object}``: the settings a run started from Python was given directly) that the
    operative config lacks, plus an ``import`` line for every user module (outside revtrain and its
    libraries) whose configurables it references, so that the CLI can rebuild the run from it alone.

    Returns:
      ``(text, modules, unnamed)``: ``modules`` maps each imported user module's top-level name to the
      directory it was imported from; ``unnamed`` lists the entries of ``values`` that are neither literals
      nor gin configurables (the CLI will use their gin defaults).
    """
    text = drop_bindings(gin.operative_config_str(), drop)
    present = operative_values(text)
    extra, unnamed = [], []
    for name, value in values.items():
        if name in present:
            continue
        rendered = _render_value(value)
        if rendered is None:
            unnamed.append(name)
        else:
            extra.append(f"{name} = {rendered}")
    if extra:
        text = text.rstrip("\n") + "\n\n# Set from Python (loop.train's TrainConfig):\n" + "\n".join(extra) + "\n"
    imported = set(re.findall(r"^import ([\w.]+)", text, re.M))
    needed = []
    for ref in dict.fromkeys(re.findall(r"@[\w./]+", text)):
        module = _module_of(ref)
        if module and module not in imported and module != "__main__":
            needed.append(module)
            imported.add(module)
    if needed:
        text = "".join(f"import {m}\n" for m in needed) + ("\n" if not text.startswith("import") else "") + text
    modules = {}
    for module in sorted(imported):
        top = module.split(".")[0]
        if top in _LIBRARIES or top == "__gin__":
            continue
        path = getattr(sys.modules.get(top), "__file__", None)
        if not path:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.basename(path) == "__init__.py":
            folder = os.path.dirname(folder)
        modules[top] = folder
    return text, modules, unnamed


def workdir_config(workdir: str, error: type[Exception] = UsageError) -> str:
    """The path of the gin config ``revtrain train`` wrote in ``workdir`` (``workdir/config.gin``).

    Raises:
      ``error`` (default `UsageError`; one line, exit status 2): ``workdir`` does not exist, or holds no such
        file, so it is not a run's directory. The line names ``workdir`` as given.
    """
    config = os.path.join(workdir, "config.gin")
    if not os.path.isdir(workdir):
        raise error(f"no config.gin in {workdir}: {workdir} does not exist (--workdir names a run's directory)")
    if not os.path.isfile(config):
        raise error(f"no config.gin in {workdir}: is it a revtrain workdir?")
    return config
