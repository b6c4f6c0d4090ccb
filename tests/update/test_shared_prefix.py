"""The shared-prefix forward (`bipace_trainer.update.shared_prefix`) gives TRL's plain row-by-row path's
per-token log-probs, entropies, loss and gradients, on every layout a training batch can take, while
forwarding fewer tokens. The reference is TRL's own `_get_per_token_logps_and_entropies`."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
from accelerate import Accelerator
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import Qwen2Config, Qwen2ForCausalLM
from trl import GRPOTrainer
from trl.trainer.utils import add_fused_lm_head

from bipace_trainer.rollout.prompting import fit_prompt_ids
from bipace_trainer.update import packed_attention
from bipace_trainer.update.shared_prefix import group_rows, packed_logps, plan_layout

PAD = 0
VOCAB = 96
RTOL, ATOL = 1e-5, 1e-6


class _TRL:
    """What TRL's `_get_per_token_logps_and_entropies` reads from its trainer: the accelerator's autocast.
    Made at each use: a TrainingArguments built by an earlier test resets accelerate's shared state,
    which an accelerator made at import would then miss."""

    @property
    def accelerator(self) -> Accelerator:
        # built when used, not at import: another test of the same worker may reset accelerate's shared
        # state in between, after which an import-time Accelerator's autocast refuses to run
        return Accelerator(cpu=True)


def tiny_model(attn: str = "sdpa", seed: int = 0, lora: bool = False, checkpointing: bool = False):
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, pad_token_id=PAD, bos_token_id=None, eos_token_id=1,
        tie_word_embeddings=True, attn_implementation=attn,
    )
    model = Qwen2ForCausalLM(config)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))  # as GRPOTrainer does, before PEFT
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
        for name, parameter in model.named_parameters():  # a non-zero adapter, so that it matters
            if "lora_B" in name:
                torch.nn.init.normal_(parameter, std=0.1)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def layout(prompts: list[list[int]], completions: list[list[int]], masked: set[int] = frozenset()):
    """TRL's rows: prompts left-padded, completions right-padded (a row in `masked` keeps its tokens with
    a zero mask, as TRL's `mask_truncated_completions` leaves it); (input_ids, attention_mask, logits_to_keep)."""
    width_p = max(map(len, prompts))
    width_c = max(max(map(len, completions)), 1)
    ids, mask = [], []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids.append([PAD] * (width_p - len(p)) + p + c + [PAD] * (width_c - len(c)))
        on = 0 if i in masked else 1
        mask.append([0] * (width_p - len(p)) + [1] * len(p) + [on] * len(c) + [0] * (width_c - len(c)))
    return torch.tensor(ids), torch.tensor(mask), width_c


def plain(model, input_ids, attention_mask, keep, batch_size=None):
    return GRPOTrainer._get_per_token_logps_and_entropies(
        _TRL(), model, input_ids, attention_mask, keep, batch_size=batch_size, compute_entropy=True
    )[:2]


def shared(model, input_ids, attention_mask, keep, kind="segments"):
    """The packed forward: segment attention (SDPA models; call inside `routed()`, the backward too) or
    eager's additive mask."""
    plan = plan_layout(input_ids, attention_mask, keep)
    logps, entropies = packed_logps(model, plan, kind, torch.float32, True, _TRL().accelerator.autocast)
    return logps, entropies, plan


def _loss(logps, entropies, attention_mask, keep):
    weights = torch.linspace(-1.0, 2.0, logps.numel()).reshape(logps.shape)
    return (logps * weights).sum() + 0.3 * (entropies * attention_mask[:, -keep:]).sum()


def assert_same(model, prompts, completions, masked=frozenset(), kind="segments", fewer=True):
    """Log-probs, entropies and the gradients of a loss over both equal the plain path's."""
    input_ids, attention_mask, keep = layout(prompts, completions, masked)
    model.zero_grad(set_to_none=True)
    expected_lp, expected_ent = plain(model, input_ids, attention_mask, keep)
    _loss(expected_lp, expected_ent, attention_mask, keep).backward()
    expected_grad = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    with packed_attention.routed():  # gradient checkpointing's replay runs in the backward
        got_lp, got_ent, plan = shared(model, input_ids, attention_mask, keep, kind)
        _loss(got_lp, got_ent, attention_mask, keep).backward()
    got_grad = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    torch.testing.assert_close(got_lp, expected_lp, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got_ent, expected_ent, rtol=RTOL, atol=ATOL)
    assert (got_lp == 0).equal(expected_lp == 0)  # zero exactly where the plain path is (padding, masked rows)
    assert got_grad.keys() == expected_grad.keys() and got_grad
    for name in expected_grad:
        torch.testing.assert_close(got_grad[name], expected_grad[name], rtol=RTOL, atol=1e-6, msg=name)
    if fewer:
        assert plan.tokens < int(attention_mask.sum())
    return plan


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2, VOCAB) for _ in range(n)]


def group_rows_of_a_task(rng, rows=6, shared=40):
    """Our envs' rows: one task's instruction and goal, then each step's own history, observation and reply."""
    head = _tokens(rng, shared)
    prompts = [head + _tokens(rng, rng.randrange(3, 15)) for _ in range(rows)]
    completions = [_tokens(rng, rng.randrange(1, 8)) for _ in range(rows)]
    return prompts, completions


def tool_episodes(rng, episodes=3, turns=4):
    """TRL's tool envs: turn k+1's prompt is turn k's prompt, its reply and the tool's answer."""
    system = _tokens(rng, 12)
    prompts, completions = [], []
    for _ in range(episodes):
        prompt = system + _tokens(rng, 2)  # the same task for a group, or another
        for _ in range(turns):
            reply = _tokens(rng, rng.randrange(1, 5))
            prompts.append(prompt)
            completions.append(reply)
            prompt = prompt + reply + _tokens(rng, rng.randrange(1, 4))
    order = list(range(len(prompts)))
    rng.shuffle(order)  # TRL shuffles the generation's rows
    return [prompts[i] for i in order], [completions[i] for i in order]


def test_a_task_groups_rows_forward_their_shared_prompt_once():
    rng = random.Random(0)
    prompts, completions = group_rows_of_a_task(rng)
    plan = assert_same(tiny_model(), prompts, completions)
    assert plan.stats["clusters"] == 1
    assert plan.tokens == 40 + sum(len(p) + len(c) - 40 for p, c in zip(prompts, completions))


def test_two_task_groups_each_share_their_own_task_not_just_the_common_system_text():
    rng = random.Random(10)
    system = _tokens(rng, 8)
    prompts, completions = [], []
    for _ in range(2):
        group = group_rows_of_a_task(rng, rows=4, shared=30)
        prompts += [system + p for p in group[0]]
        completions += group[1]
    plan = assert_same(tiny_model(), prompts, completions)
    assert plan.stats["clusters"] == 2
    assert plan.tokens == 2 * 38 + sum(len(p) + len(c) - 38 for p, c in zip(prompts, completions))


def test_a_tool_env_episode_is_forwarded_as_one_sequence():
    rng = random.Random(1)
    prompts, completions = tool_episodes(rng, episodes=3, turns=4)
    plan = assert_same(tiny_model(), prompts, completions)
    assert plan.stats["leaves"] == 3  # one sequence per episode, each turn's reply scored inside it


def test_equal_first_turns_branch_at_a_scored_token():
    """A group's first turn: the same prompt, different replies: the last prompt token predicts each
    reply's first token, so the packed prefix stops one token short."""
    rng = random.Random(2)
    prompt = _tokens(rng, 20)
    completions = [[5, 6, 7], [8, 6], [5, 9, 9, 9], [5, 6, 7]]  # two equal rows, two sharing their first token
    assert_same(tiny_model(), [prompt] * 4, completions)


def test_rows_sharing_nothing_padding_rows_and_empty_completions():
    rng = random.Random(3)
    prompts = [_tokens(rng, n) for n in (9, 3, 14, 6)] + [[PAD], [PAD]]
    completions = [_tokens(rng, n) for n in (4, 7, 1, 3)] + [[], []]  # batching's padding rows
    plan = assert_same(tiny_model(), prompts, completions, fewer=False)
    assert plan.stats["clusters"] >= 4
    # short clusters share a packed row (and must not see each other) instead of each padded to the longest
    assert plan.input_ids.size(0) < plan.stats["clusters"] and plan.input_ids.size(1) == 14 + 1
    empty_reply = group_rows_of_a_task(rng, rows=3)
    empty_reply[1][1] = []  # a reply with no tokens
    assert_same(tiny_model(), *empty_reply)


def test_short_unrelated_rows_share_a_packed_row_without_seeing_each_other():
    rng = random.Random(11)
    prompts = [[10] + _tokens(rng, 8), [20] + _tokens(rng, 2), [30] + _tokens(rng, 2)]
    completions = [_tokens(rng, 3), _tokens(rng, 2), _tokens(rng, 3)]
    plan = assert_same(tiny_model(), prompts, completions, fewer=False)
    assert plan.stats["clusters"] == 3 and plan.input_ids.shape == (2, 12)  # rows of 5 and 6 tokens side by side


def test_a_truncated_completion_masked_out_scores_nothing():
    rng = random.Random(4)
    prompts, completions = group_rows_of_a_task(rng, rows=4)
    assert_same(tiny_model(), prompts, completions, masked={1, 2})


def test_prompts_cut_in_the_middle_to_fit_the_context():
    rng = random.Random(5)
    prompts, completions = group_rows_of_a_task(rng, rows=4, shared=60)
    marker = [3, 3, 3]
    prompts = [fit_prompt_ids(p, 50, marker) if i % 2 else p for i, p in enumerate(prompts)]
    assert any(marker[0] in p[:60] for p in prompts)
    assert_same(tiny_model(), prompts, completions)


def test_eager_attention_takes_the_additive_mask():
    rng = random.Random(6)
    assert_same(tiny_model(attn="eager"), *group_rows_of_a_task(rng), kind="additive")


@pytest.mark.parametrize("checkpointing", [False, True])
def test_lora_and_gradient_checkpointing(checkpointing):
    rng = random.Random(7)
    model = tiny_model(lora=True, checkpointing=checkpointing)
    prompts, completions = tool_episodes(rng, episodes=2, turns=3)
    more_prompts, more_completions = group_rows_of_a_task(rng, rows=3)
    assert_same(model, prompts + more_prompts, completions + more_completions)
    assert any("lora_" in n and p.grad is not None for n, p in model.named_parameters())


def test_the_plan_maps_each_score_to_its_rows_own_next_token():
    """Exact values on a hand-made case: a chain of two turns and a branch."""
    input_ids, attention_mask, keep = layout([[7, 8, 9], [7, 8, 9, 4, 5, 6], [7, 8, 2]], [[4, 5], [3], [1]])
    plan = plan_layout(input_ids, attention_mask, keep)
    # row 0 (7 8 9 | 4 5) is inside row 1 (7 8 9 4 5 6 | 3); rows 1 and 2 share "7 8", then branch at a prompt token
    assert plan.stats == {"rows": 3, "leaves": 2, "clusters": 1}
    assert plan.input_ids.tolist() == [[7, 8, 2, 1, 9, 4, 5, 6, 3]]
    assert plan.position_ids.tolist() == [[0, 1, 2, 3, 2, 3, 4, 5, 6]]
    assert plan.segment.tolist() == [[0, 0, 1, 1, 2, 2, 2, 2, 2]]
    # "9" predicts 4 and "4" predicts 5 (row 0), "6" predicts 3 (row 1), "2" predicts 1 (row 2)
    assert plan.shift_labels.tolist() == [[-100, -100, 1, -100, 4, 5, -100, 3, -100]]
    flat = plan.index.tolist()
    assert flat[0] == [4, 5] and flat[1][0] == 7 and flat[2][0] == 2
    assert plan.valid.tolist() == [[True, True], [True, False], [True, False]]


def test_old_logprob_pass_chunks_stay_within_the_plain_chunk():
    rng = random.Random(8)
    prompts, completions = tool_episodes(rng, episodes=4, turns=5)
    _, attention_mask, keep = layout(prompts, completions)
    sequences = [p + c for p, c in zip(prompts, completions)]
    budget = 4 * max(map(len, sequences))
    runs = group_rows(sequences, budget)
    assert sorted(r for run in runs for r in run) == list(range(len(sequences)))
    assert len(runs) < len(sequences) / 4  # whole episodes in a forward, not 4 rows
    assert len(group_rows(sequences, budget, count=len(runs) + 3)) == len(runs) + 3  # DDP: as many as the others


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), episodes=st.integers(1, 3), turns=st.integers(1, 4), groups=st.integers(0, 4),
       masked=st.sets(st.integers(0, 12), max_size=2))
def test_any_mix_of_rows_equals_the_plain_path(seed, episodes, turns, groups, masked):
    rng = random.Random(seed)
    prompts, completions = tool_episodes(rng, episodes, turns)
    if groups:
        more = group_rows_of_a_task(rng, rows=groups, shared=rng.randrange(1, 20))
        prompts, completions = prompts + more[0], completions + more[1]
    if rng.random() < 0.3:
        completions[0] = []
    assert_same(_MODEL, prompts, completions, masked=masked, fewer=False)


_MODEL = tiny_model(seed=1)


# ---------------------------------------------------------------------------------------------- in the trainer


def _trainer(tmp_path, shared: bool, model=None, peft_config=None, **overrides):
    from bipace_trainer import BiPACETrainer
    from tests.trainer.tiny_setup import make_model, make_tokenizer, tiny_args

    tokenizer = _TOKENIZER.get("tiny") or _TOKENIZER.setdefault("tiny", make_tokenizer())
    args = tiny_args(tmp_path / ("on" if shared else "off"), shared_prefix=shared, **{"beta": 0.0, **overrides})
    trainer = BiPACETrainer(model=model or make_model(tokenizer), args=args, processing_class=tokenizer,
                            peft_config=peft_config)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps  # set by TRL's training loop
    return trainer


_TOKENIZER: dict = {}


def _micro_batch(seed: int = 9):
    """A micro-batch of a task group's steps and two tool-env episodes, as `batching.training_batch` lays it out."""
    rng = random.Random(seed)
    prompts, completions = group_rows_of_a_task(rng, rows=5, shared=30)
    more = tool_episodes(rng, episodes=2, turns=4)
    prompts, completions = prompts + more[0] + [[PAD]], completions + more[1] + [[]]  # and one padding row
    input_ids, attention_mask, keep = layout(prompts, completions, masked={2})
    return {
        "prompt_ids": input_ids[:, :-keep], "prompt_mask": attention_mask[:, :-keep],
        "completion_ids": input_ids[:, -keep:], "completion_mask": attention_mask[:, -keep:],
        "old_per_token_logps": None, "advantages": torch.linspace(-1, 1, len(prompts)),
        "num_items_in_batch": attention_mask[:, -keep:].sum(),
    }


def _step(trainer, inputs):
    """One micro-batch's loss and backward, as `training_step` runs them inside `train` (its scope)."""
    model = trainer.model
    model.zero_grad(set_to_none=True)
    with trainer.shared_prefix.scope() if trainer.shared_prefix is not None else contextlib.nullcontext():
        loss = trainer.compute_loss(model, inputs)
        trainer.accelerator.backward(loss)
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo"])
def test_the_trainers_loss_and_gradient_equal_the_plain_paths(tmp_path, loss_type):
    inputs = _micro_batch()
    off_loss, off_grad = _step(_trainer(tmp_path, False, loss_type=loss_type, per_device_train_batch_size=4), inputs)
    trainer = _trainer(tmp_path, True, loss_type=loss_type, per_device_train_batch_size=4)
    on_loss, on_grad = _step(trainer, inputs)
    assert trainer.shared_prefix.enabled and trainer.shared_prefix.checked
    stats = trainer.shared_prefix.stats
    assert stats["tokens_shared"] < 0.75 * stats["tokens_plain"]
    assert on_loss == pytest.approx(off_loss, rel=1e-5, abs=1e-7)
    assert on_grad.keys() == off_grad.keys() and on_grad
    for name in off_grad:
        torch.testing.assert_close(on_grad[name], off_grad[name], rtol=1e-5, atol=1e-6, msg=name)


def test_the_old_and_reference_passes_chunk_by_batch_size(tmp_path):
    """The old-logprob pass and the reference pass (LoRA: the adapter disabled) give the plain values."""
    from peft import LoraConfig

    from bipace_trainer.update.batching import reference_logps

    inputs = _micro_batch()
    values = []
    for shared in (True, False):
        lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)
        trainer = _trainer(tmp_path, shared, beta=0.04, per_device_train_batch_size=2, peft_config=lora)
        with trainer.shared_prefix.scope() if shared else contextlib.nullcontext():
            out, _ = reference_logps(trainer.batch_spec, inputs["prompt_ids"], inputs["prompt_mask"],
                                     inputs["completion_ids"], inputs["completion_mask"], force_old=True)
        values.append(out)
        assert not shared or trainer.shared_prefix.stats["packed_forwards"] >= 2  # the old and the reference pass
    assert values[0].keys() == values[1].keys() == {"old_per_token_logps", "ref_per_token_logps"}
    for key in values[1]:
        torch.testing.assert_close(values[0][key], values[1][key], rtol=RTOL, atol=ATOL)


def _causal_only(module, query, key, value, attention_mask, **kwargs):
    """Attention that ignores any mask but the causal one (as a kernel without custom masks would)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)


def test_a_model_whose_attention_ignores_the_mask_falls_back_to_the_plain_path(tmp_path, caplog):
    from transformers import AttentionInterface

    from bipace_trainer.update.shared_prefix import ModelShape, SharedPrefixForward
    from tests.trainer.tiny_setup import make_model, make_tokenizer

    AttentionInterface.register("causal_only", _causal_only)
    tokenizer = _TOKENIZER.get("tiny") or _TOKENIZER.setdefault("tiny", make_tokenizer())
    model = make_model(tokenizer)
    model.config._attn_implementation = "causal_only"
    inputs = _micro_batch()
    with caplog.at_level("WARNING", logger="bipace_trainer.update.shared_prefix"):
        trainer = _trainer(tmp_path, True, model=model, per_device_train_batch_size=4)
    assert trainer.shared_prefix is None and "takes no custom mask" in caplog.text  # off, said once
    off_loss, off_grad = _step(trainer, inputs)

    trainer.shared_prefix = SharedPrefixForward(trainer, "additive", ModelShape.of(model))  # as if it were eager
    caplog.clear()
    with caplog.at_level("WARNING", logger="bipace_trainer.update.shared_prefix"):
        _step(trainer, inputs)
    assert not trainer.shared_prefix.enabled and "differ from the plain path's" in caplog.text
    # from then on the plain path, pieces included (this attention also reads the padding: the same pieces matter)
    loss, grad = _step(trainer, inputs)
    assert loss == pytest.approx(off_loss, rel=1e-6)
    for name in off_grad:
        torch.testing.assert_close(grad[name], off_grad[name], rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------- the cost model


def test_a_models_shape_counts_what_a_token_passes_through():
    from bipace_trainer.update.shared_prefix import ModelShape

    model = tiny_model()  # hidden 32, 2 layers, 4 heads of 8, intermediate 64, float32
    shape = ModelShape.of(model)
    layers = sum(p.numel() for p in model.model.layers.parameters()) + model.model.norm.weight.numel()
    assert shape.token_flops == 2 * layers  # the (tied) embedding and LM head are not per-token matmuls here
    assert shape.pair_flops == 4 * 4 * 8 * 2
    assert shape.token_bytes == 4 * 2 * (4 * 32 + 3 * 64) and shape.heads == 4


def test_the_plain_paths_cost_on_a_hand_made_case():
    from bipace_trainer.update.shared_prefix import Cost, plain_cost

    # two rows of 3 and 5 real tokens, padded to 5, forwarded together: a padding mask, the whole squares
    assert plain_cost([3, 5], 5, 2, "segments", heads=4) == Cost(10, 2 * 25, 10, 2 * 25)
    assert plain_cost([5, 5], 5, 2, "segments", heads=4) == Cost(10, 2 * 15, 10, 0)  # no padding: fused causal
    # eager: every row's full square of scores (and their softmax), per head, and the additive mask
    assert plain_cost([3, 5], 5, 1, "additive", heads=4) == Cost(10, 50, 5, 25 * (4 + 8 * 4))


def test_packing_is_chosen_where_it_saves_and_refused_where_it_would_lose():
    from bipace_trainer.update.shared_prefix import ModelShape, packed_cost, plain_cost, plan_rows, worth_packing

    shape = ModelShape(token_flops=1000.0, pair_flops=10.0, token_bytes=10_000.0, heads=2)

    def decide(sequences, prompt_lengths, attention):
        plan = plan_rows(sequences, prompt_lengths, 4, "cpu")
        width = max(prompt_lengths) + max(len(s) - p for s, p in zip(sequences, prompt_lengths))
        plain = plain_cost([len(s) for s in sequences], width, len(sequences), attention, shape.heads)
        return worth_packing(packed_cost(plan, attention, shape.heads), plain, shape)

    rng = random.Random(12)
    task = _tokens(rng, 300)
    group = [task + _tokens(rng, 20) + _tokens(rng, 4) for _ in range(4)]  # a long shared task prompt
    assert decide(group, [320] * 4, "segments") and decide(group, [320] * 4, "additive")
    strangers = [_tokens(rng, 40) for _ in range(4)]  # nothing shared: packing saves nothing
    assert not decide(strangers, [36] * 4, "segments")
    # a short shared text before long rows of their own, all of one length: 7 % fewer tokens, but the suffix
    # batch computes each suffix's whole rectangle where the unpadded plain rows take SDPA's causal kernel
    apart = [task[:30] + _tokens(rng, 400) for _ in range(4)]
    assert not decide(apart, [426] * 4, "segments") and not decide(apart, [426] * 4, "additive")
    # a shared task and replies of their own: segment attention forwards the rows' own pairs, while eager's
    # packed row of 300 + 4 × 200 tokens would compute (and hold) its whole square
    replies = [task + _tokens(rng, 200) for _ in range(4)]
    assert decide(replies, [304] * 4, "segments") and not decide(replies, [304] * 4, "additive")


def test_the_first_use_check_forwards_no_more_rows_than_a_plain_forward(tmp_path, monkeypatch):
    """The check runs TRL's plain forward without gradients on the rows of the first packed forward: at most
    `per_device_train_batch_size` of them, within the plain path's own memory."""
    seen = []
    original = GRPOTrainer._get_per_token_logps_and_entropies

    def spy(self, model, input_ids, *args, **kwargs):
        seen.append((self.accelerator.unwrap_model(model).training, input_ids.size(0)))
        return original(self, model, input_ids, *args, **kwargs)

    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", spy)
    trainer = _trainer(tmp_path, True, per_device_train_batch_size=2)
    inputs = _micro_batch()
    assert inputs["prompt_ids"].size(0) > 6
    _step(trainer, inputs)
    assert trainer.shared_prefix.checked and trainer.shared_prefix.enabled
    checks = [rows for training, rows in seen if not training]
    assert checks and max(checks) <= 2


def test_pieces_are_cut_for_packing_only_where_the_packed_forward_will_run(tmp_path):
    """A piece cut in token order holds more rows than a plain piece, so it must be packed: outside the
    forward's scope (SDPA attention not routed) the update keeps the plain pieces."""
    from bipace_trainer.update.micro_batches import length_order

    trainer = _trainer(tmp_path, True, per_device_train_batch_size=2)
    inputs = _micro_batch()
    forward, plain = trainer.shared_prefix, length_order(inputs, 2)
    assert forward.pieces(inputs, plain) is None  # outside `scope()`
    with forward.scope():
        before_check = forward.pieces(inputs, plain)
    _step(trainer, inputs)
    assert forward.checked and forward.pieces(inputs, plain) is None  # outside `scope()`
    with forward.scope():
        runs = forward.pieces(inputs, plain)
    assert runs is not None and len(runs) < len(plain) and sorted(r for run in runs for r in run) == list(range(14))
    # the same pieces before the first-use check as after: a resumed run cuts what the run it continues cut
    assert before_check == runs


def test_the_estimate_is_what_the_update_forwards(tmp_path):
    """`estimate` (the bench's `--plan-only`) forwards nothing and reports what the update then forwarded: the
    packed side's tokens and FLOPs are the forward's own counters, the plain side's are TRL's pieces'."""
    from bipace_trainer.update.micro_batches import length_order, take_rows

    trainer = _trainer(tmp_path, True, per_device_train_batch_size=2)
    inputs, forward = _micro_batch(), trainer.shared_prefix
    _step(trainer, inputs)  # the first update, with the first-use check
    plain = length_order(inputs, 2)
    with forward.scope():
        runs = forward.pieces(inputs, plain)
        estimated = forward.estimate(take_rows(inputs, runs), packed=True)
        before = dict(forward.stats)
        _step(trainer, inputs)
    assert runs is not None and estimated["tokens"] == forward.stats["tokens_shared"] - before["tokens_shared"]
    assert estimated["flops"] == pytest.approx(forward.stats["flops_shared"] - before["flops_shared"])
    baseline = forward.estimate(take_rows(inputs, plain), packed=False)
    assert baseline["tokens"] == sum(p["prompt_ids"].numel() + p["completion_ids"].numel()
                                     for p in take_rows(inputs, plain))
    assert estimated["flops"] < 0.75 * baseline["flops"] and estimated["memory"] <= 1.05 * baseline["memory"]
