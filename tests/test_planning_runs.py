"""revtrain/planning/runs.py: the plans of a built run, as ``revtrain plan`` prints them (in this process)."""

import pytest

from helpers import REPO, revtrain_here

LLAMA = str(REPO / "configs" / "llama_small.gin")
TINY = ["--config", LLAMA, "--gin", "LlamaModel.d_model = 32", "--gin", "LlamaModel.num_layers = 2",
        "--gin", "LlamaModel.d_ff = 64", "--gin", "train.batch_size = 2", "--gin", "train.trainer = @ReversibleTrainer"]


@pytest.mark.parametrize("switch, kind", [("0", "unpinned_host memory (pageable)"), ("1", "pinned_host memory")])
def test_plan_reports_where_the_host_tiers_state_lives_as_train_does(switch, kind, capsys, monkeypatch):
    """With offload, ``revtrain plan`` prints the host tier's line that ``train`` logs (the memory kind of the
    state; with the pageable kind switched off, pinned memory, and the plan counts a pinned tier), after
    the plan's own line and before the table."""
    from revtrain import pinned
    monkeypatch.setenv(pinned.NO_PAGEABLE_ENV, switch)
    monkeypatch.setenv(pinned.LIMIT_ENV, "64")  # (what `train` would set on a GPU: none of its business here)
    result = revtrain_here(capsys, "plan", *TINY, "--gin", "ReversibleTrainer.offload = True")
    assert result.returncode == 0, result.stderr
    out = result.stdout.strip().splitlines()
    assert out[0].startswith("memory plan (ReversibleTrainer + offload, ") and out[0].endswith("; fits"), out[0]
    assert out[1].startswith(f"host tier: the state lives in {kind}"), out[1]
    assert out[2].split()[0] == "choice" and ("pinned:total" in out[2]) == (switch == "1"), out[2]


def test_plan_without_a_host_tier_prints_no_tier_line(capsys):
    result = revtrain_here(capsys, "plan", *TINY)
    assert result.returncode == 0, result.stderr
    out = result.stdout.strip().splitlines()
    assert out[0].startswith("memory plan (ReversibleTrainer, ") and out[1].split()[0] == "choice", out[:2]
