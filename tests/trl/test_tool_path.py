"""What the text-env path guarantees holds on TRL's envs too (`environment_factory`, slow).

The policy is the session's tool-calling tiny model (tests/trl/conftest.py), the env our
tiny env as a TRL class (`as_trl_environment`): resampling a generation without signal,
an exact resume from a checkpoint, rollout dumps with TRL's completions table and the
`show` viewer, user `reward_funcs`, and two processes on CPU (DDP with gloo, DeepSpeed
ZeRO-3) with a user reward function and evaluations whose shards differ in size.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from transformers import AutoModelForCausalLM

from bipace_trainer.reports import show
from bipace_trainer.models import load_tokenizer
from envs import as_trl_environment, trl_task_dataset
from tests.trainer.test_distributed import cpu_config
from tests.trainer.test_trl_environment import Recording
from tests.trainer.tiny_setup import StopAfter
from tests.trl.test_bipace_trainer import bipace_args
from tests.trl.tool_model import TINY_KWARGS

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
Tiny = as_trl_environment("tiny", **TINY_KWARGS)


class QuietFirst(Tiny):
    """The tiny env scored by how many resets its class has seen: the first `quiet` score 0
    whatever the model does (no signal), later ones 1 if odd-numbered, else 0 (any 4 in a row differ)."""

    resets = 0
    quiet = 4

    def reset(self, **row):
        type(self).resets += 1
        self.index = type(self).resets
        return super().reset(**row)

    def get_reward(self) -> float:
        return 0.0 if self.index <= self.quiet else float(self.index % 2)


def test_a_generation_without_signal_is_played_again_on_fresh_rows_and_trained(tool_policy, tmp_path):
    model, tokenizer = tool_policy
    QuietFirst.resets = 0
    data = trl_task_dataset("tiny", **TINY_KWARGS)
    args = bipace_args(tmp_path, preset="gigpo", w_ep=1.0, tasks_per_iteration=1, num_generations=4,
                       resample_without_signal=3, max_turns=3)
    trainer = Recording(model=model, processing_class=tokenizer, args=args, train_dataset=data,
                        environment_factory=QuietFirst)
    trainer.recorded = []
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    trainer.close_envs()

    (quiet, _), (replayed, estimate) = trainer.recorded  # the generation, then one redraw
    assert all(e.reward == 0 for e in quiet.episodes) and QuietFirst.resets == 8
    assert (estimate.advantage != 0).any()
    # the redraw is one training row for the group, passed whole to reset (its task_id played)
    assert len({e.task_id for e in replayed.episodes}) == 1 and replayed.episodes[0].task_id in set(data["task_id"])
    assert all(e.task for e in replayed.episodes)
    logs = next(entry for entry in trainer.state.log_history if "train/skipped_batches" in entry)
    assert logs["train/resamples"] == 1.0 and logs["train/skipped_batches"] == 0.0
    played = quiet.episodes + replayed.episodes
    assert logs["episode/success_rate_all_played"] == pytest.approx(sum(e.won for e in played) / 8)
    assert any(not p.detach().equal(before[n]) for n, p in trainer.model.named_parameters())  # the update ran


class TurnCost:
    """A user reward function: -0.01 per message after the prompt. It keeps what it was given."""

    __name__ = "turn_cost"

    def __init__(self):
        self.calls = []

    def __call__(self, prompts, completions, completion_ids, environments=None, task_id=None, **kwargs):
        scores = [-0.01 * len(completion) for completion in completions]
        env_rewards = [env.get_reward() if env is not None else None for env in environments]
        self.calls.append({"scores": scores, "env_rewards": env_rewards, "task_id": list(task_id),
                           "step": kwargs["trainer_state"].global_step})
        kwargs["log_metric"]("turn_cost/messages", sum(len(c) for c in completions) / len(completions))
        return scores


def test_reward_funcs_add_to_get_reward_weighted_on_each_episodes_last_step_and_log_their_metrics(tool_policy, tmp_path):
    model, tokenizer = tool_policy
    cost = TurnCost()
    args = bipace_args(tmp_path, tasks_per_iteration=1, num_generations=4, reward_weights=[2.0])
    trainer = Recording(model=model, processing_class=tokenizer, args=args, environment_factory=Tiny,
                        train_dataset=trl_task_dataset("tiny", **TINY_KWARGS), reward_funcs=cost)
    trainer.recorded = []
    trainer.train()
    trainer.close_envs()
    (rollout, _), = trainer.recorded
    (call,) = cost.calls  # once per generation, over its played episodes, with TRL's columns and state
    played = [e for e in rollout.episodes if not e.failed]
    assert call["task_id"] == [e.task_id for e in played] and call["step"] == 0
    assert len(call["scores"]) == len(played) and all(s < 0 for s in call["scores"])
    for episode, score, env_reward in zip(played, call["scores"], call["env_rewards"]):
        steps = [s for s in rollout.steps if s.traj == episode.traj]
        assert episode.reward == pytest.approx(env_reward + 2.0 * score)  # get_reward has weight 1, as in TRL
        assert [s.reward for s in steps[:-1]] == [0.0] * (len(steps) - 1) and steps[-1].reward == episode.reward
        assert episode.won == (episode.reward > 0)
    # what the function logged through TRL's log_metric is in the step's log, as under GRPOTrainer
    (logged,) = [entry["turn_cost/messages"] for entry in trainer.state.log_history if "turn_cost/messages" in entry]
    assert logged == pytest.approx(-sum(call["scores"]) / 0.01 / len(call["scores"]))


class AsyncTiny(Tiny):
    """The tiny env with an async tool and an async `get_reward`, which TRL accepts ("sync or async")."""

    async def act(self, command: str) -> str:
        await asyncio.sleep(0)
        return super().act(command)

    act.__doc__ = Tiny.act.__doc__  # the tool schema comes from the docstring

    async def get_reward(self) -> float:
        await asyncio.sleep(0)
        return super().get_reward()


def test_async_tools_and_get_reward_play_exactly_as_their_sync_versions(tool_policy_dir, tmp_path):
    runs = []
    for factory in (Tiny, AsyncTiny):
        model, tokenizer = AutoModelForCausalLM.from_pretrained(tool_policy_dir), load_tokenizer(tool_policy_dir)
        args = bipace_args(tmp_path / factory.__name__, tasks_per_iteration=1, num_generations=4)
        trainer = Recording(model=model, processing_class=tokenizer, args=args, environment_factory=factory,
                            train_dataset=trl_task_dataset("tiny", **TINY_KWARGS))
        trainer.recorded = []
        trainer.train()
        trainer.close_envs()
        (rollout, estimate), = trainer.recorded
        runs.append((rollout, estimate))
    (sync, sync_estimate), (asynchronous, async_estimate) = runs
    assert any(step.t > 0 for step in sync.steps)  # the tool was called: its results are observations
    # the awaited results, not coroutine objects, are the observations, anchors and rewards
    assert [s.observation for s in asynchronous.steps] == [s.observation for s in sync.steps]
    assert [s.anchor for s in asynchronous.steps] == [s.anchor for s in sync.steps]
    assert [e.reward for e in asynchronous.episodes] == [e.reward for e in sync.episodes]
    assert torch.equal(async_estimate.advantage, sync_estimate.advantage)


def test_a_reward_function_never_sees_a_failed_episode_so_a_broken_env_cannot_stop_the_run(tool_policy, tmp_path):
    model, tokenizer = tool_policy
    faulty = as_trl_environment("tests.reliability.faulty_envs:FaultyTinyEnv", step_timeout=None)
    seen = []

    def on_task_0(environments, **kwargs):  # reads every instance it is given, as a user's function may
        seen.extend(env.task_id for env in environments)
        return [float(env.task_id == 0 and env.won) for env in environments]

    data = trl_task_dataset("tests.reliability.faulty_envs:FaultyTinyEnv").filter(lambda row: row["task_id"] in (0, 1))
    ids = list(data["task_id"])
    data = data.select([ids.index(0), ids.index(1)])  # no shuffle: the one generation plays task 0's group and task 1's
    args = bipace_args(tmp_path, tasks_per_iteration=2, num_generations=2, per_device_train_batch_size=2)
    trainer = Recording(model=model, processing_class=tokenizer, args=args, environment_factory=faulty,
                        train_dataset=data, reward_funcs=on_task_0)
    trainer.recorded = []
    trainer.train()  # task 1's engine crashes in reset: its episodes fail before any turn
    trainer.close_envs()
    assert trainer.state.global_step == 1
    (rollout, _), = trainer.recorded
    failed = [e for e in rollout.episodes if e.failed]
    assert [e.task_id for e in failed] == [1, 1] and all(e.length == 0 and e.reward == 0 for e in failed)
    assert seen == [e.task_id for e in rollout.episodes if not e.failed] and set(seen) == {0}


def comparable_logs(trainer):
    keys = ("loss", "episode/success_rate", "episode/steps", "advantage/mean", "advantage/std", "env/steps")
    return [{k: e[k] for k in keys if k in e} for e in trainer.state.log_history if "loss" in e]


def test_resume_continues_as_if_uninterrupted_and_dumps_show_the_tool_calls(tool_policy_dir, tmp_path):
    data = trl_task_dataset("tiny", **TINY_KWARGS)

    def make(run_dir):
        args = bipace_args(run_dir, max_steps=2, save_strategy="steps", save_steps=1, rollout_dump_steps=1,
                           log_completions=True, num_completions_to_print=1, tasks_per_iteration=1, num_generations=4)
        return Recording(
            model=AutoModelForCausalLM.from_pretrained(tool_policy_dir), processing_class=load_tokenizer(tool_policy_dir),
            args=args, train_dataset=data, environment_factory=Tiny,
        )

    straight = make(tmp_path / "straight")
    straight.recorded = []
    straight.train()
    straight.close_envs()
    stopped = make(tmp_path / "resumed")
    stopped.recorded = []
    stopped.add_callback(StopAfter(1))
    stopped.train()
    stopped.close_envs()
    resumed = make(tmp_path / "resumed")
    resumed.recorded = []
    resumed.train(resume_from_checkpoint=str(tmp_path / "resumed" / "checkpoint-1"))
    resumed.close_envs()

    assert stopped.state.global_step == 1 and resumed.state.global_step == 2
    assert resumed.estimator.num_calls == straight.estimator.num_calls
    # step 2 plays the same tasks, the same replies, and trains to the same weights
    replies = [[s.completion_ids for s in rollout.steps] for rollout, _ in straight.recorded]
    assert len(replies) == 2 and replies[0] != replies[1]  # step 2 is not step 1 again
    (_, straight_step2), (_, resumed_step2) = straight.recorded[-1], resumed.recorded[-1]
    assert [s.completion_ids for s in resumed.recorded[-1][0].steps] == replies[1]
    assert [e.task_id for e in resumed.recorded[-1][0].episodes] == [e.task_id for e in straight.recorded[-1][0].episodes]
    assert [e["train/skipped_batches"] for e in straight.state.log_history if "loss" in e] == [0.0, 0.0]  # both trained
    assert comparable_logs(resumed)[-1] == comparable_logs(straight)[-1]
    assert torch.equal(straight_step2.advantage, resumed_step2.advantage)
    for (name, p), q in zip(straight.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(q, p, msg=name)

    # the dump of step 2 holds the tool calls and the tool results as turns, the viewer renders them,
    # and TRL's completions table has one row per turn
    run = tmp_path / "straight"
    dump = run / "rollouts" / "step-000002.jsonl"
    episodes = [json.loads(line) for line in dump.read_text().splitlines()]
    rollout = straight.recorded[-1][0]
    assert len(episodes) == len(rollout.episodes) and sum(e["turns_taken"] for e in episodes) == len(rollout.steps)
    turns = [t for e in episodes for t in e["turns"]]
    calls = [t for t in turns if t["action"]]
    assert calls and all(json.loads(t["action"])[0]["name"] == "act" for t in calls)  # the parsed tool calls
    assert all(t["observation"] for t in turns)
    out = io.StringIO()
    assert show.main([str(dump), "--color", "never"], stream=out) == 0
    lines = out.getvalue().splitlines()
    assert sum(line.startswith("episode ") for line in lines) == len(episodes)
    assert sum(line.startswith("  turn ") for line in lines) == len(turns)
    assert all(any(line.endswith(" " + t["action"]) for line in lines) for t in calls)  # each tool call, as run
    table = pd.read_parquet(run / "completions" / "completions_00002.parquet")
    assert len(table) == len(turns)
    assert sorted(table["completion"]) == sorted(t["reply"] for t in turns)


@pytest.mark.parametrize("mode", ["ddp", "zero3"])
def test_two_processes_train_and_evaluate_with_a_reward_function_on_unequal_shards(mode, tool_policy_dir, tmp_path):
    config = cpu_config(mode, tmp_path / "accelerate.yaml")
    env = dict(os.environ, OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1", PYTHONPATH=str(ROOT))
    job = ROOT / "tests" / "trl" / "tool_dist_job.py"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),  # a free port (cpu_config)
           str(job), "--out", str(tmp_path), "--model", str(tool_policy_dir)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    expected_type = "MULTI_CPU" if mode == "ddp" else "DEEPSPEED"
    assert all(r["world"] == 2 and r["distributed_type"].endswith(expected_type) for r in ranks)
    assert [r["zero_stage"] for r in ranks] == ([None, None] if mode == "ddp" else [3, 3])
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == 1
    (first,), (second,) = ranks[0]["rollouts"], ranks[1]["rollouts"]
    assert first["generate_calls"] == second["generate_calls"]  # lockstep over ranks
    assert not {t for g in first["groups"] for t in g} & {t for g in second["groups"] for t in g}
    # the user's reward function scored every episode played to its end: get_reward is 0 or 1,
    # and its cost of 0.01 per turn makes the sum no whole number
    episodes = first["episodes"] + second["episodes"]
    scored = [e["reward"] for e in episodes if not e["failed"]]
    assert len(episodes) == 4 and scored and all(r != round(r) for r in scored)
    # the evaluation's shards are 2 and 1 tasks; both ranks end with the gathered summary of all 3
    assert ranks[0]["final_eval"]["num_tasks"] == ranks[1]["final_eval"]["num_tasks"] == 3
    assert [r["final_eval"]["tag"] for r in ranks] == ["final", "final"]
    # and a 1-task evaluation, which leaves rank 1 nothing to play (under ZeRO-3 it still joins
    # every generate call, which gathers the parameters), ends on both ranks
    assert ranks[0]["one_task_eval"]["num_tasks"] == ranks[1]["one_task_eval"]["num_tasks"] == 1


def test_beacon_trains_on_a_trl_env_that_counts_its_milestones_and_refuses_one_that_does_not(tool_policy, tmp_path):
    """`as_trl_environment` declares `milestones_reached` for the tiny env (a flag env): each turn whose tool call
    raised it is a milestone step of the estimator's batch. A factory without the count is refused before the
    model loads (here the same class without its declaration)."""
    model, tokenizer = tool_policy
    data = trl_task_dataset("tiny", **TINY_KWARGS)
    args = bipace_args(tmp_path, preset="beacon", tasks_per_iteration=1, num_generations=4, max_turns=3)
    trainer = Recording(model=model, processing_class=tokenizer, args=args, train_dataset=data, environment_factory=Tiny)
    trainer.recorded = []
    trainer.train()
    trainer.close_envs()
    rollout, estimate = trainer.recorded[0]
    # a turn that ran tool calls says whether they reached one; an answer (no call) says nothing: no milestone
    flags = [step.milestone for step in rollout.steps]
    assert all(flag is None or isinstance(flag, bool) for flag in flags) and any(flags)
    assert any(flag is not None for flag in flags)
    assert estimate.diagnostics["milestone/step_frac"] == pytest.approx(sum(bool(f) for f in flags) / len(flags))
    assert torch.isfinite(estimate.advantage).all()

    uncounted = as_trl_environment("tiny", **TINY_KWARGS)
    del uncounted.milestones_reached  # as a plan env's class is made: no count declared
    with pytest.raises(ValueError, match="declare `milestones_reached = 0` on the env class"):
        Recording(model=model, processing_class=tokenizer, args=args, train_dataset=data, environment_factory=uncounted)
