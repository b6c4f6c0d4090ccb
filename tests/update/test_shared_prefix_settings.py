"""Every setting of TRL's loss that looks across rows gives, with `shared_prefix` on, the loss, the gradients
and every logged metric of the plain path (float32, 1e-5), on our envs' batches and TRL tool episodes.

The shared-prefix update cuts a micro-batch into other pieces than the plain path (rows that share a prefix
together), so anything TRL's loss computes over a piece's rows (the entropy threshold, token-count
normalisers, importance-sampling corrections, logged means) is at risk. Each case runs two updates on the
same micro-batch with the feature on (the first runs the first-use check on the plain pieces, the second
cuts its own: asserted) and off, and compares them update by update."""

from __future__ import annotations

import contextlib
import random
from types import SimpleNamespace

import pytest
import torch

from bipace_trainer import BiPACETrainer
from bipace_trainer.update.batching import padded_tensors, reference_logps
from bipace_trainer.rollout.vllm_backend import importance_sampling_ratio
from bipace_trainer.run.demonstrations import collect_demonstrations
from tests.trainer.tiny_setup import HISTORY_LENGTH, TINY_ENV_KWARGS, make_model, make_tokenizer, tiny_args

RTOL, ATOL = 1e-5, 1e-6

# name: (BiPACEConfig overrides, what the update does under it: "regroups" its pieces for packing, packs
# "within plain pieces", or packs "nothing" (`SharedPrefixForward.applies`))
SETTINGS = {
    "dapo": ({}, "regroups"),
    "grpo": ({"loss_type": "grpo"}, "regroups"),
    "bnpo": ({"loss_type": "bnpo"}, "regroups"),
    "dr_grpo": ({"loss_type": "dr_grpo"}, "regroups"),
    "cispo": ({"loss_type": "cispo"}, "regroups"),
    "sapo": ({"loss_type": "sapo"}, "regroups"),
    "luspo": ({"loss_type": "luspo", "importance_sampling_level": "sequence"}, "regroups"),
    "vespo": ({"loss_type": "vespo"}, "regroups"),
    "sequence_ratio": ({"importance_sampling_level": "sequence"}, "regroups"),
    "kl": ({"beta": 0.04}, "regroups"),
    "kl_bias_corrected": ({"beta": 0.04, "use_bias_correction_kl": True}, "regroups"),
    "off_policy_mask": ({"off_policy_mask_threshold": 0.02}, "regroups"),
    "two_sided_clip": ({"delta": 1.1}, "regroups"),
    "vllm_importance_sampling": ({}, "regroups"),  # TRL's correction by the rows' `importance_sampling_ratio`
    "top_entropy_quantile": ({"top_entropy_quantile": 0.2}, "nothing"),
    "entropy_bonus": ({"entropy_coef": 0.05}, "within plain pieces"),
    "adaptive_entropy": ({"use_adaptive_entropy": True, "entropy_coef": 0.01, "entropy_target": 5.0},
                         "within plain pieces"),
}
# Fields of TRL's loss that this matrix leaves at their defaults: per-token or per-row, and covered above
# through the loss they feed (epsilon, epsilon_high, sapo temperatures, vespo's k and lambda).

_TOKENIZERS: dict = {}


def tokenizer(batch: str):
    """The tiny env's tokenizer, or the TRL tool env's (Qwen2.5's chat template, which renders tools)."""
    if batch not in _TOKENIZERS:
        from tests.trainer import tool_setup

        _TOKENIZERS[batch] = make_tokenizer() if batch == "tiny_env" else tool_setup.make_tokenizer()
    return _TOKENIZERS[batch]


def env_steps() -> list[SimpleNamespace]:
    """Our env's rows: two task groups of the tiny env, 3 episodes each, history in the prompt."""
    rows = collect_demonstrations("tiny", [0, 1], env_kwargs=TINY_ENV_KWARGS, expert_prob=0.5, episodes_per_task=3,
                                  max_turns=4, history_length=HISTORY_LENGTH, seed=0)
    tok = tokenizer("tiny_env")
    prompt = lambda messages: tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)  # noqa: E731
    return [SimpleNamespace(prompt_ids=tok.encode(prompt(r["prompt"]), add_special_tokens=False),
                            completion_ids=tok.encode(r["completion"][0]["content"])[:12] + [tok.eos_token_id])
            for r in rows]


def tool_steps() -> list[SimpleNamespace]:
    """TRL tool episodes (`tests/trainer/tool_setup.py`'s Lamps env, rendered with its tools by TRL's Qwen2.5
    template): one row per assistant turn, its prompt the chat so far (earlier calls and the tools' answers),
    its completion that turn's tokens, so that each turn's prompt holds the turn before."""
    from tests.trainer import tool_setup

    tok, tools = tokenizer("tool_env"), [getattr(tool_setup.Lamps(), name) for name in tool_setup.TOOLS]
    render = lambda chat, more: tok.encode(  # noqa: E731
        tok.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=more), add_special_tokens=False)
    steps = []
    for chat in tool_setup.demonstration_chats(6, seed=3):
        for turn in (i for i, message in enumerate(chat) if message["role"] == "assistant"):
            prompt, whole = render(chat[:turn], True), render(chat[: turn + 1], False)
            assert whole[: len(prompt)] == prompt
            steps.append(SimpleNamespace(prompt_ids=prompt, completion_ids=whole[len(prompt):]))
    return steps


BATCHES = {"tiny_env": env_steps, "tool_env": tool_steps}
_STEPS: dict = {}


def make_trainer(tmp_path, shared: bool, overrides: dict, batch: str, lora_dropout: float | None = None,
                 attention_dropout: float = 0.0) -> BiPACETrainer:
    from peft import LoraConfig

    args = tiny_args(tmp_path / ("on" if shared else "off"), shared_prefix=shared, per_device_train_batch_size=2,
                     gradient_accumulation_steps=1, **{"beta": 0.0, **overrides})
    # with a KL term (or a `lora_dropout`), LoRA: the reference is the model with its adapter off
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=lora_dropout or 0.0, init_lora_weights=False)
    from tests.trainer import tool_setup

    model = make_model(tokenizer(batch), seed=0) if batch == "tiny_env" else tool_setup.make_model(tokenizer(batch))
    model.config.attention_dropout = attention_dropout
    peft = lora if args.beta or lora_dropout is not None else None
    trainer = BiPACETrainer(model=model, args=args, processing_class=tokenizer(batch), peft_config=peft)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by TRL's training loop
    return trainer


def micro_batch(trainer, steps, setting: str) -> dict:
    """The rows as training lays them out, with old (and reference) log-probs of the current weights moved by
    a fixed amount, so that the ratios clip and the off-policy mask drops rows."""
    steps = list(steps)
    random.Random(1).shuffle(steps)  # TRL shuffles the generation's rows
    prompt_ids, prompt_mask, completion_ids, completion_mask = padded_tensors(trainer.batch_spec, steps, len(steps))
    logps, _ = reference_logps(trainer.batch_spec, prompt_ids, prompt_mask, completion_ids, completion_mask,
                               force_old=True)
    shift = torch.linspace(-0.3, 0.3, completion_ids.numel()).reshape(completion_ids.shape) * completion_mask
    inputs = {
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
        "completion_mask": completion_mask, "advantages": torch.linspace(-1, 1, len(steps)),
        "num_items_in_batch": completion_mask.sum() * 2,  # the generation spans two micro-batches
        **logps, "old_per_token_logps": logps["old_per_token_logps"] + shift,
    }
    if setting in ("vllm_importance_sampling", "vespo"):  # built as TRL builds it: 1 off the completion tokens
        sampling = inputs["old_per_token_logps"] + shift.flip(0) * completion_mask
        inputs["importance_sampling_ratio"] = importance_sampling_ratio(
            inputs["old_per_token_logps"], sampling, completion_mask, mode="token_truncate")
    return inputs


def two_updates(trainer, inputs, setting: str) -> list[tuple[float, dict, dict]]:
    if setting == "vllm_importance_sampling":  # what TRL reads in its loss; a vLLM engine is not needed for it
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    results = []
    for _ in range(2):
        buffer = trainer.metric_buffer("train")
        buffer.clear()
        trainer.model.zero_grad(set_to_none=True)
        with trainer.shared_prefix.scope() if trainer.shared_prefix is not None else contextlib.nullcontext():
            loss = trainer.compute_loss(trainer.model, inputs)
            trainer.accelerator.backward(loss)
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        results.append((float(loss.detach()), grads, {key: list(values) for key, values in buffer.items()}))
    return results


def assert_same_updates(on, off) -> None:
    """Update by update (`two_updates`): the same loss, gradients and logged metrics, to RTOL / ATOL."""
    for (on_loss, on_grads, on_metrics), (off_loss, off_grads, off_metrics) in zip(on, off):
        assert on_loss == pytest.approx(off_loss, rel=RTOL, abs=ATOL)
        assert on_grads.keys() == off_grads.keys() and on_grads
        for name in off_grads:
            torch.testing.assert_close(on_grads[name], off_grads[name], rtol=RTOL, atol=ATOL, msg=name)
        assert on_metrics.keys() == off_metrics.keys() and "entropy" in on_metrics
        for key in off_metrics:
            torch.testing.assert_close(torch.tensor(on_metrics[key]), torch.tensor(off_metrics[key]), rtol=RTOL,
                                       atol=ATOL, equal_nan=True, msg=key)


@pytest.mark.parametrize("batch", [pytest.param("tiny_env"), pytest.param("tool_env", marks=pytest.mark.slow)])
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_every_loss_setting_equals_the_plain_path(tmp_path, setting, batch, caplog):
    overrides, update = SETTINGS[setting]
    steps = _STEPS.get(batch) or _STEPS.setdefault(batch, BATCHES[batch]())
    off_trainer = make_trainer(tmp_path, False, overrides, batch)
    off = two_updates(off_trainer, micro_batch(off_trainer, steps, setting), setting)
    on_trainer = make_trainer(tmp_path, True, overrides, batch)
    with caplog.at_level("WARNING", logger="bipace_trainer.update.shared_prefix"):
        on = two_updates(on_trainer, micro_batch(on_trainer, steps, setting), setting)

    forward = on_trainer.shared_prefix
    # both updates cut their own pieces (the first-use check changes no piece), unless the setting keeps the
    # plain ones or packs nothing (said once)
    assert forward.enabled and forward.stats["regrouped"] == (2 if update == "regroups" else 0)
    assert forward.checked == (forward.stats["packed_forwards"] > 0) == (update != "nothing")
    assert ("packs within the plain path's pieces" in caplog.text) == (update == "within plain pieces")
    assert ("is off for the update's forward" in caplog.text) == (update == "nothing")
    assert_same_updates(on, off)


@pytest.mark.parametrize("dropout", ["lora_dropout", "attention_dropout"])
def test_a_model_that_trains_with_dropout_runs_the_plain_path(tmp_path, dropout, caplog):
    """Under dropout the packed forward would draw one mask for a prefix its rows share, where the plain path
    draws one per row (measured on this batch: gradients 5.8e-3 apart at lora_dropout 0.05), so the feature is
    off, with the reason and the fix logged."""
    kwargs = {"lora_dropout": 0.05} if dropout == "lora_dropout" else {"attention_dropout": 0.1}
    with caplog.at_level("WARNING", logger="bipace_trainer.update.shared_prefix"):
        trainer = make_trainer(tmp_path, True, {}, "tiny_env", **kwargs)
    assert trainer.shared_prefix is None
    said = caplog.text
    assert "shared_prefix is off: the model trains with dropout" in said
    if dropout == "lora_dropout":
        assert "p up to 0.05" in said and "lora_dropout" in said and "set disable_dropout=True" in said
        assert "attention_dropout" not in said
    else:
        assert "attention_dropout=0.1 in the model's config: load it with attention_dropout=0" in said
        assert "dropout module" not in said and "disable_dropout" not in said


def test_disable_dropout_keeps_it_on_and_equal_to_the_plain_path(tmp_path, caplog):
    """TRL's `disable_dropout` zeroes LoRA's dropout modules too: the feature stays on and the update is the
    plain path's (two updates, loss, gradients and logged metrics)."""
    steps = _STEPS.get("tiny_env") or _STEPS.setdefault("tiny_env", env_steps())
    trainers = {shared: make_trainer(tmp_path, shared, {"disable_dropout": True}, "tiny_env", lora_dropout=0.05)
                for shared in (False, True)}
    assert trainers[True].shared_prefix is not None and trainers[True].shared_prefix.enabled
    off, on = (two_updates(trainers[shared], micro_batch(trainers[shared], steps, "dapo"), "dapo")
               for shared in (False, True))
    assert trainers[True].shared_prefix.stats["packed_forwards"] > 0
    assert all(any("lora" in name for name in grads) for _, grads, _ in on)
    assert_same_updates(on, off)
