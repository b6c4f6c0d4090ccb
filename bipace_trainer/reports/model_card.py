"""The model card `BiPACETrainer` writes next to the weights and pushes to the Hub.

It names the project (its home as the package metadata states it, no link when none is
set), the base model, env, preset and recipe, the training settings, the evaluation per
task type, the trackers' run links, and the papers to cite.
"""

from __future__ import annotations

import html
import importlib.metadata
import logging
import os
from pathlib import Path
from typing import Any

import trl

from .. import trl_compat
from ..models import cache_dir

__all__ = [
    "model_card", "write_model_card", "keep_foreign_readme", "table_cell", "project_url", "tracker_links", "PAPERS", "PRESET_PAPERS", "CARD_MARKER",
]

logger = logging.getLogger(__name__)
# The card's own mark: a README.md without it was not written by this project and is kept.
CARD_MARKER = "<!-- model card written by bipace-trainer -->"

PROJECT = "bipace-trainer"
# title, link (None where none is public); docs/concepts/math.md#presets names which method each preset is
PAPERS = {
    "bipace": (
        "BiPACE: Bisimulation-Guided Policy Optimization with Action Counterfactual Estimation for LLM Agents",
        "https://arxiv.org/abs/2606.25556",
    ),
    "gigpo": ("Group-in-Group Policy Optimization for LLM Agent Training (GiGPO)", "https://arxiv.org/abs/2505.10978"),
    "gagpo": ("Generalized Advantage Grouped Policy Optimization (GAGPO)", None),
    "grpo": (
        "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models (GRPO)",
        "https://arxiv.org/abs/2402.03300",
    ),
}
PRESET_PAPERS = {
    "grpo": ["grpo"],
    "gigpo": ["gigpo", "grpo"],
    "bigpo": ["bipace", "gigpo", "grpo"],
    "bipace_q": ["bipace", "gigpo", "grpo"],
    "bipace_diff": ["bipace", "gigpo", "grpo"],
    "gagpo": ["gagpo", "gigpo", "grpo"],
    "bigagpo": ["gagpo", "bipace", "gigpo", "grpo"],
}
TRL_CITATION = """@software{vonwerra2020trl,
  title   = {{TRL: Transformers Reinforcement Learning}},
  author  = {von Werra, Leandro and Belkada, Younes and Tunstall, Lewis and Beeching, Edward and Thrush, Tristan and Lambert, Nathan and Huang, Shengyi and Rasul, Kashif and Gallouédec, Quentin},
  license = {Apache-2.0},
  url     = {https://github.com/huggingface/trl},
  year    = {2020}
}"""  # noqa: E501 - TRL's own citation, as its model-card template gives it


def project_url() -> str | None:
    """The project's home from its package metadata (pyproject `[project.urls]`), or None."""
    try:
        metadata = importlib.metadata.metadata(PROJECT)
    except importlib.metadata.PackageNotFoundError:
        return None
    for entry in metadata.get_all("Project-URL") or []:
        label, _, url = entry.partition(",")
        if label.strip().lower() in ("homepage", "home", "repository", "source", "code"):
            return url.strip()
    home = metadata.get("Home-page")
    return home if home and home != "UNKNOWN" else None


def install_line() -> str:
    """How to install the project, for a card that has no project URL to link: it is not on PyPI
    (`pip install bipace-trainer` finds nothing), so from a checkout of its repository, with the
    torch this run used (the README's pin gets a CPU build on a CPU machine)."""
    import torch

    version = torch.__version__.split("+")[0]
    return f"not on PyPI; from a checkout of its repository: `pip install torch=={version} -e .`"


def tracker_links(report_to: list[str]) -> list[str]:
    """Where the run's metrics are: the trackers' run URLs when they have one."""
    links = []
    if "wandb" in report_to:
        import wandb

        if wandb.run is not None and wandb.run.url:
            links.append(f"[Weights & Biases run]({wandb.run.url})")
    if "trackio" in report_to:
        from trl.trainer.utils import get_trackio_space_url

        url = get_trackio_space_url()
        links.append(f"[Trackio run]({url})" if url else "Trackio (local, `trackio show`)")
    if "tensorboard" in report_to:
        links.append("TensorBoard logs in the training output's `runs/`")
    return links


def _base_model(name_or_path: str) -> tuple[str, str | None]:
    """(how the card names the base model, its Hub id or None for a local checkpoint)."""
    if name_or_path and Path(name_or_path).parent == cache_dir() / "models":
        return "SmolLM2-135M-Instruct (embedded)", "HuggingFaceTB/SmolLM2-135M-Instruct"
    if os.path.isdir(name_or_path):
        return f"a local checkpoint ({Path(name_or_path).name})", None
    return name_or_path or "unknown", name_or_path or None


def table_cell(value) -> str:
    """`value` as the text of one markdown table cell: HTML escaped (a task name is not markup),
    `|` escaped (it would end the cell) and line breaks folded into spaces (they would end the row)."""
    text = html.escape(str(value), quote=False).replace("|", "\\|")
    return " ".join(text.split())


def keep_foreign_readme(directory: str | os.PathLike) -> Path | None:
    """Before a run writes its card as `<directory>/README.md`: a README.md there that this
    project did not write (no `CARD_MARKER`: the user's own notes) is renamed to
    README.previous.md (or -2, -3, ...), with a warning, instead of being overwritten. Returns its new path."""
    directory = Path(directory)
    path = directory / "README.md"
    if not path.is_file() or CARD_MARKER in path.read_text(errors="replace"):
        return None
    names = ("README.previous.md", *(f"README.previous-{k}.md" for k in range(2, 10_000)))
    kept = next(directory / name for name in names if not (directory / name).exists())
    os.replace(path, kept)
    logger.warning(f"{path} was not written by {PROJECT}: kept as {kept.name}; the model card will be README.md.")
    return kept


def _evaluation(args, eval_history: list[dict[str, Any]], report_key: str | None) -> list[str]:
    final = next((e for e in reversed(eval_history) if e.get("tag") == "final"), None)
    before = next((e for e in eval_history if e.get("tag") == "before"), None)
    if not final:
        return ["No final evaluation was run."]
    lines = [
        f"Final success rate on {final['num_tasks']} `{args.eval_split}` tasks "
        f"(temperature {args.eval_temperature}): **{final['success_rate']:.3f}**"
        + (f" (before training: {before['success_rate']:.3f})" if before else ""),
        "",
        f"| {table_cell(report_key or 'tasks')} | success after training | before training |",
        "|---|---|---|",
        f"| all | {final['success_rate']:.3f} | {before['success_rate']:.3f} |" if before
        else f"| all | {final['success_rate']:.3f} | – |",
    ]
    before_types = (before or {}).get("per_type", {})
    for key, value in final.get("per_type", {}).items():
        earlier = f"{before_types[key]:.3f}" if key in before_types else "–"
        lines.append(f"| {table_cell(key)} | {value:.3f} | {earlier} |")
    return lines


def _citations(preset: str) -> list[str]:
    lines = []
    for key in PRESET_PAPERS.get(preset, ["grpo"]):
        title, url = PAPERS[key]
        lines.append(f"- [{title}]({url})" if url else f"- {title}")
    grpo = trl_compat.grpo_citation()
    return lines + ["", "```bibtex", grpo, "", TRL_CITATION, "```"]


def model_card(
    args,
    model,
    model_name: str,
    *,
    steps: int,
    env: str,
    report_key: str | None,
    eps: float | None,
    eval_history: list[dict[str, Any]],
    recipe: str | None = None,
    trackers: list[str] | None = None,
    estimator=None,
    cluster_layer: int | None = None,
) -> str:
    """The card's markdown, from the run's values (the trainer passes its own: `create_model_card`).

    `args`: the run's BiPACEConfig; `model`: the trained model (its config's base name, its PEFT
    config); `steps`: optimizer steps taken; `env`/`report_key`: the env's name and the task
    attribute evaluations are broken down by; `eps`: the estimator's clustering ε in use
    (`StepAdvantageEstimator.eps_in_use`: calibrated, fixed or its fallback; None without
    clustering); `eval_history`: the run's evaluations; `recipe`: the recipe file, if any;
    `trackers`: lines for the tracking section (default: `tracker_links`); `estimator`, `cluster_layer`:
    the run plan's (`run.plan.RunPlan`; default: the config's).
    """
    base, hub_id = _base_model(getattr(model.config, "name_or_path", "") or "")
    peft = getattr(model, "peft_config", None)
    adapter = next(iter(peft.values())) if peft else None
    url = project_url()
    project = f"[{PROJECT}]({url})" if url else f"{PROJECT} ({install_line()})"
    trackers = tracker_links(args.report_to) if trackers is None else trackers
    lines = [
        "---",
        *([f"base_model: {hub_id}"] if hub_id else []),
        "library_name: peft" if peft else "library_name: transformers",
        "tags: [trl, bipace, multi-turn-agent, reinforcement-learning, " + env + ", " + args.preset + "]",
        "---",
        CARD_MARKER,
        f"# {model_name}",
        "",
        f"An agent for the **{env}** text environment, trained with step-level RL by "
        f"{project} (preset **{args.preset}**) from base model `{base}`.",
        "",
        "## Training",
        f"- recipe: `{recipe}`" if recipe else "- recipe: none (the command line's settings)",
        f"- {steps} optimizer steps with `BiPACETrainer` on TRL {trl.__version__}; "
        + (f"LoRA r {adapter.r}, α {adapter.lora_alpha}" if adapter else "every parameter trained"),
        f"- learning rate {args.learning_rate} ({getattr(args.lr_scheduler_type, 'value', args.lr_scheduler_type)}), "
        f"KL β {args.beta}, clip ε {args.epsilon}, rollout temperature {args.temperature}",
        f"- rollouts per task {args.num_generations}, tasks per iteration {args.tasks_per_iteration}, "
        f"max turns {args.max_turns}, history {args.history_length}",
        "- tracking: " + ("; ".join(trackers) if trackers else "none"),
        "",
        *_estimator_lines(args, eps, estimator or args.estimator, args.cluster_layer if cluster_layer is None else cluster_layer),
        "",
        "## Evaluation",
        *_evaluation(args, eval_history, report_key),
        "",
        *_use_lines(model_name, bool(peft)),
        "",
        "## Citation",
        "The methods behind this preset:",
        "",
        *_citations(args.preset),
        "",
    ]
    return "\n".join(lines)


def _estimator_lines(args, eps: float | None, est, cluster_layer: int) -> list[str]:
    return [
        "## Estimator",
        f"- preset: `{args.preset}`; partition `{est.step_partition}`, baseline `{est.step_baseline}`, "
        f"w_ep {est.w_ep}, w_step {est.w_step}, γ {est.step_gamma}, norm `{est.advantage_norm}`",
        f"- cluster layer {cluster_layer}, ε {eps}" if eps is not None else "- no clustering ε (the partition takes none)",
    ]


def _use_lines(model_name: str, peft: bool) -> list[str]:
    return [
        "## Use",
        "```python",
        "from peft import AutoPeftModelForCausalLM" if peft else "from transformers import AutoModelForCausalLM",
        f"model = {'AutoPeftModelForCausalLM' if peft else 'AutoModelForCausalLM'}.from_pretrained({model_name!r})",
        "```",
    ]


def write_model_card(directory, args, model, model_name: str | None, *, steps: int, source, eps, eval_history, recipe=None,
                     estimator=None, cluster_layer: int | None = None) -> None:
    """`model_card` written as `<directory>/README.md`; `source` is the run's env source (its name and
    `report_key`), `model_name` defaults to the folder's name."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    card = model_card(
        args, model, model_name or directory.name, steps=steps, env=source.name, report_key=source.report_key,
        eps=eps, eval_history=eval_history, recipe=recipe, estimator=estimator, cluster_layer=cluster_layer,
    )
    (directory / "README.md").write_text(card)
