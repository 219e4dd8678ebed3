"""How `make test` shares its files between its two processes: a replay of pytest-xdist's ``--dist loadfile``
from one run's ``REVTRAIN_TEST_CPU`` records, and, where the records carry wall times, the run as it went.

    REVTRAIN_TEST_CPU=/tmp/cpu.jsonl make test
    .venv/bin/python scripts/replay_test_schedule.py /tmp/cpu.jsonl [--workers 2] [--cost cpu_s|wall_s] [--order]

The replay hands files (each a unit: ``--dist loadfile`` keeps a file's tests in one process) to the workers in
the order ``tests/conftest.py`` collects them (`LONGEST_FIRST`, then the other files by name;
``--no-loadscope-reorder`` keeps it) the way pytest-xdist 3.8's ``LoadScopeScheduling`` does: one file to
each worker, then a file more to a worker as soon as its tests not yet finished are 2 or fewer. Each test
costs its ``cpu_s`` (its seconds on an idle core; ``--cost wall_s`` replays the wall seconds of a run alone).
It prints each worker's files and end, the balanced end (the sum over the workers) and the tail (the last
worker's end less the first's). A file's cost depends somewhat on what its worker compiled before (the jit
caches of a process; the session's persistent compilation cache is shared), so a replay with another order
is a prediction of a few seconds' accuracy per file, not a measurement.

Records written with ``worker`` and ``start`` (tests/conftest.py since 2026-12-06) also give the run as it
went: each worker's first start, last end, the seconds its tests took and what it waited at the end.
``--order`` prints the files by cost, longest first: a `LONGEST_FIRST` for tests/conftest.py.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import sys

TESTS = pathlib.Path(__file__).resolve().parent.parent / "tests"


def read(path: str) -> list[dict]:
    """The JSON records of a ``REVTRAIN_TEST_CPU`` file, in file order."""
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line.strip()]


def file_of(nodeid: str) -> str:
    """The test file's name of a node id (``tests/test_x.py::test_y[z]`` -> ``test_x.py``)."""
    return nodeid.split("::", 1)[0].rsplit("/", 1)[-1]


def collection_order(names: list[str]) -> list[str]:
    """``names`` in the order tests/conftest.py collects them: `LONGEST_FIRST`, then the rest by name."""
    sys.path.insert(0, str(TESTS))
    from conftest import LONGEST_FIRST
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    return sorted(sorted(names), key=lambda name: rank.get(name, len(rank)))


def replay(units: list[tuple[str, list[float]]], workers: int) -> tuple[list[float], list[list[tuple[str, float]]]]:
    """pytest-xdist's loadfile scheduling of ``units`` (``(file, [each test's seconds])`` in collection order)
    on ``workers`` processes that each run one test at a time.

    Returns:
      ``(ends, files)``: each worker's end in seconds from the start, and its ``(file, start)`` list.
    """
    queue = collections.deque(units)
    pending = [collections.deque() for _ in range(workers)]
    files = [[] for _ in range(workers)]
    clock = [0.0] * workers

    def assign(w):
        name, costs = queue.popleft()
        pending[w].extend(costs)
        files[w].append((name, clock[w]))

    for w in range(workers):  # one unit each, then more to whoever has 2 tests or fewer (xdist #277)
        if queue:
            assign(w)
    for w in range(workers):
        if queue and len(pending[w]) <= 2:
            assign(w)
    while any(pending):
        w = min((w for w in range(workers) if pending[w]), key=lambda w: clock[w] + pending[w][0])
        clock[w] += pending[w].popleft()
        if queue and len(pending[w]) <= 2:  # xdist reschedules on each finished test
            assign(w)
    return clock, files


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("records", help="a REVTRAIN_TEST_CPU file of one run")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cost", default="cpu_s", choices=["cpu_s", "wall_s"])
    parser.add_argument("--order", action="store_true", help="print the files by cost, longest first")
    args = parser.parse_args(argv)
    records = read(args.records)
    if args.cost not in records[0]:
        parser.error(f"{args.records} has no {args.cost} (records written before tests/conftest.py kept it)")
    costs = collections.defaultdict(list)
    for r in records:
        costs[file_of(r["test"])].append(r[args.cost])
    total = sum(map(sum, costs.values()))
    if args.order:
        for name in sorted(costs, key=lambda n: -sum(costs[n])):
            print(f"{sum(costs[name]):8.1f}  {len(costs[name]):3d}  {name}")
        return 0
    ends, files = replay([(name, costs[name]) for name in collection_order(list(costs))], args.workers)
    print(f"replay of {len(records)} tests in {len(costs)} files, {args.cost}: {total:.1f} s in all")
    for w, (end, names) in enumerate(zip(ends, files)):
        print(f"  worker {w}: ends at {end:.1f} s: " + ", ".join(f"{n} ({s:.0f})" for n, s in names))
    print(f"  balanced end {total / args.workers:.1f} s; last end {max(ends):.1f} s; tail {max(ends) - min(ends):.1f} s")
    if "worker" in records[0]:
        t0 = min(r["start"] for r in records)
        print("as it ran (seconds from the first test's start):")
        by_worker = collections.defaultdict(list)
        for r in records:
            by_worker[r["worker"]].append(r)
        last = max(r["start"] + r["wall_s"] for r in records)
        for name in sorted(by_worker):
            rs = by_worker[name]
            end = max(r["start"] + r["wall_s"] for r in rs)
            print(f"  {name}: {len(rs)} tests, {sum(r['cpu_s'] for r in rs):.1f} CPU s, "
                  f"{sum(r['wall_s'] for r in rs):.1f} s of tests from {min(r['start'] for r in rs) - t0:.1f} to "
                  f"{end - t0:.1f} s; idle at the end {last - end:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
