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

import torch
from torch import nn

__all__ = ["resolve_layer_module", "PrefillCapture", "PositionCapture", "forward_hidden_states", "num_hidden_layers"]


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


def clamp_layer(model: nn.Module, layer: int) -> int:
    """`layer` (`cluster_layer`), or, past this model's depth, the nearest decoder layer, with a warning:
    the default -8 (8 from the top, as the paper's -8 of 28 for a 7B model) has no meaning on a
    model with fewer layers, and the one-word switch from GRPOTrainer must work on any model.
    A negative index clamps to -num_layers (the first decoder layer's output, never the
    embeddings, which only say which token came last), a positive one to num_layers."""
    num_layers = num_hidden_layers(model)
    clamped = max(-num_layers, min(layer, num_layers))
    if clamped != layer:
        warnings.warn(
            f"cluster_layer={layer} is out of range for a model with {num_layers} layers; using cluster_layer={clamped} "
            f"(set cluster_layer in -{num_layers + 1}..{num_layers} to choose).",
            stacklevel=2,
        )
    resolve_layer_module(model, clamped)
    return clamped


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
