"""A TRL-docs-style environment of our own, a tiny tool-calling policy for it, and its variants that misbehave.

`Thermostat` is written as TRL 1.16's docs write an `environment_factory` class: `reset(**row)`
returns the observation, three public methods with type hints and Google-style docstrings are
the tools (`warmer`, `cooler`, `read`), `get_reward()` scores the episode. The room starts at
18 °C and the row's `target` says where it should be when the agent answers; `warmer` then
`cooler` (or `read`) comes back to a state already seen, so step credit has cells to share.

The policy is the tests' 2-layer Qwen2 with TRL's Qwen2.5 chat template (it renders tools and TRL
parses its calls), a byte-level BPE trained here on such chats, and a short SFT on chats that call
random tools for 1-3 turns and then answer: it calls tools, and only RL could make it stop at the
right temperature, so rewards differ within a group. Nothing is downloaded.
(tests/trl/test_trl_parity.py has its misbehaving variants.)
"""

from __future__ import annotations

import json
import random

from datasets import Dataset

from bipace_trainer.models import bpe_chat_tokenizer, tiny_qwen2
from tests.trainer.tool_setup import qwen2_5_template, sft

SYSTEM = "Set the room to the target temperature, then answer."
TOOLS = ("warmer", "cooler", "read")


class Thermostat:
    """A room at 18 °C; reach the row's target temperature, then answer."""

    def reset(self, target: int = 20, **kwargs) -> str | None:
        self.target, self.degrees = int(target), 18
        return self._state()

    def _state(self) -> str:
        return f"The room is at {self.degrees} degrees."

    def warmer(self) -> str:
        """
        Raise the thermostat by one degree.

        Returns:
            The room's temperature.
        """
        self.degrees += 1
        return self._state()

    def cooler(self) -> str:
        """
        Lower the thermostat by one degree.

        Returns:
            The room's temperature.
        """
        self.degrees -= 1
        return self._state()

    def read(self) -> str:
        """
        Read the room's temperature.

        Returns:
            The room's temperature.
        """
        return self._state()

    def get_reward(self) -> float:
        return 1.0 if self.degrees == self.target else 0.0


def prompt(target: int = 20) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Set the room to {target} degrees. "}]


def prompt_dataset(rows: int, targets=(19, 20)) -> Dataset:
    """TRL's kind of dataset: conversational prompts (the env appends its observation) and a column reset reads."""
    chosen = [targets[i % len(targets)] for i in range(rows)]
    return Dataset.from_dict({"prompt": [prompt(t) for t in chosen], "target": chosen})


def demonstration_chats(count: int, seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)
    chats = []
    for _ in range(count):
        env, target = Thermostat(), rng.choice([19, 20])
        chat = prompt(target)
        chat[-1]["content"] += env.reset(target=target)
        for _ in range(rng.choice([1, 2, 2, 3])):
            name = rng.choice(TOOLS)
            chat.append({"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": name, "arguments": {}}}]})
            chat.append({"role": "tool", "name": name, "content": getattr(env, name)()})
        chat.append({"role": "assistant", "content": "Done."})
        chats.append(chat)
    return chats


def _tools():
    return [getattr(Thermostat(), name) for name in TOOLS]


def make_tokenizer():
    template = qwen2_5_template()
    probe = bpe_chat_tokenizer(["x"], vocab_size=300)
    probe.chat_template = template
    corpus = [probe.apply_chat_template(chat, tools=_tools(), tokenize=False) for chat in demonstration_chats(40)]
    corpus += ["<tool_call>\n" + json.dumps({"name": n, "arguments": {}}) + "\n</tool_call>" for n in TOOLS] + ["Done."]
    tokenizer = bpe_chat_tokenizer(corpus, vocab_size=2000)
    tokenizer.chat_template = template
    return tokenizer


def warm_start(tokenizer, max_steps: int = 120, seed: int = 0):
    """The tiny Qwen2 after SFT on one sample per assistant turn of `demonstration_chats`."""
    pairs = []
    for chat in demonstration_chats(120, seed=seed):
        for k, message in enumerate(chat):
            if message["role"] != "assistant":
                continue
            head = tokenizer.apply_chat_template(chat[:k], tools=_tools(), tokenize=False, add_generation_prompt=True)
            full = tokenizer.apply_chat_template(chat[: k + 1], tools=_tools(), tokenize=False)
            completion = full[len(head):]
            pairs.append((head, completion[: completion.index("<|im_end|>") + len("<|im_end|>")]))
    return sft(tiny_qwen2(tokenizer, hidden_size=64, layers=2, seed=seed), tokenizer, pairs, max_steps=max_steps, seed=seed)
