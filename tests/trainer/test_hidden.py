"""The prefill hook captures exactly the hidden state a separate forward pass gives."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from bipace_trainer.rollout.hidden import PrefillCapture, forward_hidden_states, resolve_layer_module
from trl.trainer.utils import pad

from .tiny_setup import make_model, make_tokenizer

PROMPTS = [
    "You are at cell 0. The goal is cell 3.",
    "Nothing happens.",
    "You moved right. You are at cell 2. The goal is cell 1. Your task is to: reach cell 1.",
]


@pytest.fixture(scope="module")
def tiny():
    tokenizer = make_tokenizer()
    model = make_model(tokenizer, layers=3).eval()
    return model, tokenizer


def left_padded(tokenizer, texts):
    ids = [torch.tensor(tokenizer(t)["input_ids"]) for t in texts]
    input_ids = pad(ids, padding_value=tokenizer.pad_token_id, padding_side="left")
    mask = pad([torch.ones_like(i) for i in ids], padding_value=0, padding_side="left")
    return ids, input_ids, mask


@pytest.mark.parametrize("layer", [0, 1, 2, -2, -1])
def test_hook_during_generate_equals_separate_forward(tiny, layer):
    model, tokenizer = tiny
    ids, input_ids, mask = left_padded(tokenizer, PROMPTS)
    with PrefillCapture(model, layer) as capture:
        model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert capture.states.shape == (len(PROMPTS), model.config.hidden_size)
    for row, prompt_ids in enumerate(ids):  # each prompt alone, unpadded
        with torch.no_grad():
            alone = model(input_ids=prompt_ids[None], output_hidden_states=True).hidden_states[layer][0, -1]
        torch.testing.assert_close(capture.states[row], alone, atol=1e-5, rtol=1e-5)
    # the extra-forward-pass variant agrees too
    torch.testing.assert_close(forward_hidden_states(model, input_ids, mask, layer), capture.states, atol=1e-5, rtol=1e-5)


def test_hook_ignores_decode_steps_and_detaches(tiny):
    model, tokenizer = tiny
    _, input_ids, mask = left_padded(tokenizer, PROMPTS[:1])
    with PrefillCapture(model, -1) as capture:
        model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    first = capture.states
    assert not first.requires_grad
    handles = resolve_layer_module(model, -1)._forward_hooks
    assert not handles  # removed on exit


def test_hook_works_through_a_peft_wrapper(tiny):
    model, tokenizer = tiny
    peft_model = get_peft_model(make_model(tokenizer, layers=3), LoraConfig(r=2, target_modules=["q_proj"]))
    _, input_ids, mask = left_padded(tokenizer, PROMPTS)
    with PrefillCapture(peft_model, -2) as capture:
        peft_model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    expected = forward_hidden_states(peft_model, input_ids, mask, -2)
    torch.testing.assert_close(capture.states, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layer", [5, -5, 100])
def test_out_of_range_layer_names_the_field(tiny, layer):
    with pytest.raises(ValueError, match="cluster_layer"):
        resolve_layer_module(tiny[0], layer)
