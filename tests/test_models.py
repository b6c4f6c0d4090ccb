"""A tiny policy saved to disk comes back with the tokenizer it was trained with."""

from __future__ import annotations

from bipace_trainer.models import bpe_chat_tokenizer, load_tokenizer, tiny_qwen2

CORPUS = [
    "craft 4 acacia planks using 1 acacia logs",
    "You are now at step 12 and your current observation is: Got 2 acacia logs",
    "Prior to this step, you have already taken 3 step(s).",
] * 20


def test_saved_tiny_policy_tokenizes_as_trained(tmp_path):
    tokenizer = bpe_chat_tokenizer(CORPUS, vocab_size=400)
    # A model config (model_type qwen2) next to the tokenizer is what made
    # AutoTokenizer swap in Qwen2Tokenizer, which splits every digit off.
    tiny_qwen2(tokenizer, hidden_size=16, layers=1).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)

    loaded = load_tokenizer(tmp_path)

    messages = [{"role": "user", "content": CORPUS[1]}, {"role": "assistant", "content": "<action>get 12 stick</action>"}]
    expected = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert loaded.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"] == expected
    for text in CORPUS[:3]:
        assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert (loaded.eos_token, loaded.pad_token, len(loaded)) == (tokenizer.eos_token, tokenizer.pad_token, len(tokenizer))


def test_tokenizer_saved_alone_loads_as_saved(tmp_path):
    tokenizer = bpe_chat_tokenizer(CORPUS, vocab_size=300)
    tokenizer.save_pretrained(tmp_path)  # no model config next to it
    assert load_tokenizer(tmp_path)("step 12")["input_ids"] == tokenizer("step 12")["input_ids"]
