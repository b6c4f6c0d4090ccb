"""Shared fixtures: the tiny policy, warm-started once per session (SFT, ~1 minute)."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from bipace_trainer.models import load_tokenizer

from tests.trainer.tiny_setup import make_model, make_tokenizer, warm_start


@pytest.fixture(scope="session")
def warm_policy_dir(tmp_path_factory):
    """Directory of the tiny model after a format warm start on random-move demonstrations."""
    root = tmp_path_factory.mktemp("warm_policy")
    tokenizer = make_tokenizer()
    model = warm_start(make_model(tokenizer), tokenizer, str(root / "sft"))
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    return root / "model"


@pytest.fixture(scope="session")
def raw_tiny_dir(tmp_path_factory):
    """Directory of the tiny model as initialised: it never writes the reply format."""
    root = tmp_path_factory.mktemp("raw_tiny")
    tokenizer = make_tokenizer()
    make_model(tokenizer).save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


@pytest.fixture
def warm_policy(warm_policy_dir):
    """(model, tokenizer), a fresh copy of the warm-started tiny policy."""
    return AutoModelForCausalLM.from_pretrained(warm_policy_dir), load_tokenizer(warm_policy_dir)
