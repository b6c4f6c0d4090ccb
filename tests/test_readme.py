"""The README's "From your own script" example runs as written (a tiny saved model in place
of "embedded", to stay fast): the trainer takes a model path and loads its tokenizer, trains,
leaves its card and evaluations, and `close_envs` stops the envs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.trainer.tiny_setup import make_model, make_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def readme_example() -> str:
    section = (ROOT / "README.md").read_text().split("\n## From your own script\n")[1].split("\n## ")[0]
    return re.search(r"```python\n(.*?)\n```", section, re.S).group(1)


@pytest.mark.slow  # launches a process or trains (pyproject's marker)
def test_the_readme_api_example_runs_as_written(tmp_path, monkeypatch, capsys):
    code = readme_example()
    assert len(code.splitlines()) <= 18, "a short example"
    assert code.count('model="embedded"') == 1
    tokenizer = make_tokenizer()
    make_model(tokenizer).save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    monkeypatch.chdir(tmp_path)

    namespace: dict = {}
    exec(compile(code.replace('model="embedded"', f"model={str(tmp_path / 'tiny')!r}"), "README.md", "exec"), namespace)

    trainer = namespace["trainer"]
    assert trainer.state.global_step == namespace["args"].max_steps
    assert trainer.processing_class.get_vocab() == tokenizer.get_vocab()  # the model's own tokenizer, as saved
    final = trainer.eval_history[-1]
    assert final["tag"] == "final" and final["per_type"]
    assert all(re.fullmatch(r"depth=\d", key) for key in final["per_type"]), final["per_type"]
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(final["success_rate"])
    out = tmp_path / "outputs" / "my-run"
    assert (out / "model.safetensors").exists() and (out / "eval_results.json").exists()
    card = (out / "README.md").read_text()
    assert "**textcraft**" in card and "preset **gigpo**" in card
    assert trainer.collector.envs == {}  # close_envs() stopped and dropped every env


@pytest.mark.slow  # loads the embedded SmolLM2 (converted on first use, ~1 minute, once)
def test_the_readme_example_builds_its_trainer_on_the_embedded_model_as_written(tmp_path, monkeypatch):
    """The part the test above swaps out: the example up to its trainer, unchanged, with "embedded"."""
    from bipace_trainer.models import embedded_model_path

    code = readme_example()
    setup = code.split("\ntry:\n")[0]
    assert 'BiPACETrainer(model="embedded", args=args)' in setup
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(setup, "README.md", "exec"), namespace)
    trainer = namespace["trainer"]
    try:
        assert trainer.model.config._name_or_path == str(embedded_model_path())  # no Hub id was tried
        assert trainer.processing_class.chat_template and trainer.processing_class.padding_side == "left"
        assert len(trainer.processing_class) == trainer.model.config.vocab_size  # SmolLM2's tokenizer, not another
    finally:
        trainer.close_envs()
