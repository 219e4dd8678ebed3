"""The old entry point of the trainer benchmarks, kept so that its command lines still work: runs the script
of the ``--sweep`` named (default ``trainers``) with the other arguments as they are.

  python scripts/benchmark.py [--sweep trainers] ARGS   = python scripts/bench_trainers.py ARGS  (make bench)
  python scripts/benchmark.py --sweep point ARGS        = python scripts/bench_trainers.py ARGS  (--point LABEL)
  python scripts/benchmark.py --sweep depth ARGS        = python scripts/bench_depth.py ARGS     (make bench-depth)
  python scripts/benchmark.py --sweep seq ARGS          = python scripts/bench_seq.py ARGS       (make bench-long)
  python scripts/benchmark.py --sweep shard ARGS        = python scripts/bench_shard.py ARGS

Each of those scripts takes only its own options (see its ``--help``).
"""

import os
import pathlib
import sys

SCRIPTS = {"trainers": "bench_trainers.py", "point": "bench_trainers.py", "depth": "bench_depth.py",
           "seq": "bench_seq.py", "shard": "bench_shard.py"}


def main():
    argv, sweep, named = sys.argv[1:], "trainers", False
    for i, a in enumerate(argv):
        if a == "--sweep" and i + 1 < len(argv):
            sweep, argv, named = argv[i + 1], argv[:i] + argv[i + 2:], True
            break
        if a.startswith("--sweep="):
            sweep, argv, named = a.split("=", 1)[1], argv[:i] + argv[i + 1:], True
            break
    if not named and argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return
    if sweep not in SCRIPTS:
        print(f"benchmark.py: --sweep: one of {', '.join(SCRIPTS)}, not {sweep!r}", file=sys.stderr)
        sys.exit(2)
    if sweep == "point" and not any(a == "--point" or a.startswith("--point=") for a in argv):
        print("benchmark.py: --sweep point needs --point LABEL", file=sys.stderr)
        sys.exit(2)
    script = pathlib.Path(__file__).resolve().parent / SCRIPTS[sweep]
    os.execv(sys.executable, [sys.executable, str(script), *argv])


if __name__ == "__main__":
    main()
