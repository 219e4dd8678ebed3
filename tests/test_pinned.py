"""Pinned host memory (`revtrain.pinned`): XLA's pinned pool's size where it grows (doubling regions) and where
it is preallocated, the variables as XLA reads them, `revtrain train` setting them before JAX's backend starts,
and the host tier with the pageable kind switched off (pinned memory on the CPU, one log line)."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from revtrain import pinned
from revtrain.placement import HOST_MEMORY, PAGEABLE_MEMORY, make_mesh
from revtrain.tiers.host import HostTier as HostResidency

from helpers import REPO

MiB, GiB = 2**20, 2**30


def test_a_grown_pool_adds_doubling_regions():
    """Regions of 2, 4, 8, ... MiB, none returned: S bytes in small requests cost the least sum 2 + 4 + ... that
    holds them; the 1.44 B Llama's 16.14 GiB of AdamW state needs 32 GiB less 2 MiB; the limit caps the last
    region, and a need over it does not fit (limit + 1)."""
    grown = pinned.grown_pool_bytes
    assert grown(0) == 0 and grown(1) == 2 * MiB and grown(2 * MiB) == 2 * MiB
    assert grown(2 * MiB + 1) == 6 * MiB and grown(6 * MiB) == 6 * MiB and grown(6 * MiB + 1) == 14 * MiB
    assert grown(int(16.14 * GiB)) == 32 * GiB - 2 * MiB
    assert grown(int(16.14 * GiB), 24 * GiB) == 24 * GiB  # the last region is what the limit leaves
    assert grown(25 * GiB, 24 * GiB) == 24 * GiB + 1
    # Request by request (BFCAllocator::Extend): a request larger than the region doubles it (no doubling after
    # that region); free tails are filled first (best fit).
    assert grown([MiB] * 4) == 6 * MiB  # 2 MiB holds two, then a 4 MiB region
    assert grown([3 * MiB, 3 * MiB]) == 8 * MiB  # 4 MiB (doubled to fit), then 4 MiB again
    assert grown([100, 100]) == 2 * MiB  # (each rounded up to 256 bytes, in the first region)
    assert grown([5 * GiB], 4 * GiB) == 4 * GiB + 1


def test_the_pools_variables_read_as_xla_reads_them():
    """Grown: 64 GiB by default; preallocated: the whole limit (16 GiB by default); the limit is an integer
    number of GiB (XLA ignores anything else); the preallocation flag is true/1/false/0 in any case."""
    assert pinned.limit({}) == (64 * GiB, "XLA's pinned pool default, 64 GiB, grown on demand")
    assert pinned.limit({pinned.PREALLOCATE_ENV: "TRUE"})[0] == 16 * GiB
    assert pinned.limit({pinned.LIMIT_ENV: "20", pinned.PREALLOCATE_ENV: "1"}) == (
        20 * GiB, "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=20, preallocated")
    assert pinned.limit({pinned.LIMIT_ENV: "24.5"})[0] == 64 * GiB
    assert "is not an integer" in pinned.limit({pinned.LIMIT_ENV: "24.5"})[1]
    assert not pinned.preallocated({pinned.PREALLOCATE_ENV: "yes"})
    need = int(16.14 * GiB)
    assert pinned.pool_bytes(need, {}) == 32 * GiB - 2 * MiB
    assert pinned.pool_bytes(need, {pinned.PREALLOCATE_ENV: "true", pinned.LIMIT_ENV: "18"}) == 18 * GiB
    assert pinned.limit_gb_for(need) == 18 and pinned.limit_gb_for(0) == 1  # (with a GiB of staging beside)


def test_train_environment_sets_only_what_the_user_left_and_refuses_a_small_cap():
    env = {}
    chosen, refusal = pinned.train_environment(int(16.14 * GiB), env)
    assert refusal is None and env == chosen == {pinned.PREALLOCATE_ENV: "true", pinned.LIMIT_ENV: "18"}
    env = {pinned.PREALLOCATE_ENV: "false"}
    chosen, refusal = pinned.train_environment(GiB, env)
    assert chosen == {pinned.LIMIT_ENV: "2"} and env[pinned.PREALLOCATE_ENV] == "false" and refusal is None
    env = {pinned.LIMIT_ENV: "8"}
    chosen, refusal = pinned.train_environment(int(16.14 * GiB), env)
    assert env[pinned.LIMIT_ENV] == "8" and env[pinned.PREALLOCATE_ENV] == "true"
    assert refusal == ("the host tier's state needs 16.14 GiB of pinned host memory, over XLA's pinned pool of 8 "
                       "GiB (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=8, preallocated); raise "
                       "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB to at least 18, or use ReversibleTrainer.offload = 'disk'")


CHILD = r"""
import json, os, sys
from revtrain import cli
from revtrain.lifecycle import lost_peer
cli._parse_gin([sys.argv[1]], sys.argv[2:])
cli._size_pinned_pool()
print(json.dumps({"started": lost_peer.backends_started(), "pre": os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE"),
                  "limit": os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"), "need": cli._pinned_need()}))
import jax
platform = jax.devices()[0].platform
print(json.dumps({"started": lost_peer.backends_started(), "platform": platform}))
"""


@pytest.mark.parametrize("offload", [True, False])
def test_train_sets_the_pool_before_the_backend_starts(offload, byte_lm_data_dir, tmp_path):
    """`revtrain train`'s step before the run is built, in a child process whose platform may be a GPU: the
    state's bytes from shapes (the model built under ``jax.eval_shape``: no backend started), the pool
    preallocated at that size and a GiB beside it; nothing without a host tier."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_PJRT_GPU_HOST_MEMORY")}
    env.pop("JAX_PLATFORMS", None)  # (a configuration that may start a GPU backend)
    env.update(PYTHONPATH=str(REPO), REVTRAIN_DATA_DIR=str(byte_lm_data_dir))
    gin = ["LlamaModel.d_model = 64", "LlamaModel.num_layers = 2", "LlamaModel.num_heads = 2",
           "LlamaModel.num_kv_heads = 1", "LlamaModel.d_ff = 128", f"ReversibleTrainer.offload = {offload}",
           "train.trainer = @ReversibleTrainer"]
    out = subprocess.run([sys.executable, "-c", CHILD, str(REPO / "configs" / "llama_small.gin"), *gin], env=env,
                         capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = (json.loads(line) for line in out.stdout.splitlines()[-2:])
    assert before["started"] is False and after["started"] is True
    if not offload:
        assert before == {"started": False, "pre": None, "limit": None, "need": None}
        return
    # d 64, 2 blocks, bytes vocab, AdamW float32: 12 bytes a parameter and the largest layer once more.
    assert before["pre"] == "true" and before["limit"] == str(pinned.limit_gb_for(before["need"])) == "2"
    assert 0 < before["need"] < 10 * MiB


def test_the_switch_puts_the_host_tier_in_pinned_memory_and_says_so(capsys, monkeypatch):
    """The CPU has pageable host memory; with the switch (an argument, or the environment) the host tier keeps
    its state in ``pinned_host`` as on a GPU, and says where in one line; a placed layer lands there."""
    mesh = make_mesh(jax.devices()[:1])
    monkeypatch.delenv(pinned.NO_PAGEABLE_ENV, raising=False)
    layer = {"w": np.ones((4, 4), np.float32)}
    plain = HostResidency(mesh)
    assert plain.memory_kind == PAGEABLE_MEMORY and capsys.readouterr().err == ""  # (said when a state is placed)
    plain.put_layer(0, layer, ())
    assert capsys.readouterr().err == "host tier: the state lives in unpinned_host memory (pageable)\n"
    host = HostResidency(mesh, pageable=False)
    line = ("host tier: the state lives in pinned_host memory (the pageable kind is switched off "
            "(REVTRAIN_NO_PAGEABLE_HOST=1 or pageable=False); on the cpu it is ordinary host memory)")
    assert host.memory_line == line
    assert host.memory_kind == HOST_MEMORY == host.store.memory_kind
    assert host.describe() == "host memory (pinned_host), replicated"
    params, _ = host.put_layer(0, layer, ())
    host.put_layer(1, layer, ())
    assert capsys.readouterr().err == line + "\n"  # once
    assert params["w"].sharding.memory_kind == HOST_MEMORY
    monkeypatch.setenv(pinned.NO_PAGEABLE_ENV, "1")
    switched = HostResidency(mesh)
    switched.layer_template(0, {"w": jax.ShapeDtypeStruct((4, 4), np.float32)}, ())
    assert switched.memory_kind == HOST_MEMORY and capsys.readouterr().err == line + "\n"
    # A GPU's line names the pool (its limit and how it is sized), from the same variables XLA reads.
    monkeypatch.setattr(pinned, "TRAIN_SETTING", None)
    gpu = pinned.describe(HOST_MEMORY, "gpu", environ={pinned.LIMIT_ENV: "18", pinned.PREALLOCATE_ENV: "true"})
    assert gpu == ("host tier: the state lives in pinned_host memory (the gpu backend has no pageable host memory), "
                   "XLA's pinned pool of 18 GiB (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=18, preallocated)")


def test_the_pinned_host_tier_trains_bit_for_bit_with_the_device_tier(monkeypatch):
    """With the pageable kind switched off, the host tier's state is pinned_host arrays and the run is the
    device tier's, every bit (losses, weights, AdamW state over four steps)."""
    import optax

    from revtrain.models import ReversibleTransformerLM
    from revtrain.placement import global_batch
    from revtrain.trainers import ReversibleTrainer
    monkeypatch.setenv(pinned.NO_PAGEABLE_ENV, "1")
    mesh = make_mesh(jax.devices()[:1])
    data = np.random.default_rng(0).integers(0, 256, (4, 4, 16), dtype=np.int32)
    results = {}
    for offload in (False, True):
        model = ReversibleTransformerLM(16, num_layers=3, d_model=32, num_heads=2, dropout_rate=0.0)
        trainer = ReversibleTrainer(model, optax.adamw(1e-3), mesh, seed=0, offload=offload, scan_layers=False)
        ts, losses = trainer.init(), []
        for x in data:
            ts, metrics = trainer.train_step(ts, global_batch({"inputs": x, "targets": x}, mesh))
            losses.append(float(metrics["loss"]))
        if offload:
            assert trainer.residency.memory_kind == HOST_MEMORY
            assert {x.sharding.memory_kind for x in jax.tree.leaves((ts.params, ts.opt_state))} == {HOST_MEMORY}
        results[offload] = losses, jax.tree.map(np.asarray, (list(ts.params), list(ts.opt_state)))
    assert results[True][0] == results[False][0]
    a, b = results[True][1], results[False][1]
    assert jax.tree.structure(a) == jax.tree.structure(b)
    assert all(np.array_equal(u, v) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
