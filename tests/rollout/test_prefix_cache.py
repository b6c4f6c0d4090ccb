"""HF generation with prefix reuse gives what plain `generate` gives, computing fewer prompt tokens.

The reference is the plain left-padded `generate` TRL's HF path runs, in float32 and greedy, on
a tiny Qwen2 whose weights are scaled up so greedy choices are far from ties.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from bipace_trainer.rollout.hidden import PrefillCapture
from bipace_trainer.rollout.prefix_cache import PrefixReuse, PrefixStore, supports_prefix_reuse

VOCAB, PAD, EOS = 97, 0, 1


def tiny_model(seed: int = 0, **config) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    values = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None,
        initializer_range=0.3,  # peaked logits: greedy choices are not near-ties
    )
    values.update(config)
    return Qwen2ForCausalLM(Qwen2Config(**values)).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def config(max_new_tokens: int = 6, eos=(EOS,)) -> GenerationConfig:
    return GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=PAD, eos_token_id=list(eos),
        output_scores=True, return_dict_in_generate=True,
    )


def cut_after_eos(completion: torch.Tensor, eos) -> list[list[int]]:
    """TRL's `_generate_single_turn` cut, written out."""
    is_eos = torch.isin(completion, torch.tensor(list(eos)))
    eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long)
    eos_idx[is_eos.any(dim=1)] = is_eos.int().argmax(dim=1)[is_eos.any(dim=1)]
    keep = torch.arange(is_eos.size(1)).expand(is_eos.size(0), -1) <= eos_idx.unsqueeze(1)
    return [c[m].tolist() for c, m in zip(completion, keep)]


def plain_generate(model, prompts, generation_config, layer=None):
    """No cache passed in: left padding, every prompt token prefilled (TRL's HF path)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    capture = PrefillCapture(model, layer) if layer is not None else None
    if capture:
        capture.__enter__()
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=generation_config)
    finally:
        if capture:
            capture.__exit__(None, None, None)
    return cut_after_eos(out.sequences[:, width:], generation_config.eos_token_id), out.scores[0], capture


def reuse_generate(reuse, model, prompts, generation_config, layer=None):
    prepared = reuse.prepare(model, prompts, PAD)
    capture = PrefillCapture(model, layer) if layer is not None else None
    if capture:
        capture.__enter__()
    try:
        completions = reuse.generate(model, prepared, generation_config, generation_config.eos_token_id)
    finally:
        if capture:
            capture.__exit__(None, None, None)
    return completions, prepared, capture


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_shared_prefixes_of_different_lengths_give_plain_generates_completions(model):
    system, task = tokens(0, 30), tokens(1, 12)
    prompts = [
        system + task + tokens(2, 3),    # a group's rows: system + task shared, then apart
        system + task + tokens(3, 9),
        system + task,                   # the whole prompt of turn 0, twice
        system + task,
        system + tokens(4, 5),           # shares only the system text
        tokens(5, 11),                   # nothing cached
    ]
    generation_config = config()
    reference, scores, _ = plain_generate(model, prompts, generation_config)
    reuse = PrefixReuse(store_bytes=0)
    completions, prepared, _ = reuse_generate(reuse, model, prompts, generation_config)
    assert completions == reference
    torch.testing.assert_close(prepared.output.scores[0], scores, atol=1e-5, rtol=1e-5)
    assert prepared.cached == [42, 42, 41, 41, 30, 0]
    # one pass over the two maximal shared prefixes (42 tokens; 30 is inside it), then what is left
    total = sum(map(len, prompts))
    assert prepared.encoded == 42 + (total - sum(prepared.cached))
    assert prepared.encoded + prepared.reused == total and prepared.reused > 100
    assert reuse.take_counts() == {"prompt_tokens_encoded": prepared.encoded, "prompt_tokens_reused": prepared.reused}
    assert reuse.take_counts() == {"prompt_tokens_encoded": 0, "prompt_tokens_reused": 0}


def test_nothing_shared_is_plain_left_padded_generate(model):
    prompts = [tokens(10, 4), tokens(11, 13), tokens(12, 1)]
    generation_config = config()
    reference, scores, _ = plain_generate(model, prompts, generation_config)
    reuse = PrefixReuse(store_bytes=0)
    completions, prepared, _ = reuse_generate(reuse, model, prompts, generation_config)
    assert completions == reference
    assert prepared.cache is None and prepared.reused == 0 and prepared.encoded == 18
    torch.testing.assert_close(prepared.output.scores[0], scores, atol=1e-5, rtol=1e-5)


def test_an_empty_call_generates_nothing(model):
    reuse = PrefixReuse()
    prepared = reuse.prepare(model, [], PAD)
    assert reuse.generate(model, prepared, config(), [EOS]) == []
    assert reuse.take_counts() == {"prompt_tokens_encoded": 0, "prompt_tokens_reused": 0}


def test_an_empty_prompt_is_refused(model):
    with pytest.raises(ValueError, match="empty prompt"):
        PrefixReuse().prepare(model, [[3, 4], []], PAD)


def test_completions_are_cut_after_eos_as_trl_does(model):
    prompts = [tokens(20, 9), tokens(20, 9), tokens(21, 9)]
    long = config(max_new_tokens=8, eos=())
    free, _, _ = plain_generate(model, prompts, long)
    eos = (free[0][2], free[2][5])  # stop row 0 after its third token, row 2 after its sixth
    generation_config = config(max_new_tokens=8, eos=eos)
    reference, _, _ = plain_generate(model, prompts, generation_config)
    completions, _, _ = reuse_generate(PrefixReuse(), model, prompts, generation_config)
    assert completions == reference
    assert len(completions[0]) <= 3 and completions[0][-1] in eos


def test_the_next_turn_reuses_the_previous_prompt_and_completion(model):
    """A tool env's next prompt is the previous prompt + completion + the tool's reply."""
    generation_config = config()
    first = [tokens(30, 20), tokens(31, 14)]
    reuse = PrefixReuse()
    done, _, _ = reuse_generate(reuse, model, first, generation_config)
    assert len(reuse.store) == 2
    second = [p + c + tokens(32 + i, 4) for i, (p, c) in enumerate(zip(first, done))]
    reference, scores, _ = plain_generate(model, second, generation_config)
    completions, prepared, _ = reuse_generate(reuse, model, second, generation_config)
    assert completions == reference
    torch.testing.assert_close(prepared.output.scores[0], scores, atol=1e-5, rtol=1e-5)
    # every token but the last generated one (never fed) came from the store
    assert prepared.cached == [len(p) + len(c) - 1 for p, c in zip(first, done)]
    assert prepared.encoded == sum(len(s) for s in second) - sum(prepared.cached)
    assert len(reuse.store) == 2  # each episode's entry replaced by its longer sequence
    reuse.clear()
    assert len(reuse.store) == 0 and reuse.store.nbytes == 0


@pytest.mark.parametrize("layer", [0, 1, -1])
def test_prefill_hidden_states_are_those_without_reuse(model, layer):
    system = tokens(40, 25)
    prompts = [system + tokens(41, 2), system + tokens(42, 7), system, tokens(43, 6)]
    generation_config = config(max_new_tokens=3)
    _, _, plain = plain_generate(model, prompts, generation_config, layer=layer)
    _, prepared, reused = reuse_generate(PrefixReuse(), model, prompts, generation_config, layer=layer)
    assert prepared.reused > 0
    torch.testing.assert_close(reused.states, plain.states, atol=1e-5, rtol=1e-5)


def test_the_store_stays_within_its_bytes_least_recently_used_first():
    kv = lambda n: [(torch.zeros(2, n, 4), torch.zeros(2, n, 4))]  # 64 bytes a token, one layer
    store = PrefixStore(max_bytes=64 * 10)
    store.put([1, 2, 3, 4], kv(4))
    store.put([5, 6, 7, 8], kv(4))
    assert store.match([1, 2, 3, 9])[1] == 3
    store.get(store.match([1, 2])[0])  # used: [5..8] is now the oldest
    store.put([9, 9, 9], kv(3))
    assert store.nbytes <= 640 and [e.ids for e in store.entries.values()] == [[1, 2, 3, 4], [9, 9, 9]]
    store.put(list(range(11)), kv(11))  # larger than the whole store: not kept
    assert len(store) == 2


def test_models_whose_cache_is_not_plain_are_refused():
    assert supports_prefix_reuse(tiny_model()) == ""
    sliding = tiny_model(use_sliding_window=True, sliding_window=8, max_window_layers=0)
    assert "sliding" in supports_prefix_reuse(sliding) or "DynamicSlidingWindowLayer" in supports_prefix_reuse(sliding)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(st.integers(1, 40), min_size=1, max_size=3),                  # shared prefix lengths
    st.lists(st.tuples(st.integers(-1, 2), st.integers(0, 12)), min_size=1, max_size=7),  # (which prefix, own tail)
    st.integers(0, 2**16),
)
def test_random_prompt_sets_sharing_random_prefixes(model, prefix_lengths, rows, seed):
    prefixes = [tokens(seed + k, n) for k, n in enumerate(prefix_lengths)]
    prompts = []
    for r, (which, tail) in enumerate(rows):
        head = prefixes[which % len(prefixes)] if which >= 0 else []
        prompt = head + tokens(seed + 100 + r, tail)
        prompts.append(prompt or [5])
    generation_config = config(max_new_tokens=4)
    reference, scores, _ = plain_generate(model, prompts, generation_config)
    completions, prepared, _ = reuse_generate(PrefixReuse(store_bytes=0, min_shared=1), model, prompts, generation_config)
    assert completions == reference
    torch.testing.assert_close(prepared.output.scores[0], scores, atol=1e-5, rtol=1e-5)
    assert prepared.encoded + prepared.reused == sum(map(len, prompts))
    assert all(0 <= c < len(p) for c, p in zip(prepared.cached, prompts))
