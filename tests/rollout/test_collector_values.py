"""The rollout takes values: the collector and its env sources are built from `RolloutSettings` and an
`EnvSpec`, never from the run's config, and every policy is a whole `Policy` (issue 59, item 2)."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from bipace_trainer.rollout import trajectories
from bipace_trainer.rollout.collector import RolloutCollector, TextEnvSource, ToolEnvSource, env_source
from bipace_trainer.rollout.loop import EnvSpec, RolloutSettings
from bipace_trainer.rollout.policy import SAMPLING_FIELDS, ModelPolicy, Policy, PolicyBase, VLLMPolicy, generation_config_for

ROLLOUT_DIR = Path(__file__).resolve().parents[2] / "bipace_trainer" / "rollout"


def _config_reads(path: Path) -> list[str]:
    """Where `path` imports the config module, names `BiPACEConfig`, or reads an `.args`/`.estimator` attribute."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] == "config":
            found.append(f"{path.name}:{node.lineno} imports {node.module}")
        elif isinstance(node, ast.ImportFrom) and any(alias.name == "config" for alias in node.names):
            found.append(f"{path.name}:{node.lineno} imports the config module")
        elif isinstance(node, ast.Import) and any(alias.name.endswith(".config") for alias in node.names):
            found.append(f"{path.name}:{node.lineno} imports a config module")
        elif isinstance(node, ast.Name) and node.id == "BiPACEConfig":
            found.append(f"{path.name}:{node.lineno} names BiPACEConfig")
        elif isinstance(node, ast.Attribute) and node.attr in ("args", "estimator", "BiPACEConfig"):
            found.append(f"{path.name}:{node.lineno} reads .{node.attr}")
    return found


def test_nothing_in_the_rollout_imports_or_reads_the_config():
    found = [line for path in sorted(ROLLOUT_DIR.glob("*.py")) for line in _config_reads(path)]
    assert not found, "the rollout takes values (RolloutSettings, EnvSpec), not the config: " + "; ".join(found)


def test_the_scan_catches_a_config_read(tmp_path):
    # the checker itself: each way of reaching the config is flagged
    bad = tmp_path / "bad.py"
    bad.write_text("from ..config import BiPACEConfig\nimport bipace_trainer.config\nfrom .. import config\n"
                   "made = BiPACEConfig()\nx = self.args.max_turns\ny = settings.estimator\n")  # fmt: skip
    assert sorted(_config_reads(bad)) == [
        "bad.py:1 imports config", "bad.py:2 imports a config module", "bad.py:3 imports the config module",
        "bad.py:4 names BiPACEConfig", "bad.py:5 reads .args", "bad.py:6 reads .estimator",
    ]  # fmt: skip


def _plain_policy(raw_tiny_dir) -> ModelPolicy:
    from transformers import AutoModelForCausalLM

    from bipace_trainer.models import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(raw_tiny_dir)
    tokenizer = load_tokenizer(raw_tiny_dir, padding_side="left")
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": None, "repetition_penalty": 1.0,
                "cache_implementation": None, "generation_kwargs": None}  # fmt: skip
    assert set(sampling) == set(SAMPLING_FIELDS)
    config = generation_config_for(sampling, tokenizer, [tokenizer.eos_token_id], max_new_tokens=8)
    return ModelPolicy(model, tokenizer, config, 8)


def test_the_collector_plays_and_records_from_values_alone(raw_tiny_dir, tmp_path):
    from accelerate import Accelerator

    settings = RolloutSettings(
        max_turns=2, history_length=1, eval_tasks=2, eval_rollouts_per_task=2, disable_tqdm=True, rollout_dump_steps=1,
        output_dir=str(tmp_path),
    )  # fmt: skip
    env = EnvSpec(name="tiny", kwargs={"size": 4}, train_split="valid", eval_split="valid", backend="thread", workers=2,
                  step_timeout=30.0)  # fmt: skip
    source = env_source(env, settings)
    assert isinstance(source, TextEnvSource) and source.env == env
    collector = RolloutCollector(_plain_policy(raw_tiny_dir), source, settings, Accelerator(cpu=True))
    try:
        assert collector.settings.instruction == source.env_class.instruction  # the env's, filled in
        assert collector.settings.invalid_action == source.env_class.invalid_action
        assert dataclasses.replace(collector.settings, instruction="", invalid_action="look") == settings
        tasks = collector.eval_task_refs("valid")
        assert [task.group for task in tasks] == [0, 0, 1, 1]  # eval_tasks tasks, eval_rollouts_per_task each
        rollout = collector.collect("eval", tasks)
        envs = collector.envs["eval"]
        assert (envs.num_envs, envs.backend, envs.step_timeout) == (4, "thread", 30.0)
        assert len(rollout.episodes) == 4 and all(len([s for s in rollout.steps if s.traj == e.traj]) <= 2
                                                  for e in rollout.episodes)  # fmt: skip
        collector.record(rollout, tag="values", step=3)
        dumped = trajectories.dump_path(tmp_path, 3, "eval", "values").read_text().splitlines()
        assert len(dumped) == 4 and {json.loads(line)["task_id"] for line in dumped} == {t.task_id for t in tasks}
        assert f"are in {tmp_path}." in collector.every_env_failed("a test")  # settings.output_dir
    finally:
        collector.close()


def test_trls_env_source_takes_its_evaluation_panel_from_the_settings():
    setup = SimpleNamespace(environment_factories=None, tools=[], multi_environment=False, standalone_tools=[])
    settings = RolloutSettings(eval_tasks=2, eval_rollouts_per_task=3, tool_errors="fail")
    source = env_source(EnvSpec(), settings, setup, 0, [{"prompt": str(i)} for i in range(5)])
    assert isinstance(source, ToolEnvSource) and source.plain_prompts
    assert [ref.group for ref in source.eval_task_refs("ignored")] == [0, 0, 0, 1, 1, 1]
    factory, _ = source.env_factory()
    assert factory.args[-1] == "fail"  # ToolSession's tool_errors


# ------------------------------------------------------------------------------ Policy is a Protocol


def _protocol_members() -> set[str]:
    annotated = set(Policy.__annotations__)
    defined = {
        name for name, value in vars(Policy).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    }  # fmt: skip
    return annotated | defined


def test_the_policy_protocol_names_its_optional_capabilities():
    assert {"can_stream", "weight_syncs", "vllm_generation", "prefix_cache", "push_weights", "seed", "tokenizer",
            "generation_config", "pad_to_multiple_of"} <= _protocol_members()  # fmt: skip
    assert not isinstance(object(), Policy)
    missing = SimpleNamespace(**{name: None for name in _protocol_members() - {"can_stream"}})
    assert not isinstance(missing, Policy)  # one capability absent: not a Policy


def test_every_concrete_policy_is_a_whole_policy(raw_tiny_dir):
    from bipace_trainer.update.overlap import SnapshotPolicy
    from bipace_trainer.update.policy import TRLGeneration, TRLPolicy

    plain = _plain_policy(raw_tiny_dir)
    generation = SimpleNamespace(mode="server", sync_weights=lambda: None)  # a server: no engine in this process
    served = VLLMPolicy(generation, plain.module, plain.tokenizer, 8, plain.eos_token_ids)
    args = SimpleNamespace(per_device_train_batch_size=2, seed=7, vllm_mode="server", hf_prefix_cache=False)
    accelerator = SimpleNamespace(device="cpu", num_processes=1, unwrap_model=lambda model: model)
    trl = TRLGeneration(
        generate_single_turn=None, tokenize_prompts=None, tokenizer=plain.tokenizer, processing_class=plain.tokenizer,
        model=lambda: plain.module, model_wrapped=lambda: plain.module, accelerator=accelerator, args=args, generation_config=plain.generation_config, generation_kwargs={},
        eos_token_ids=plain.eos_token_ids, step=lambda: 0, loaded_step=lambda step: 0, summon_full_params=None,
        profile=None,
    )  # fmt: skip
    trl_policy = TRLPolicy(trl)
    for policy in (plain, served, trl_policy):
        assert isinstance(policy, Policy), type(policy).__name__
        assert isinstance(policy, PolicyBase)
    assert issubclass(SnapshotPolicy, ModelPolicy)  # the overlap's snapshot is a plain model's policy
    # absent capabilities are typed values, not missing attributes
    assert (plain.can_stream, plain.weight_syncs, plain.vllm_generation, plain.prefix_cache) == (False, None, None, None)
    assert served.vllm_generation is generation and served.use_vllm and not served.can_stream
    assert (trl_policy.can_stream, trl_policy.vllm_generation, trl_policy.seed) == (False, None, 7)
    assert trl_policy.generation_config is plain.generation_config and trl_policy.tokenizer is plain.tokenizer
    assert trl_policy.push_weights() is None  # no engine: nothing to push


def test_the_rollout_reads_no_policy_attribute_outside_the_protocol():
    # no `getattr(policy, ...)` back door, no `policy.trl`: what the rollout reads of a policy is typed
    members = _protocol_members()
    reads = set()
    for path in sorted(ROLLOUT_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr") and node.args:
                target = ast.unparse(node.args[0])
                assert "policy" not in target and "generator" not in target, f"{path.name}:{node.lineno} {ast.unparse(node)}"
            if isinstance(node, ast.Attribute) and ast.unparse(node.value) in ("self.policy", "policy", "live"):
                reads.add(node.attr)
    assert reads <= members, f"the rollout reads {sorted(reads - members)} of a policy outside the Policy protocol"
