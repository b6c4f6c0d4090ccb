"""A TRL user's training script, as TRL 1.16's docs write one: GRPOTrainer on an environment_factory env.

    python tests/trl/grpo_script.py MODEL_DIR OUTPUT_DIR

tests/trl/test_trl_parity.py runs this file twice: as it is, and with its import line and the two
class names switched to bipace_trainer's (`from bipace_trainer import BiPACEConfig, BiPACETrainer`),
the change the README's "Coming from TRL" promises is all it takes.
"""

import sys

from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

from tests.trl.thermostat import Thermostat, prompt_dataset


def brevity(completions, **kwargs) -> list[float]:
    """A user's reward function: a small bonus for answering in few messages."""
    return [1.0 / len(completion) for completion in completions]


def main(model_dir: str, output_dir: str):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    # The tests' tiny tokenizer is a generic fast tokenizer, which AutoTokenizer would rebuild as Qwen2's
    # (other ids); a script for a real model loads AutoTokenizer.from_pretrained(model_dir) here.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    args = GRPOConfig(
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
        seed=0,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[brevity],
        args=args,
        train_dataset=prompt_dataset(8),
        processing_class=tokenizer,
        environment_factory=Thermostat,
    )
    trainer.train()
    return trainer


if __name__ == "__main__":
    main(*sys.argv[1:3])
