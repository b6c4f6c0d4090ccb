"""A TRL user's training script, as TRL 1.16's docs write one: GRPOTrainer on an environment_factory env,
or on a plain prompt dataset scored by reward functions.

    python tests/trl/grpo_script.py MODEL_DIR OUTPUT_DIR [CASE]

tests/trl/test_trl_parity.py runs this file twice: as it is, and with its import line and the two
class names switched to bipace_trainer's (`from bipace_trainer import BiPACEConfig, BiPACETrainer`),
the change the README's "Coming from TRL" promises is all it takes. `CASE` picks what the script does,
each from TRL's docs: "tools" (the env, the default), "eval" (the env, with an `eval_dataset` evaluated
every 2 steps), "prompts" (no env, no tools: two reward functions on the prompts, as TRL's quickstart),
"prompts+eval_dataset" (the same with an `eval_dataset`, which TRL does not evaluate without an
`eval_strategy`), "prompts+signal_once" (a reward that tells completions apart in the first
generation only); keyword arguments of `main` override the config's.
"""

import sys

from datasets import Dataset
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

from tests.trl.thermostat import Thermostat, prompt_dataset


def brevity(completions, **kwargs) -> list[float]:
    """A user's reward function: a small bonus for answering in few messages."""
    return [1.0 / len(completion) for completion in completions]


def short_reply(completions, **kwargs) -> list[float]:
    """A user's reward function on plain prompts: fewer characters, more reward."""
    return [-len(completion[0]["content"]) / 100 for completion in completions]


def says_degrees(completions, target, **kwargs) -> list[float]:
    """A second one, reading a dataset column: the reply names the target temperature."""
    return [float(str(t) in completion[0]["content"]) for completion, t in zip(completions, target)]


class SignalOnce:
    """A reward function whose first call scores by length and every later call gives 1.0: the
    generations after the first have no signal (every advantage 0)."""

    __name__ = "signal_once"

    def __init__(self):
        self.calls = 0

    def __call__(self, completions, **kwargs) -> list[float]:
        self.calls += 1
        return [-len(c[0]["content"]) / 100 if self.calls == 1 else 1.0 for c in completions]


def plain_prompts(rows: int) -> Dataset:
    """The thermostat's prompts, without an env to append an observation: a plain GRPO dataset."""
    return prompt_dataset(rows)


def main(model_dir: str, output_dir: str, case: str = "tools", **config):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    # The tests' tiny tokenizer is a generic fast tokenizer, which AutoTokenizer would rebuild as Qwen2's
    # (other ids); a script for a real model loads AutoTokenizer.from_pretrained(model_dir) here.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    settings = dict(
        output_dir=output_dir,
        max_steps=4,
        per_device_train_batch_size=4,
        generation_batch_size=8,  # two prompts x 4 completions per generation, used over 2 optimizer steps
        num_generations=4,
        max_completion_length=48,
        max_tool_calling_iterations=3,
        reward_weights=[0.5],  # of the reward_funcs; get_reward is added with weight 1
        learning_rate=1e-3,
        temperature=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,  # float32 on a CPU (both configs' default, TRL's, would autocast to bf16 there)
        seed=0,
        disable_tqdm=True,
    )
    trainer_arguments = dict(reward_funcs=[brevity], environment_factory=Thermostat, train_dataset=prompt_dataset(8))
    if case == "eval":  # TRL's evaluation: eval_loss and the eval_* metrics every eval_steps
        settings.update(eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4)
        trainer_arguments["eval_dataset"] = prompt_dataset(2)
    if case.startswith("prompts"):  # plain GRPO: prompts and reward functions, no env, no tools
        settings.update(reward_weights=[1.0, 0.5], max_completion_length=16)
        trainer_arguments = dict(reward_funcs=[short_reply, says_degrees], train_dataset=plain_prompts(8))
    if case == "prompts+eval_dataset":
        trainer_arguments["eval_dataset"] = plain_prompts(2)
    if case == "prompts+signal_once":
        settings.update(reward_weights=[1.0])
        trainer_arguments["reward_funcs"] = [SignalOnce()]
    settings.update(config)
    args = GRPOConfig(**settings)
    trainer = GRPOTrainer(model=model, args=args, processing_class=tokenizer, **trainer_arguments)
    trainer.train()
    return trainer


if __name__ == "__main__":
    main(*sys.argv[1:4])
