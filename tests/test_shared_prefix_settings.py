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
from bipace_trainer.rollout.batching import padded_tensors, reference_logps
from bipace_trainer.run.demonstrations import collect_demonstrations
from tests.trainer.tiny_setup import HISTORY_LENGTH, TINY_ENV_KWARGS, make_model, make_tokenizer, tiny_args

RTOL, ATOL = 1e-5, 1e-6

# name: (BiPACEConfig overrides, whether the update keeps the plain path's pieces for it)
SETTINGS = {
    "dapo": ({}, False),
    "grpo": ({"loss_type": "grpo"}, False),
    "bnpo": ({"loss_type": "bnpo"}, False),
    "dr_grpo": ({"loss_type": "dr_grpo"}, False),
    "cispo": ({"loss_type": "cispo"}, False),
    "sapo": ({"loss_type": "sapo"}, False),
    "luspo": ({"loss_type": "luspo", "importance_sampling_level": "sequence"}, False),
    "vespo": ({"loss_type": "vespo"}, False),
    "sequence_ratio": ({"importance_sampling_level": "sequence"}, False),
    "kl": ({"beta": 0.04}, False),
    "kl_bias_corrected": ({"beta": 0.04, "use_bias_correction_kl": True}, False),
    "off_policy_mask": ({"off_policy_mask_threshold": 0.02}, False),
    "two_sided_clip": ({"delta": 1.1}, False),
    "vllm_importance_sampling": ({}, False),  # TRL's correction by the rows' `importance_sampling_ratio`
    "top_entropy_quantile": ({"top_entropy_quantile": 0.2}, True),
    "entropy_bonus": ({"entropy_coef": 0.05}, True),
    "adaptive_entropy": ({"use_adaptive_entropy": True, "entropy_coef": 0.01, "entropy_target": 5.0}, True),
}
# Fields of TRL's loss that this matrix leaves at their defaults: per-token or per-row, and covered above
# through the loss they feed (epsilon, epsilon_high, sapo temperatures, vespo's k and lambda).

_TOKENIZER: dict = {}


def tokenizer():
    return _TOKENIZER.get("tiny") or _TOKENIZER.setdefault("tiny", make_tokenizer())


def chat_ids(messages) -> list[int]:
    text = tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer().encode(text, add_special_tokens=False)


def env_steps() -> list[SimpleNamespace]:
    """Our env's rows: two task groups of the tiny env, 3 episodes each, history in the prompt."""
    rows = collect_demonstrations("tiny", [0, 1], env_kwargs=TINY_ENV_KWARGS, expert_prob=0.5, episodes_per_task=3,
                                  max_turns=4, history_length=HISTORY_LENGTH, seed=0)
    eos = tokenizer().eos_token_id
    return [SimpleNamespace(prompt_ids=chat_ids(r["prompt"]),
                            completion_ids=tokenizer().encode(r["completion"][0]["content"])[:12] + [eos]) for r in rows]


def tool_steps(turns: int = 4, episodes: int = 3) -> list[SimpleNamespace]:
    """TRL tool episodes: each turn's prompt is the one before, its reply (a tool call) and the tool's answer."""
    rng, eos, encode = random.Random(0), tokenizer().eos_token_id, tokenizer().encode
    start = chat_ids([{"role": "system", "content": "You can call add(a, b)."},
                      {"role": "user", "content": "Add 3, 14 and 15 one call at a time."}])
    steps = []
    for _ in range(episodes):
        prompt, total = start, 0
        for _ in range(turns):
            a, b = total, rng.randrange(1, 20)
            reply = encode(f"<tool_call>add({a}, {b})</tool_call>") + [eos]
            steps.append(SimpleNamespace(prompt_ids=prompt, completion_ids=reply))
            total = a + b
            prompt = prompt + reply + encode(f"\n<|im_start|>user\n{total}<|im_end|>\n<|im_start|>assistant\n")
    return steps


BATCHES = {"tiny_env": env_steps, "tool_episodes": tool_steps}
_STEPS: dict = {}


def make_trainer(tmp_path, shared: bool, overrides: dict) -> BiPACETrainer:
    from peft import LoraConfig

    args = tiny_args(tmp_path / ("on" if shared else "off"), shared_prefix=shared, per_device_train_batch_size=2,
                     gradient_accumulation_steps=1, **{"beta": 0.0, **overrides})
    # with a KL term, LoRA: the reference is the model with its adapter off (no second model to load)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)
    trainer = BiPACETrainer(model=make_model(tokenizer(), seed=0), args=args, processing_class=tokenizer(),
                            peft_config=lora if args.beta else None)
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
    if setting in ("vllm_importance_sampling", "vespo"):
        inputs["importance_sampling_ratio"] = 1.0 + shift.flip(0)
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


@pytest.mark.parametrize("batch", [pytest.param("tiny_env"), pytest.param("tool_episodes", marks=pytest.mark.slow)])
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_every_loss_setting_equals_the_plain_path(tmp_path, setting, batch, caplog):
    overrides, keeps_plain_pieces = SETTINGS[setting]
    steps = _STEPS.get(batch) or _STEPS.setdefault(batch, BATCHES[batch]())
    off_trainer = make_trainer(tmp_path, False, overrides)
    off = two_updates(off_trainer, micro_batch(off_trainer, steps, setting), setting)
    on_trainer = make_trainer(tmp_path, True, overrides)
    with caplog.at_level("WARNING", logger="bipace_trainer.shared_prefix"):
        on = two_updates(on_trainer, micro_batch(on_trainer, steps, setting), setting)

    forward = on_trainer.shared_prefix
    assert forward.enabled and forward.checked and forward.stats["packed_forwards"] > 0
    # the second update cut its own pieces, unless the setting keeps the plain ones (said once)
    assert forward.stats["regrouped"] == (0 if keeps_plain_pieces else 1)
    assert ("packs within the plain path's pieces" in caplog.text) == keeps_plain_pieces
    for (on_loss, on_grads, on_metrics), (off_loss, off_grads, off_metrics) in zip(on, off):
        assert on_loss == pytest.approx(off_loss, rel=RTOL, abs=ATOL)
        assert on_grads.keys() == off_grads.keys() and on_grads
        for name in off_grads:
            torch.testing.assert_close(on_grads[name], off_grads[name], rtol=1e-4, atol=1e-6, msg=name)
        assert on_metrics.keys() == off_metrics.keys() and "entropy" in on_metrics
        for key in off_metrics:
            torch.testing.assert_close(torch.tensor(on_metrics[key]), torch.tensor(off_metrics[key]), rtol=RTOL,
                                       atol=ATOL, equal_nan=True, msg=key)
