"""The lockstep rollout: every turn waits for every active episode's reply and every env's step."""

from __future__ import annotations

import math

import torch

from .play import LoopState, timed_generate
from .types import Action

__all__ = ["lockstep"]


def lockstep(state: LoopState) -> int:
    """`run_rollouts`' "lockstep": every turn, every active env's prompt is generated (in calls of at most
    `rollout_batch_size`, as many calls on every rank), then every env steps at once. Returns the calls made."""
    envs, generate, settings, sync, adapter = state.envs, state.generate, state.settings, state.sync, state.adapter
    play, counter, seconds, clock, on_turn = state.play, state.counter, state.seconds, state.clock, state.on_turn
    done, current, n = play.done, play.current, len(play.done)
    generate_calls = 0
    for turn in range(settings.max_turns):
        active = [i for i in range(n) if not done[i]]
        if not sync.any(bool(active)):
            break
        messages = [adapter.messages(i, turn) for i in active]
        environments = [adapter.environment(i) for i in active]
        chunk = settings.rollout_batch_size or max(len(active), 1)
        num_calls = sync.max(math.ceil(len(active) / chunk))
        cuts = [slice(c * chunk, (c + 1) * chunk) for c in range(num_calls)]
        outputs = timed_generate(
            generate, adapter, [messages[cut] for cut in cuts],
            [environments[cut] if adapter.uses_tools else None for cut in cuts], seconds, clock,
        )
        generate_calls += num_calls
        for c, out in enumerate(outputs):
            counter.add(active[cuts[c]], out)
        prompt_ids = [ids for out in outputs for ids in out.prompt_ids]
        completion_ids = [ids for out in outputs for ids in out.completion_ids]
        texts = [text for out in outputs for text in out.texts]
        hidden_rows = [out.hidden for out in outputs if out.hidden is not None and len(out.hidden)]
        hidden = torch.cat(hidden_rows) if hidden_rows else None
        logprobs = [lp for out in outputs for lp in out.logprobs] if all(out.logprobs is not None for out in outputs) else None

        actions: list[Action | None] = [None] * n
        for j, i in enumerate(active):
            actions[i] = adapter.act(i, texts[j], prompt_ids[j], completion_ids[j])
        start = clock()
        results = adapter.step(envs, actions) if active else [None] * n
        seconds["env"] += clock() - start
        seconds["env_wait"] += clock() - start  # lockstep waits out every env step

        for j, i in enumerate(active):
            play.record(
                i, turn, results[i], actions[i], prompt_ids[j], completion_ids[j], texts[j],
                hidden[j] if hidden is not None else None, logprobs[j] if logprobs is not None else None,
            )
        if on_turn is not None:
            on_turn(turn, done.count(False))
    return generate_calls

