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
is a 2-layer Qwen2 warm-started by TRL's SFTTrainer on chats that flip random lamps for
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


def demonstration_chats(count: int, seed: int = 0) -> list[list[dict]]:
    """Chats that call random tools for 1-3 turns and then answer "Done."."""
    rng = random.Random(seed)
    chats = []
    for _ in range(count):
        env = Lamps()
        chat = [dict(m) for m in PROMPT]
        chat[-1]["content"] += env.reset()
        for _ in range(rng.choice([1, 2, 2, 3])):
            name = rng.choice(TOOLS)
            chat.append({"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": name, "arguments": {}}}]})
            chat.append({"role": "tool", "name": name, "content": getattr(env, name)()})
        chat.append({"role": "assistant", "content": "Done."})
        chats.append(chat)
    return chats


def make_tokenizer():
    tools = [getattr(Lamps(), name) for name in TOOLS]
    template = qwen2_5_template()
    probe = bpe_chat_tokenizer(["x"], vocab_size=300)
    probe.chat_template = template
    corpus = [probe.apply_chat_template(chat, tools=tools, tokenize=False) for chat in demonstration_chats(40)]
    corpus += [_call(name) for name in TOOLS] + ["Done."]
    tokenizer = bpe_chat_tokenizer(corpus, vocab_size=2000)
    tokenizer.chat_template = template
    return tokenizer


def make_model(tokenizer, seed: int = 0):
    return tiny_qwen2(tokenizer, hidden_size=64, layers=2, seed=seed)


def warm_start(model, tokenizer, output_dir: str, max_steps: int = 60, seed: int = 0):
    """SFT on one sample per assistant turn of `demonstration_chats`: the prompt as the chat
    template renders it with the tools, the completion the turn's text up to <|im_end|>."""
    from trl import SFTConfig, SFTTrainer

    tools = [getattr(Lamps(), name) for name in TOOLS]
    rows = []
    for chat in demonstration_chats(120, seed=seed):
        for k, message in enumerate(chat):
            if message["role"] != "assistant":
                continue
            prompt = tokenizer.apply_chat_template(chat[:k], tools=tools, tokenize=False, add_generation_prompt=True)
            full = tokenizer.apply_chat_template(chat[: k + 1], tools=tools, tokenize=False)
            completion = full[len(prompt):]
            completion = completion[: completion.index("<|im_end|>") + len("<|im_end|>")]
            rows.append({"prompt": prompt, "completion": completion})
    args = SFTConfig(
        output_dir=output_dir, max_steps=max_steps, per_device_train_batch_size=8, learning_rate=5e-3,
        logging_steps=20, save_strategy="no", report_to="none", use_cpu=True, seed=seed, lr_scheduler_type="constant",
        disable_tqdm=True,
    )
    SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer).train()
    return model


def prompt_dataset(rows: int) -> Dataset:
    """TRL's kind of dataset: conversational prompts; the env appends its observation."""
    return Dataset.from_dict({"prompt": [PROMPT] * rows})
