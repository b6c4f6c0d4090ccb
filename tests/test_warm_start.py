"""The warm start (bipace_trainer/run/warm_start.py) and the run summary (bipace_trainer/reports/run_summary.py):
hand-computed intervals, demonstrations built as the rollout builds prompts, clear errors,
and the main job's path on the tiny setup: warm start -> RL whose batches carry signal -> eval."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bipace_trainer.cli import preflight, train  # noqa: E402
from bipace_trainer.rollout.prompting import build_messages  # noqa: E402
from bipace_trainer.reports.run_summary import (  # noqa: E402
    evaluation_summary, format_evaluation, learning_curve, wilson_interval,
)
from bipace_trainer.run.warm_start import (  # noqa: E402
    WarmStartArguments,
    apply_warm_start,
    demonstration_rows,
    load_warm_start,
)
from envs.base import StepResult, TaskSpec, TextEnv, register_env  # noqa: E402
from envs.tiny import TinyEnv  # noqa: E402

TINY = ["--env", "tiny", "--env_kwargs", '{"size": 4}', "--max_turns", "4", "--max_completion_length", "16",
        "--use_cpu", "true", "--cluster_layer", "-1", "--dtype", "float32", "--warm_start_from", ""]  # fmt: skip
# A random-init tiny model cannot learn the reply format through low-rank updates of random
# weights alone: its embeddings and output head train in full next to the adapter.
TINY_LORA = ["--lora_r", "8", "--lora_alpha", "16", "--lora_target_modules", "q_proj", "k_proj", "v_proj", "o_proj",
             "gate_proj", "up_proj", "down_proj", "--lora_modules_to_save", "lm_head", "embed_tokens"]  # fmt: skip


def test_wilson_interval_hand_values():
    # 3 of 8: centre (0.375 + 0.2401) / 1.4802 = 0.4156, half 1.96 * sqrt(0.0293 + 0.0150) / 1.4802 = 0.2787
    assert wilson_interval(3, 8) == pytest.approx((0.13684, 0.69426), abs=1e-5)
    assert wilson_interval(0, 8) == pytest.approx((0.0, 0.32442), abs=1e-5)
    assert wilson_interval(8, 8) == pytest.approx((0.67558, 1.0), abs=1e-5)
    with pytest.raises(ValueError, match="n=0"):
        wilson_interval(0, 0)


def test_summary_lines_and_curve():
    summary = evaluation_summary({"num_tasks": 8, "success_rate": 0.375, "valid_action_rate": 0.95, "step": 0})
    assert (summary["successes"], summary["episodes"]) == (3, 8)
    assert format_evaluation("before", summary) == "before: 0.375 (3 of 8 episodes, 95% CI 0.137-0.694), valid actions 0.95"
    history = [
        {"eval/success_rate": 0.5, "step": 0},
        {"episode/success_rate": 0.25, "episode/invalid_action_rate": 0.1, "loss": 0.3, "train/skipped_batches": 0.0, "step": 1},
        {"train_runtime": 3.0, "step": 1},
        {"episode/success_rate": 0.5, "train/resamples": 2.0, "episode/success_rate_all_played": 1 / 6, "step": 2},
    ]
    assert learning_curve(history) == [
        {"step": 1, "batch_success": 0.25, "valid_rate": pytest.approx(0.9), "loss": 0.3, "skipped": 0.0},
        {"step": 2, "batch_success": 0.5, "resamples": 2.0, "played_success": 1 / 6},
    ]


def test_demonstrations_are_rl_prompts_on_training_tasks():
    _, config, _ = train.parse_args([*TINY, "--history_length", "1"])
    rows = demonstration_rows(config, WarmStartArguments(warm_start_steps=1, warm_start_tasks=0, warm_start_expert_prob=1.0))
    train_ids = {spec.task_id for spec in TinyEnv.tasks("train", size=4)}
    assert {row["task_id"] for row in rows} == train_ids  # never an evaluation task
    env = TinyEnv(size=4)
    first = rows[0]
    result = env.reset(first["task_id"])
    expected = build_messages(env.instruction, env.task, [], result.observation, result.admissible_actions,
                              step_index=0, history_length=1)  # fmt: skip
    assert first["prompt"] == expected
    assert first["completion"][0]["content"] == f"<think></think><action>{env.expert_action()}</action>"
    assert all(row["won"] for row in rows)


@register_env("no-expert-test")
class _NoExpert(TextEnv):
    instruction = "Nothing to do."

    @classmethod
    def tasks(cls, split="train", **kwargs):
        return [TaskSpec(0, split)]

    @classmethod
    def splits(cls):
        return ("train", "valid")

    def reset(self, task_id):
        return StepResult("o", 0.0, True, False, [])

    def step(self, action):
        return StepResult("o", 0.0, True, False, [])


def test_clear_errors(tmp_path):
    _, config, _ = train.parse_args(["--env", "no-expert-test", "--warm_start_from", ""])
    with pytest.raises(ValueError, match=r"warm_start_steps=5: env_name='no-expert-test' has no expert.*--warm_start_from"):
        demonstration_rows(config, WarmStartArguments(warm_start_steps=5))
    with pytest.raises(ValueError, match=r"warm_start_from=.*no adapter_config.json.*--warm_start_steps N"):
        load_warm_start(object(), tmp_path)
    with pytest.raises(ValueError, match=r"warm_start_expert_prob=1.5 must lie in \[0, 1\]"):
        WarmStartArguments(warm_start_expert_prob=1.5)
    with pytest.raises(SystemExit):  # train.py: error: warm_start_steps=-1 must be >= 0 ...
        train.parse_args(["--warm_start_steps", "-1"])
    with pytest.raises(preflight.ConfigError, match=r"warm_start_steps=5: env_name='no-expert-test' has no expert"):
        train.main(*train.parse_args(["--env", "no-expert-test", "--warm_start_steps", "5"]))


def test_the_main_job_loads_the_shipped_adapter_by_default():
    script_args, config, model_args = train.parse_args([])
    assert script_args.warm_start_from == train.SHIPPED_WARM_START and script_args.warm_start_steps == 0
    assert (Path(train.SHIPPED_WARM_START) / "adapter_config.json").is_file()


def test_a_loaded_adapter_names_the_base_model_it_sits_on_now(tmp_path):
    """The shipped warm start was built on another machine, and its adapter_config.json names that
    machine's cache path as the base model. Loaded here, the adapter must name this run's base model,
    so the adapters RL saves point at a model that exists (bipace-eval loads their base from it) and
    peft, which looks for the base model's config when it saves, warns nothing."""
    import warnings

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.trainer.tiny_setup import make_model, make_tokenizer

    built, here = tmp_path / "built_elsewhere", tmp_path / "here"
    tokenizer = make_tokenizer()
    make_model(tokenizer).save_pretrained(built)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    get_peft_model(AutoModelForCausalLM.from_pretrained(built), lora).save_pretrained(tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(built)
    built.rename(here)  # the machine the adapter was built on is gone

    policy = load_warm_start(AutoModelForCausalLM.from_pretrained(here), tmp_path / "adapter")
    assert policy.peft_config["default"].base_model_name_or_path == str(here)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        policy.save_pretrained(tmp_path / "after_rl")
    assert not [w for w in caught if "Could not find a config file" in str(w.message)]
    assert json.loads((tmp_path / "after_rl" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(here)


@pytest.mark.slow
def test_warm_start_then_rl_then_eval(raw_tiny_dir, tmp_path):
    """train.py's main-job path on the tiny setup: SFT on expert play makes the random policy act
    (valid replies, some wins), RL batches have non-zero advantages (or resample before skipping), the run
    evaluates after RL,
    writes the curve, and the saved adapter starts a later run (--warm_start_from)."""
    run = tmp_path / "run"
    argv = [*TINY, *TINY_LORA, "--model_name_or_path", str(raw_tiny_dir), "--output_dir", str(run),
            "--warm_start_steps", "60", "--warm_start_learning_rate", "1e-2", "--warm_start_batch_size", "8",
            "--warm_start_tasks", "0", "--max_steps", "3", "--learning_rate", "5e-3", "--eval_tasks", "0",
            "--eval_rollouts_per_task", "4", "--summary_file", str(tmp_path / "summary.json")]  # fmt: skip
    summary = train.main(*train.parse_args(argv))
    assert summary["warm_start"]["loss"][-1]["loss"] < summary["warm_start"]["loss"][0]["loss"] / 4
    before, after = summary["before"], summary["after"]
    assert before["valid_action_rate"] >= 0.5 and before["successes"] > 0
    assert after is not None and after["step"] == 3 and after["episodes"] == before["episodes"] == 8
    assert [row["step"] for row in summary["curve"]] == [1, 2, 3]
    curve = summary["curve"]
    assert curve[0]["skipped"] == 0.0 and curve[0]["advantage_std"] > 0  # the warm start's play has signal
    # a later batch may have none left (the policy wins every rollout of its goals): skipped only after its
    # resampling (the main job's resample_without_signal = 2) found none either
    assert all(row["advantage_std"] > 0 if row["skipped"] == 0.0 else row["resamples"] == 2.0 for row in curve)
    assert Path(summary["plot"]).stat().st_size > 10_000 and (tmp_path / "summary.json").is_file()

    # the saved warm start is the adapter RL started from: it loads, trainable, with the same weights
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    script_args, config, model_args = train.parse_args([*argv, "--warm_start_steps", "0", "--warm_start_from",
                                                        str(run / "warm_start")])  # fmt: skip
    model, peft_config, report = apply_warm_start(
        AutoModelForCausalLM.from_pretrained(raw_tiny_dir), None, script_args, config, object()
    )
    assert peft_config is None and report == {"adapter": str(run / "warm_start")}
    saved = load_file(run / "warm_start" / "adapter_model.safetensors")
    params = {name.replace(".default", ""): p for name, p in model.named_parameters() if "lora_" in name}
    lora_keys = [key for key in saved if "lora_" in key]
    assert lora_keys and all(params[key].requires_grad for key in lora_keys)
    assert all(torch.equal(params[key], saved[key]) for key in lora_keys)


@pytest.mark.slow
def test_warm_start_is_bit_for_bit_reproducible(raw_tiny_dir, tmp_path):
    """What bench/warm_start_adapter.py relies on: the same settings give the same adapter bytes on a CPU."""
    digests = []
    for name in ("a", "b"):
        argv = [*TINY, *TINY_LORA, "--model_name_or_path", str(raw_tiny_dir), "--output_dir", str(tmp_path / name),
                "--warm_start_steps", "6", "--warm_start_tasks", "0"]  # fmt: skip
        script_args, config, model_args = train.parse_args(argv)
        from transformers import AutoModelForCausalLM
        from trl import get_peft_config

        from bipace_trainer.models import load_tokenizer

        apply_warm_start(
            AutoModelForCausalLM.from_pretrained(raw_tiny_dir), load_tokenizer(raw_tiny_dir), script_args, config,
            get_peft_config(model_args),
        )
        digests.append(hashlib.sha256((tmp_path / name / "warm_start" / "adapter_model.safetensors").read_bytes()).hexdigest())
    assert digests[0] == digests[1]


@pytest.mark.slow
def test_main_job_eval_bench_plays_every_held_out_goal_the_asked_number_of_times(raw_tiny_dir, tmp_path):
    """bench/main_job_eval.py on the tiny setup: each adapter plays each `valid` goal --rollouts times."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from bench import main_job_eval

    adapter = tmp_path / "adapter"
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    get_peft_model(AutoModelForCausalLM.from_pretrained(raw_tiny_dir), lora).save_pretrained(adapter)
    flags = [*TINY[:-2], "--model_name_or_path", str(raw_tiny_dir), "--lora_r", "4", "--lora_alpha", "8",
             "--lora_target_modules", "q_proj", "v_proj"]  # fmt: skip
    results = main_job_eval.main([str(adapter), str(adapter), "--rollouts", "3", "--output_dir", str(tmp_path / "eval"),
                                  *flags])  # fmt: skip
    goals = len(TinyEnv.tasks("valid", size=4))
    assert [r["num_tasks"] for r in results] == [3 * goals, 3 * goals]
    assert results[0]["temperature"] == 0.4 and all(0.0 <= r["success_rate"] <= 1.0 for r in results)
    # through bipace-eval: the same adapter twice plays the same episodes (seeds 123, 456, 789 once each)
    assert [r["label"] for r in results] == ["adapter", "adapter-2"] and results[0]["per_seed"] == results[1]["per_seed"]
    written = json.loads((tmp_path / "eval" / "bipace_eval.json").read_text())
    assert written["paired"][0]["difference"] == 0.0 and written["protocol"]["seeds"] == [123, 456, 789]


def test_the_fingerprint_of_a_large_embedding_stays_inside_it():
    """SmolLM2-135M's embedding holds 49,152 × 576 = 28,311,552 values: float32 rounds the last of 64 evenly
    spaced positions to 28,311,552, one past the end (every `--warm_start_steps` run of the embedded model
    stopped there)."""
    import torch

    from bipace_trainer.run.warm_start import base_fingerprint

    class Embedded(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(49_152, 576)
            with torch.no_grad():
                self.embed.weight.view(-1)[-1] = 7.0  # the last value: the fingerprint's last entry

        def get_input_embeddings(self):
            return self.embed

    fingerprint = base_fingerprint(Embedded())
    assert len(fingerprint) == 64 and fingerprint[-1] == 7.0
