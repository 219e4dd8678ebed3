"""``ReversibleTrainer.offload = 'auto'`` (revtrain/planning/runs.py, `choose_tier`): the run is built with the
fastest tier whose memory plan fits the limits (device, then host, then disk), one line saying which and why,
and a one-line refusal when none fits. The limits are given to the plan (`run.build(limits=...)`), as the
memory-plan tests give them, so no cgroup is needed; nothing of a model's state is placed (plans only)."""

import gin
import pytest

from helpers import REPO

GIB = 2**30
# The 0.3 B byte Llama of docs/memory.md and docs/disk.md: 308.9 M parameters, 3.45 GiB of weights and AdamW
# state (more than the 2.5 GiB memory cgroup of docs/disk.md's run).
LLAMA_03B = ["LlamaModel.d_model = 1024", "LlamaModel.num_layers = 24", "LlamaModel.num_heads = 16",
             "LlamaModel.num_kv_heads = 16", "LlamaModel.d_ff = 2816", "train.batch_size = 2",
             "train.trainer = @ReversibleTrainer"]


def _build(config: str, bindings: list, limits: dict):
    """The run of ``configs/<config>`` with ``bindings`` and ``offload = 'auto'``, built against ``limits``."""
    from revtrain import registry
    from revtrain import run as run_lib
    registry.parse_gin([str(REPO / "configs" / config)], [*bindings, "ReversibleTrainer.offload = 'auto'"])
    try:
        return run_lib.build(say_data=False, limits=limits)
    finally:
        gin.clear_config()


def test_the_default_model_gets_the_device_tier(capsys):
    """configs/enwik_modern.gin within 20 GiB: the device tier's plan fits, so the run keeps the device tier (its
    plan is the run's own: the programs compiled for it are the run's)."""
    run = _build("enwik_modern.gin", [], {"host": (20 * GIB, "test: 20 GiB")})
    assert run.trainer.residency.name == "device" and not run.trainer.auto_tier
    line = [x for x in capsys.readouterr().err.splitlines() if "offload = 'auto'" in x]
    assert len(line) == 1 and "ReversibleTrainer.offload = 'auto': device tier (its plan fits: host " in line[0]
    assert line[0].endswith(" of 20.00 GiB)"), line


def test_the_03b_llama_in_25_gib_gets_the_disk_tier(capsys):
    """The 0.3 B Llama inside 2.5 GiB: neither the device tier nor the host tier fits (each refused from shapes
    alone, nothing compiled), the disk tier does; the line names both shortfalls. The trainer then holds the disk
    tier (its state not placed)."""
    run = _build("llama_small.gin", LLAMA_03B, {"host": (int(2.5 * GIB), "test: a 2.5 GiB cgroup"),
                                                "disk": (None, "test: not asked")})
    tier = run.trainer.residency
    assert (tier.name, tier.state_memory, run.trainer.auto_tier) == ("disk", None, False)
    assert run.trainer.memory_setup()["label"] == "ReversibleTrainer + offload='disk'"
    line = [x for x in capsys.readouterr().err.splitlines() if "offload = 'auto'" in x]
    assert len(line) == 1 and line[0].startswith("ReversibleTrainer.offload = 'auto': disk tier (device tier: host "
                                                 "needs at least "), line
    assert "; host tier: host needs at least " in line[0] and line[0].endswith("of 2.50 GiB (test: a 2.5 GiB cgroup))")


def test_no_tier_fits_is_one_line():
    """Within 0.25 GiB of memory and 1 GiB of disk the 0.3 B Llama fits no tier: one line naming each, and the
    CLI's exit 2 (a `ConfigError`)."""
    from revtrain.errors import ConfigError
    with pytest.raises(ConfigError) as caught:
        _build("llama_small.gin", LLAMA_03B, {"host": (GIB // 4, "test"), "disk": (GIB, "test: 1 GiB")})
    text = str(caught.value)
    assert "\n" not in text and text.startswith("ReversibleTrainer.offload = 'auto': no tier fits this machine "
                                                "(device tier: host needs at least ")
    assert "; host tier: " in text and "; disk tier: " in text and "of 1.00 GiB (test: 1 GiB)" in text
