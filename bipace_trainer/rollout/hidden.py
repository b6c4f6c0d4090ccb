"""The actor's hidden state at one layer, at the last prompt token (BiGPO's φ(s)).

`hidden_states[layer]` follows the `output_hidden_states=True` convention of
transformers: index 0 is the embedding output, index i (1..L) the output of decoder
layer i-1, and index L (= -1) the last layer's output after the final norm. Negative
indices count from the end, as in the BiPACE paper ("layer -8 of 28").

Two ways to get it:

- `PrefillCapture` hooks the module that produces that tensor and keeps the last
  position of its *first* call inside a `generate()` — the prefill, which processes the
  whole (left-padded) prompt — so the state costs no extra forward pass. Decode calls
  (one new token each) are ignored.
- `PositionCapture` hooks the same module during any other forward pass over the
  prompts and keeps one column of every call: under vLLM, the old-logprob pass over
  [left-padded prompt | completion] runs anyway, and attention is causal, so column
  P - 1 is exactly the prefill's last prompt token (no extra pass either).
- `forward_hidden_states` runs one batched no-grad forward pass (`hidden_capture="forward"`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "resolve_layer_module", "PrefillCapture", "PositionCapture", "forward_hidden_states", "num_hidden_layers",
    "HiddenPlan", "HIDDEN_SOURCES", "resolve_cluster_layer", "clamp_layer",
]

# Where a run's hidden states come from: nowhere (the estimator reads none), a hook in generate's
# prefill (HF), the old-logprob pass that runs anyway under vLLM, or one extra forward pass.
HIDDEN_SOURCES = ("none", "prefill", "old_logprobs", "forward")


@dataclass(frozen=True)
class HiddenPlan:
    """Where this run's hidden states come from and at which layer: chosen once, by `choose`.

    The rollout reads it to capture in the generation ("prefill", "forward"; training rollouts
    only), the training batch to capture in its old-logprob pass ("old_logprobs"), which hands
    the states back to the caller, who passes them into the estimator's input."""

    source: str = "none"
    layer: int = -1

    @classmethod
    def choose(cls, needs_hidden: bool, hidden_capture: str, use_vllm: bool, layer: int) -> "HiddenPlan":
        """`hidden_capture="hook"` is the prefill hook under HF generate and the old-logprob pass under
        vLLM (whose engine exposes no hidden states); "forward" is one extra pass either way."""
        if not needs_hidden:
            return cls("none", layer)
        if hidden_capture == "forward":
            return cls("forward", layer)
        return cls("old_logprobs" if use_vllm else "prefill", layer)

    @property
    def in_generation(self) -> bool:
        """The generation itself captures them (prefill hook or extra pass)."""
        return self.source in ("prefill", "forward")


def num_hidden_layers(model: nn.Module) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(config.num_hidden_layers)


def _decoder_parts(model: nn.Module) -> tuple[nn.Module, nn.ModuleList, nn.Module | None]:
    """(embedding, decoder layer list, final norm) of a causal LM, found structurally so
    it works through PEFT and DeepSpeed wrappers and across architectures."""
    num_layers = num_hidden_layers(model)
    layers = next(
        (m for _, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == num_layers),
        None,
    )
    if layers is None:
        raise ValueError(f"Could not find the {num_layers} decoder layers of {type(model).__name__}.")
    embedding = model.get_input_embeddings()
    owner = next(m for m in model.modules() if any(child is layers for child in m.children()))
    norm = getattr(owner, "norm", None) or getattr(owner, "final_layernorm", None) or getattr(owner, "ln_f", None)
    return embedding, layers, norm


def resolve_layer_module(model: nn.Module, layer: int) -> nn.Module:
    """The module whose output is `hidden_states[layer]`.

    Raises ValueError naming `cluster_layer` when the index is out of range.
    """
    num_layers = num_hidden_layers(model)
    if not -(num_layers + 1) <= layer <= num_layers:
        raise ValueError(
            f"cluster_layer={layer} is out of range for a model with {num_layers} layers; "
            f"use -{num_layers + 1}..{num_layers} (output_hidden_states indexing)."
        )
    index = layer % (num_layers + 1)
    embedding, layers, norm = _decoder_parts(model)
    if index == 0:
        return embedding
    if index == num_layers and norm is not None:
        return norm
    return layers[index - 1]


def resolve_cluster_layer(num_layers: int, layer: int) -> int:
    """The one rule for `cluster_layer` on a model with `num_layers` decoder layers.

    `layer` indexes `hidden_states` (`output_hidden_states=True`): -(L+1)..L, 0 and -(L+1) the
    embeddings, L and -1 the last layer's output. A negative index past the model's depth counts
    from the top and stops at the first decoder layer (-L), with a warning: the default -8 (8 from
    the top, as the paper's -8 of 28 for a 7B model) must work on a shallower model, and the
    embeddings say only which token came last. A positive index past the depth names a layer that
    does not exist: a ValueError naming `cluster_layer` and the range.
    """
    if layer > num_layers:
        raise ValueError(
            f"cluster_layer={layer} is out of range for a model with {num_layers} layers; "
            f"use -{num_layers + 1}..{num_layers} (output_hidden_states indexing, e.g. -8)."
        )
    if layer < -(num_layers + 1):
        warnings.warn(
            f"cluster_layer={layer} is out of range for a model with {num_layers} layers; using cluster_layer={-num_layers} "
            f"(set cluster_layer in -{num_layers + 1}..{num_layers} to choose).",
            stacklevel=3,
        )
        return -num_layers
    return layer


def clamp_layer(model: nn.Module, layer: int) -> int:
    """`cluster_layer` resolved for `model` (`resolve_cluster_layer`), checked to name one of its modules."""
    resolved = resolve_cluster_layer(num_hidden_layers(model), layer)
    resolve_layer_module(model, resolved)
    return resolved


class PrefillCapture:
    """Context manager recording hidden_states[layer][:, -1] during one generate() call.

    Usage:
        with PrefillCapture(model, layer) as capture:
            model.generate(**left_padded_inputs)
        capture.states  # (B, d) float32 on CPU

    With left padding the last position is every row's last prompt token.
    """

    def __init__(self, model: nn.Module, layer: int):
        self.module = resolve_layer_module(model, layer)
        self.states: torch.Tensor | None = None
        self._handle = None

    def _hook(self, module, args, output):
        if self.states is None:
            hidden = output[0] if isinstance(output, (tuple, list)) else output
            self.states = hidden[:, -1, :].detach().to(torch.float32).cpu()

    def __enter__(self) -> "PrefillCapture":
        self.states = None
        self._handle = self.module.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()
        self._handle = None


class PositionCapture(PrefillCapture):
    """Context manager recording hidden_states[layer][:, position] of *every* forward call
    inside it (a chunked pass calls the model once per chunk), concatenated in call order.

    Usage:
        with PositionCapture(model, layer, position=P - 1) as capture:
            model(input_ids=torch.cat([left_padded_prompts, completions], 1), ...)
        capture.states  # (B, d) float32 on CPU
    """

    def __init__(self, model: nn.Module, layer: int, position: int):
        super().__init__(model, layer)
        self.position = position
        self._chunks: list[torch.Tensor] = []

    def _hook(self, module, args, output):
        hidden = output[0] if isinstance(output, (tuple, list)) else output
        self._chunks.append(hidden[:, self.position, :].detach().to(torch.float32).cpu())
        self.states = torch.cat(self._chunks)

    def __enter__(self) -> "PositionCapture":
        self._chunks = []
        return super().__enter__()


@torch.no_grad()
def forward_hidden_states(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, layer: int, batch_size: int = 8
) -> torch.Tensor:
    """hidden_states[layer] at the last prompt token by extra forward passes.

    Args:
        input_ids, attention_mask: (B, P) left-padded prompts.
    Returns:
        (B, d) float32 on CPU.
    """
    out = []
    for start in range(0, input_ids.shape[0], batch_size):
        ids = input_ids[start : start + batch_size]
        mask = attention_mask[start : start + batch_size]
        position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)  # as generate() does for left padding
        hidden = model(
            input_ids=ids, attention_mask=mask, position_ids=position_ids, output_hidden_states=True, use_cache=False
        ).hidden_states[layer]
        out.append(hidden[:, -1, :].to(torch.float32).cpu())
    return torch.cat(out) if out else torch.zeros(0)
