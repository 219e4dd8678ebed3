"""What keeps a run alive and its data safe: one package, one concern each.

* `interrupts`: SIGINT / SIGTERM in every command (the first signal finishes the step and saves it, a second
  stops at once with the newest checkpoint intact; signal bursts count as one), and `_stopped`, the
  stdlib-only script that finishes a process stopped at once (exec: every other thread ends, the lock is
  handed over).
* `lost_peer`: a process of a multi-process run that is lost is noticed (heartbeats) and reported in one
  line, exit 1; the same command on every host resumes.
* `oom`: an out-of-memory error from XLA as one line that says how many bytes the step needed and which
  settings lower it.
* `workdir`: the workdir's lock (one `train` / `eval` / `check` at a time, naming the holder's PID and
  host), and the clean-up of a workdir a failed run created before it saved anything.

docs/faults.md and docs/checkpoints.md describe the behaviour; tests/test_reliability.py and
tests/test_faults.py exercise it from the command line.
"""
