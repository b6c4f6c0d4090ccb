"""Every model kept in the repository is kept whole: a checkpoint folder under docs/results/, studies/ or
warm_starts/ holds its weights, and git does not ignore them.

A study's warm start was once committed without its `model.safetensors` (the `*.safetensors`
rule in .gitignore dropped it silently), leaving a tokenizer and a README that promised a policy
nobody could load. In a clean clone (CI) a weight file that was never committed is missing, so
this test fails there; in a working tree it fails while the file is still ignored.
"""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KEPT = [ROOT / "docs" / "results", ROOT / "studies", ROOT / "warm_starts"]
WEIGHTS = {"config.json": "model.safetensors", "adapter_config.json": "adapter_model.safetensors"}


def checkpoint_folders() -> list[tuple[Path, str]]:
    """(folder, weight file name) for each folder whose config says it is a model or an adapter."""
    found = []
    for top in KEPT:
        for config_name, weights in WEIGHTS.items():
            for config in sorted(top.rglob(config_name)):
                keys = json.loads(config.read_text())
                if "model_type" in keys or "peft_type" in keys:
                    found.append((config.parent, weights))
    return found


def test_the_repository_keeps_checkpoints():
    # the scan itself must see the shipped warm start, or the test below checks nothing
    assert (ROOT / "warm_starts" / "smollm2-135m-textcraft", "adapter_model.safetensors") in checkpoint_folders()


@pytest.mark.parametrize("folder,weights", checkpoint_folders(), ids=lambda x: str(x).replace(str(ROOT) + "/", ""))
def test_checkpoint_has_its_weights(folder, weights):
    path = folder / weights
    assert path.is_file() and path.stat().st_size > 0, (
        f"{path.relative_to(ROOT)} is missing: a kept checkpoint needs its weights committed "
        "(`git add -f`, or a `!` rule in .gitignore as for studies/**/checkpoint/)")
    if shutil.which("git") and (ROOT / ".git").exists():
        ignored = subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=ROOT).returncode == 0
        tracked = subprocess.run(["git", "ls-files", "--error-unmatch", str(path)], cwd=ROOT,
                                 capture_output=True).returncode == 0
        assert tracked or not ignored, (
            f"{path.relative_to(ROOT)} is ignored by .gitignore and not tracked, so it would not be committed; "
            "add a `!` rule for it to .gitignore")
