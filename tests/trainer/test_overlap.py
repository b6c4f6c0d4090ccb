"""`max_staleness=1`: the next generation plays on a background thread while the current update
runs (`update.overlap`), corrected by TRL's importance-sampling ratio."""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM

from bipace_trainer import BiPACEConfig, BiPACETrainer
from bipace_trainer.models import load_tokenizer
from bipace_trainer.update.batching import padded_tensors, training_batch
from bipace_trainer.update.overlap import Lookahead, Prefetched, SnapshotPolicy, _Background

from .tiny_setup import LORA, CapturingTrainer, StopAfter, lora_state, tiny_args


def make_trainer(model_dir, output_dir, trainer_class=BiPACETrainer, peft=True, **overrides):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = load_tokenizer(model_dir)
    args = tiny_args(output_dir, preset="bipace_q", evaluate_before_training=False, disable_tqdm=True, **overrides)
    trainer = trainer_class(model, args=args, processing_class=tokenizer, peft_config=LoraConfig(**LORA) if peft else None)
    trainer.captured = []
    return trainer


def rows_of(trainer, count):
    return [trainer.train_dataset[i % len(trainer.train_dataset)] for i in range(count)]


def completion_logps(trainer, module, steps):
    """`module`'s per-token log-probs of the steps' completions, in the training batch's layout."""
    prompt_ids, prompt_mask, completion_ids, completion_mask = padded_tensors(trainer.batch_spec, steps, len(steps))
    with torch.no_grad():
        logps, _, _ = trainer.batch_spec.per_token_logps(
            module, torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1),
            completion_ids.size(1), batch_size=trainer.args.per_device_train_batch_size,
        )
    return [row[: len(s.completion_ids)] for s, row in zip(steps, logps)]


# ---------------------------------------------------------------------- settings refused


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"max_staleness": 2}, "max_staleness=2 must be 0 (off) or 1"),
        ({"max_staleness": -1}, "max_staleness=-1 must be 0 (off) or 1"),
        ({"max_staleness": 1, "loss_type": "vespo"}, "loss_type='vespo'"),
        ({"max_staleness": 1, "use_vllm": True}, "set use_vllm=False or max_staleness=0"),
    ],
)
def test_settings_it_cannot_honour_are_refused(tmp_path, overrides, words):
    with pytest.raises(ValueError, match=None) as err:
        tiny_args(tmp_path, **overrides)
    assert words in str(err.value)


def test_trl_tool_envs_are_refused(tmp_path):
    from .tool_setup import Lamps, make_model, make_tokenizer, prompt_dataset

    tokenizer = make_tokenizer()
    args = BiPACEConfig(
        output_dir=str(tmp_path), preset="grpo", max_staleness=1, tasks_per_iteration=1, num_generations=2,
        per_device_train_batch_size=2, max_steps=1, report_to="none", use_cpu=True, save_strategy="no",
    )
    with pytest.raises(ValueError, match="max_staleness=1 plays the project's TextEnvs"):
        BiPACETrainer(make_model(tokenizer), args=args, processing_class=tokenizer, train_dataset=prompt_dataset(2),
                      environment_factory=Lamps)


# ---------------------------------------------------------------------- the pieces


def test_lookahead_reads_ahead_and_knows_positions():
    items = [[i] for i in range(5)]
    ahead = Lookahead(iter(items))
    first = next(ahead)
    assert ahead.position(first) == 0 and ahead.position([0]) is None  # by identity
    assert ahead.peek(3) is items[3] and ahead.peek(0) is first  # yielded, still remembered
    assert [next(ahead) for _ in range(4)] == items[1:]  # the peeked items still come, in order
    assert ahead.position(items[3]) == 3
    assert ahead.peek(5) is None  # past the epoch's end
    with pytest.raises(StopIteration):
        next(ahead)
    short = Lookahead(iter(items), remember=2)
    assert [next(short) for _ in range(3)] == items[:3]
    assert short.peek(1) is items[1] and short.peek(0) is None  # forgotten


def test_an_error_in_the_background_surfaces_with_its_traceback():
    def play():
        raise KeyError("the env's reply parser broke")

    background = _Background(rows=[], snapshot_step=3, play=play)
    with pytest.raises(KeyError, match="reply parser broke") as err:
        background.result()
    assert any("background rollout" in note and "step 3" in note for note in err.value.__notes__)
    assert any(frame.name == "play" for frame in __import__("traceback").extract_tb(err.value.__traceback__))


def test_the_snapshot_is_its_own_policy_and_leaves_the_global_rng_alone(raw_tiny_dir, tmp_path):
    trainer = make_trainer(raw_tiny_dir, tmp_path, max_staleness=1)
    live = trainer.accelerator.unwrap_model(trainer.model)
    policy = SnapshotPolicy(trainer.policy, trainer.batch_spec)
    shared = {n: p for n, p in live.named_parameters() if not p.requires_grad}
    copied = dict(policy.module.named_parameters())
    assert all(copied[n] is p for n, p in shared.items())  # LoRA: the frozen base is shared, not copied
    adapters = [n for n, p in live.named_parameters() if p.requires_grad]
    assert adapters and all(copied[n] is not dict(live.named_parameters())[n] for n in adapters)

    prompts = [trainer.policy.tokenize([[{"role": "user", "content": "Go to the goal."}]])[0]] * 3
    policy.refresh(step=0, seed=7)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    first = policy.generate(prompts).completion_ids
    assert torch.equal(torch.get_rng_state(), state)  # the main thread's RNG was not drawn from
    policy.refresh(step=0, seed=7)
    again = policy.generate(prompts).completion_ids
    assert again == first and len({tuple(c) for c in first}) > 1  # seeded, and sampled (not greedy)

    # the live adapter moves (an update); the snapshot keeps the weights it was refreshed with
    before = completion_logps(trainer, policy.module, _steps(prompts, first))
    with torch.no_grad():
        for name, param in live.named_parameters():
            if param.requires_grad:
                param.add_(0.5)
    after = completion_logps(trainer, policy.module, _steps(prompts, first))
    moved = completion_logps(trainer, live, _steps(prompts, first))
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert not all(torch.equal(a, b) for a, b in zip(before, moved))
    policy.refresh(step=1, seed=7)  # a refresh takes the live weights again
    refreshed = completion_logps(trainer, policy.module, _steps(prompts, first))
    assert all(torch.equal(a, b) for a, b in zip(refreshed, moved))
    trainer.close_envs()


def _steps(prompts, completions):
    from bipace_trainer.rollout.loop import StepRecord

    return [StepRecord(0, i, 0, list(p), list(c), "", "", True, None, "", 0.0) for i, (p, c) in enumerate(zip(prompts, completions))]


# ---------------------------------------------------------------------- staleness 0: exactly the plain path


@pytest.mark.slow  # the warm policy's SFT (~50-90 s) would otherwise run in the fast subset for this test alone
def test_unchanged_weights_give_ratio_one_and_the_plain_loss_and_gradient(warm_policy_dir, tmp_path):
    trainer = make_trainer(warm_policy_dir, tmp_path, max_staleness=1)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    tasks = trainer.collector.task_refs(rows_of(trainer, 2 * trainer.num_generations), trainer.num_generations)
    policy = SnapshotPolicy(trainer.policy, trainer.batch_spec)
    policy.refresh(step=0, seed=1)  # the snapshot of the current weights: staleness 0
    rollout = trainer.collector.collect("train", tasks, policy=policy)
    policy.score(rollout.steps)
    assert rollout.steps and all(len(s.sampling_logprobs) == len(s.completion_ids) for s in rollout.steps)

    scored = trainer.collect(tasks, Prefetched([], rollout, snapshot_step=0))
    stale = scored.batch
    ratio = stale["importance_sampling_ratio"]
    assert torch.equal(ratio, torch.ones_like(ratio))  # exactly, not approximately
    assert scored.batch_metrics["sampling/sampling_logp_difference/max"] == 0.0
    assert "old_per_token_logps" not in stale  # TRL's loss keeps its own (live) denominator, as without overlap
    plain, _, _ = training_batch(trainer.batch_spec, rollout, trainer._sync)
    advantages = scored.estimate.advantage
    plain["advantages"] = torch.cat([advantages, torch.zeros(plain["advantages"].numel() - advantages.numel())])
    assert (plain["advantages"] != 0).any()
    assert torch.equal(stale["advantages"], plain["advantages"].unsqueeze(1).expand_as(stale["advantages"]))

    def loss_and_grads(batch):
        trainer.model.zero_grad()
        loss = trainer._compute_loss(trainer.model, batch)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}

    loss_stale, grads_stale = loss_and_grads(stale)
    loss_plain, grads_plain = loss_and_grads(plain)
    assert torch.equal(loss_stale, loss_plain)
    assert all(torch.equal(grads_stale[n], grads_plain[n]) for n in grads_plain)
    trainer.close_envs()


# ---------------------------------------------------------------------- training with overlap


class WeightsPerGeneration(CapturingTrainer):
    """Also keeps the adapter's weights at each training generation, before its update."""

    def generate_and_score(self, inputs):
        self.weights = getattr(self, "weights", [])
        self.weights.append(lora_state(self.model))
        return super().generate_and_score(inputs)


@pytest.mark.slow
def test_overlap_trains_on_the_previous_weights_rollouts_repeatably(warm_policy_dir, tmp_path):
    runs = []
    for name in ("a", "b"):
        trainer = make_trainer(warm_policy_dir, tmp_path / name, WeightsPerGeneration, max_staleness=1, max_steps=4)
        trainer.train()
        trainer.close_envs()
        runs.append(trainer)
    trainer = runs[0]
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [e["rollout/staleness"] for e in logs] == [0.0, 1.0, 1.0, 1.0]  # the first generation plays now
    assert all(math.isfinite(e["loss"]) for e in logs)
    for entry in logs[1:]:
        assert {"sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
                "sampling/importance_sampling_ratio/max", "sampling/sampling_logp_difference/mean"} <= set(entry)
    assert any(e["sampling/importance_sampling_ratio/min"] < 1 or e["sampling/importance_sampling_ratio/max"] > 1
               for e in logs[1:])  # the correction is active
    for rollout, _, _ in trainer.captured:
        assert all(e.length > 0 and not e.failed for e in rollout.episodes)

    # generation 3 (index 2) was played by the weights of generation 2, before its update, not by its own
    rollout, advantages, batch = trainer.captured[2]
    model = trainer.accelerator.unwrap_model(trainer.model)
    final = lora_state(model)
    played_by, trained_with = trainer.weights[1], trainer.weights[2]
    assert any(not torch.equal(played_by[n], trained_with[n]) for n in played_by)  # an update happened between

    def logps_with(weights):
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in weights:
                    p.copy_(weights[n])
        return completion_logps(trainer, model, rollout.steps)

    behaviour = [torch.tensor(s.sampling_logprobs) for s in rollout.steps]
    by_previous, by_current = logps_with(played_by), logps_with(trained_with)
    logps_with(final)
    assert all(torch.allclose(b, p, atol=1e-5) for b, p in zip(behaviour, by_previous))
    assert not all(torch.allclose(b, c, atol=1e-5) for b, c in zip(behaviour, by_current))
    # the ratio scales the advantages: (B, T) rows, ρ·A
    assert batch["advantages"].dim() == 2
    rows = len(rollout.steps)
    ratio = batch["importance_sampling_ratio"][:rows]
    torch.testing.assert_close(batch["advantages"][:rows], advantages.unsqueeze(1) * ratio)

    # a second run under the same seed plays and trains the same
    other = runs[1]
    for (mine, _, _), (theirs, _, _) in zip(trainer.captured, other.captured):
        assert [s.completion_ids for s in mine.steps] == [s.completion_ids for s in theirs.steps]
    final_other = lora_state(other.model)
    for n in final:
        assert torch.equal(final[n], final_other[n])


class BehaviourSteps(CapturingTrainer):
    """Also keeps, per training generation, the optimizer step at which it was trained and the one
    whose weights played it (None: played now)."""

    def on_scored(self, scored):
        self.behaviour = getattr(self, "behaviour", [])
        self.behaviour.append((self.state.global_step, scored.behaviour_step))
        return scored


@pytest.mark.slow
def test_several_generations_per_optimizer_step_are_all_prefetched(warm_policy_dir, tmp_path):
    # 1 task × 4 episodes = one micro-batch of 4 rows: a generation per micro-step, two per optimizer step
    # (as the default settings give on two processes). The Trainer hands out both micro-steps' rows at
    # once, so the second generation's rows are known, already yielded, when the first one is built.
    trainer = make_trainer(warm_policy_dir, tmp_path, BehaviourSteps, max_staleness=1, max_steps=2,
                           tasks_per_iteration=1, num_generations=4, per_device_train_batch_size=4,
                           gradient_accumulation_steps=2)
    assert trainer.args.steps_per_generation == 1
    trainer.train()
    trainer.close_envs()
    # the second generation of a step plays beside the first's micro-step with the same weights (staleness 0),
    # the first of the next step beside the optimizer step (staleness 1)
    assert trainer.behaviour == [(0, None), (0, 0), (1, 0), (1, 1)]
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [e["rollout/prefetched"] for e in logs] == [0.5, 1.0]
    assert [e["rollout/staleness"] for e in logs] == [0.0, 0.5]
    for index in (1, 3):  # played with the weights it trains with: the ratio is exactly 1
        ratio = trainer.captured[index][2]["importance_sampling_ratio"]
        assert torch.equal(ratio, torch.ones_like(ratio))
    ratio = trainer.captured[2][2]["importance_sampling_ratio"]
    rows = len(trainer.captured[2][0].steps)
    assert not torch.equal(ratio[:rows], torch.ones_like(ratio[:rows]))  # one update old: corrected


@pytest.mark.slow
def test_env_failures_in_the_background_are_episode_failures(warm_policy_dir, tmp_path):
    # dataset order kept: generation 1 (foreground) plays healthy tasks, 2 and 3 (background) faulty ones
    model = AutoModelForCausalLM.from_pretrained(warm_policy_dir)
    tokenizer = load_tokenizer(warm_policy_dir)
    args = tiny_args(tmp_path, preset="grpo", env_name="tests.reliability.faulty_envs:FaultyTinyEnv", env_kwargs={},
                     max_steps=3, max_staleness=1, shuffle_dataset=False, evaluate_before_training=False,
                     disable_tqdm=True, eval_tasks=2)
    dataset = Dataset.from_dict({"task_id": [0, 8, 1, 2, 9, 4]})
    trainer = CapturingTrainer(model, args=args, processing_class=tokenizer, train_dataset=dataset)
    trainer.captured = []
    trainer.train()
    trainer.close_envs()
    assert trainer.state.global_step == 3
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [e["rollout/staleness"] for e in logs] == [0.0, 1.0, 1.0]
    assert logs[0]["episode/env_failures"] == 0 and logs[1]["episode/env_failures"] > 0
    failed = {e.task_id for rollout, _, _ in trainer.captured[1:] for e in rollout.episodes if e.failed}
    assert {1, 2} <= failed


@pytest.mark.slow
def test_an_error_in_the_background_rollout_stops_the_run(warm_policy_dir, tmp_path, monkeypatch):
    calls = []

    def broken(self, prompt_ids, *args, **kwargs):
        calls.append(len(prompt_ids))
        raise RuntimeError("snapshot generate broke")

    monkeypatch.setattr(SnapshotPolicy, "generate", broken)
    trainer = make_trainer(warm_policy_dir, tmp_path, max_staleness=1, max_steps=3)
    with pytest.raises(RuntimeError, match="snapshot generate broke") as err:
        trainer.train()
    assert calls and any("background rollout" in note for note in err.value.__notes__)
    assert trainer.state.global_step == 1  # the first generation trained; the second never came
    trainer.close_envs()


@pytest.mark.slow
def test_resume_with_a_prefetched_generation_continues_as_if_uninterrupted(warm_policy_dir, tmp_path):
    from tests.reliability.test_resume import timing

    from .test_checkpoints import comparable_logs

    settings = dict(max_staleness=1, max_steps=4, save_strategy="steps", save_steps=2)
    straight = make_trainer(warm_policy_dir, tmp_path / "straight", **settings)
    straight.train()
    straight.close_envs()

    stopped = make_trainer(warm_policy_dir, tmp_path / "resumed", **settings)
    stopped.add_callback(StopAfter(2))
    stopped.train()
    stopped.close_envs()
    checkpoint = tmp_path / "resumed" / "checkpoint-2"
    assert (checkpoint / "overlap_rollout_rank0.pt").exists()  # generation 3, played during update 2

    resumed = make_trainer(warm_policy_dir, tmp_path / "resumed", **settings)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    resumed.close_envs()
    assert resumed.state.global_step == 4
    logs = [e for e in resumed.state.log_history if "loss" in e]
    assert [e["rollout/staleness"] for e in logs[-2:]] == [1.0, 1.0]  # the stored generation, then a new one
    assert comparable_logs(resumed)[-2:] == comparable_logs(straight)[-2:]
    # every key of the uninterrupted run's log, env/* counters included, and every value but timings
    steps = [[e for e in run.state.log_history if "loss" in e][-2:] for run in (resumed, straight)]
    assert [sorted(e) for e in steps[0]] == [sorted(e) for e in steps[1]]
    assert [{k: v for k, v in e.items() if not timing(k)} for e in steps[0]] == \
        [{k: v for k, v in e.items() if not timing(k)} for e in steps[1]]
    assert steps[0][0]["env/steps"] == steps[1][0]["env/steps"] > 0
    final_straight, final_resumed = lora_state(straight.model), lora_state(resumed.model)
    for name in final_straight:
        torch.testing.assert_close(final_resumed[name], final_straight[name])
