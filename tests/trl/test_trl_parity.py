"""TRL parity: a GRPOTrainer script switched to BiPACETrainer keeps its schedule, its metric names,
its constructor, and TRL's behaviour on tools that misbehave; what TRL would let pass silently or
fail on mid-run is refused up front with an error that names the fix.

The end-to-end test runs one script file (tests/trl/grpo_script.py, a TRL user's script on our own
TRL-docs-style env `tests/trl/thermostat.py`) under both trainers, only the import line and the two
class names switched by the test.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import re
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainingArguments
from trl import GRPOConfig, GRPOTrainer

from bipace_trainer import BiPACEConfig, BiPACETrainer
from bipace_trainer.advantages import StepAdvantageEstimator, StepBatch
from bipace_trainer.advantages.presets import estimate_advantages
from bipace_trainer.trl_compat import GRPO_FIELDS
from bipace_trainer.rollout.loop import StepRecord
from bipace_trainer.update.one_step import grpo_advantages
from bipace_trainer.rollout.hidden import clamp_layer
from bipace_trainer.models import bpe_chat_tokenizer, tiny_qwen2
from bipace_trainer.rollout.tool_envs import check_environment_factory
from bipace_trainer.update.metrics import EpisodeSummary, processed_token_count, trl_metrics, trl_token_count
from tests.rollout.test_tool_envs import BrokenLamps, call, play, tokenizer  # noqa: F401  (the module's fixture)
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


def _precision(config_class, **values) -> tuple:
    """(bf16, fp16) as `config_class` resolves them, or the error it raises."""
    try:
        config = config_class(**{**COMMON, **values})
    except ValueError as err:
        return ("refused", "bf16" in str(err) or "fp16" in str(err))
    return (config.bf16, config.fp16)


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu-only", "bf16-gpu"])
def test_bf16_resolves_as_grpo_config_resolves_it(gpu, monkeypatch):
    """Every use_cpu / bf16 / fp16 combination, on a machine with and without a bf16 GPU (transformers'
    check, patched): the same precision, or a refusal of both, so a switched script trains as it did."""
    import transformers.training_args

    monkeypatch.setattr(transformers.training_args, "is_torch_bf16_gpu_available", lambda: gpu)
    for use_cpu in (False, True):
        for bf16 in (None, True, False):
            for fp16 in (False, True):
                values = dict(use_cpu=use_cpu, bf16=bf16, fp16=fp16)
                assert _precision(BiPACEConfig, **values) == _precision(GRPOConfig, **values), values
    assert _precision(BiPACEConfig, use_cpu=True) == (True, False)  # TRL's default: bf16, on the CPU too
    assert _precision(BiPACEConfig, use_cpu=False) == ((True, False) if gpu else ("refused", True))


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
    with pytest.raises(ValueError, match="env_name='textcraft' gives its own rewards"):  # named by the script
        BiPACETrainer(model="no/such-model", args=BiPACEConfig(**COMMON, env_name="textcraft"),
                      reward_funcs=[lambda completions, **kw: [0.0]])
    with pytest.raises(ValueError, match="train on train_dataset's prompts, as GRPOTrainer does: pass a train_dataset"):
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


def _run_script(source: str, model_dir: Path, output_dir: Path, trainer_class, monkeypatch, case="tools", **config):
    """Execute the script's source; count the generations and their episodes as the trainer makes them,
    and keep each training generation's batch (`trainer.batches`)."""
    generations, batches = [], []
    # ours: its public hook; TRL's: its seam for a custom rollout
    seam = "generate_and_score" if hasattr(trainer_class, "generate_and_score") else "_generate_and_score_completions"
    original = getattr(trainer_class, seam)

    def counted(self, inputs):
        output = original(self, inputs)
        if self.model.training:
            generations.append(len(inputs))
            batches.append(output)
        return output

    monkeypatch.setattr(trainer_class, seam, counted)
    namespace = {"__name__": "grpo_script"}
    exec(compile(source, str(SCRIPT), "exec"), namespace)  # noqa: S102 - the test's own script file
    trainer = namespace["main"](str(model_dir), str(output_dir), case, **config)
    monkeypatch.setattr(trainer_class, seam, original)
    logged = {key for entry in trainer.state.log_history for key in entry}
    trainer.batches = batches
    return trainer, generations, logged


def switched_script() -> tuple[str, str]:
    """The script as it is, and with the import line and the two class names switched (nothing else)."""
    source = SCRIPT.read_text()
    assert "from trl import GRPOConfig, GRPOTrainer" in source
    switched = source.replace("from trl import GRPOConfig, GRPOTrainer", "from bipace_trainer import BiPACEConfig, BiPACETrainer")
    switched = switched.replace("GRPOConfig(", "BiPACEConfig(").replace("GRPOTrainer(", "BiPACETrainer(")
    changed = [(a, b) for a, b in zip(source.splitlines(), switched.splitlines()) if a != b]
    assert len(changed) == 3  # the import line and the two constructor calls: nothing else
    return source, switched


def run_both(model_dir, tmp_path, monkeypatch, case="tools", **config):
    """The script under GRPOTrainer, then under BiPACETrainer: (theirs, ours), each with `logged` keys."""
    source, switched = switched_script()
    grpo, grpo_generations, grpo.logged = _run_script(source, model_dir, tmp_path / "grpo", GRPOTrainer, monkeypatch, case, **config)
    ours, our_generations, ours.logged = _run_script(switched, model_dir, tmp_path / "ours", BiPACETrainer, monkeypatch, case,
                                                     **config)
    ours.close_envs()
    grpo.generations, ours.generations = grpo_generations, our_generations
    return grpo, ours


@pytest.mark.slow
def test_the_same_script_has_the_same_schedule_and_every_grpo_metric_under_bipace(thermostat_policy_dir, tmp_path, monkeypatch):
    grpo, ours = run_both(thermostat_policy_dir, tmp_path, monkeypatch)
    grpo_generations, our_generations, grpo_logged, our_logged = grpo.generations, ours.generations, grpo.logged, ours.logged
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
    # the same episodes (one seed, one script), the same running token count: prompts and model tokens
    assert [e["num_tokens"] for e in entries] == [e["num_tokens"] for e in grpo.state.log_history if "reward" in e]


# --------------------------------------------------------------------------- every GRPOConfig field, honoured or refused


def test_every_grpo_config_field_is_in_the_table_of_what_bipace_does_with_it():
    trainers_own = {f.name for f in dataclasses.fields(TrainingArguments)}  # the Trainer's meaning, unchanged
    grpos_own = {f.name for f in dataclasses.fields(GRPOConfig)} - trainers_own
    assert set(GRPO_FIELDS) == grpos_own, "a GRPOConfig field is missing from trl_compat.GRPO_FIELDS (or one is gone)"
    assert all(verdict in ("honoured", "refused") and how.strip() for verdict, how in GRPO_FIELDS.values())
    assert {f.name for f in dataclasses.fields(GRPOConfig)} <= {f.name for f in dataclasses.fields(BiPACEConfig)}


@pytest.mark.parametrize("scale, norm", [("group", "mean_std"), ("none", "mean")])
def test_scale_rewards_is_the_estimators_normalisation(scale, norm):
    for preset in ("grpo", "gigpo", "bipace_q", "hgpo"):
        assert BiPACEConfig(**COMMON, preset=preset, scale_rewards=scale).estimator.advantage_norm == norm
    # TRL's docstring: "none" applies no scaling, "group" divides by the std within the group
    batch = StepBatch(group=[0] * 4, traj=[0, 1, 2, 3], t=[0] * 4, reward=[1.0, 0.0, 0.0, 0.0], valid=[True] * 4,
                      anchor=["s"] * 4, action_key=["a"] * 4)
    advantage = estimate_advantages(batch, BiPACEConfig(**COMMON, preset="grpo", scale_rewards=scale).estimator).advantage
    divisor = 0.5 + 1e-6 if scale == "group" else 1.0  # std of (1, 0, 0, 0), unbiased: 0.5
    assert advantage.tolist() == pytest.approx([0.75 / divisor] + [-0.25 / divisor] * 3)


@pytest.mark.parametrize("preset", ["grpo", "bipace_q", "hgpo", "graphgpo", "bigraphgpo"])
def test_plain_prompts_take_the_episode_term_of_every_preset(preset):
    """Plain prompts (one-step episodes): every preset, the graph ones included, becomes its episode term."""
    from bipace_trainer.run.plan import one_step_settings

    s = one_step_settings(BiPACEConfig(**COMMON, preset=preset).estimator)
    assert (s.step_partition, s.step_baseline, s.w_ep, s.w_step, s.step_return) == ("none", None, 1.0, 0.0, "discounted")


def test_scale_rewards_and_advantage_norm_that_contradict_each_other_stop_the_config():
    with pytest.raises(ValueError, match="scale_rewards='none' asks for advantage_norm='mean' but advantage_norm='mean_std'"):
        BiPACEConfig(**COMMON, scale_rewards="none", advantage_norm="mean_std")
    # TRL's default "group" yields to ours
    assert BiPACEConfig(**COMMON, advantage_norm="mean").estimator.advantage_norm == "mean"


def test_reward_settings_with_no_step_level_form_are_refused_on_multi_turn_episodes_before_loading():
    with pytest.raises(ValueError, match="scale_rewards='batch' divides by one std over the whole batch"):
        BiPACETrainer(model="no/such-model", args=BiPACEConfig(**COMMON, scale_rewards="batch"), environment_factory=Thermostat)
    with pytest.raises(ValueError, match="multi_objective_aggregation='normalize_then_sum' normalises each reward"):
        BiPACETrainer(model="no/such-model", args=BiPACEConfig(**COMMON, multi_objective_aggregation="normalize_then_sum"),
                      environment_factory=Thermostat)
    with pytest.raises(ValueError, match="reward_weights weigh reward_funcs, and env_name='textcraft' gives one reward"):
        BiPACETrainer(model="no/such-model", args=BiPACEConfig(**COMMON, env_name="textcraft", reward_weights=[2.0]))
    with pytest.raises(ValueError, match="max_turn_length=64 must be >= 1 and at most max_completion_length"):
        BiPACEConfig(**COMMON, max_turn_length=64, max_completion_length=32)


# --------------------------------------------------------------------------- GRPOTrainer's advantage of one-step episodes


def _reference_advantages(rows, weights, group_size, scale, aggregation):
    """TRL's documented advantage, one row at a time in plain Python (None: the function returned None)."""

    def mean(values):
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    def std(values):  # unbiased; undefined (None) below two values, which TRL's NaN turns into advantage 0
        values = [v for v in values if v is not None]
        if len(values) < 2:
            return None
        m = sum(values) / len(values)
        return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))

    def group_of(values, i):
        start = i // group_size * group_size
        return values[start:start + group_size]

    unscorable = [all(r is None for r in row) for row in rows]
    if aggregation == "sum_then_normalize":
        total = [None if u else sum(w * r for w, r in zip(weights, row) if r is not None) for row, u in zip(rows, unscorable)]
        out = []
        for i, value in enumerate(total):
            if value is None:
                out.append(0.0)
                continue
            centred = value - mean(group_of(total, i))
            spread = std(total) if scale == "batch" else std(group_of(total, i))
            out.append(centred if scale == "none" else 0.0 if spread is None else centred / (spread + 1e-4))
        return out
    summed = []
    for i, row in enumerate(rows):
        terms = []
        for k, (w, r) in enumerate(zip(weights, row)):
            column = group_of([other[k] for other in rows], i)
            spread = std(column)
            if r is not None and spread is not None:
                terms.append(w * (r - mean(column)) / (spread + 1e-4))
        summed.append(None if unscorable[i] else sum(terms))
    spread, centre = std(summed), mean(summed)
    return [0.0 if v is None or spread is None else (v - centre) / (spread + 1e-4) for v in summed]


def test_grpo_advantages_match_a_hand_computation():
    one = torch.tensor([[1.0], [0.0], [0.0], [0.0], [1.0], [1.0], [1.0], [1.0]])
    weights = torch.tensor([1.0])
    assert grpo_advantages(one, weights, 4, "none").tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0])
    assert grpo_advantages(one, weights, 4, "group").tolist()[:4] == pytest.approx([0.75 / 0.5001] + [-0.25 / 0.5001] * 3)
    batch_std = math.sqrt(120 / 448)  # the std of all eight rewards, unbiased
    assert grpo_advantages(one, weights, 4, "batch").tolist()[:4] == pytest.approx(
        [0.75 / (batch_std + 1e-4)] + [-0.25 / (batch_std + 1e-4)] * 3)
    nan = float("nan")
    unscorable = torch.tensor([[nan], [1.0], [0.0], [0.5]])
    assert grpo_advantages(unscorable, weights, 4, "none").tolist() == pytest.approx([0.0, 0.5, -0.5, 0.0])


rewards = st.sampled_from([None, -1.0, 0.0, 0.25, 0.5, 1.0, 2.0])


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(), group_size=st.integers(2, 4), groups=st.integers(1, 3), functions=st.integers(1, 3),
    scale=st.sampled_from(["group", "batch", "none"]), aggregation=st.sampled_from(["sum_then_normalize", "normalize_then_sum"]),
)
def test_grpo_advantages_equal_the_plain_python_reference(data, group_size, groups, functions, scale, aggregation):
    rows = [data.draw(st.lists(rewards, min_size=functions, max_size=functions)) for _ in range(group_size * groups)]
    weights = data.draw(st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=functions, max_size=functions))
    # in float64: a batch std near 0 divides by about 1e-4, where float32 rounding alone moves the result
    table = torch.tensor([[float("nan") if r is None else r for r in row] for row in rows], dtype=torch.float64)
    ours = grpo_advantages(table, torch.tensor(weights, dtype=torch.float64), group_size, scale, aggregation)
    assert ours.tolist() == pytest.approx(_reference_advantages(rows, weights, group_size, scale, aggregation), rel=1e-6, abs=1e-6)


# --------------------------------------------------------------------------- TRL's token count, our own next to it


def test_num_tokens_counts_prompts_and_model_tokens_as_trl_and_ours_every_token_once():
    grown = [  # a chat that grew: TRL's one sample, prompt [1, 2, 3], replies [4, 5] and [8]; 6, 7 a tool result
        StepRecord(0, 0, 0, [1, 2, 3], [4, 5], "", "", True, None, "", 0.0),
        StepRecord(0, 0, 1, [1, 2, 3, 4, 5, 6, 7], [8], "", "", True, None, "", 0.0),
    ]
    assert trl_token_count(grown) == 3 + 2 + 1  # TRL's tool_mask leaves the tool result out
    assert processed_token_count(grown) == 3 + 2 + 2 + 1  # the model read the tool result
    re_rendered = [  # the template renders the reply otherwise than it was generated ([4, 9] for [4, 5])
        StepRecord(0, 1, 0, [1, 2, 3], [4, 5], "", "", True, None, "", 0.0),
        StepRecord(0, 1, 1, [1, 2, 3, 4, 9, 6, 7], [8], "", "", True, None, "", 0.0),
    ]
    assert trl_token_count(re_rendered) == 3 + 2 + 1 and processed_token_count(re_rendered) == 3 + 2 + 3 + 1
    rebuilt = [  # our envs' history window: the second prompt is rebuilt, a sample of its own
        StepRecord(0, 2, 0, [1, 2, 3], [4], "", "", True, None, "", 0.0),
        StepRecord(0, 2, 1, [1, 9, 9, 9], [5], "", "", True, None, "", 0.0),
    ]
    assert trl_token_count(rebuilt) == (3 + 1) + (4 + 1) and processed_token_count(rebuilt) == (3 + 1) + (3 + 1)
    assert trl_token_count(grown + rebuilt) == 6 + 9  # each episode against its own previous turn


# --------------------------------------------------------------------------- credit on look-alike states


class Rooms:
    """Two rooms; the key is in neither, and looking says so in the same words in both."""

    def reset(self, **kwargs) -> str:
        self.room = "hall"
        return "You are in the hall."

    def look(self) -> str:
        """
        Look around the room.

        Returns:
            What the room holds.
        """
        return "There is no key here."

    def go_east(self) -> str:
        """
        Walk into the east room.

        Returns:
            Where you are.
        """
        self.room = "east room"
        return "You are in the east room."


def test_identical_text_in_different_states_shares_a_cell_under_exact_matching_not_under_hidden_states(tokenizer):  # noqa: F811
    from bipace_trainer.models import tiny_qwen2

    scripts = [[call("look"), "Done."], [call("go_east"), call("look"), "Done."]]
    rollout, _ = play(tokenizer, Rooms, scripts)
    after_look = [i for i, step in enumerate(rollout.steps) if step.anchor == "There is no key here."]
    assert len(after_look) == 2 and {rollout.steps[i].traj for i in after_look} == {0, 1}  # the hall; the east room
    gigpo = estimate_advantages(rollout.step_batch(), BiPACEConfig(**COMMON, preset="gigpo").estimator)
    assert gigpo.cell[after_look[0]] == gigpo.cell[after_look[1]]  # one cell for two states: exact text matching
    # the hidden partition reads the model's state at the prompt's last token, and the prompts differ
    # (one holds the walk east): a fixed ε of 0 parts every two prompts that differ at all
    model = tiny_qwen2(tokenizer, layers=2).eval()
    with torch.no_grad():
        for step in rollout.steps:
            out = model(torch.tensor([step.prompt_ids]), output_hidden_states=True)
            step.hidden = out.hidden_states[-1][0, -1]
    bigpo = estimate_advantages(rollout.step_batch(), BiPACEConfig(**COMMON, preset="bigpo", cluster_eps="0.0").estimator)
    assert bigpo.cell[after_look[0]] != bigpo.cell[after_look[1]]


# --------------------------------------------------------------------------- the same script, more of TRL's cases


@pytest.mark.slow
def test_eval_dataset_with_eval_strategy_steps_logs_trls_eval_loss_and_eval_metrics(thermostat_policy_dir, tmp_path, monkeypatch):
    grpo, ours = run_both(thermostat_policy_dir, tmp_path, monkeypatch, case="eval")
    grpo_eval = {key for key in grpo.logged if key.startswith("eval_")}
    assert {"eval_loss", "eval_reward", "eval_num_tokens", "eval_completions/mean_length"} <= grpo_eval
    assert grpo_eval - ours.logged == set()  # every eval_* key GRPOTrainer logged, under the same name
    evals = [entry for entry in ours.state.log_history if "eval_loss" in entry]
    assert [entry["step"] for entry in evals] == [2, 4] and all(math.isfinite(entry["eval_loss"]) for entry in evals)
    assert all(0.0 <= entry["eval_rewards/Thermostat/mean"] <= 1.0 for entry in evals)
    # TRL's evaluation leaves the training's counters alone: the token count and the estimator's calls
    assert [e for e in ours.state.log_history if "num_tokens" in e][-1]["num_tokens"] == ours.state.num_input_tokens_seen
    assert ours.estimator.num_calls == len(ours.generations)


def _completions(batch) -> list[list[int]]:
    ids, mask = batch["completion_ids"], batch["completion_mask"]
    rows = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    return [row for row, m in zip(rows, mask) if m.any()]


@pytest.mark.slow
@pytest.mark.parametrize("case, config", [
    ("prompts", {}), ("prompts", {"scale_rewards": "none"}), ("prompts", {"scale_rewards": "batch"}),
    ("prompts", {"multi_objective_aggregation": "normalize_then_sum"}),
    # our evaluation before and after training plays the eval_dataset's rows: it leaves the random streams alone
    ("prompts+eval_dataset", {}),
], ids=["default", "scale-none", "scale-batch", "normalize-then-sum", "eval-dataset"])
def test_a_plain_grpo_script_trains_as_grpo_trainer_does(case, config, thermostat_policy_dir, tmp_path, monkeypatch):
    grpo, ours = run_both(thermostat_policy_dir, tmp_path, monkeypatch, case=case, max_steps=2, **config)
    if case == "prompts+eval_dataset":
        assert [e["tag"] for e in ours.eval_history] == ["before", "final"] and not grpo.state.log_history[0].get("eval_loss")
    assert ours.generations == grpo.generations == [8] and ours.state.global_step == grpo.state.global_step == 2
    theirs, mine = grpo.batches[0], ours.batches[0]
    # the same seed samples the same completions, scored by the same reward functions...
    assert _completions(mine) == _completions(theirs)
    # ... so each completion, a one-step episode, gets GRPOTrainer's advantage, and the same loss follows
    assert mine["advantages"][: len(theirs["advantages"])].tolist() == pytest.approx(theirs["advantages"].tolist(), abs=1e-6)
    assert float(theirs["advantages"].abs().sum()) > 0  # the rewards differ within a group: there is something to match
    their_logs, our_logs = ([e for e in t.state.log_history if "loss" in e] for t in (grpo, ours))
    assert [e["loss"] for e in our_logs] == pytest.approx([e["loss"] for e in their_logs], rel=1e-4, abs=1e-6)
    their_logs, our_logs = ([e for e in t.state.log_history if "reward" in e] for t in (grpo, ours))  # a generation's
    for key in ("reward", "reward_std", "rewards/short_reply/mean", "rewards/says_degrees/mean", "num_tokens",
                "frac_reward_zero_std", "completions/mean_length"):
        assert [e[key] for e in our_logs] == pytest.approx([e[key] for e in their_logs], rel=1e-4, abs=1e-6), key
    assert grpo.logged - ours.logged == set()


@pytest.mark.slow
@pytest.mark.parametrize("skip", [True, False], ids=["skip (ours)", "update (TRL's)"])
def test_a_generation_without_signal_skips_its_update_unless_told_as_grpo_trainer(
    skip, thermostat_policy_dir, tmp_path, monkeypatch
):
    """Two generations, the second without signal: GRPOTrainer still steps its optimizer there (Adam's
    moments move the weights); ours skips by default, and `skip_update_without_signal = False` trains
    as GRPOTrainer does, to the same weights."""
    monkeypatch.setattr(BiPACETrainer, "skip_update_without_signal", skip)
    grpo, ours = run_both(thermostat_policy_dir, tmp_path, monkeypatch, case="prompts+signal_once", max_steps=4)
    assert ours.generations == grpo.generations == [8, 8]
    skipped = [e["train/skipped_batches"] for e in ours.state.log_history if "train/skipped_batches" in e]
    assert skipped == ([0.0, 1.0] if skip else [0.0, 0.0])  # logged once per generation
    theirs, mine = dict(grpo.model.named_parameters()), dict(ours.model.named_parameters())
    apart = max(float((mine[name] - weight).abs().max()) for name, weight in theirs.items())
    # updating: float32 rounding of the same steps (1.8e-6 here); skipping: two Adam steps missing (5.5e-4)
    assert apart > 1e-4 if skip else apart < 2e-5


@pytest.mark.slow
def test_max_completion_length_caps_a_tool_episodes_whole_completion_and_max_turn_length_each_reply(
    thermostat_policy_dir, tmp_path, monkeypatch
):
    recorded = []
    monkeypatch.setattr(BiPACETrainer, "on_rollout", lambda self, rollout, advantages, diagnostics: recorded.append(rollout))
    grpo, ours = run_both(thermostat_policy_dir, tmp_path, monkeypatch, max_completion_length=64, max_steps=2)
    for trainer in (grpo, ours):
        assert max(e["completions/max_length"] for e in trainer.state.log_history if "completions/max_length" in e) <= 64
    first_prompt, longest = {}, 0
    for step in recorded[0].steps:
        first_prompt.setdefault(step.traj, len(step.prompt_ids))
        # every token after the episode's first prompt, replies and tool results, within TRL's budget
        longest = max(longest, len(step.prompt_ids) + len(step.completion_ids) - first_prompt[step.traj])
    # a second turn ran after a reply and its tool result (about 50 tokens), within what the 64 left
    assert any(step.t > 0 for step in recorded[0].steps) and 48 < longest <= 64
    # a per-turn cap of its own, below the episode's
    args = BiPACEConfig(**{**COMMON, "output_dir": str(tmp_path / "turns")}, max_completion_length=48, max_turn_length=5,
                        per_device_train_batch_size=4, num_generations=4, max_steps=1)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(thermostat_policy_dir)
    trainer = BiPACETrainer(model=str(thermostat_policy_dir), args=args, processing_class=tokenizer,
                            train_dataset=prompt_dataset(4), environment_factory=Thermostat)
    trainer.on_rollout = lambda rollout, advantages, diagnostics: recorded.append(rollout)
    trainer.train()
    trainer.close_envs()
    assert trainer.generation_config.max_new_tokens == 5
    assert all(len(step.completion_ids) <= 5 for step in recorded[-1].steps)


@pytest.mark.slow
def test_a_skipped_batch_logs_trls_loss_metrics_as_numbers(thermostat_policy_dir, tmp_path):
    args = BiPACEConfig(**{**COMMON, "output_dir": str(tmp_path)}, max_steps=2, per_device_train_batch_size=4,
                        num_generations=4, generation_batch_size=8, max_completion_length=8, beta=0.04, logging_steps=1,
                        disable_tqdm=True)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(thermostat_policy_dir)
    model = AutoModelForCausalLM.from_pretrained(thermostat_policy_dir)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = BiPACETrainer(model=model, args=args, processing_class=tokenizer, train_dataset=prompt_dataset(8),
                            reward_funcs=[lambda completions, **kwargs: [1.0] * len(completions)])  # no signal at all
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["train/skipped_batches"] for entry in logs if "train/skipped_batches" in entry] == [1.0]
    for entry in logs:
        names = ["entropy", "kl", *(f"clip_ratio/{n}" for n in ("low_mean", "high_mean", "region_mean", "low_min", "high_max"))]
        assert all(isinstance(entry[name], float) and math.isfinite(entry[name]) for name in names), entry
        assert all(entry[f"clip_ratio/{n}"] == 0.0 for n in ("low_mean", "high_mean", "region_mean"))  # zero advantages
        assert entry["entropy"] > 0
    assert all(torch.equal(before[name], p) for name, p in trainer.model.named_parameters())  # still no update


@pytest.mark.slow
def test_our_envs_take_trls_eval_dataset_and_keep_their_per_reply_cap(warm_policy, tmp_path):
    from bipace_trainer import task_dataset
    from tests.trainer.tiny_setup import TINY_ENV_KWARGS, tiny_args

    model, tokenizer = warm_policy
    args = tiny_args(tmp_path, preset="gigpo", eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4,
                     evaluate_before_training=False)
    trainer = BiPACETrainer(model, args=args, processing_class=tokenizer,
                            eval_dataset=task_dataset("tiny", "valid", TINY_ENV_KWARGS, limit=2))
    assert trainer.generation_config.max_new_tokens == args.max_completion_length == 16  # max_turn_length unset
    trainer.train()
    trainer.close_envs()
    evals = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    assert len(evals) == 1 and math.isfinite(evals[0]["eval_loss"])
    assert {"eval_episode/success_rate", "eval_reward", "eval_rewards/env_reward/mean", "eval_advantage/std"} <= set(evals[0])
