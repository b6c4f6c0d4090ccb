"""What a run leaves behind and hands back: the project's model card at the end of every run
(and kept over PEFT's by `save_model`), evaluations keyed as logged, logged values printed as
numbers, and the process's SIGTERM handler restored however `train()` ends."""

from __future__ import annotations

import json
import re
import signal

import pytest
from peft import LoraConfig
from transformers import TrainerCallback

from bipace_trainer import BiPACETrainer
from tests.trainer.tiny_setup import LORA, make_model, make_tokenizer, tiny_args


@pytest.fixture(scope="module")
def tiny_policy():
    tokenizer = make_tokenizer()
    return make_model(tokenizer), tokenizer


@pytest.mark.slow  # launches a process or trains (pyproject's marker)
def test_every_run_ends_with_the_projects_card_and_save_model_keeps_it(tiny_policy, tmp_path, capsys):
    model, tokenizer = tiny_policy
    out = tmp_path / "run"
    args = tiny_args(out, preset="gigpo", max_steps=1, eval_tasks=3, gradient_accumulation_steps=1,
                     tasks_per_iteration=1, per_device_train_batch_size=4)
    trainer = BiPACETrainer(model=model, args=args, processing_class=tokenizer, peft_config=LoraConfig(**LORA))
    try:
        trainer.train()
        card = (out / "README.md").read_text()  # written by train() itself: no push, no checkpoint
        assert card.startswith("---") and "preset **gigpo**" in card and "**tiny**" in card
        assert "## Evaluation" in card and "No final evaluation was run." not in card

        trainer.save_model()  # PEFT writes its blank card next to the adapter; ours replaces it
        saved = (out / "README.md").read_text()
        assert (out / "adapter_config.json").exists()
        assert "[More Information Needed]" not in saved and "preset **gigpo**" in saved
    finally:
        trainer.close_envs()

    # evaluation results keyed as the log keys them (distance=2, not "2")
    evaluations = json.loads((out / "eval_results.json").read_text())
    final = evaluations[-1]
    assert final["tag"] == "final" and final["per_type"]
    for key, value in final["per_type"].items():
        assert re.fullmatch(r"distance=\d+", key), key
        assert final[f"success_rate/{key}"] == value
        assert f"| {key} | {value:.3f} |" in saved
    # logged values are printed as numbers, not quoted strings ({'loss': 0.01}, not {'loss': '0.01'})
    printed = capsys.readouterr().out
    logged = [line for line in printed.splitlines() if line.startswith("{") and "'loss'" in line]
    assert logged, printed[-2000:]
    assert re.search(r"'loss': -?\d", logged[0]) and not re.search(r"': '-?\d", logged[0]), logged[0]


class _FailAtFirstStep(TrainerCallback):
    """Raises inside train(), after the stop handler is installed (a crash, a non-finite loss...)."""

    def on_step_begin(self, args, state, control, **kwargs):
        self.handler_in_train = signal.getsignal(signal.SIGTERM)
        raise FloatingPointError("stand-in for a failure inside train()")


def test_the_sigterm_handler_is_restored_after_train_raises(tiny_policy, tmp_path):
    model, tokenizer = tiny_policy
    received = []

    def handler(signum, frame):
        received.append(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    failing = _FailAtFirstStep()
    try:
        args = tiny_args(tmp_path, preset="grpo", evaluate_before_training=False)
        trainer = BiPACETrainer(model=model, args=args, processing_class=tokenizer, callbacks=[failing])
        try:
            with pytest.raises(FloatingPointError, match="stand-in"):
                trainer.train()
        finally:
            trainer.close_envs()
        assert failing.handler_in_train != handler  # the graceful stop was installed during train()
        assert signal.getsignal(signal.SIGTERM) == handler  # and is gone after the exception
        signal.raise_signal(signal.SIGTERM)
        assert received == [signal.SIGTERM]  # the process answers SIGTERM as before train()
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_signal_line_says_why_a_step_whose_episodes_all_won_still_trained():
    from bipace_trainer.cli.run_end import signal_line

    curve = [{"step": 1, "batch_success": 0.5, "skipped": 0.0}, {"step": 2, "batch_success": 0.75, "resamples": 1.0},
             {"step": 3, "batch_success": 1.0, "skipped": 0.0}, {"step": 4, "batch_success": 1.0, "skipped": 1.0}]
    assert signal_line(curve) == (
        "RL steps with non-zero advantages: 3 of 4 (1 batch without signal played again on another goal; step 3 won "
        "every episode: the advantages come from the discount, which pays a shorter win more); training-batch success "
        "0.50 at step 1 -> 1.00 at step 4")  # step 4 won every episode too, but was skipped: no signal, nothing to explain
    assert signal_line(curve[:2]).endswith("(1 batch without signal played again on another goal); training-batch "
                                           "success 0.50 at step 1 -> 0.75 at step 2")
