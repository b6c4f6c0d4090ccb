"""TRL parity: a GRPOTrainer script switched to BiPACETrainer keeps its schedule, its metric names,
its constructor, and TRL's behaviour on tools that misbehave; what TRL would let pass silently or
fail on mid-run is refused up front with an error that names the fix.

The end-to-end test runs one script file (tests/trl/grpo_script.py, a TRL user's script on our own
TRL-docs-style env `tests/trl/thermostat.py`) under both trainers, only the import line and the two
class names switched by the test.
"""

from __future__ import annotations

import inspect
import logging
import re
import warnings
from pathlib import Path

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

from bipace_trainer import BiPACEConfig, BiPACETrainer
from bipace_trainer.advantages import StepAdvantageEstimator
from bipace_trainer.rollout.hidden import clamp_layer
from bipace_trainer.models import bpe_chat_tokenizer, tiny_qwen2
from bipace_trainer.rollout.tool_envs import check_environment_factory
from bipace_trainer.trl_metrics import EpisodeSummary, trl_metrics
from tests.test_tool_envs import BrokenLamps, call, play, tokenizer  # noqa: F401  (the module's fixture)
from tests.trainer.tool_setup import Lamps
from tests.trl.thermostat import Thermostat, prompt_dataset

SCRIPT = Path(__file__).with_name("grpo_script.py")
README = Path(__file__).parents[2] / "README.md"


def readme_row(label: str) -> tuple[list[str], list[str]]:
    """The backticked names in the GRPOTrainer and BiPACETrainer cells of the README's "Coming from TRL" row `label`."""
    section = README.read_text().split("## Coming from TRL", 1)[1].split("\n## ", 1)[0]
    row = next(line for line in section.splitlines() if line.startswith(f"| {label} "))
    _, theirs, ours = [cell.strip() for cell in row.strip("|").split("|")]
    return re.findall(r"`([^`]+)`", theirs), re.findall(r"`([^`]+)`", ours)
COMMON = dict(output_dir="unused", report_to="none", use_cpu=True)


# --------------------------------------------------------------------------- 1. the same schedule


@pytest.mark.parametrize(
    "batch",
    [
        dict(per_device_train_batch_size=4, num_generations=4),  # TRL's defaults for the rest
        dict(per_device_train_batch_size=4, num_generations=4, generation_batch_size=8),
        dict(per_device_train_batch_size=4, num_generations=4, steps_per_generation=1),
        dict(per_device_train_batch_size=2, num_generations=4, steps_per_generation=4),
        dict(per_device_train_batch_size=4, num_generations=2, gradient_accumulation_steps=3),
    ],
)
def test_trls_batch_arguments_give_trls_schedule(batch):
    grpo, ours = GRPOConfig(**COMMON, **batch), BiPACEConfig(**COMMON, **batch)
    assert (ours.generation_batch_size, ours.steps_per_generation) == (grpo.generation_batch_size, grpo.steps_per_generation)
    assert ours.tasks_per_iteration == grpo.generation_batch_size // grpo.num_generations  # derived, not imposed


def test_our_knob_still_sets_the_generation_and_a_conflict_names_both():
    assert BiPACEConfig(**COMMON, tasks_per_iteration=3, num_generations=4, per_device_train_batch_size=4).generation_batch_size == 12
    with pytest.raises(ValueError, match="tasks_per_iteration=3 .* generation_batch_size / steps_per_generation give 8"):
        BiPACEConfig(**COMMON, tasks_per_iteration=3, num_generations=4, per_device_train_batch_size=4, generation_batch_size=8)


# --------------------------------------------------------------------------- 3. the same constructor


def test_the_constructor_takes_grpo_trainers_arguments_keyword_for_keyword_with_its_defaults():
    ours = list(inspect.signature(BiPACETrainer.__init__).parameters.values())
    theirs = list(inspect.signature(GRPOTrainer.__init__).parameters.values())
    assert [(p.name, p.kind, p.default) for p in ours] == [(p.name, p.kind, p.default) for p in theirs]


def test_the_readmes_table_names_the_constructor_and_the_options_as_they_are():
    theirs, ours = readme_row("constructor ✓")
    assert theirs[0].split(", ") == list(inspect.signature(GRPOTrainer.__init__).parameters)[1:]
    options = [name.split("=")[0] for label in ("a tool raises, an unknown tool", "an env fault", "schedule ✓")
               for name in readme_row(label)[1] if "=" in name or name == "tasks_per_iteration"]
    assert set(options) == {"tool_errors", "penalize_env_failures", "tasks_per_iteration"}
    assert all(hasattr(BiPACEConfig(**COMMON), option) for option in options)


def test_what_cannot_apply_says_so_before_any_model_loads():
    args = BiPACEConfig(**COMMON)
    with pytest.raises(ValueError, match="rollout_func .* pass environment_factory/tools, or env_name"):
        BiPACETrainer(model="no/such-model", args=args, rollout_func=lambda prompts, trainer: {})
    with pytest.raises(ValueError, match="reward_funcs apply to TRL's environments"):
        BiPACETrainer(model="no/such-model", args=args, reward_funcs=[lambda completions, **kw: [0.0]])
    with pytest.raises(TypeError, match="args must be a BiPACEConfig, got GRPOConfig"):
        BiPACETrainer(model="no/such-model", args=GRPOConfig(**COMMON), environment_factory=Thermostat)


# --------------------------------------------------------------------------- 6. bad values that passed silently


def test_an_instance_for_a_factory_says_pass_the_class():
    with pytest.raises(TypeError, match="pass the class, not an instance .environment_factory=Thermostat."):
        BiPACETrainer(model="no/such-model", args=BiPACEConfig(**COMMON), environment_factory=Thermostat())
    with pytest.raises(TypeError, match=r"environment_factory\['warm'\] is a Thermostat instance"):
        check_environment_factory({"warm": Thermostat()}, {})


def test_a_dict_factory_refuses_rows_naming_an_unknown_environment_before_training():
    factories = {"room": Thermostat, "lamps": Lamps}
    good = prompt_dataset(4).add_column("environment", ["room", "lamps"] * 2)
    check_environment_factory(factories, {"train_dataset": good, "eval_dataset": None})  # every row routes
    some_wrong = prompt_dataset(4).add_column("environment", ["room", "lamp", "room", "lamps"])
    with pytest.raises(ValueError, match=r"Example has `environment='lamp'`, which is not among .* Expected one of: "
                                         r"\['room', 'lamps'\]\. train_dataset: 1 of 4 rows"):
        check_environment_factory(factories, {"train_dataset": some_wrong})
    with pytest.raises(ValueError, match=r"environment=None.*eval_dataset: 4 of 4 rows"):  # no column at all: TRL's KeyError: None
        check_environment_factory(factories, {"train_dataset": good, "eval_dataset": prompt_dataset(4)})


class TextRewardLamps(Lamps):
    def get_reward(self) -> str:  # type: ignore[override]
        return str(super().get_reward())


def test_a_reward_that_is_not_a_number_stops_with_the_env_method_and_type(tokenizer):  # noqa: F811
    with pytest.raises(TypeError, match=r"TextRewardLamps.get_reward\(\) returned str '1.0'; it must return a number"):
        play(tokenizer, TextRewardLamps, [[call("flip_a", "flip_b"), "Done."]])


class SilentLamps(Lamps):
    """Its switches return None: the state is in nothing the tools say."""

    def flip_a(self) -> None:
        """
        Flip the switch of lamp A.
        """
        self.lamps["A"] = not self.lamps["A"]

    def flip_b(self) -> None:
        """
        Flip the switch of lamp B.
        """
        self.lamps["B"] = not self.lamps["B"]


def test_tools_that_return_nothing_key_the_state_on_the_history_and_warn_once(tokenizer, caplog, monkeypatch):  # noqa: F811
    import bipace_trainer.rollout.tool_envs as tool_envs

    monkeypatch.setattr(tool_envs, "_warned_stateless", set())  # as in a fresh process
    scripts = [[call("flip_a"), call("flip_b"), "Done."], [call("flip_b"), call("flip_a"), "Done."], [call("flip_a"), "Done."]]
    with caplog.at_level(logging.WARNING, logger="bipace_trainer.rollout.tool_envs"):
        rollout, _ = play(tokenizer, SilentLamps, scripts)
        play(tokenizer, SilentLamps, scripts)
    anchors = {}
    for step in rollout.steps:
        anchors.setdefault(step.traj, []).append(step.anchor)
    after_first = [a[1] for a in anchors.values()]
    assert len(set(after_first)) == 3 - 1  # flip_a in episodes 0 and 2: one history, one cell; flip_b another
    assert anchors[0][1] == anchors[2][1] != anchors[1][1] and all(a != "None" for a in after_first)
    assert len(set(a[2] for a in list(anchors.values())[:2])) == 2  # two histories, never collapsed into one cell
    warned = [r.getMessage() for r in caplog.records if "returned nothing" in r.getMessage()]
    assert len(warned) == 2 and "flip_a" in warned[0] and "flip_b" in warned[1]  # once per tool, not per call or run


# --------------------------------------------------------------------------- 4. env faults are not the policy's


def test_failed_episodes_leave_the_batch_and_their_groups_statistics(tokenizer):  # noqa: F811
    # one group: a broken env (flip_b raises, tool_errors="fail": an env fault), then a win, a half and a loss
    scripts = [[call("flip_b"), "Done."], [call("flip_a", "flip_b"), "Done."], [call("flip_a"), "Done."], ["Done."]]
    environment = ["broken", "good", "good", "good"]
    rollout, _ = play(tokenizer, {"good": Lamps, "broken": BrokenLamps}, scripts, environment=environment, tool_errors="fail")
    assert [e.failed for e in rollout.episodes] == [True, False, False, False]
    estimator = StepAdvantageEstimator(BiPACEConfig(**COMMON, preset="grpo").estimator)
    unmasked = estimator.estimate(rollout.step_batch()).advantage
    assert float(unmasked[0]) < 0  # the env's fault, trained as the policy's loss: pushed down by a sibling's win
    masked = rollout.without_failed_episodes()
    assert [s.traj for s in masked.steps] == [s.traj for s in rollout.steps if s.traj != 0]
    healthy, _ = play(tokenizer, Lamps, scripts[1:])  # the same group without the failed episode
    expected = estimator.estimate(healthy.step_batch()).advantage
    assert torch.allclose(estimator.estimate(masked.step_batch()).advantage, expected)


# --------------------------------------------------------------------------- 8. any model depth


def test_a_layer_past_the_models_depth_is_clamped_with_a_warning():
    model = tiny_qwen2(bpe_chat_tokenizer(["a b c"], vocab_size=300), layers=2)
    with pytest.warns(UserWarning, match="cluster_layer=-8 is out of range .* using cluster_layer=-2"):
        assert clamp_layer(model, -8) == -2  # the first decoder layer's output, not the embeddings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert clamp_layer(model, -1) == -1 and clamp_layer(model, 2) == 2


# --------------------------------------------------------------------------- 2. TRL's metrics, per episode


def test_trls_metrics_over_episodes_match_a_hand_computation():
    episodes = [
        EpisodeSummary(group=(0, 0), model_tokens=10, clipped=False, scored=True, reward=1.0,
                       reward_terms={"Lamps": 1.0, "brevity": 0.0}, tool_calls=2, tool_failures=1),
        EpisodeSummary(group=(0, 0), model_tokens=30, clipped=True, scored=True, reward=0.0,
                       reward_terms={"Lamps": 0.0, "brevity": 0.0}, tool_calls=1),
        EpisodeSummary(group=(0, 1), model_tokens=20, clipped=False, scored=True, reward=0.5,
                       reward_terms={"Lamps": 0.5, "brevity": 0.0}),
        EpisodeSummary(group=(0, 1), model_tokens=40, clipped=False, scored=False, reward=0.0, tool_calls=1),
    ]
    m = trl_metrics(episodes, ["brevity", "Lamps"], tools=True)
    assert (m["completions/mean_length"], m["completions/min_length"], m["completions/max_length"]) == (25, 10, 40)
    assert m["completions/clipped_ratio"] == 0.25 and m["completions/mean_terminated_length"] == pytest.approx(70 / 3)
    assert (m["tools/call_frequency"], m["tools/failure_frequency"]) == (1.0, 0.25)
    assert m["rewards/Lamps/mean"] == pytest.approx(0.5) and m["rewards/Lamps/std"] == pytest.approx(0.5)  # unbiased
    assert m["reward"] == pytest.approx(0.5) and m["reward_std"] == pytest.approx(0.5)  # the failed episode: unscored
    assert m["frac_reward_zero_std"] == pytest.approx(1 / 3)  # group 1 has one scored episode: no spread


# --------------------------------------------------------------------------- the same script under both trainers


@pytest.fixture(scope="module")
def thermostat_policy_dir(tmp_path_factory):
    from tests.trl.thermostat import make_tokenizer, warm_start

    root = tmp_path_factory.mktemp("thermostat_policy") / "model"
    tokenizer = make_tokenizer()
    warm_start(tokenizer).save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


def _run_script(source: str, model_dir: Path, output_dir: Path, trainer_class, monkeypatch):
    """Execute the script's source; count the generations and their episodes as the trainer makes them."""
    generations = []
    original = trainer_class._generate_and_score_completions

    def counted(self, inputs):
        generations.append(len(inputs))
        return original(self, inputs)

    monkeypatch.setattr(trainer_class, "_generate_and_score_completions", counted)
    namespace = {"__name__": "grpo_script"}
    exec(compile(source, str(SCRIPT), "exec"), namespace)  # noqa: S102 - the test's own script file
    trainer = namespace["main"](str(model_dir), str(output_dir))
    monkeypatch.setattr(trainer_class, "_generate_and_score_completions", original)
    logged = {key for entry in trainer.state.log_history for key in entry}
    return trainer, generations, logged


@pytest.mark.slow
def test_the_same_script_has_the_same_schedule_and_every_grpo_metric_under_bipace(thermostat_policy_dir, tmp_path, monkeypatch):
    source = SCRIPT.read_text()
    assert "from trl import GRPOConfig, GRPOTrainer" in source
    switched = source.replace("from trl import GRPOConfig, GRPOTrainer", "from bipace_trainer import BiPACEConfig, BiPACETrainer")
    switched = switched.replace("GRPOConfig(", "BiPACEConfig(").replace("GRPOTrainer(", "BiPACETrainer(")
    changed = [(a, b) for a, b in zip(source.splitlines(), switched.splitlines()) if a != b]
    assert len(changed) == 3  # the import line and the two constructor calls: nothing else

    grpo, grpo_generations, grpo_logged = _run_script(source, thermostat_policy_dir, tmp_path / "grpo", GRPOTrainer, monkeypatch)
    ours, our_generations, our_logged = _run_script(switched, thermostat_policy_dir, tmp_path / "ours", BiPACETrainer, monkeypatch)
    ours.close_envs()
    # the schedule: generations, episodes per generation, optimizer steps
    assert our_generations == grpo_generations == [8, 8]
    assert ours.state.global_step == grpo.state.global_step == 4
    # every metric GRPOTrainer logged, with the same name, next to ours
    assert grpo_logged - our_logged == set()
    assert {"tools/call_frequency", "tools/failure_frequency", "rewards/Thermostat/mean", "rewards/brevity/mean",
            "reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "num_tokens"} <= grpo_logged
    assert {"episode/steps", "advantage/std", "train/masked_failed_episodes"} <= our_logged
    listed = [name for name in readme_row("metrics ✓")[0] if "<" not in name and "*" not in name]
    assert len(listed) >= 8 and set(listed) <= grpo_logged & our_logged  # the README's table stays true
    # and with their meaning: the tools were called, the env and the user's function both scored
    entries = [e for e in ours.state.log_history if "reward" in e]
    assert max(e["tools/call_frequency"] for e in entries) > 0
    assert all(0.0 <= e["rewards/Thermostat/mean"] <= 1.0 for e in entries)
    assert ours.state.num_input_tokens_seen > 0 and entries[-1]["num_tokens"] == ours.state.num_input_tokens_seen
