"""The README's "From your own script" example runs as written (a tiny saved model in place
of "embedded" and a LoRA adapter on it in place of the shipped warm start, to stay fast): RL
trains the warm start's adapter (saved alone, not the whole model), the trainer loads the
model's tokenizer, leaves its card and evaluations, and `close_envs` stops the envs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.trainer.tiny_setup import make_model, make_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def readme_example() -> str:
    section = (ROOT / "README.md").read_text().split("\n## From your own script\n")[1].split("\n## ")[0]
    return re.search(r"```python\n(.*?)\n```", section, re.S).group(1)


EMBEDDED = 'resolve_model_name("embedded")'
WARM_START = '"warm_starts/smollm2-135m-textcraft"'


def tiny_warm_start(folder: Path):
    """The tiny model and a LoRA adapter on it, saved as `load_warm_start` reads them; its tokenizer."""
    from peft import LoraConfig, get_peft_model

    tokenizer = make_tokenizer()
    model = make_model(tokenizer)
    model.save_pretrained(folder / "tiny")
    tokenizer.save_pretrained(folder / "tiny")
    adapter = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    get_peft_model(make_model(tokenizer), adapter).save_pretrained(folder / "adapter")
    return tokenizer


@pytest.mark.slow  # launches a process or trains (pyproject's marker)
def test_the_readme_api_example_runs_as_written(tmp_path, monkeypatch, capsys):
    code = readme_example()
    assert len(code.splitlines()) <= 21, "a short example"
    assert code.count(EMBEDDED) == 1 and code.count(WARM_START) == 1
    tokenizer = tiny_warm_start(tmp_path)
    monkeypatch.chdir(tmp_path)

    namespace: dict = {}
    code = code.replace(EMBEDDED, repr(str(tmp_path / "tiny"))).replace(WARM_START, repr(str(tmp_path / "adapter")))
    exec(compile(code, "README.md", "exec"), namespace)

    trainer = namespace["trainer"]
    assert trainer.state.global_step == namespace["args"].max_steps
    assert trainer.processing_class.get_vocab() == tokenizer.get_vocab()  # the model's own tokenizer, as saved
    trained = [name for name, p in trainer.model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in name for name in trained)  # RL trains the adapter, not the model
    final = trainer.eval_history[-1]
    assert final["tag"] == "final" and final["per_type"]
    assert all(re.fullmatch(r"depth=\d", key) for key in final["per_type"]), final["per_type"]
    shown = {e["tag"]: (e["valid_action_rate"], e["success_rate"]) for e in trainer.eval_history}
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(shown) and set(shown) == {"before", "final"}
    out = tmp_path / "outputs" / "my-run"
    assert (out / "adapter_model.safetensors").exists() and (out / "eval_results.json").exists()
    assert not (out / "model.safetensors").exists()  # the adapter alone: not the base model's weights again
    card = (out / "README.md").read_text()
    assert "**textcraft**" in card and "preset **gigpo**" in card
    assert trainer.collector.envs == {}  # close_envs() stopped and dropped every env


@pytest.mark.slow  # loads the embedded SmolLM2 (converted on first use, ~1 minute, once)
def test_the_readme_example_builds_its_trainer_on_the_embedded_model_as_written(tmp_path, monkeypatch):
    """The part the test above swaps out: the example up to its trainer, unchanged: the embedded model and the
    shipped warm start (its output_dir in tmp_path)."""
    from bipace_trainer.models import embedded_model_path

    code = readme_example()
    setup = code.split("\ntry:\n")[0]
    assert EMBEDDED in setup and WARM_START in setup
    monkeypatch.chdir(ROOT)  # the example runs from the checkout, where warm_starts/ is
    namespace: dict = {}
    exec(compile(setup.replace('"outputs/my-run"', repr(str(tmp_path / "out"))), "README.md", "exec"), namespace)
    trainer = namespace["trainer"]
    try:
        assert trainer.model.config._name_or_path == str(embedded_model_path())  # no Hub id was tried
        assert type(trainer.model).__name__.startswith("PeftModel")  # the shipped warm start, trained further
        assert all("lora_" in name for name, p in trainer.model.named_parameters() if p.requires_grad)
        assert trainer.processing_class.chat_template and trainer.processing_class.padding_side == "left"
        assert len(trainer.processing_class) == trainer.model.config.vocab_size  # SmolLM2's tokenizer, not another
    finally:
        trainer.close_envs()
