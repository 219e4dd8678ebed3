"""scripts/prepare_python.py: the Python fine-tuning corpus, split by file."""

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

from revtrain.data.byte_lm import split_bounds

REPO = Path(__file__).resolve().parents[1]


def test_python_corpus_holds_out_whole_files(tmp_path):
    """Training files first, held-out files after: disjoint, read from the stdlib, and the 90% boundary of
    ByteLMTask's split falls within a few kilobytes of the end of the training files."""
    out = tmp_path / "py.txt"
    subprocess.run([sys.executable, str(REPO / "scripts" / "prepare_python.py"), str(out), "--max_bytes", "400000"],
                   check=True, capture_output=True)
    manifest = json.loads((tmp_path / "py.txt.json").read_text())
    assert manifest["stdlib"] == sysconfig.get_paths()["stdlib"]
    train, held = set(manifest["train"]), set(manifest["held_out"])
    assert train and held and not train & held
    assert all(p.endswith(".py") and "test" not in Path(p).parts for p in train | held)
    data = out.read_bytes()
    assert len(data) == manifest["train_bytes"] + manifest["held_out_bytes"] <= 400_000
    first_held = (Path(manifest["stdlib"]) / manifest["held_out"][0]).read_bytes()
    assert data[manifest["train_bytes"]:].startswith(first_held)
    start, _ = split_bounds(len(data))["validation"]
    assert abs(start - manifest["train_bytes"]) < 0.02 * len(data)
