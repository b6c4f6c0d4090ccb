"""A TRL-docs-style environment of our own, a tiny tool-calling policy for it, and its variants that misbehave.

`Thermostat` is written as TRL 1.16's docs write an `environment_factory` class: `reset(**row)`
returns the observation, three public methods with type hints and Google-style docstrings are
the tools (`warmer`, `cooler`, `read`), `get_reward()` scores the episode. The room starts at
18 °C and the row's `target` says where it should be when the agent answers; `warmer` then
`cooler` (or `read`) comes back to a state already seen, so step credit has cells to share.

The policy is the tests' 2-layer Qwen2 with TRL's Qwen2.5 chat template (it renders tools and TRL
parses its calls), a byte-level BPE trained here on such chats, and a short SFT on chats that call
random tools for 1-3 turns and then answer: it calls tools, and only RL could make it stop at the
right temperature, so rewards differ within a group. Nothing is downloaded; the chats, the
tokenizer and the SFT are `tests/trainer/tool_setup.py`'s, played on this env.
"""

from __future__ import annotations

import random

from datasets import Dataset

from bipace_trainer.models import tiny_qwen2
from tests.trainer import tool_setup

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


def _episode(rng: random.Random):
    """A reset `Thermostat` with a random target, and its first prompt (`tool_setup.demonstration_chats`)."""
    env, target = Thermostat(), rng.choice([19, 20])
    chat = prompt(target)
    chat[-1]["content"] += env.reset(target=target)
    return env, chat


def make_tokenizer():
    return tool_setup.make_tokenizer(env_class=Thermostat, episode=_episode, tools=TOOLS)


def warm_start(tokenizer, max_steps: int = 120, seed: int = 0):
    """The tiny Qwen2 after SFT on one sample per assistant turn of Thermostat's demonstration chats."""
    model = tiny_qwen2(tokenizer, hidden_size=64, layers=2, seed=seed)
    return tool_setup.warm_start(model, tokenizer, max_steps, seed, env_class=Thermostat, episode=_episode, tools=TOOLS)
