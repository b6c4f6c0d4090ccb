"""A TRL-style environment (`environment_factory`), a tiny tool-calling policy, and its warm start.

`Lamps` is written the way TRL's docs write an environment: `reset(**kwargs)` returns the
observation, public methods with type hints and Google-style docstrings are the tools,
and `get_reward()` scores the episode. Two lamps start off; `flip_a()` and `flip_b()`
toggle one each, `look()` changes nothing, and the reward is the fraction of lamps on when
the agent answers. Different tool sequences reach the same state (A then B and B then A
light the room; look, or A then A, leave it as it started), and every tool returns the
full state as text.

The tokenizer is a byte-level BPE trained here on such chats, with Qwen2.5's chat template
taken from the installed TRL (`trl/chat_templates/qwen2_5.jinja`, the template TRL
recognises to parse tool calls; SmolLM2's ChatML template renders no tools). The policy
is a 2-layer Qwen2 warm-started by supervised fine-tuning (`sft`) on chats that flip random lamps for
1-3 turns and then answer: it calls tools, and only RL can make it stop at the right time.
Nothing is downloaded.
"""

from __future__ import annotations

import json
import random

from datasets import Dataset

from bipace_trainer.models import bpe_chat_tokenizer, tiny_qwen2

SYSTEM = "Light both lamps, then answer."
PROMPT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Light both lamps. "}]
TOOLS = ("flip_a", "flip_b", "look")


class Lamps:
    """Two lamps, A and B, both off at the start; light both, then answer."""

    def reset(self, **kwargs) -> str | None:
        self.lamps = {"A": False, "B": False}
        return self._state()

    def _state(self) -> str:
        return " ".join(f"Lamp {name} is {'on' if on else 'off'}." for name, on in self.lamps.items())

    def flip_a(self) -> str:
        """
        Flip the switch of lamp A.

        Returns:
            The state of both lamps.
        """
        self.lamps["A"] = not self.lamps["A"]
        return self._state()

    def flip_b(self) -> str:
        """
        Flip the switch of lamp B.

        Returns:
            The state of both lamps.
        """
        self.lamps["B"] = not self.lamps["B"]
        return self._state()

    def look(self) -> str:
        """
        Look at the lamps.

        Returns:
            The state of both lamps.
        """
        return self._state()

    def get_reward(self) -> float:
        return sum(self.lamps.values()) / len(self.lamps)


def qwen2_5_template() -> str:
    """Qwen2.5's chat template as the installed TRL ships it (`trl/chat_templates/qwen2_5.jinja`):
    it renders tools, and TRL's `add_response_schema` recognises it."""
    from trl.chat_template_utils import qwen2_5_chat_template

    return qwen2_5_chat_template


def _call(name: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": {}}) + "\n</tool_call>"


def _lamps_episode(rng: random.Random):
    """A reset `Lamps` and its first prompt, the observation appended (TRL's rule)."""
    env = Lamps()
    chat = [dict(m) for m in PROMPT]
    chat[-1]["content"] += env.reset()
    return env, chat


def demonstration_chats(count: int, seed: int = 0, *, episode=_lamps_episode, tools=TOOLS) -> list[list[dict]]:
    """Chats that call random `tools` for 1-3 turns and then answer "Done."; `episode(rng)` gives
    each chat's reset env and first prompt (default: `Lamps`)."""
    rng = random.Random(seed)
    chats = []
    for _ in range(count):
        env, chat = episode(rng)
        for _ in range(rng.choice([1, 2, 2, 3])):
            name = rng.choice(tools)
            chat.append({"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": name, "arguments": {}}}]})
            chat.append({"role": "tool", "name": name, "content": getattr(env, name)()})
        chat.append({"role": "assistant", "content": "Done."})
        chats.append(chat)
    return chats


def make_tokenizer(*, env_class=Lamps, episode=_lamps_episode, tools=TOOLS):
    """A BPE trained on `demonstration_chats` of `env_class` rendered with its tools, with Qwen2.5's template."""
    methods = [getattr(env_class(), name) for name in tools]
    template = qwen2_5_template()
    probe = bpe_chat_tokenizer(["x"], vocab_size=300)
    probe.chat_template = template
    chats = demonstration_chats(40, episode=episode, tools=tools)
    corpus = [probe.apply_chat_template(chat, tools=methods, tokenize=False) for chat in chats]
    corpus += [_call(name) for name in tools] + ["Done."]
    tokenizer = bpe_chat_tokenizer(corpus, vocab_size=2000)
    tokenizer.chat_template = template
    return tokenizer


def make_model(tokenizer, seed: int = 0):
    return tiny_qwen2(tokenizer, hidden_size=64, layers=2, seed=seed)


def sft(model, tokenizer, pairs, *, max_steps: int, batch_size: int = 8, learning_rate: float = 5e-3, seed: int = 0):
    """Supervised fine-tuning on (prompt text, completion text) pairs, loss on the completion's tokens only.

    What TRL's SFTTrainer does with a prompt-completion dataset (prompt and completion tokenized
    apart and joined, as the policy later sees them when it generates; AdamW without weight decay,
    gradients clipped to norm 1, a constant learning rate, seeded shuffles), in a plain loop: on a
    CPU, SFTTrainer spends most of each step of these 2-layer models in its fused LM-head kernel's
    torch fallback (and in gradient checkpointing, its default), which made these warm starts
    the suite's costliest fixtures. Returns the model, in eval mode.
    """
    import torch

    eos = tokenizer.eos_token_id
    encoded = []
    for prompt, completion in pairs:
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
        if completion_ids[-1:] != [eos]:
            completion_ids.append(eos)
        encoded.append((prompt_ids, completion_ids))
    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    model.train()
    order: list[int] = []
    for _ in range(max_steps):
        if len(order) < batch_size:
            order += rng.sample(range(len(encoded)), len(encoded))
        batch = [encoded[i] for i in order[:batch_size]]
        del order[:batch_size]
        width = max(len(p) + len(c) for p, c in batch)
        input_ids = torch.full((len(batch), width), tokenizer.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (p, c) in enumerate(batch):
            ids = torch.tensor(p + c)
            input_ids[row, : len(ids)] = ids
            labels[row, len(p) : len(ids)] = ids[len(p) :]
            attention_mask[row, : len(ids)] = 1
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    return model


def warm_start(model, tokenizer, max_steps: int = 120, seed: int = 0, *, env_class=Lamps, episode=_lamps_episode, tools=TOOLS):
    """SFT (`sft`) on one sample per assistant turn of `demonstration_chats` (of `env_class`): the prompt as the chat
    template renders it with the tools, the completion the turn's text up to <|im_end|>.

    120 steps, not the 60 that SFTTrainer ran: at 60 the policy garbles about a fifth of its tool
    calls when sampled at temperature 1 (a name like "flip_", broken JSON), at 120 about one in
    seventy, and the step-credit test in test_trl_environment.py wants no failed episode in its
    healthy group (a garbled call fails its episode). It still calls random tools, so it lights
    both lamps only now and then."""
    methods = [getattr(env_class(), name) for name in tools]
    pairs = []
    for chat in demonstration_chats(120, seed=seed, episode=episode, tools=tools):
        for k, message in enumerate(chat):
            if message["role"] != "assistant":
                continue
            prompt = tokenizer.apply_chat_template(chat[:k], tools=methods, tokenize=False, add_generation_prompt=True)
            full = tokenizer.apply_chat_template(chat[: k + 1], tools=methods, tokenize=False)
            completion = full[len(prompt):]
            completion = completion[: completion.index("<|im_end|>") + len("<|im_end|>")]
            pairs.append((prompt, completion))
    return sft(model, tokenizer, pairs, max_steps=max_steps, seed=seed)


def prompt_dataset(rows: int) -> Dataset:
    """TRL's kind of dataset: conversational prompts; the env appends its observation."""
    return Dataset.from_dict({"prompt": [PROMPT] * rows})
