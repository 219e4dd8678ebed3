"""Out-of-memory failures of a compiled step, said in one line: how much memory it needed, and what lowers it.

XLA reports an allocation it cannot make as a runtime error whose text varies by backend and by how
deep in the dispatch it happened, e.g. on CPU ``INTERNAL: Error dispatching computation: Error dispatching
computation: ... Out of memory allocating 15361676800000 bytes.`` (the prefix repeated once per nested
call), on GPU ``RESOURCE_EXHAUSTED: Out of memory while trying to allocate 15361676800000 bytes.``, on TPU
``RESOURCE_EXHAUSTED: ... Ran out of memory in memory space hbm. Used 20.5G of 15.48G hbm``.
"""

from __future__ import annotations

import contextlib
import re
from typing import Callable

from revtrain.errors import RunFailure


class OutOfMemory(RunFailure, RuntimeError):
    """A step (or evaluation) needed more memory than the device (or host) has; one line (exit status 1)."""


_PATTERNS = (
    r"RESOURCE_EXHAUSTED",
    r"[Oo]ut of memory",
    r"\bOOM\b",
    r"[Ff]ailed to allocate",
    r"[Aa]llocation .*fail",
)


def _chain(e: BaseException):
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def is_out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` (or an exception it was raised from) is an allocation failure: XLA's
    RESOURCE_EXHAUSTED / "Out of memory" runtime errors, or Python's ``MemoryError``."""
    for x in _chain(e):
        if isinstance(x, MemoryError):
            return True
        if type(x).__name__ in ("XlaRuntimeError", "JaxRuntimeError") and any(
                re.search(p, str(x)) for p in _PATTERNS):
            return True
    return False


def bytes_needed(e: BaseException) -> int | None:
    """The size of the allocation that failed, in bytes, when XLA's message says it; else None."""
    units = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    for x in _chain(e):
        text = str(x)
        m = re.search(r"allocat\w*\s+(?:of\s+)?([\d,]+)\s*bytes", text, re.I)
        if m:
            return int(m.group(1).replace(",", ""))
        m = re.search(r"allocat\w*\s+(?:of\s+)?([\d.]+)\s*([KMGT])i?B\b", text, re.I)
        if m:
            return int(float(m.group(1)) * units[m.group(2).upper()])
        m = re.search(r"\bUsed ([\d.]+)([KMGT])?i?B? of ([\d.]+)([KMGT])?i?B?", text)
        if m:
            return int(float(m.group(1)) * units[(m.group(2) or "").upper()])
    return None


def human_bytes(n: int) -> str:
    """``15361676800000`` -> ``'14.0 TiB'``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{n} B"
        size /= 1024
    return f"{n} B"


def describe(e: BaseException, what: str, knobs: list[str]) -> str:
    """One line: ``what`` ran out of memory, how many bytes it asked for, and the ``knobs`` that lower it.

    Args:
      e: the allocation failure (see `is_out_of_memory`).
      what: e.g. ``"training step 1"``.
      knobs: gin settings, most effective first, e.g. ``["train.batch_size", ...]``.
    """
    n = bytes_needed(e)
    need = (f"it needed {human_bytes(n)} ({n:,} bytes) in one allocation" if n is not None
            else "XLA did not say how much it needed")
    lower = f"; lower it with {', '.join(knobs[:-1])} or {knobs[-1]}" if len(knobs) > 1 else (
        f"; lower it with {knobs[0]}" if knobs else "")
    return f"{what} ran out of memory: {need}{lower} (--verbose shows XLA's message)"


@contextlib.contextmanager
def in_one_line(what: Callable[[], str], knobs: list[str]):
    """Turns an allocation failure raised inside the block into `OutOfMemory` with the `describe` line;
    ``what()`` names what failed at that moment (e.g. ``"training step 12"``). Other errors pass."""
    try:
        yield
    except Exception as e:
        if is_out_of_memory(e):
            raise OutOfMemory(describe(e, what(), knobs)) from e
        raise
