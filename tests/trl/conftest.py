"""The tool-calling tiny policy, warm-started once per session (SFT on tiny-env tool turns)."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from bipace_trainer.models import load_tokenizer


@pytest.fixture(scope="session")
def tool_policy_dir(tmp_path_factory):
    """Directory of the tiny model after SFT on tool-calling conversations (tests/trl/tool_model.py)."""
    from tests.trl.tool_model import make_tool_tokenizer, warm_start

    root = tmp_path_factory.mktemp("tool_policy")
    tokenizer = make_tool_tokenizer()
    model = warm_start(tokenizer)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    return root / "model"


@pytest.fixture
def tool_policy(tool_policy_dir):
    """(model, tokenizer), a fresh copy of the tool-calling tiny policy."""
    return AutoModelForCausalLM.from_pretrained(tool_policy_dir), load_tokenizer(tool_policy_dir)
