"""What bipace-trainer changes inside TRL and vLLM (`bipace_trainer.trl_compat`): each change is
checked against the versions it was written for, and none outlives the trainer that needs it, so a
plain `GRPOTrainer` built after a `BiPACETrainer` in the same process is TRL's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from bipace_trainer import trl_compat

ROOT = Path(__file__).resolve().parents[2]
# The modules and classes whose attributes TRL's GRPO reads while it trains (and the ones a patch touches).
TRL_MODULES = ("trl.trainer.utils", "trl.kernels.chunked_logprob", "trl.trainer.grpo_trainer", "trl.generation.vllm_generation")


# ---------------------------------------------------------------------- the version check


def test_every_patch_is_a_function_of_the_module_with_a_reason_and_a_range():
    assert set(trl_compat.PATCHES) <= set(trl_compat.__all__)
    for name, patch in trl_compat.PATCHES.items():
        assert callable(getattr(trl_compat, name)), name
        assert patch.reason and patch.touches and patch.tested[0] < patch.tested[1]


def test_the_installed_trl_is_in_the_range_of_every_trl_patch():
    # the suite runs the TRL the patches were written for: importing the module warned about nothing
    assert trl_compat.check_versions() == []


def test_a_library_outside_a_patch_range_warns_once_per_patch_naming_it():
    trl_patches = sorted(name for name, p in trl_compat.LEDGER.items() if p.library == ("trl",))
    with pytest.warns(RuntimeWarning) as caught:
        outside = trl_compat.check_versions(lambda library: "1.18.0" if library == ("trl",) else None)
    assert sorted(outside) == trl_patches and len(caught) == len(trl_patches)
    for name, warning in zip(outside, caught):
        assert f"{name!r} was written for trl>=1.16,<1.17, and trl 1.18.0 is installed" in str(warning.message)
    with pytest.warns(RuntimeWarning) as caught:
        vllm = trl_compat.check_versions(
            lambda library: "0.32.0.dev1+cpu" if "vllm" in library else "5.25.0" if "transformers" in library else "1.16.2")
    assert any("'wrap_llm_generate' was written for vllm>=0.10.2,<0.31.1, and vllm 0.32" in str(w.message) for w in caught)
    assert sorted(vllm) == sorted(n for n, p in trl_compat.LEDGER.items() if "vllm" in p.library)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert trl_compat.check_versions(lambda library: None) == []  # not installed: nothing to check
        assert trl_compat.check_versions(
            lambda library: "0.31.0" if "vllm" in library else "5.25.1" if "transformers" in library else "1.16.0rc1") == []
    with pytest.warns(RuntimeWarning, match="'routed_attention' was written for transformers>=5.25,<5.26"):
        assert trl_compat.check_versions(lambda library: "5.30.0" if "transformers" in library else None) == [
            name for name, entry in trl_compat.LEDGER.items() if entry.library == ("transformers",)]


# ---------------------------------------------------------------------- each patch, and its undo


def test_routed_attention_routes_one_name_for_a_scope_and_puts_transformers_own_back():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    seen = []

    def route(original):
        def routed(*args, **kwargs):
            seen.append(kwargs.pop("tag", None))
            return original(*args, **kwargs)

        return routed

    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
    with pytest.raises(RuntimeError, match="inside"):
        with trl_compat.routed_attention("sdpa", route):
            assert ALL_ATTENTION_FUNCTIONS["sdpa"] is not sdpa_attention_forward
            module = torch.nn.Module()
            query = torch.randn(1, 2, 3, 4)
            ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, query, query, None, tag="layout")
            raise RuntimeError("an error inside the scope")
    assert seen == ["layout"]
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward  # transformers' own, after an error too


def test_rank_local_gather_gives_trl_its_gather_back_even_after_an_error():
    import trl.trainer.grpo_trainer as grpo_module
    from accelerate.utils import gather

    assert grpo_module.gather is gather
    tensor = torch.arange(3.0)
    with pytest.raises(KeyError), trl_compat.rank_local_gather():
        assert grpo_module.gather(tensor) is tensor
        raise KeyError("a reward function failed")
    assert grpo_module.gather is gather


class Generation:
    """A class with TRL's `VLLMGeneration` shape for what `wrap_sync_weights` touches."""

    def __init__(self):
        self.pushed = 0

    def sync_weights(self):
        self.pushed += 1


def test_wrapping_sync_weights_changes_one_instance_and_is_undone():
    ours, theirs = Generation(), Generation()
    seen = []
    undo = trl_compat.wrap_sync_weights(ours, lambda: seen.append(ours.pushed))
    ours.sync_weights()
    theirs.sync_weights()
    assert (seen, ours.pushed, theirs.pushed) == ([0], 1, 1)
    assert "sync_weights" in vars(ours) and "sync_weights" not in vars(theirs)
    assert Generation.sync_weights.__qualname__ == "Generation.sync_weights"  # the class is left alone
    undo()
    ours.sync_weights()
    assert (seen, ours.pushed, "sync_weights" in vars(ours)) == ([0], 2, False)


class Engine:
    """What `engine_awake` calls on vLLM's `LLM`, recorded."""

    def __init__(self):
        self.calls = []

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))

    def sleep(self, level):
        self.calls.append(("sleep", level))


def test_the_engine_stays_awake_for_one_rollout_and_sleeps_as_trl_leaves_it():
    generation = Generation()
    generation.mode, generation.enable_sleep_mode, generation._llm_weights_sleeping = "colocate", True, True
    generation.llm = Engine()
    with trl_compat.engine_awake(generation) as pushed:
        # TRL's generate neither re-pushes nor sleeps while the flag is off
        assert pushed and generation.pushed == 1 and generation.enable_sleep_mode is False
    assert generation.enable_sleep_mode is True and generation._llm_weights_sleeping is True
    assert generation.llm.calls == [("wake_up", ("kv_cache",)), ("sleep", 2)]
    generation.mode = "server"
    with trl_compat.engine_awake(generation) as pushed:
        assert pushed is False and generation.enable_sleep_mode is True  # nothing to keep awake


def test_the_fused_lm_head_settings_are_read_back_from_trls_closure():
    from trl.trainer.utils import add_fused_lm_head

    from bipace_trainer.models import bpe_chat_tokenizer, tiny_qwen2

    model = tiny_qwen2(bpe_chat_tokenizer(["get 1 oak log"] * 10, vocab_size=280), hidden_size=16, layers=1)
    assert trl_compat.fused_lm_head_settings(model) is None
    add_fused_lm_head(model, temperature=0.7, cast_lm_head_to_fp32=True, outputs=("log_probs", "entropy"))
    settings = trl_compat.fused_lm_head_settings(model)
    assert settings == {"temperature": 0.7, "cast_lm_head_to_fp32": True, "outputs": ("log_probs", "entropy")}
    assert trl_compat.forward_closes_over(model.forward.__func__, {id(model)})  # over the original forward
    assert not trl_compat.forward_closes_over(model.forward.__func__, {id(object())})


# ---------------------------------------------------------------------- a plain GRPOTrainer afterwards


def trl_state() -> dict[str, object]:
    """Every attribute of TRL's GRPO modules and of its trainer and vLLM classes, by name."""
    import importlib

    from trl import GRPOTrainer
    from trl.generation.vllm_generation import VLLMGeneration

    state = {}
    for module in TRL_MODULES:
        state.update({f"{module}.{k}": v for k, v in vars(importlib.import_module(module)).items()})
    for cls in (GRPOTrainer, VLLMGeneration):
        state.update({f"{cls.__qualname__}.{k}": v for k, v in vars(cls).items()})
    return state


def plain_grpo_logs(output_dir: str) -> list[dict[str, float]]:
    """Two steps of TRL's own GRPOTrainer on a tiny model and a length reward: the logged numbers
    (times left out). Run here after a BiPACETrainer, and in a fresh process that never imports it."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from bipace_trainer.models import bpe_chat_tokenizer, tiny_qwen2

    tokenizer = bpe_chat_tokenizer(["light the lamp", "turn it off", "look around the room"] * 20, vocab_size=300)
    model = tiny_qwen2(tokenizer, hidden_size=32, layers=1, seed=0)
    prompts = [[{"role": "user", "content": text}] for text in ("light the lamp", "turn it off", "look around")]
    args = GRPOConfig(
        output_dir=output_dir, max_steps=2, per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
        learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=lambda completions, **_: [float(len(c[0]["content"])) for c in completions], args=args,
        train_dataset=Dataset.from_list([{"prompt": p} for p in prompts * 4]), processing_class=tokenizer,
    )
    trainer.train()
    return [
        {k: v for k, v in entry.items() if not any(word in k for word in ("runtime", "per_second", "time"))}
        for entry in trainer.state.log_history
    ]


@pytest.mark.slow
def test_a_grpo_trainer_after_a_bipace_trainer_is_trls_own(tmp_path):
    from tests.trainer.tiny_setup import make_model, make_tokenizer, tiny_args

    from bipace_trainer import BiPACETrainer

    before = trl_state()
    tokenizer = make_tokenizer()
    ours = BiPACETrainer(model=make_model(tokenizer), args=tiny_args(tmp_path / "ours", max_steps=1, eval_tasks=0),
                         processing_class=tokenizer)
    ours.train()
    ours.close_envs()
    changed = sorted(name for name, value in trl_state().items() if before.get(name, object()) is not value)
    assert not changed, f"left changed after a BiPACETrainer trained: {changed}"

    logs = plain_grpo_logs(str(tmp_path / "theirs"))
    code = (
        "import json, sys; from tests.update.test_trl_compat import plain_grpo_logs; "
        f"logs = plain_grpo_logs({str(tmp_path / 'fresh')!r}); "
        "assert 'bipace_trainer.trainer' not in sys.modules and 'bipace_trainer.update.memory' not in sys.modules; "
        "print(json.dumps(logs))"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TRL_EXPERIMENTAL_SILENCE="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fresh = json.loads(proc.stdout.strip().splitlines()[-1])
    assert logs and logs == fresh  # every logged number, bit for bit: loss, rewards, entropy, grad norm, ...
