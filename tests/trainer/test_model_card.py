"""The model card pushed with a recipe run (to a recording stand-in for the Hub API) says
what was trained, from what, how, how well per task type, where its metrics are and
which papers to cite, and links nowhere the project does not state."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from bipace_trainer.reports.model_card import PAPERS, project_url, tracker_links

from .test_checkpoints import RecordingHubApi
from .test_recipe_run import shrunk_recipe

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bipace_trainer.cli import train  # noqa: E402


@pytest.mark.slow
def test_the_card_pushed_with_a_recipe_run(warm_policy_dir, tmp_path, monkeypatch):
    import transformers.trainer

    hub = RecordingHubApi()
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: hub)
    # the stand-in is the Hub here: the pre-flight's token and network check has nothing to reach
    monkeypatch.setattr(train.preflight, "check_hub_access", lambda repo: None)
    path, recipe = shrunk_recipe(tmp_path, warm_policy_dir, max_steps=1, save_strategy="no", push_to_hub=True,
                                 hub_model_id="tiny-agent")
    summary = train.main(*train.parse_args(["--config", str(path)]))

    upload = hub.uploads[-1]
    assert upload["message"] == "gigpo on tiny" and "model.safetensors" in upload["files"]
    card = upload["files"]["README.md"].decode()
    front_matter = yaml.safe_load(card.split("---")[1])
    assert front_matter["library_name"] == "transformers"  # the recipe trains every parameter
    assert "base_model" not in front_matter  # a local checkpoint has no Hub id to link
    assert "from base model `a local checkpoint (model)`" in card and "every parameter trained" in card
    assert "**tiny**" in card and "preset **gigpo**" in card and f"- recipe: `{path}`" in card
    # the project's own link only when its metadata states one, never a placeholder
    assert "https://github.com/)" not in card
    # without one, the install that works: there is no bipace-trainer on PyPI
    import torch

    checkout = f"bipace-trainer (not on PyPI; from a checkout of its repository: `pip install torch=={torch.__version__.split('+')[0]} -e .`)"
    assert (f"[bipace-trainer]({project_url()})" if project_url() else checkout) in card
    assert "pip install bipace-trainer" not in card
    # evaluation per task type, after and before training
    final, before = summary["success_after"], summary["success_before"]
    assert f"| all | {final:.3f} | {before:.3f} |" in card
    for task_type, success in summary["per_type_after"].items():
        assert f"| {task_type} | {success:.3f} |" in card
    assert "- tracking: TensorBoard logs in the training output's `runs/`" in card  # the recipe's tracker
    title, url = PAPERS["gigpo"]
    assert f"- [{title}]({url})" in card and "@article{shao2024deepseekmath" in card and "vonwerra2020trl" in card


def test_tracker_links():
    assert tracker_links([]) == []
    assert tracker_links(["tensorboard"]) == ["TensorBoard logs in the training output's `runs/`"]


def test_the_card_from_plain_values_without_a_trainer(tmp_path):
    # the card takes the run's values, not the trainer: built here from a config, a stand-in
    # model (a LoRA config on it) and an evaluation history
    from types import SimpleNamespace

    from bipace_trainer import BiPACEConfig
    from bipace_trainer.reports.model_card import model_card

    args = BiPACEConfig(output_dir=str(tmp_path), use_cpu=True, env_name="tiny", preset="gigpo", report_to="none")
    model = SimpleNamespace(config=SimpleNamespace(name_or_path="Qwen/Qwen2.5-1.5B-Instruct"),
                            peft_config={"default": SimpleNamespace(r=8, lora_alpha=16)})
    history = [
        {"tag": "before", "success_rate": 0.25, "num_tasks": 8, "per_type": {"depth=1": 0.5}},
        {"tag": "final", "success_rate": 0.625, "num_tasks": 8, "per_type": {"depth=1": 0.75, "depth=2": 0.5}},
    ]
    card = model_card(args, model, "my-agent", steps=12, env="tiny", report_key="depth", eps=0.05,
                      eval_history=history, recipe="recipes/x.yaml", trackers=[])
    front_matter = yaml.safe_load(card.split("---")[1])
    assert front_matter["base_model"] == "Qwen/Qwen2.5-1.5B-Instruct" and front_matter["library_name"] == "peft"
    assert "# my-agent" in card and "- 12 optimizer steps" in card and "LoRA r 8, α 16" in card
    assert "- recipe: `recipes/x.yaml`" in card and "- tracking: none" in card
    assert f"- cluster layer {args.cluster_layer}, ε 0.05" in card
    assert "| depth | success after training | before training |" in card
    assert "| all | 0.625 | 0.250 |" in card and "| depth=1 | 0.750 | 0.500 |" in card and "| depth=2 | 0.500 | – |" in card
    assert "pip install bipace-trainer" not in card and ("-e .`" in card or "](" in card.split("trained with step-level RL by")[1])
    no_eval = model_card(args, model, "my-agent", steps=0, env="tiny", report_key=None, eps=None, eval_history=[])
    assert "No final evaluation was run." in no_eval and "- no clustering ε" in no_eval
