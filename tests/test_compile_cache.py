"""revtrain/compile_cache.py: where the compiled programs are kept between commands, and that a second process
finds them there."""

import json
import os
import subprocess
import sys

import pytest

from revtrain import compile_cache

from helpers import CONFIG, env, records, revtrain

# A process that turns the cache on as a command does, compiles one program and says what JAX's cache did.
_PROBE = """
import json, jax
from revtrain.compile_cache import enable
hits = []
jax.monitoring.register_event_listener(lambda event, **kw: hits.append(event) if event.endswith("cache_hits") else None)
directory = enable()
print(json.dumps({"directory": directory, "value": float(jax.jit(lambda x: x * 3.0 + 1.0)(2.0)),
                  "hits": len(hits)}))
"""


def test_the_directory_is_revtrains_own_unless_the_user_chose_one(tmp_path):
    home = str(tmp_path)
    assert compile_cache.resolve({"XDG_CACHE_HOME": home}) == os.path.join(home, "revtrain", "xla")
    assert compile_cache.resolve({"REVTRAIN_COMPILE_CACHE": str(tmp_path / "c"), "XDG_CACHE_HOME": home}) == str(
        tmp_path / "c")
    for off in ("off", "0", "", "OFF "):
        assert compile_cache.resolve({"REVTRAIN_COMPILE_CACHE": off}) is None
    # (a cache given to JAX itself is the user's: left as it is)
    assert compile_cache.resolve({"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "j"), "XDG_CACHE_HOME": home}) is None


def _probe(**extra):
    child = env(**extra)
    child.pop("JAX_COMPILATION_CACHE_DIR", None)  # (the test session's own cache: not this one's)
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=child, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_process_fetches_the_program_the_first_compiled(tmp_path):
    """The first process compiles and writes the program (its entry on disk); the second finds it there (one
    cache hit, no new entry) and computes the same value. ``off`` keeps none."""
    directory = tmp_path / "xla"
    first = _probe(REVTRAIN_COMPILE_CACHE=str(directory))
    assert first == {"directory": str(directory), "value": 7.0, "hits": 0}
    entries = sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))
    assert any(name.endswith("-cache") for name in entries), entries
    second = _probe(REVTRAIN_COMPILE_CACHE=str(directory))
    assert second == {"directory": str(directory), "value": 7.0, "hits": 1}
    assert sorted(p.name for p in directory.iterdir() if not p.name.startswith(".")) == entries
    assert _probe(REVTRAIN_COMPILE_CACHE="off") == {"directory": None, "value": 7.0, "hits": 0}


def test_a_directory_that_cannot_be_made_leaves_the_command_uncached(tmp_path):
    """``REVTRAIN_COMPILE_CACHE`` naming a path under a file (no directory can be made there): no cache, and the
    program still compiles and runs."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    assert _probe(REVTRAIN_COMPILE_CACHE=str(blocker / "xla")) == {"directory": None, "value": 7.0, "hits": 0}


@pytest.mark.slow  # make test-all: two tiny training processes (about 30 s)
def test_a_second_train_compiles_nothing_and_trains_the_same(tmp_path, byte_lm_data_dir):
    """``revtrain train`` twice on the same config, each in a fresh workdir, with the cache in a fresh directory:
    the second run writes no new entry (every program found compiled) and logs the same losses."""
    directory = tmp_path / "xla"
    tiny = ["--gin", "ReversibleTransformerLM.num_layers = 2", "--gin", "ReversibleTransformerLM.d_model = 32",
            "--gin", "train.batch_size = 4", "--gin", "evaluate.max_batches = 1", "--gin", "STEPS = 3",
            "--gin", "WARMUP = 1", "--gin", "train.log_every = 1", "--gin", "train.sample_every = 0"]
    child = env(data_dir=byte_lm_data_dir, REVTRAIN_COMPILE_CACHE=str(directory))
    child.pop("JAX_COMPILATION_CACHE_DIR", None)
    losses, entries = [], []
    for name in ("a", "b"):
        result = revtrain("train", "--config", CONFIG, "--workdir", tmp_path / name, *tiny, child_env=child)
        assert result.returncode == 0, result.stderr
        losses.append([r["loss"] for r in records(tmp_path / name) if "loss" in r])
        entries.append(sorted(p.name for p in directory.iterdir() if p.name.endswith("-cache")))
    assert len(losses[0]) == 3 and losses[0] == losses[1]
    assert entries[0] and entries[1] == entries[0]
