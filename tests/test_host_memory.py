"""Host memory at the reversible trainer's floor: one copy of the state in every phase (docs/memory.md).

A child process trains a 57 M-parameter Llama (AdamW, float32: the 12 bytes per parameter of weights and two
moments dominate the runtime's constant), saves, resumes and saves again; its own peak resident memory (VmHWM,
read by the child at exit: a child's ru_maxrss starts at its parent's) must stay within the floor plus a bound.
Before the one-copy work the same run peaked near 50 bytes per parameter.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from revtrain.allocator import bound_retention, release_free_memory

from helpers import CONFIGS, env

MODEL = ["--gin", "LlamaModel.d_model = 768", "--gin", "LlamaModel.num_layers = 8", "--gin", "LlamaModel.num_heads = 12",
         "--gin", "LlamaModel.num_kv_heads = 12", "--gin", "LlamaModel.d_ff = 2048", "--gin", "train.batch_size = 2",
         "--gin", "train.log_every = 1", "--gin", "train.checkpoint_every = 2", "--gin", "train.sample_every = 0",
         "--gin", "evaluate.max_batches = 1", "--gin", "WARMUP = 1", "--gin", "train.trainer = @ReversibleTrainer",
         # The evaluation runs on one batch of 2 (64 by default: a 57 M-parameter forward of 8,192 tokens is ~20 s
         # of each run here); the state is held through it the same way, whatever the batch.
         "--gin", "evaluate.batch_size = 2"]
PARAMS = 57_029_376  # the model's parameter count (the run's first log line)
# Runtime (Python, JAX, TensorFlow's data readers: about 0.6 GiB here), one program's temporaries, Orbax's
# bounded staging (256 MiB) and the allocator's slack.
BOUND_BYTES = 12 * PARAMS + int(1.25 * 2**30)

_CHILD = ("import sys, re\n"
          "from revtrain.cli import main\n"
          "code = main(sys.argv[1:])\n"
          "hwm = re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1)\n"
          "print('VMHWM', int(hwm) * 1024)\n"
          "sys.exit(code)\n")


def _train(workdir, steps):
    result = subprocess.run([sys.executable, "-c", _CHILD, "train", "--config", str(CONFIGS / "llama_small.gin"),
                             *MODEL, "--gin", f"STEPS = {steps}", "--workdir", str(workdir)],
                            capture_output=True, text=True, env=env(), timeout=600)
    assert result.returncode == 0, result.stderr
    assert f"{PARAMS:,} params" in result.stderr
    return int(result.stdout.split("VMHWM")[-1])


@pytest.mark.slow  # make test: the plan's host terms (test_planning_*, test_memory_plan)
def test_train_save_resume_peak_within_floor(tmp_path):
    first = _train(tmp_path / "run", 3)  # init, steps, a save at step 2 and the final one, evaluation
    second = _train(tmp_path / "run", 4)  # restore, a step, its save, evaluation
    print(f"peaks {first / 2**30:.2f} and {second / 2**30:.2f} GiB ({first / PARAMS:.1f}, {second / PARAMS:.1f} B/p)")
    for peak in (first, second):
        assert peak <= BOUND_BYTES, f"peak {peak / 2**30:.2f} GiB, {peak / PARAMS:.1f} bytes per parameter"
    assert (tmp_path / "run" / "checkpoints" / "4").is_dir()


def test_bound_retention_returns_freed_buffers():
    """After many freed buffers of a few MiB, the process does not keep them resident."""
    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    assert bound_retention() or "MALLOC_MMAP_THRESHOLD_" in os.environ
    base = rss()
    blocks = [np.ones(3 * 2**20 // 8) for _ in range(100)]  # 300 MiB in 3 MiB buffers
    del blocks
    release_free_memory()
    assert rss() - base < 64 * 2**20
