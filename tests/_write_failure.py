"""Runs ``revtrain train`` with the file system failing from its second checkpoint on, then resumes.

Used by tests/test_disk_full.py, as a separate process (it may run inside a private mount namespace).

  python tests/_write_failure.py drive-enospc FILLER RESULT_JSON -- TRAIN_ARGS...
  python tests/_write_failure.py drive-efbig RESULT_JSON -- TRAIN_ARGS...   (or drive-silent)

Roles:
  ``child-enospc FILLER``: inside ``revtrain train``, just before the second checkpoint save (after the
    first one is complete on disk), write FILLER until the file system reports ENOSPC: a real full disk.
  ``child-efbig``: same moment, lower RLIMIT_FSIZE to 16 KiB (SIGXFSZ ignored), so that the kernel fails
    every write past 16 KiB of a file with EFBIG (a file system refusing writes, without needing a mount).
  ``child-silent``: as ``child-efbig``, with Orbax made to give up on the failed save without raising
    (as it does when a write fails late: it logs and skips finalization), so only revtrain's own check
    that the step directory exists can catch it.
  ``drive-enospc FILLER`` / ``drive-efbig`` / ``drive-silent``: run the matching child, then free the
    space (delete FILLER; no limit) and run plain ``revtrain train`` again with the same arguments; write
    what happened (exit statuses, stderr, checkpoint directory listings, whether train.jsonl parses) to
    RESULT_JSON.
"""

import errno
import json
import os
import resource
import signal
import subprocess
import sys


def _child(mode: str, filler: str | None, argv: list[str]) -> int:
    from revtrain import checkpoint, cli
    real_save = checkpoint.Checkpointer.save
    calls = [0]

    def save(self, ts, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            self.wait()  # the first checkpoint is complete: now the disk fills up
            if mode == "enospc":
                with open(filler, "wb") as f:
                    try:
                        while True:
                            f.write(b"\0" * (1 << 16))
                            f.flush()
                    except OSError as e:
                        if e.errno != errno.ENOSPC:
                            raise
            else:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        return real_save(self, ts, *args, **kwargs)

    checkpoint.Checkpointer.save = save
    if mode == "silent":
        from orbax.checkpoint import checkpoint_manager
        wait = checkpoint_manager.CheckpointManager._wait_for_checkpointers

        def swallow(manager):
            try:
                wait(manager)
            except Exception:  # noqa: BLE001 (Orbax's finalizer then logs and skips the step)
                pass

        checkpoint_manager.CheckpointManager._wait_for_checkpointers = swallow
    return cli.main(argv)


def _listing(workdir: str) -> list[str]:
    path = os.path.join(workdir, "checkpoints")
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


def _drive(mode: str, filler: str | None, result_path: str, argv: list[str]) -> None:
    workdir = argv[argv.index("--workdir") + 1]
    child = [sys.executable, os.path.abspath(__file__), f"child-{mode}"] + ([filler] if filler else []) + ["--"]
    first = subprocess.run(child + argv, capture_output=True, text=True, timeout=600)
    after_failure = _listing(workdir)
    try:
        from revtrain import metrics
        parses = bool(metrics.read_jsonl(os.path.join(workdir, "metrics", "train.jsonl")))
    except ValueError:
        parses = False
    if filler and os.path.exists(filler):
        os.remove(filler)
    second = subprocess.run([sys.executable, "-m", "revtrain"] + argv, capture_output=True, text=True, timeout=600)
    records = []
    for line in open(os.path.join(workdir, "metrics", "train.jsonl")):
        records.append(json.loads(line)["step"])
    with open(result_path, "w") as f:
        json.dump({"first_rc": first.returncode, "first_stderr": first.stderr, "after_failure": after_failure,
                   "jsonl_parses": parses, "second_rc": second.returncode, "second_stderr": second.stderr,
                   "after_resume": _listing(workdir), "logged_steps": records}, f)


def main() -> int:
    args = sys.argv[1:]
    split = args.index("--")
    head, argv = args[:split], args[split + 1:]
    role, mode = head[0].split("-")
    if role == "child":
        return _child(mode, head[1] if mode == "enospc" else None, argv)
    _drive(mode, head[1] if mode == "enospc" else None, head[-1], argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
