"""Runs a ``revtrain`` command that kills itself (SIGKILL, as ``kill -9``) in the middle of a disk-tier step:
at the Nth write of a layer file, after half of it is written.

Used by tests/test_disk_tier.py as a separate process:

  python tests/_kill_inside.py N -- REVTRAIN_ARGS...
"""

import os
import signal
import sys


def main(argv: list[str]) -> int:
    n, rest = int(argv[1]), argv[argv.index("--") + 1:]
    from revtrain.tiers import disk_format  # (every layer file is written by its write_layer)
    original, calls = disk_format.write_layer, [0]

    def patched(path, layout, leaves):
        calls[0] += 1
        if calls[0] == n:  # a layer file half written, the step's other layers in flight: killed
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.write(fd, b"\0" * (layout.size // 2))
            os.close(fd)
            os.kill(os.getpid(), signal.SIGKILL)
        return original(path, layout, leaves)

    disk_format.write_layer = patched
    from revtrain import cli
    return cli.main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
