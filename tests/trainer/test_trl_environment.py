"""A TRL user's environment trains under `GRPOTrainer` and, one word changed, under `BiPACETrainer`.

`Lamps` (tests/trainer/tool_setup.py) is written as TRL's docs write an environment; the
policy is a tiny Qwen2 with Qwen2.5's tool-calling chat template, warm-started to call
the tools. The same arguments train 2 steps with TRL's `GRPOTrainer` and with
`BiPACETrainer` (config class `GRPOConfig` -> `BiPACEConfig`); under `BiPACETrainer` each
assistant turn is a sample, and the steps that reach one state by different tool
sequences share a cell of the hash partition and get non-zero step advantages.
"""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM
from trl import GRPOConfig, GRPOTrainer

from bipace_trainer import BiPACEConfig, BiPACETrainer
from bipace_trainer.models import load_tokenizer

from tests.rollout.test_tool_envs import BrokenLamps
from tests.trainer.tool_setup import Lamps, make_model, make_tokenizer, prompt_dataset, warm_start

# What a TRL user passes, the same for both trainers.
SHARED = dict(
    max_steps=2, per_device_train_batch_size=4, num_generations=4, max_completion_length=40, learning_rate=1e-3,
    max_tool_calling_iterations=4, temperature=1.0, logging_steps=1, save_strategy="no", report_to="none",
    use_cpu=True, bf16=False, seed=0, disable_tqdm=True,
)


@pytest.fixture(scope="module")
def tool_policy_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tool_policy")
    tokenizer = make_tokenizer()
    model = warm_start(make_model(tokenizer), tokenizer)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    return root / "model"


@pytest.mark.slow
@pytest.mark.parametrize("trainer_class, config_class", [(GRPOTrainer, GRPOConfig), (BiPACETrainer, BiPACEConfig)])
def test_the_same_environment_trains_under_grpo_and_bipace_with_one_word_changed(
    tool_policy_dir, tmp_path, trainer_class, config_class
):
    model, tokenizer = AutoModelForCausalLM.from_pretrained(tool_policy_dir), load_tokenizer(tool_policy_dir)
    # Nothing but the class names differs: the default preset's cluster_layer=-8 clamps to this 2-layer model.
    args = config_class(output_dir=str(tmp_path), **SHARED)
    trainer = trainer_class(
        model=model, args=args, processing_class=tokenizer, train_dataset=prompt_dataset(8), environment_factory=Lamps
    )
    trainer.train()
    assert trainer.state.global_step == 2
    logged = {key for entry in trainer.state.log_history for key in entry}
    assert "loss" in logged
    if trainer_class is BiPACETrainer:
        trainer.close_envs()
        assert {"episode/steps", "env/failures", "advantage/std", "estimator/cluster_eps"} <= logged  # a sample per turn
        assert trainer.args.preset == "bipace_q"
    else:
        assert "rewards/Lamps/mean" in logged  # TRL scored the rollouts with get_reward


class Recording(BiPACETrainer):
    """Keeps each training generation's rollout and the estimator's full estimate (cells included)."""

    def on_scored(self, scored):
        self.recorded.append((scored.rollout, scored.estimate))
        return scored


@pytest.mark.slow
def test_steps_reaching_one_state_by_different_tool_sequences_share_a_cell_and_get_step_credit(tool_policy_dir, tmp_path):
    model, tokenizer = AutoModelForCausalLM.from_pretrained(tool_policy_dir), load_tokenizer(tool_policy_dir)
    # Group 0 plays Lamps, group 1 BrokenLamps (flip_b raises): a dict of factories, by the rows' column.
    # 16 rollouts per group: paths such as (look) and (), or (flip_a, flip_b) and (flip_b, flip_a), meet.
    dataset = prompt_dataset(4).add_column("environment", ["lamps", "broken"] * 2)
    args = BiPACEConfig(
        output_dir=str(tmp_path), preset="gigpo", w_ep=0.0,  # the advantage is the step term alone
        tasks_per_iteration=2, max_turns=5, rollout_dump_steps=1, shuffle_dataset=False, eval_tasks=2,
        # each reply up to 40 tokens, the episode's completion (TRL's cap) up to 1024: paths of several turns
        **{**SHARED, "num_generations": 16, "max_steps": 1, "max_turn_length": 40, "max_completion_length": 1024},
    )
    trainer = Recording(
        model=model, args=args, processing_class=tokenizer, train_dataset=dataset,
        eval_dataset=prompt_dataset(2).add_column("environment", ["lamps"] * 2),
        environment_factory={"lamps": Lamps, "broken": BrokenLamps},
    )
    trainer.recorded = []
    trainer.train()
    trainer.close_envs()

    rollout, estimate = trainer.recorded[0]
    history, paths = {}, {}  # each step's tool calls so far; per (group, anchor) the histories reaching it
    for step in rollout.steps:
        key = (step.group, step.anchor)
        paths.setdefault(key, {}).setdefault(history.get(step.traj, ()), []).append(step)
        history[step.traj] = history.get(step.traj, ()) + (step.action,)
    shared = [steps for key, by_path in paths.items() if len(by_path) > 1 for steps in [sum(by_path.values(), [])]]
    assert shared, "no state was reached by two different tool sequences"
    index = {id(step): k for k, step in enumerate(rollout.steps)}
    credited = 0
    for steps in shared:
        cells = {int(estimate.cell[index[id(s)]]) for s in steps}
        assert len(cells) == 1  # one state, one cell, whatever the path
        credited += sum(float(estimate.advantage[index[id(s)]]) != 0.0 for s in steps)
    assert credited > 0
    # the broken switch's error came back to the model as the tool's result (TRL's behaviour), only in
    # the broken env's group, and the episode went on; TRL's metric counts it
    refused = [s for s in rollout.steps if "refused the connection" in s.observation]
    assert refused and all(s.group == 1 for s in refused)
    assert not any(e.failed and "refused the connection" in e.failure for e in rollout.episodes)
    assert any(entry.get("tools/failure_frequency", 0) > 0 for entry in trainer.state.log_history)
    # dumps and evaluation work on this path too
    dumps = sorted((tmp_path / "rollouts").glob("step-*.jsonl"))
    assert dumps and json.loads(dumps[0].read_text().splitlines()[0])["turns"]
    assert [e["tag"] for e in trainer.eval_history] == ["before", "final"] and trainer.eval_history[-1]["num_tasks"] == 2
