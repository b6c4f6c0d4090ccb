"""What a training step costs per preset, phase by phase, on one model and one batch.

    OMP_NUM_THREADS=2 python -m bench.cost           # CPU: embedded SmolLM2-135M on TextCraft (~15 minutes)
    OMP_NUM_THREADS=2 python -m bench.cost --quick   # CI size: tiny random model on the tiny env (~1 minute)
    OMP_NUM_THREADS=1 python -m bench.cost --quick --vllm   # also the vLLM variants (where vLLM is installed)
    python -m bench.cost --device cuda --model Qwen/Qwen2.5-1.5B-Instruct --tasks 4 --num-generations 8 \
        --max-turns 5 --max-completion-length 256 --steps 4

Variants, trained one after another in this process: grpo, gigpo, bipace_q (hidden state
captured by a hook during generation's prefill), bipace_q with `hidden_capture="forward"`
(one extra no-grad forward pass over the prompts, what a vLLM backend needs), gagpo and
bigagpo. Every variant starts from the same weights with the same seed and a learning
rate of 0, so all of them roll out the very same episodes (checked: the fingerprints of
their batches must agree) and differ only in what their preset adds.

With `--vllm` three more variants generate through vLLM (colocate): gigpo, bipace_q
with the hidden state captured by a hook in the old-logprob pass that runs anyway under
vLLM (no extra pass), and bipace_q with the extra forward pass (`forward`, what this
trainer did under vLLM before); their batches are compared among themselves.

Per step the trainer logs time/rollout_s (= generate + env + hidden capture),
time/hidden_s, time/estimator_s, time/logps_s and TRL's step_time; the update is what
remains of step_time. The first step is a warm-up (and calibrates ε) and is left out;
figures are medians over the remaining steps. Reported side by side:
- the BiPACE-specific share of a step, (step(bipace_q) - step(gigpo)) / step(bipace_q),
  for each capture variant, next to the paper's 11.3% (an extra forward pass);
- the parts measured directly: the extra forward pass (time/hidden_s of the forward
  variant) and the estimator's time, each as a share of the step.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import tempfile
from pathlib import Path

from transformers import AutoModelForCausalLM

from bench import common
from bipace_trainer import BiPACEConfig, BiPACETrainer
from bipace_trainer.run.demonstrations import collect_demonstrations
from bipace_trainer.models import load_tokenizer, resolve_model_name
from envs.base import resolve_env_class

PAPER_SHARE = 0.113  # BiPACE: share of a step's wall time that is BiPACE-specific
VARIANTS = {  # name: (preset, hidden_capture)
    "grpo": ("grpo", "hook"),
    "gigpo": ("gigpo", "hook"),
    "bipace_q": ("bipace_q", "hook"),
    "bipace_q/forward": ("bipace_q", "forward"),
    "gagpo": ("gagpo", "hook"),
    "bigagpo": ("bigagpo", "hook"),
}
VLLM_VARIANTS = {
    "gigpo/vllm": ("gigpo", "hook"),
    "bipace_q/vllm": ("bipace_q", "hook"),
    "bipace_q/vllm-forward": ("bipace_q", "forward"),
}
PHASES = ("generate_s", "env_s", "hidden_s", "estimator_s", "logps_s", "update_s")


class FingerprintTrainer(BiPACETrainer):
    """`BiPACETrainer` for timing: records a hash of every rollout batch, always updates, never evaluates.

    Overrides `on_rollout` and `evaluate_policy`; everything else is inherited. Timing must
    include the update in every variant, whatever its advantages: it never skips one.
    """

    skip_update_without_signal = False

    def evaluate_policy(self, tag: str = "manual", split: str | None = None) -> dict:
        return {}

    def on_rollout(self, rollout, advantages, diagnostics):
        digest = hashlib.sha256()
        for step in rollout.steps:
            digest.update(repr((step.traj, step.t, step.prompt_ids, step.completion_ids)).encode())
        self.fingerprints.append(digest.hexdigest()[:16])
        self.completion_tokens.append(sum(len(step.completion_ids) for step in rollout.steps))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CI size: tiny random model, tiny env, 2 steps")
    parser.add_argument("--model", default="embedded", help="model id or path; 'embedded' = SmolLM2-135M-Instruct")
    parser.add_argument("--env", default="textcraft")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--tasks", type=int, default=1, help="task groups per step")
    parser.add_argument("--num-generations", type=int, default=2, help="rollouts per task (G)")
    parser.add_argument("--max-turns", type=int, default=2)
    parser.add_argument("--max-completion-length", type=int, default=24)
    parser.add_argument("--steps", type=int, default=3, help="steps per variant; the first is a warm-up")
    parser.add_argument("--cluster-layer", type=int, default=-8)
    parser.add_argument("--vllm", action="store_true", help="also the variants generating through vLLM (colocate)")
    parser.add_argument("--out", default=str(common.ROOT / "docs" / "results" / "cost.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.env, args.tasks, args.num_generations, args.max_turns, args.steps = None, "tiny", 2, 4, 3, 2
        args.cluster_layer, args.max_completion_length = -1, 16
    return args


def load_policy(args, path: Path):
    """The model, saved once to `path` so that every variant loads the very same weights."""
    if args.model:
        name = resolve_model_name(args.model)
        tokenizer, model = load_tokenizer(name), AutoModelForCausalLM.from_pretrained(name)
    else:
        task_ids = [spec.task_id for spec in resolve_env_class(args.env).tasks("train")]
        tokenizer = common.train_tokenizer(args.env, collect_demonstrations(args.env, task_ids, history_length=1))
        heads = dict(heads=1, kv_heads=1) if args.vllm else {}  # vLLM's CPU attention needs head_dim >= 32
        model = common.tiny_model(tokenizer, **heads)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def train_variant(name: str, args, policy: Path, output_dir: str) -> dict:
    preset, capture = {**VARIANTS, **VLLM_VARIANTS}[name]
    vllm = dict(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=4096) if name in VLLM_VARIANTS else {}
    config = BiPACEConfig(
        output_dir=output_dir,
        env_name=args.env,
        preset=preset,
        hidden_capture=capture,
        cluster_layer=args.cluster_layer,
        learning_rate=0.0,  # weights never change: every variant and every step sees the same policy
        max_steps=args.steps,
        tasks_per_iteration=args.tasks,
        num_generations=args.num_generations,
        per_device_train_batch_size=args.num_generations,
        gradient_accumulation_steps=args.tasks,
        max_turns=args.max_turns,
        history_length=1,
        max_completion_length=args.max_completion_length,
        eval_tasks=0,
        evaluate_before_training=False,
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=args.device == "cpu",
        bf16=args.device != "cpu",  # float32 on a CPU
        seed=0,
        **vllm,
    )
    model, tokenizer = AutoModelForCausalLM.from_pretrained(policy), load_tokenizer(policy)
    trainer = FingerprintTrainer(model, args=config, processing_class=tokenizer)
    trainer.fingerprints, trainer.completion_tokens = [], []
    try:
        trainer.train()
    finally:
        trainer.close_envs()
    logs = [entry for entry in trainer.state.log_history if "step_time" in entry][1:]  # first step: warm-up
    phases = {
        "step_s": [e["step_time"] for e in logs],
        "rollout_s": [e["time/rollout_s"] for e in logs],
        **{phase: [e.get(f"time/{phase}", 0.0) for e in logs] for phase in PHASES if phase != "update_s"},
    }
    phases["update_s"] = [
        e["step_time"] - e["time/rollout_s"] - e["time/estimator_s"] - e["time/logps_s"] for e in logs
    ]
    return {
        "preset": preset,
        "hidden_capture": capture,
        "median": {key: statistics.median(values) for key, values in phases.items()},
        "steps": phases,
        "fingerprints": trainer.fingerprints,
        "completion_tokens": trainer.completion_tokens,
    }


def shares(variants: dict) -> dict:
    """BiPACE-specific cost next to the paper's, from step differences and from measured parts."""
    out = {"paper": PAPER_SHARE}
    pairs = [("bipace_q", "gigpo"), ("bipace_q/forward", "gigpo"),
             ("bipace_q/vllm", "gigpo/vllm"), ("bipace_q/vllm-forward", "gigpo/vllm")]
    for name, base in pairs:
        if name not in variants:
            continue
        mine, gigpo = variants[name]["median"], variants[base]["median"]
        out[name] = {
            "step_difference_vs_gigpo": (mine["step_s"] - gigpo["step_s"]) / mine["step_s"],
            "hidden_forward_pass": mine["hidden_s"] / mine["step_s"],
            "estimator_vs_gigpo": (mine["estimator_s"] - gigpo["estimator_s"]) / mine["step_s"],
            # under vLLM the hook rides on the old-logprob pass: what it adds there
            "logprob_pass_vs_gigpo": (mine["logps_s"] - gigpo["logps_s"]) / mine["step_s"],
        }
    return out


def report(result: dict) -> None:
    variants = result["variants"]
    print(f"\n{'variant':<18}{'step s':>8}" + "".join(f"{p[:-2]:>11}" for p in PHASES) + f"{'vs gigpo':>10}")
    gigpo = variants["gigpo"]["median"]["step_s"]
    for name, variant in variants.items():
        median = variant["median"]
        line = f"{name:<18}{median['step_s']:>8.2f}" + "".join(f"{median[p] / median['step_s']:>11.1%}" for p in PHASES)
        print(line + f"{median['step_s'] / gigpo:>10.3f}")
    share = result["bipace_share"]
    print(f"\nBiPACE-specific share of a step (paper: {share['paper']:.1%}):")
    for name in [n for n in share if n != "paper"]:
        s = share[name]
        print(f"  {name:<17} step difference vs gigpo {s['step_difference_vs_gigpo']:+.1%}, "
              f"extra forward pass {s['hidden_forward_pass']:.1%}, estimator extra {s['estimator_vs_gigpo']:+.2%}, "
              f"old-logprob pass extra {s['logprob_pass_vs_gigpo']:+.2%}")
    print(f"same batches in every variant: {result['same_batches']}"
          + (f"; in every vLLM variant: {result['same_batches_vllm']}" if "same_batches_vllm" in result else ""))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["variants"])
    fig, ax = plt.subplots(figsize=(8, 4))
    left = [0.0] * len(names)
    for phase in PHASES:
        widths = [result["variants"][n]["median"][phase] for n in names]
        ax.barh(names, widths, left=left, label=phase[:-2])
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set(xlabel="seconds per training step (median)", title=f"{result['model']} on {result['env']}, {result['device']}")
    ax.legend(ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    if args.vllm:  # vLLM's CPU build otherwise reserves a share of RAM for its KV cache
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        load_policy(args, Path(tmp) / "policy")
        variants = {}
        for name in list(VARIANTS) + (list(VLLM_VARIANTS) if args.vllm else []):
            print(f"{name} ...", flush=True)
            variants[name] = train_variant(name, args, Path(tmp) / "policy", str(Path(tmp) / name.replace("/", "-")))
    fingerprints = {tuple(v["fingerprints"]) for n, v in variants.items() if n in VARIANTS}
    result = {
        "model": args.model or "tiny random Qwen2 (64 x 2)",
        "env": args.env,
        "device": args.device,
        "batch": {"tasks": args.tasks, "num_generations": args.num_generations, "max_turns": args.max_turns,
                  "max_completion_length": args.max_completion_length},
        "steps_timed": args.steps - 1,
        "same_batches": len(fingerprints) == 1,
        "variants": variants,
        "bipace_share": shares(variants),
        "machine": common.machine(),
    }
    if args.vllm:
        result["same_batches_vllm"] = len({tuple(variants[n]["fingerprints"]) for n in VLLM_VARIANTS}) == 1
    report(result)
    out = common.write_json(args.out, result)
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return result


if __name__ == "__main__":  # vLLM spawns workers: the guard keeps them from re-running the bench
    main()
