"""`revtrain.loop`'s decisions that need no training: which metrics file a split's scores go to, the line
about a disk-tier state a run leaves unused, the refusal of a checkpoint made by another run (naming what
differs and, for the optimizer, both optimizers), and the note when a resumed run's new optimizer brings
other values of the old one's settings."""

import pytest

from revtrain import loop, tiers
from revtrain.errors import ConfigError
from revtrain.placement import make_mesh
from revtrain.tiers.disk_store import STEP_PREFIX


def test_a_splits_scores_go_to_eval_or_eval_split():
    assert loop.eval_kind("validation", "validation") == "eval"
    assert loop.eval_kind("test", "validation") == "eval_test"


def test_an_unused_disk_tier_state_is_named_with_its_size(tmp_path):
    device = tiers.from_gin(False, make_mesh())  # (loop asks every tier but the run's own: `tiers.leftovers`)
    assert tiers.leftovers(str(tmp_path), device) == []
    step = tmp_path / "offload" / f"{STEP_PREFIX}3"  # (the disk tier's step folders, as the tier reads them)
    step.mkdir(parents=True)
    (step / "layer_0").write_bytes(b"\0" * (3 * 2**20))
    (tmp_path / "offload" / "unrelated").mkdir()
    [line] = tiers.leftovers(str(tmp_path), device)
    assert line.startswith(f"{tmp_path / 'offload'} holds 1 step(s) of an earlier disk-tier state (3 MiB)")


SIGNATURE = {"trainer": "reversible", "layers": [["block_0", 2]], "optimizer_state": [[1]], "batch_size": 8,
             "seed": 0}


@pytest.mark.parametrize("key, value, optimizers, what", [
    ("layers", [["block_0", 3]], None, "model (layers or parameter shapes)"),
    ("batch_size", 16, None, "train.batch_size"),
    ("optimizer_state", [[2]], ("@optax.adamw", "@optax.lion"), "optimizer (@optax.adamw; this run's is @optax.lion)"),
    ("optimizer_state", [[2]], ("@optax.adamw", "@optax.adamw"), "optimizer state (@optax.adamw with other settings)"),
], ids=["layers", "batch_size", "two_optimizers", "optimizer_settings"])
def test_a_checkpoint_of_another_run_is_refused_naming_what_differs(key, value, optimizers, what):
    saved = dict(SIGNATURE, **{key: value})
    loop._check_resumable(SIGNATURE, dict(SIGNATURE), 5, "/w")  # the same: resumes
    with pytest.raises(ConfigError) as e:
        loop._check_resumable(saved, SIGNATURE, 5, "/w", optimizers)
    assert str(e.value) == (f"the checkpoint at step 5 in /w was made with a different {what}; resume with the "
                            "same config or start a new --workdir")


def test_a_new_optimizer_names_the_settings_it_brings_other_values_of():
    before = {"train.optimizer": "@optax.adamw", "adamw.weight_decay": "0.01", "adamw.b1": "0.9"}
    after = {"train.optimizer": "@optax.nadamw", "nadamw.weight_decay": "0.0001", "nadamw.b1": "0.9"}
    assert loop._optimizer_defaults_note(before, after) == (
        "the optimizer changed (@optax.adamw -> @optax.nadamw) and trains on with its own values of "
        "@optax.adamw's settings: weight_decay 0.01 -> 0.0001")
    assert loop._optimizer_defaults_note(before, dict(before)) is None
