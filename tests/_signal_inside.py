"""Runs a ``revtrain`` command that signals itself at a chosen moment: when a chosen function is first called.

Used by tests/test_faults.py, as a separate process (a stop at once replaces the process, see
`revtrain.lifecycle.interrupts`), so that a signal lands while the command's work is in progress, whatever the
machine's speed:

  python tests/_signal_inside.py MODULE.FUNCTION GAPS -- REVTRAIN_ARGS...

When ``MODULE.FUNCTION`` is first called, the process sends itself SIGTERM once, then once more after each
gap (seconds) in the comma-separated ``GAPS`` ("" for one signal, "0" for two at once, "1.5" for two
1.5 s apart), waits a second for the signals to be handled, and then calls the function.
"""

import importlib
import os
import signal
import sys
import time


def main(argv: list[str]) -> int:
    target, gaps, rest = argv[1], argv[2], argv[argv.index("--") + 1:]
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):  # the longest importable prefix is the module
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
            break
        except ImportError:
            continue
    for attr in parts[cut:-1]:  # a method: module.Class.method
        owner = getattr(owner, attr)
    name = parts[-1]
    original = getattr(owner, name)
    fired = [False]

    def patched(*args, **kwargs):
        if not fired[0]:
            fired[0] = True
            os.kill(os.getpid(), signal.SIGTERM)
            for gap in [float(g) for g in gaps.split(",") if g.strip()]:
                time.sleep(gap)
                os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1.0)
        return original(*args, **kwargs)

    setattr(owner, name, patched)
    from revtrain import cli
    return cli.main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
