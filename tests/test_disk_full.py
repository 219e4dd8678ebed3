"""Disk full during a checkpoint: one error line, exit 1, the previous checkpoint survives, resume works."""

import json
import shutil
import subprocess
import sys

import pytest

from helpers import CONFIG, REPO, env

DRIVER = str(REPO / "tests" / "_write_failure.py")
ARGS = ["train", "--config", CONFIG, "--gin", "ReversibleTransformerLM.num_layers = 3",
        "--gin", "ReversibleTransformerLM.d_model = 32", "--gin", "train.batch_size = 8", "--gin", "STEPS = 6",
        "--gin", "WARMUP = 1", "--gin", "train.log_every = 1", "--gin", "train.checkpoint_every = 1",
        "--gin", "evaluate.max_batches = 1", "--gin", "train.sample_every = 0"]  # samples: test_sample.py


def _private_tmpfs_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                           capture_output=True)
    return probe.returncode == 0


@pytest.mark.slow  # make test-all: a full run per failure kind
@pytest.mark.parametrize("mode", ["enospc", "efbig", "silent"])
def test_a_failed_checkpoint_write_keeps_the_previous_one_and_resumes(tmp_path, mode):
    result = tmp_path / "result.json"
    if mode == "enospc":
        # A real full disk: a 64 MiB tmpfs in a private mount namespace (nothing outside this test sees it).
        if not _private_tmpfs_works():
            pytest.skip("unshare -rm / mount -t tmpfs not permitted here (the efbig case covers the path)")
        mnt = tmp_path / "mnt"
        mnt.mkdir()
        workdir = mnt / "run"
        script = f'mount -t tmpfs -o size=64m tmpfs "{mnt}" && exec "$@"'
        cmd = ["unshare", "-rm", "sh", "-c", script, "sh", sys.executable, DRIVER, "drive-enospc",
               str(mnt / "filler"), str(result), "--", *ARGS, "--workdir", str(workdir)]
    else:
        workdir = tmp_path / "run"
        cmd = [sys.executable, DRIVER, f"drive-{mode}", str(result), "--", *ARGS, "--workdir", str(workdir)]
    subprocess.run(cmd, check=True, env=env(), timeout=900)
    r = json.loads(result.read_text())

    # The failing run: exit 1, one line naming the failed step, the reason and the kept checkpoint.
    lines = [l for l in r["first_stderr"].splitlines() if l.startswith("revtrain: error:")]
    assert r["first_rc"] == 1, r["first_stderr"]
    assert len(lines) == 1 and "Traceback" not in r["first_stderr"], r["first_stderr"]
    reason = {"enospc": "No space left on device", "efbig": "File too large",
              "silent": "Orbax did not commit it"}[mode]
    assert "cannot write the checkpoint at step 2: " + reason in lines[0], lines[0]
    assert "the newest checkpoint (step 1) is kept" in lines[0], lines[0]
    assert r["after_failure"] == ["1"]  # step 1 intact, no half-written step 2 left behind
    assert r["jsonl_parses"]

    # Space freed: the same command resumes from step 1 and finishes.
    assert r["second_rc"] == 0, r["second_stderr"]
    assert "resumed from checkpoint at step 1" in r["second_stderr"]
    assert r["after_resume"][-1] == "6"
    assert r["logged_steps"][-5:] == [2, 3, 4, 5, 6]


def test_a_record_cut_short_by_a_failed_write_is_dropped_on_resume(tmp_path):
    from revtrain import metrics
    path = tmp_path / "metrics" / "train.jsonl"
    path.parent.mkdir()
    path.write_bytes(b'{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert [r["step"] for r in metrics.read_jsonl(str(path))] == [1]  # the partial record is not one
    writer = metrics.MetricWriter(str(tmp_path))  # a resumed run's writer cuts it off
    assert path.read_bytes() == b'{"step": 1, "loss": 2.0}\n'
    writer.write("train", 2, {"loss": 1.5})
    writer.close()
    assert [r["step"] for r in metrics.read_jsonl(str(path))] == [1, 2]
