"""Writes a corpus of Python source for fine-tuning: the ``.py`` files of this interpreter's standard library.

  python scripts/prepare_python.py OUT_FILE [--max_bytes N]

The files are found with ``sysconfig.get_paths()["stdlib"]`` (tests, site-packages and idle excluded), read in
sorted path order, and split by file: a file whose path's SHA-1 ends in a digit below 1 (about 1 in 16) is
held out; the others are training files. OUT_FILE is the training files (up to 90% of ``max_bytes``) followed
by held-out files (the rest), so that `ByteLMTask`'s contiguous 90 / 5 / 5 split puts training files in the
train split and held-out files in validation and test (only the one file that straddles the 90% boundary is
cut between train and validation). A JSON manifest (OUT_FILE.json) lists the files of each part.
"""

import argparse
import hashlib
import json
import os
import sysconfig


def stdlib_files() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        parts = [] if rel == "." else rel.split(os.sep)
        if any(p in ("site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__") or p.startswith(".")
               for p in parts):
            dirnames[:] = []
            continue
        out.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--max_bytes", type=int, default=3_000_000)
    args = p.parse_args()
    root = sysconfig.get_paths()["stdlib"]
    train, held = [], []
    for path in stdlib_files():
        (held if hashlib.sha1(os.path.relpath(path, root).encode()).hexdigest()[-1] in "0" else train).append(path)
    budget_train, budget_held = args.max_bytes * 90 // 100, args.max_bytes - args.max_bytes * 90 // 100
    chosen = {"train": [], "held_out": []}
    data = []
    for name, files, budget in (("train", train, budget_train), ("held_out", held, budget_held)):
        used = 0
        for path in files:
            with open(path, "rb") as f:
                text = f.read()
            if used + len(text) > budget:
                continue
            used += len(text)
            data.append(text)
            chosen[name].append(os.path.relpath(path, root))
        chosen[name + "_bytes"] = used
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "wb") as f:
        f.write(b"".join(data))
    with open(args.out + ".json", "w") as f:
        json.dump({"stdlib": root, **chosen}, f, indent=1)
    print(f"{args.out}: {chosen['train_bytes']:,} bytes of {len(chosen['train'])} training files, then "
          f"{chosen['held_out_bytes']:,} bytes of {len(chosen['held_out'])} held-out files from {root}")


if __name__ == "__main__":
    main()
