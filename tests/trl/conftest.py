"""The tool-calling tiny policy, warm-started once per run (SFT on tiny-env tool turns)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from bipace_trainer.models import load_tokenizer

from tests.shared_builds import built_once


@pytest.fixture(scope="session")
def tool_policy_dir(tmp_path_factory):
    """Directory of the tiny model after SFT on tool-calling conversations (tests/trl/tool_model.py)."""
    from tests.trl.tool_model import make_tool_tokenizer, warm_start

    def build(root: Path) -> None:
        tokenizer = make_tool_tokenizer()
        model = warm_start(tokenizer)
        model.save_pretrained(root / "model")
        tokenizer.save_pretrained(root / "model")

    return built_once(tmp_path_factory, "tool_policy", build) / "model"


@pytest.fixture
def tool_policy(tool_policy_dir):
    """(model, tokenizer), a fresh copy of the tool-calling tiny policy."""
    return AutoModelForCausalLM.from_pretrained(tool_policy_dir), load_tokenizer(tool_policy_dir)
