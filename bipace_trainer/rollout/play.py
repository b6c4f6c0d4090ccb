"""What every rollout loop shares: the loop's state, the per-episode bookkeeping, prompt counts, timed calls.

    state = LoopState(envs, generate, settings, sync, adapter, play, counter, seconds, clock, on_turn, env_runner)
    generate_calls = lockstep(state)          # or continuous(state), continuous_stream(state)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from envs.base import MILESTONE_FLAG

from .adapters import EnvAdapter, is_failure
from .types import Generation, RolloutSettings, StepRecord

__all__ = ["LoopState", "Play", "PromptCounter", "call_generate", "timed_generate"]


class PromptCounter:
    """Prompt tokens sent to the engine, and how many of them it could have skipped.

    - prompt_tokens: every prompt token of every generate call (what HF `generate` prefills);
    - prompt_tokens_shared: tokens of prompts identical to an earlier prompt of the same call
      (a group's G turn-0 prompts are G copies of one): vLLM's prefix cache encodes them once,
      HF `generate` encodes every copy;
    - prompt_tokens_prefix_of_previous: tokens at the start of a prompt that repeat the same
      episode's previous prompt and reply (the history that only grew): what a KV cache kept
      across turns could skip. Neither HF path here keeps one, so this counts, it does not save.
    """

    def __init__(self):
        self.counts = {"prompt_tokens": 0, "prompt_tokens_shared": 0, "prompt_tokens_prefix_of_previous": 0}
        self.previous: dict[int, list[int]] = {}  # episode -> its last prompt + reply

    def add(self, episodes: Sequence[int], generation: Generation) -> None:
        """One generate call: its prompts, then their replies."""
        self.add_prompts(episodes, generation.prompt_ids)
        self.add_replies(episodes, generation.prompt_ids, generation.completion_ids)

    def add_replies(self, episodes: Sequence[int], prompt_ids: Sequence[list[int]], completion_ids: Sequence[list[int]]) -> None:
        """What each episode's next prompt may repeat: this prompt and its reply."""
        for i, prompt, completion in zip(episodes, prompt_ids, completion_ids):
            self.previous[i] = list(prompt) + list(completion)

    def add_prompts(self, episodes: Sequence[int], prompt_ids: Sequence[list[int]]) -> None:
        """Prompts sent together (one generate call, or one round of submissions to a stream)."""
        seen: set[tuple[int, ...]] = set()
        for i, prompt in zip(episodes, prompt_ids):
            key = tuple(prompt)
            self.counts["prompt_tokens"] += len(prompt)
            if key in seen:
                self.counts["prompt_tokens_shared"] += len(prompt)
            seen.add(key)
            before = self.previous.get(i)
            if before is not None:
                common = 0
                for a, b in zip(before, prompt):
                    if a != b:
                        break
                    common += 1
                self.counts["prompt_tokens_prefix_of_previous"] += common



class Play:
    """The per-episode bookkeeping both rollout modes share: turning a reply, its action and
    the env's result into a `StepRecord` and updating the `Episode`."""

    def __init__(self, tasks, episodes, current, done):
        self.tasks, self.episodes, self.current, self.done = tasks, episodes, current, done
        self.steps: list[StepRecord] = []

    def record(self, i, turn, result, action, prompt_ids, completion_ids, text, hidden, logprobs) -> None:
        episode = self.episodes[i]
        failed = is_failure(result)
        reward = 0.0 if failed else float(result.reward)
        self.steps.append(
            StepRecord(
                group=self.tasks[i].group,
                traj=episode.traj,
                t=turn,
                prompt_ids=prompt_ids,
                completion_ids=completion_ids,
                reply=text,
                action=action.command if action.command is not None else "",
                valid=action.valid,
                action_key=action.key,
                anchor=self.current[i].anchor,
                observation=self.current[i].observation,
                reward=reward,
                hidden=hidden,
                sampling_logprobs=logprobs,
                milestone=None if failed else (result.info or {}).get(MILESTONE_FLAG),
            )
        )
        episode.length += 1
        episode.reward += reward
        episode.invalid_steps += not action.valid
        if failed:
            self.done[i] = episode.failed = True
            episode.failure = (result.info or {}).get("env_failure", "") if result else "no result"
            episode.final_observation = episode.final_anchor = None  # the fault reached no state: a dead end
            return
        # the state reached so far (the episode's end once it is done); a reply that ends the episode
        # without an env call (`Action.command` None, TRL's envs) leaves the state as it was
        episode.final_observation = result.observation
        episode.final_anchor = result.anchor if action.command is not None else self.current[i].anchor
        episode.won = episode.won or result.won
        if "score" in (result.info or {}):
            episode.score = float(result.info["score"])
        episode.truncated = "truncated" in (result.info or {})
        self.current[i] = result
        self.done[i] = result.done


def call_generate(generate, adapter, messages, environments) -> Generation:
    if adapter.uses_tools:
        return generate(messages, environments=environments)
    return generate(messages)



def timed_generate(generate, adapter, batches, environments, seconds, clock) -> list[Generation]:
    outputs = []
    start = clock()
    for messages, envs_of_batch in zip(batches, environments):
        outputs.append(call_generate(generate, adapter, messages, envs_of_batch))
    hidden_seconds = sum(out.hidden_seconds for out in outputs)
    seconds["generate"] += clock() - start - hidden_seconds
    seconds["hidden"] += hidden_seconds
    return outputs



@dataclass
class LoopState:
    """What a rollout loop plays with (`run_rollouts` builds it; each loop returns its generate calls).

    envs: the `VectorEnv`; generate: a `Generator` or `StreamingGenerator`; settings: `RolloutSettings`;
    sync: cross-rank reductions (`sync.LocalSync` for one process); adapter: the kind of environment;
    play: the per-episode bookkeeping (`Play`); counter: the `PromptCounter`; seconds: the wall times
    being added up; clock: their time source; on_turn: (turn, playing) after each turn, or None;
    env_runner: where continuous env steps run (None: a `continuous.ThreadEnvRunner`)."""

    envs: Any
    generate: Any
    settings: RolloutSettings
    sync: Any
    adapter: EnvAdapter
    play: Play
    counter: PromptCounter
    seconds: dict[str, float]
    clock: Callable[[], float]
    on_turn: Callable[[int, int], None] | None = None
    env_runner: Any = None
