"""Gin files for revtrain: where ``include`` finds files, clear value errors, and what changed on resume.

* Include search path (t5x style): a relative ``include 'base.gin'`` resolves next to the file that
  includes it first, then in the current directory, then in the project's ``configs/`` directory; a
  top-level ``--config FILE`` the same way, without the first step. A missing file is one `IncludeNotFound`
  naming it and every directory searched.
* `value_error_line`: a value gin cannot parse (``--gin.train.steps=abc``) named with its binding and a hint
  to quote strings, instead of Python's "malformed node or string" text.
* `call_error_line`: an error raised inside a call gin makes for a binding (``@optax.warmup_cosine_decay_
  schedule()`` with ``decay_steps`` below ``warmup_steps``) as one line naming the configurable and its
  bindings, with the values of the macros they use (``decay_steps = %STEPS = 30``), instead of the
  library's message alone.
* `config_differences`: the operative values (macros resolved) that differ between two operative configs,
  e.g. a run's saved ``config.gin`` and the configuration resuming it.
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any

import gin
from gin import config_parser

PROJECT_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


class IncludeNotFound(OSError):
    """A gin file (``--config`` or ``include``) found in none of the directories searched."""


def search_dirs(including_file: str | None) -> list[str]:
    """Directories a relative gin path is looked up in, in order: the including file's directory (when
    there is one), the current directory, and the project's ``configs/`` (when it exists)."""
    dirs = [os.path.dirname(os.path.abspath(including_file))] if including_file else []
    dirs.append(os.getcwd())
    if os.path.isdir(PROJECT_CONFIGS):
        dirs.append(PROJECT_CONFIGS)
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
def include_search_path():
    """Within this context, gin resolves config files and their includes with `find_config`.

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

    prefixes, readers = gin_config._LOCATION_PREFIXES, gin_config._FILE_READERS  # noqa: SLF001 (see above)
    saved = list(prefixes), list(readers)
    prefixes[:], readers[:] = [""], [(reader, exists)]
    try:
        yield
    finally:
        prefixes[:], readers[:] = saved


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
    return f"{first} (in {where})"


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
