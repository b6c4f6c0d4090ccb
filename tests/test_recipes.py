"""Recipes mean what they say: through train.py's real parser each resolves to exactly its
YAML plus the dataclasses' documented defaults (never the main job's CPU-demo defaults),
holds the papers' setting, and is documented in docs/RECIPES.md; `--print_config` shows
the resolved configuration without loading a model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bipace_trainer.cli import train  # noqa: E402

RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
# docs/concepts/math.md#paper-setups, shared by every recipe: G, task groups, lr, KL, clip, γ, penalty, history, temperatures
PAPERS = dict(num_generations=8, tasks_per_iteration=16, learning_rate=1e-6, beta=0.01, epsilon=0.2, step_gamma=0.95,
              invalid_action_penalty=0.1, history_length=2, temperature=1.0, eval_temperature=0.4)
CLUSTERING = {"7b": (-8, "0.10"), "1.5b": (-12, "0.05")}  # docs/concepts/math.md#hidden-partition: layer and ε per model size
MAX_TURNS = {"alfworld": 50, "webshop": 15, "textcraft": 30, "scienceworld": 30}
# HGPO's public scripts (verl-agent recipe/hgpo/run_qwen2.5_*_train.sh, b4918cc; docs/concepts/math.md#hgpo): K = the
# history window, α = 1, no base group, ALFWorld mean_std_norm, WebShop mean_norm with ≤ 30 steps
HGPO = {"alfworld": dict(advantage_norm="mean_std", max_turns=50), "webshop": dict(advantage_norm="mean", max_turns=30)}
EVAL_SPLIT = {"alfworld": "valid_unseen", "webshop": "test", "textcraft": "test_ood", "scienceworld": "test"}
# GraphGPO's public scripts (verl-agent recipe/GraphGPO/run_qwen2.5_*_train.sh, commit 234a913): the graph
# return's γ (ALFWorld 0.1, WebShop 0.2), weights 1, mean_std_norm, no normalize_distance, no merge
GRAPHGPO = {"alfworld": dict(step_gamma=0.1), "webshop": dict(step_gamma=0.2)}
# BEACON's public scripts (ZJU-REAL/BEACON examples/migpo_trainer/run_{alfworld,webshop,sciworld}.sh, db9347f): the
# segment rewards' γ and weight, mode mean_norm, threshold 0.95, ≤ 30 steps with the whole history (ALFWorld,
# ScienceWorld), WebShop's invalid penalty 1
BEACON = {
    "alfworld": dict(step_gamma=0.9, w_step=10.0, max_turns=30, history_length=30),
    "webshop": dict(step_gamma=0.95, w_step=1.0, max_turns=15, invalid_action_penalty=1.0),
    "scienceworld": dict(step_gamma=0.95, w_step=1.0, max_turns=30, history_length=30),
}
# Fields that decide what a run does; those a recipe does not set must be the documented defaults
# (generation_batch_size is derived: tasks_per_iteration × num_generations, checked below).
MATTERS = [
    "model_name_or_path", "dtype", "use_peft", "lora_r", "lora_alpha", "lora_target_modules", "load_in_4bit",
    "save_strategy", "save_steps", "save_total_limit", "report_to", "output_dir", "per_device_train_batch_size",
    "gradient_accumulation_steps", "learning_rate", "lr_scheduler_type", "warmup_steps",
    "beta", "epsilon", "step_gamma", "invalid_action_penalty", "cluster_eps", "cluster_layer", "history_length",
    "max_turns", "temperature", "eval_temperature", "eval_split", "train_split", "max_steps", "max_completion_length",
    "seed", "eval_tasks", "eval_interval", "num_iterations", "loss_type", "rollout_dump_steps", "use_vllm",
]  # fmt: skip


def parse(argv):
    return train.parse_args(argv)


def value(parsed, key):
    for args in parsed:
        if hasattr(args, key):
            found = getattr(args, key)
            return found.value if hasattr(found, "value") else found  # enums (save_strategy, ...) → their string
    raise KeyError(key)


def as_resolved(key, raw):
    """A YAML value in the form the parser gives it."""
    if key == "report_to" and isinstance(raw, str):
        return [] if raw == "none" else [raw]
    if key == "env_kwargs" and isinstance(raw, str):
        return json.loads(raw)
    return raw


@pytest.fixture(scope="module")
def documented_defaults(tmp_path_factory):
    """What a recipe that sets nothing resolves to: the dataclasses' own defaults."""
    empty = tmp_path_factory.mktemp("recipe") / "empty.yaml"
    empty.write_text("{}\n")
    return parse(["--config", str(empty), "--use_cpu", "true"])


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_is_its_yaml_plus_documented_defaults(recipe, documented_defaults):
    written = yaml.safe_load(recipe.read_text())
    parsed = parse(["--config", str(recipe), "--use_cpu", "true"])
    for key, raw in written.items():
        assert value(parsed, key) == as_resolved(key, raw), key
    for key in MATTERS:
        if key not in written:
            assert value(parsed, key) == value(documented_defaults, key), key


def test_the_main_job_defaults_apply_only_without_a_config(documented_defaults):
    main_job = parse([])
    for key, demo in train.MAIN_JOB_DEFAULTS.items():
        assert value(main_job, key) == as_resolved(key, demo), key
    # a config that sets nothing gets the dataclasses' defaults, not the demo's
    assert value(documented_defaults, "use_peft") is False and value(documented_defaults, "save_strategy") == "steps"
    assert value(documented_defaults, "max_steps") == -1 and value(documented_defaults, "max_turns") == 15
    # flags still go on top of either
    assert value(parse(["--max_steps", "5"]), "max_steps") == 5
    assert value(parse(["--max_steps", "5"]), "use_peft") is True


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_holds_the_papers_setting(recipe):
    env, size, preset = recipe.stem.split("_")[0], recipe.stem.split("-")[1].split("_")[0], recipe.stem.split("_", 2)[2]
    written = yaml.safe_load(recipe.read_text())
    parsed = parse(["--config", str(recipe), "--use_cpu", "true"])
    assert (value(parsed, "env_name"), value(parsed, "preset")) == (env, preset)
    assert value(parsed, "model_name_or_path") == f"Qwen/Qwen2.5-{size.upper()}-Instruct"
    own = {"graphgpo": GRAPHGPO, "beacon": BEACON}.get(preset, {}).get(env, {})
    for key, expected in {**PAPERS, **own}.items():
        assert value(parsed, key) == expected, key
    assert (value(parsed, "cluster_layer"), value(parsed, "cluster_eps")) == CLUSTERING[size]
    turns = HGPO[env]["max_turns"] if preset == "hgpo" else own.get("max_turns", MAX_TURNS[env])
    assert value(parsed, "max_turns") == turns and value(parsed, "eval_split") == EVAL_SPLIT[env]
    if preset == "hgpo":
        assert value(parsed, "advantage_norm") == HGPO[env]["advantage_norm"]
        assert value(parsed, "context_levels") == value(parsed, "history_length") == 2
        assert (value(parsed, "level_alpha"), value(parsed, "base_group")) == (1.0, False)
        estimator = next(args for args in parsed if hasattr(args, "estimator")).estimator
        resolved = (estimator.step_partition, estimator.step_baseline, estimator.w_ep, estimator.context_levels)
        assert resolved == ("hash", "hierarchy", 0.0, 2)
    if preset == "graphgpo":
        estimator = next(args for args in parsed if hasattr(args, "estimator")).estimator
        resolved = (estimator.step_partition, estimator.step_baseline, estimator.step_return, estimator.w_ep, estimator.w_step)
        assert resolved == ("hash", "mean", "graph", 1.0, 1.0) and estimator.advantage_norm == "mean_std"
        assert (estimator.normalize_distance, estimator.similarity_merge, estimator.similarity_threshold) == (False, False, 0.95)
    if preset == "beacon":
        estimator = next(args for args in parsed if hasattr(args, "estimator")).estimator
        resolved = (estimator.step_partition, estimator.step_baseline, estimator.step_return, estimator.advantage_norm)
        assert resolved == ("segment", "mean", "milestone", "mean") and estimator.milestone_threshold == 0.95
        assert (estimator.w_ep, estimator.w_step, estimator.step_gamma) == (1.0, BEACON[env]["w_step"], BEACON[env]["step_gamma"])
    assert value(parsed, "generation_batch_size") == 16 * 8
    # the settings that used to leak from the CPU demo are written out: no LoRA, checkpoints, a tracker
    for key in ("use_peft", "save_strategy", "save_steps", "report_to", "lr_scheduler_type"):
        assert key in written, key
    assert value(parsed, "use_peft") is False and value(parsed, "save_strategy") == "steps"
    assert value(parsed, "report_to") == ["tensorboard"] and value(parsed, "lr_scheduler_type") == "constant"
    assert value(parsed, "output_dir") == f"outputs/{recipe.stem}"


def test_every_env_and_size_of_the_bipace_paper_has_a_bipace_q_recipe():
    """arXiv 2606.25556 reports BiPACE_Q on ALFWorld and TextCraft at 1.5B and 7B, and on WebShop at 7B (1.5B: the
    other papers' WebShop rows): a recipe for each, with the paper's clustering (`CLUSTERING`)."""
    names = {recipe.stem for recipe in RECIPES}
    for env in ("alfworld", "textcraft", "webshop"):
        for size in ("1.5b", "7b"):
            assert f"{env}_qwen2.5-{size}_bipace_q" in names, (env, size)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_a_recipes_success_rate_is_the_papers_validation_success(recipe):
    """What `evaluate_policy` plays and reports for the recipe: the whole validation split, one episode per task,
    the training turn budget, temperature 0.4; its success rate is the share of won episodes over all of them
    (not a mean of per-type rates), and WebShop's reported score is the mean over every episode, 0 without a
    purchase (the papers' "score" is 100 × it)."""
    from bipace_trainer.run.evaluation import evaluation_settings, summarise_evaluation

    env = recipe.stem.split("_")[0]
    args = next(a for a in parse(["--config", str(recipe), "--use_cpu", "true"]) if hasattr(a, "estimator"))
    played = evaluation_settings(args)
    assert (played["tasks"], played["episodes_per_task"], played["temperature"]) == (0, 1, 0.4)
    assert played["max_turns"] == args.max_turns and args.eval_split == EVAL_SPLIT[env]
    records = [{"won": won, "length": 3, "failed": False, "task_type": kind, "score": score}
               for won, kind, score in [(True, "a", 1.0), (False, "a", 0.5), (False, "a", 0.0), (True, "b", 1.0)]]
    summary = summarise_evaluation(records, "task_type")
    assert summary["success_rate"] == 0.5 and summary["per_type"] == {"task_type=a": 1 / 3, "task_type=b": 1.0}
    assert summary["score"] == pytest.approx(0.625)


def test_flags_override_a_recipe():
    parsed = parse(["--config", str(RECIPES[0]), "--use_cpu", "true", "--use_peft", "true", "--lora_r", "8",
                    "--report_to", "none"])
    assert value(parsed, "use_peft") is True and value(parsed, "lora_r") == 8 and value(parsed, "report_to") == []


def test_recipes_md_documents_every_recipe_and_setting():
    doc = (ROOT / "docs" / "RECIPES.md").read_text()
    for recipe in RECIPES:
        assert f"`{recipe.name}`" in doc, recipe.name
        for key in yaml.safe_load(recipe.read_text()):
            assert f"| `{key}` |" in doc, f"{recipe.name}: {key} has no row in docs/RECIPES.md"


def test_print_config_prints_the_resolved_recipe_without_loading_a_model():
    recipe = ROOT / "recipes" / "alfworld_qwen2.5-7b_bipace_q.yaml"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRL_EXPERIMENTAL_SILENCE="1")
    cmd = [sys.executable, "train.py", "--config", str(recipe), "--print_config", "--use_cpu", "true"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    text = done.stdout
    assert text.startswith("# script")  # stdout is the YAML alone (env notes go to stderr), ready for > file.yaml
    printed = yaml.safe_load(text)  # flat: the keys a recipe or a flag sets
    parsed = parse(["--config", str(recipe), "--use_cpu", "true"])
    for key in ("model_name_or_path", "use_peft", "lora_r", "save_strategy", "save_steps", "report_to", "learning_rate",
                "beta", "cluster_layer", "cluster_eps", "max_turns", "eval_split", "preset"):
        assert printed[key] == value(parsed, key), key
    assert "#   step_partition: hidden" in text and "#   step_baseline: pace_q" in text  # the preset, resolved
    assert "Loading weights" not in done.stderr and "model.safetensors" not in done.stderr  # no model was loaded


def test_qlora_fails_clearly_before_the_model_loads(tmp_path):
    missing_model = str(tmp_path / "no-such-model")  # loading it would raise OSError, not our message
    base = ["--model_name_or_path", missing_model, "--env", "tiny", "--preset", "grpo", "--use_cpu", "true"]
    with pytest.raises(ValueError, match="load_in_4bit=True quantizes the base model.*--use_peft true"):
        train.main(*parse([*base, "--use_peft", "false", "--load_in_4bit", "true"]))
    import importlib.util

    expected = "needs bitsandbytes" if importlib.util.find_spec("bitsandbytes") is None else "needs a CUDA GPU"
    with pytest.raises(ValueError, match=f"load_in_4bit=True {expected}"):
        train.main(*parse([*base, "--load_in_4bit", "true"]))
    with pytest.raises(ValueError, match=f"load_in_8bit=True {expected}"):
        train.main(*parse([*base, "--load_in_8bit", "true"]))


def test_a_missing_tracker_fails_before_the_model_loads(tmp_path):
    missing_model = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError, match=r"report_to=\['clearml'\]: \['clearml'\] not installed"):
        train.main(*parse(["--model_name_or_path", missing_model, "--env", "tiny", "--preset", "grpo",
                           "--report_to", "clearml", "--use_cpu", "true", "--output_dir", str(tmp_path / "run")]))
