"""A simulated engine and simulated envs on a virtual clock, for `run_rollouts` itself.

    clock = SimClock()
    engine = SimEngine(clock, LatencyModel.gpu_hf())
    envs = SimEnvs(clock, num_envs=512, env=EnvModel())
    rollout = run_rollouts(envs, tasks, engine, settings, clock=clock, env_runner=SimEnvRunner(clock))

Nothing here schedules: the lockstep and continuous loops that play the episodes are
`bipace_trainer.rollout.loop`'s own, with the real `TextEnvAdapter` (prompts, reply parsing,
history). Only the costs are modelled, on a virtual clock that generate calls and env
steps advance, so a 512-episode rollout with 2,000-token replies plays in seconds and
gives the same figures on every machine.

- `LatencyModel`: a generate call costs `per_call` + its prompt tokens x `per_prompt_token`
  + for each decode step up to the call's longest reply, `per_step` + `per_token` x the
  sequences still decoding (`engine="hf"`: HF `generate` keeps every sequence of the batch,
  padded, until the longest ends; `engine="vllm"`: a finished sequence frees its slot).
  `per_step` is the fixed cost of a step (reading the weights: large on a GPU, where a
  step costs nearly the same for 1 or 256 sequences), `per_token` the cost per sequence
  (dominant on a CPU, where compute scales with the batch).
- reply lengths: log-normal, clipped to [min_reply, max_reply] (default 50..2,000 tokens),
  drawn per (episode, turn) from the seed, so both modes see the same replies;
- `EnvModel`: each episode lasts a drawn number of turns (then its env says done); each
  env step costs a log-normal time; a `VectorEnv.step` over k envs on `workers` workers
  costs max(longest, sum / workers).
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass

from bipace_trainer.rollout.loop import Generation
from envs.base import StepResult


class SimClock:
    """Virtual seconds. A generate call or a foreground env step advances `now`; an env step
    submitted to `SimEnvRunner` runs in the background: its cost is its own, and the
    caller's clock catches up only when it waits for the result."""

    def __init__(self):
        self.now = 0.0
        self._background: float | None = None

    def __call__(self) -> float:
        return self.now + (self._background or 0.0)

    def charge(self, seconds: float) -> None:
        if self._background is None:
            self.now += seconds
        else:
            self._background += seconds


class SimEnvRunner:
    """`run_rollouts`' env runner on a `SimClock`: a step runs at once but finishes at
    submit time + its cost; `result` waits (advances the clock) until then. Steps do not
    overlap each other (one worker, as `ThreadEnvRunner`)."""

    def __init__(self, clock: SimClock):
        self.clock = clock
        self.free_at = 0.0  # the worker is busy until then

    def submit(self, fn):
        clock = self.clock
        start = max(clock.now, self.free_at)
        clock._background = 0.0
        try:
            value = fn()
            cost = clock._background
        finally:
            clock._background = None
        self.free_at = start + cost
        return value, self.free_at

    def result(self, handle):
        value, done_at = handle
        self.clock.now = max(self.clock.now, done_at)
        return value

    def close(self) -> None:
        pass


def _draw(seed: int, *key) -> random.Random:
    digest = hashlib.sha256(repr((seed, key)).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


@dataclass(frozen=True)
class LatencyModel:
    per_call: float
    per_prompt_token: float
    per_step: float
    per_token: float
    engine: str = "hf"  # "hf" (padded batch to the longest reply) or "vllm" (finished sequences free their slot)

    @classmethod
    def gpu_hf(cls) -> "LatencyModel":
        """A 1.5B model on one GPU, HF generate: ~25 ms a step whatever the batch, 0.05 ms per sequence."""
        return cls(per_call=0.05, per_prompt_token=2e-6, per_step=0.025, per_token=5e-5, engine="hf")

    @classmethod
    def gpu_vllm(cls) -> "LatencyModel":
        """The same model under vLLM: ~12 ms a step, finished sequences leave the batch."""
        return cls(per_call=0.02, per_prompt_token=1e-6, per_step=0.012, per_token=3e-5, engine="vllm")

    @classmethod
    def cpu_hf(cls) -> "LatencyModel":
        """A small model on a 2-core CPU, HF generate: compute grows with the batch."""
        return cls(per_call=0.01, per_prompt_token=5e-5, per_step=0.002, per_token=0.001, engine="hf")

    def cost(self, prompt_tokens: int, reply_lengths: list[int]) -> float:
        if not reply_lengths:
            return self.per_call
        steps = max(reply_lengths)
        if self.engine == "hf":
            slots = steps * len(reply_lengths)
        else:
            slots = sum(reply_lengths)
        return self.per_call + prompt_tokens * self.per_prompt_token + steps * self.per_step + slots * self.per_token


@dataclass(frozen=True)
class ReplyModel:
    median: float = 300.0
    sigma: float = 0.8
    min_reply: int = 50
    max_reply: int = 2000

    def draw(self, rng: random.Random) -> int:
        return int(min(max(rng.lognormvariate(math.log(self.median), self.sigma), self.min_reply), self.max_reply))


class SimEngine:
    """A `Generator`: replies "<action>go</action>" of drawn lengths; the call costs what
    the latency model says. A reply's length is drawn from the seed and the episode and
    turn its prompt names (SimEnvs puts them in the observation), not from call order."""

    def __init__(self, clock: SimClock, latency: LatencyModel, replies: ReplyModel = ReplyModel(), seed: int = 0,
                 prompt_tokens: int = 200):
        self.clock, self.latency, self.replies, self.seed, self.prompt_tokens = clock, latency, replies, seed, prompt_tokens
        self.calls: list[int] = []  # batch size of each call

    def __call__(self, messages, environments=None) -> Generation:
        lengths = [self.replies.draw(_draw(self.seed, "reply", m[-1]["content"])) for m in messages]
        prompts = [[1] * self.prompt_tokens for _ in messages]
        self.clock.charge(self.latency.cost(self.prompt_tokens * len(messages), lengths))
        self.calls.append(len(messages))
        return Generation(prompts, [[2] * n for n in lengths], ["<action>go</action>"] * len(messages))


@dataclass(frozen=True)
class EnvModel:
    step_median: float = 0.02  # seconds
    step_sigma: float = 0.7
    min_turns: int = 2
    max_turns: int = 12
    workers: int = 4


class SimEnvs:
    """A `VectorEnv` stand-in: env i plays task i for a drawn number of turns."""

    def __init__(self, clock: SimClock, num_envs: int, env: EnvModel = EnvModel(), seed: int = 0):
        self.clock, self.num_envs, self.env, self.seed = clock, num_envs, env, seed
        self.turn = [0] * num_envs
        self.length = [0] * num_envs
        self.task = [0] * num_envs

    def _result(self, i: int, done: bool) -> StepResult:
        observation = f"episode {self.task[i]} turn {self.turn[i]}"
        return StepResult(observation=observation, reward=float(done), done=done, won=done, anchor=observation,
                          admissible_actions=["go"], info={"task": f"task {self.task[i]}"})

    def reset(self, task_ids):
        for i, task in enumerate(task_ids):
            self.task[i], self.turn[i] = task, 0
            self.length[i] = _draw(self.seed, "length", task).randint(self.env.min_turns, self.env.max_turns)
        return [self._result(i, False) for i in range(len(task_ids))]

    def step(self, actions):
        results, costs = [], []
        for i, action in enumerate(actions):
            if action is None:
                results.append(None)
                continue
            costs.append(_draw(self.seed, "step", self.task[i], self.turn[i]).lognormvariate(math.log(self.env.step_median), self.env.step_sigma))
            self.turn[i] += 1
            results.append(self._result(i, self.turn[i] >= self.length[i]))
        if costs:
            self.clock.charge(max(max(costs), sum(costs) / self.env.workers))
        return results
