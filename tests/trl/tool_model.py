"""A tiny offline policy that calls tools through a real chat template, for TRL `environment_factory` tests.

The embedded SmolLM2's ChatML template (and `bipace_trainer.models.CHAT_TEMPLATE`) render no
tools, so `GRPOTrainer` refuses them ("The provided chat template does not support tool
calling"). This tokenizer carries TRL's own copy of Qwen2.5's template
(`trl.chat_template_utils.qwen2_5_chat_template`), which TRL recognises: it renders the tool
schema in the system message, `<tool_call>{json}</tool_call>` turns and `<tool_response>`
results, and `add_response_schema` gives it TRL's parser. Nothing is downloaded: the BPE
tokenizer is trained here on rendered conversations of the tiny env, and the model is a
randomly initialised 2-layer Qwen2 (`bipace_trainer.models.tiny_qwen2`).

`warm_start` fine-tunes it (`tests.trainer.tool_setup.sft`: what TRL's SFTTrainer does with
prompt-completion pairs, in a plain loop several times faster on a CPU) on conversations played
through the same TRL class the tests train: each turn's prompt is the conversation so far
rendered exactly as `GRPOTrainer` renders it (`apply_chat_template(..., tools=[env.act], add_generation_prompt=True)`),
and the completion is one `act` call (the goal's side half of the time, a random admissible
move otherwise) or, after the episode ends, a short reply with no tool call. The policy then
calls `act` with well-formed JSON and wins some episodes, not all: GRPO has signal.
"""

from __future__ import annotations

import random
import re

from trl.chat_template_utils import qwen2_5_chat_template

from bipace_trainer.models import bpe_chat_tokenizer, tiny_qwen2
from envs import as_trl_environment, trl_task_dataset
from tests.trainer.tool_setup import sft

TINY_KWARGS = {"size": 4}
FINAL_REPLY = "Done."


def _render(tokenizer, messages, tools, add_generation_prompt):
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False)


def _choose(text: str, admissible: list[str], rng: random.Random, expert_prob: float) -> str:
    side = re.search(r"to your (left|right)", text)
    if side and rng.random() < expert_prob:
        return side.group(1)
    return rng.choice(admissible)


def tool_conversations(tokenizer, env_class, rows, *, episodes_per_task=4, expert_prob=0.5, max_turns=4, seed=0):
    """(prompt text, completion text) pairs of turns played through `env_class`, rendered by `tokenizer`."""
    rng = random.Random(seed)
    pairs = []
    for row in rows:
        for _ in range(episodes_per_task):
            env = env_class()
            messages = [{"role": "user", "content": row["prompt"][0]["content"] + env.reset(**row)}]
            tools = [env.act]
            text = messages[0]["content"]
            for _turn in range(max_turns):
                if env.done:
                    reply = {"role": "assistant", "content": FINAL_REPLY}
                else:
                    command = _choose(text, env.admissible_actions or ["right"], rng, expert_prob)
                    call = {"type": "function", "function": {"name": "act", "arguments": {"command": command}}}
                    reply = {"role": "assistant", "content": "", "tool_calls": [call]}
                prompt = _render(tokenizer, messages, tools, add_generation_prompt=True)
                full = _render(tokenizer, messages + [reply], tools, add_generation_prompt=False)
                assert full.startswith(prompt), "the chat template is not prefix-preserving"
                pairs.append((prompt, full[len(prompt):].rstrip("\n")))
                messages.append(reply)
                if reply.get("content") == FINAL_REPLY:
                    break
                text = env.act(command)
                messages.append({"role": "tool", "name": "act", "content": text})
    return pairs


def make_tool_tokenizer():
    """A byte-level BPE tokenizer trained on rendered tiny-env tool conversations, with Qwen2.5's template."""
    probe = bpe_chat_tokenizer(["a"], vocab_size=300)
    probe.chat_template = qwen2_5_chat_template
    env_class = as_trl_environment("tiny", **TINY_KWARGS)
    rows = list(trl_task_dataset("tiny", **TINY_KWARGS))
    corpus = [p + c for p, c in tool_conversations(probe, env_class, rows, episodes_per_task=1)]
    tokenizer = bpe_chat_tokenizer(corpus, vocab_size=2000)
    tokenizer.chat_template = qwen2_5_chat_template
    return tokenizer


def warm_start(tokenizer, *, max_steps: int = 80, seed: int = 0, heads: int = 4, kv_heads: int = 2):
    """The tiny Qwen2, SFT-ed on tool-calling turns of the tiny env (module docstring); returns the model.

    `heads=1, kv_heads=1` (head_dim 64) for vLLM, whose CPU attention needs head_dim >= 32."""
    env_class = as_trl_environment("tiny", **TINY_KWARGS)
    rows = list(trl_task_dataset("tiny", **TINY_KWARGS))
    pairs = tool_conversations(tokenizer, env_class, rows, episodes_per_task=6, seed=seed)
    model = tiny_qwen2(tokenizer, hidden_size=64, layers=2, seed=seed, heads=heads, kv_heads=kv_heads)
    return sft(model, tokenizer, pairs, max_steps=max_steps, seed=seed)
