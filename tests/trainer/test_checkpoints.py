"""Push to the Hub (against a recording stand-in for its API), and resume from a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM

from bipace_trainer import BiPACETrainer
from bipace_trainer.models import load_tokenizer

from .tiny_setup import LORA, StopAfter, lora_state, tiny_args


class RecordingHubApi:
    """Stands in for `huggingface_hub.HfApi` as transformers' Trainer uses it."""

    def __init__(self):
        self.created: list[str] = []
        self.uploads: list[dict] = []

    def create_repo(self, repo_id, token=None, private=None, exist_ok=False, **kwargs):
        self.created.append(repo_id)
        return SimpleNamespace(repo_id=f"someone/{repo_id.split('/')[-1]}")

    def upload_folder(self, repo_id, folder_path, commit_message=None, ignore_patterns=(), **kwargs):
        folder = Path(folder_path)
        files = {
            str(p.relative_to(folder)): p.read_bytes()
            for p in folder.rglob("*")
            if p.is_file() and not any(p.relative_to(folder).match(pattern) for pattern in ignore_patterns or ())
            and not str(p.relative_to(folder)).startswith("checkpoint-")
        }
        self.uploads.append({"repo_id": repo_id, "message": commit_message, "files": files})
        return SimpleNamespace(commit_url=f"https://hub.invalid/{repo_id}")


@pytest.mark.slow
def test_push_to_hub_uploads_adapter_and_model_card(warm_policy, tmp_path, monkeypatch):
    import transformers.trainer

    hub = RecordingHubApi()
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: hub)
    model, tokenizer = warm_policy
    args = tiny_args(tmp_path / "run", preset="bipace_q", push_to_hub=True, hub_model_id="tiny-agent", max_steps=1)
    trainer = BiPACETrainer(model, args=args, processing_class=tokenizer, peft_config=LoraConfig(**LORA))
    trainer.train()
    trainer.push_to_hub(commit_message="bipace_q on tiny")
    trainer.close_envs()

    assert hub.created == ["tiny-agent"]
    upload = hub.uploads[-1]
    assert upload["repo_id"] == "someone/tiny-agent" and upload["message"] == "bipace_q on tiny"
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md", "eval_results.json"} <= set(upload["files"])
    card = upload["files"]["README.md"].decode()
    final = trainer.eval_history[-1]
    assert final["tag"] == "final"
    assert "**tiny**" in card and "bipace_q" in card and "library_name: peft" in card
    assert f"**{final['success_rate']:.3f}**" in card  # the final evaluation is in the card


def comparable_logs(trainer):
    keys = ("loss", "episode/success_rate", "episode/steps", "advantage/mean", "estimator/cluster_eps")
    return [{k: e[k] for k in keys if k in e} for e in trainer.state.log_history if "loss" in e]


@pytest.mark.slow
def test_resume_continues_the_run_as_if_uninterrupted(warm_policy_dir, tmp_path):
    def make(run_dir, **kw):
        model = AutoModelForCausalLM.from_pretrained(warm_policy_dir)
        tokenizer = load_tokenizer(warm_policy_dir)
        args = tiny_args(run_dir, preset="bipace_q", max_steps=4, save_strategy="steps", save_steps=2,
                         evaluate_before_training=False, **kw)
        return BiPACETrainer(model, args=args, processing_class=tokenizer, peft_config=LoraConfig(**LORA))

    straight = make(tmp_path / "straight")
    straight.train()
    straight.close_envs()

    stopped = make(tmp_path / "resumed")
    stopped.add_callback(StopAfter(2))
    stopped.train()
    stopped.close_envs()
    checkpoint = tmp_path / "resumed" / "checkpoint-2"
    saved_state = json.loads((checkpoint / "bipace_state.json").read_text())
    assert saved_state["estimator"]["cluster_eps"] is not None  # the calibrated ε is checkpointed

    resumed = make(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(checkpoint))
    resumed.close_envs()
    assert resumed.state.global_step == 4
    assert resumed.estimator.cluster_eps == saved_state["estimator"]["cluster_eps"]
    assert resumed.estimator.num_calls == straight.estimator.num_calls
    # the resumed run's steps 3-4 match the uninterrupted run's (seeded, deterministic on CPU)
    assert comparable_logs(resumed)[-2:] == comparable_logs(straight)[-2:]
    final_straight, final_resumed = lora_state(straight.model), lora_state(resumed.model)
    for name in final_straight:
        torch.testing.assert_close(final_resumed[name], final_straight[name])


def test_per_rank_files_load_on_a_multi_process_cpu_device(tmp_path):
    """accelerate's device on a multi-process CPU run is `cpu:0`, a location `torch.load` refuses
    ("don't know how to restore data location"): the resume of a two-process CPU run with a
    buffered generation or a prefetched rollout failed on it (`test_distributed_overlap`)."""
    from bipace_trainer.update.overlap import RolloutOverlap
    from bipace_trainer.run.checkpointing import BUFFER_FILE, OVERLAP_FILE, load_run_state

    rank = 1
    torch.save({"step": 1, "buffered_inputs": [{"advantages": torch.ones(2)}], "skip_update": False},
               tmp_path / BUFFER_FILE.format(rank=rank))
    torch.save({"rows": [{"task_id": 3}], "rollout": {"logps": torch.zeros(2)}, "snapshot_step": 4},
               tmp_path / OVERLAP_FILE.format(rank=rank))
    state = load_run_state(str(tmp_path), rank, torch.device("cpu", 0))
    assert state.buffer["step"] == 1 and torch.equal(state.buffer["buffered_inputs"][0]["advantages"], torch.ones(2))
    assert state.buffer["skip_update"] is False and state.estimator is None and state.env_counters is None
    overlap = RolloutOverlap(collector=None, spec=None, step=lambda: 0, num_generations=2)
    overlap.load_state_dict(state.prefetched)
    resumed = overlap.resumed
    assert resumed.rows == [{"task_id": 3}] and resumed.snapshot_step == 4 and resumed.rollout["logps"].device.type == "cpu"
