"""Attention over packed rows without an N × N mask (`shared_prefix.py`'s forward on SDPA models).

A packed row of the shared-prefix forward holds clusters side by side, each laid out as

    [ prefix (P tokens) | suffix 1 (L_1) | suffix 2 (L_2) | ... ]       (then padding)

where the prefix attends causally to itself and suffix i to the whole prefix and causally to
itself, never to another suffix or cluster. A materialised mask of that pattern is (C, 1, N, N)
over the packed row of N tokens, and a kernel given it computes all N² query-key pairs (on a
CPU and on a GPU alike: a custom mask rules out the fused causal kernels). `segment_attention`
computes the same output from the pattern's blocks:

    prefix:    softmax(Q_p K_pᵀ · scale + causal) V_p                   one causal SDPA, no mask
    suffix i:  softmax(Q_i [K_p; K_i]ᵀ · scale + M_i) [V_p; V_i]         the cluster's suffixes batched

with M_i (L × (P + L)) all-visible over the prefix and causal over the suffix, so the pairs
computed are P(P+1)/2 + Σ_i L_max (P + L_max) (`pairs`) and the only masks are the suffixes'
(k, 1, L_max, P + L_max): no larger than the masks the plain path's padded rows get. Padding
positions give zeros (no query of any row sees them).

**How it reaches the model.** transformers looks the attention function up by name at each call
(`AttentionInterface`). Inside `routed()` (`BiPACETrainer.train` runs in it) transformers' "sdpa"
entry is `route(sdpa)`: a call that carries `shared_prefix_layout` (the packed forward passes it as
a model keyword, which transformers hands to every attention call, gradient checkpointing's replay
included) takes `segment_attention`; every other call is transformers' own SDPA, unchanged. The
layout travels with the call, so a replay in the backward pass sees the same layout as the forward.
The packed forward's `attention_mask` is a placeholder that no SDPA call could broadcast: a packed
forward outside `routed()` fails loudly rather than attending wrongly.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from .. import trl_compat

__all__ = ["Cluster", "SegmentLayout", "segment_attention", "routed", "routing", "placeholder_mask", "LAYOUT_KEYWORD"]

LAYOUT_KEYWORD = "shared_prefix_layout"
# Keywords of attention calls whose semantics a segment layout does not reproduce.
_UNSUPPORTED = ("sliding_window", "softcap", "s_aux", "position_bias")


@dataclass(frozen=True)
class Cluster:
    """One cluster of a packed row: its offset in the row, its prefix length P and its suffixes as
    (start in the row, length) pairs, in row order."""

    offset: int
    prefix: int
    suffixes: tuple[tuple[int, int], ...] = ()

    @property
    def end(self) -> int:
        return self.offset + self.prefix + sum(length for _, length in self.suffixes)


@dataclass
class SegmentLayout:
    """The clusters of each of a plan's C packed rows of width N (`shared_prefix.Plan.layout`)."""

    rows: list[list[Cluster]]
    width: int
    _tensors: dict = field(default_factory=dict, repr=False)

    def suffix_batch(self, cluster: Cluster, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, L_max) row positions of the cluster's k suffixes (padding repeats a suffix's last
        position) and their (k, 1, L_max, P + L_max) mask; built once per forward, shared by the layers."""
        key = (cluster, device)
        if key not in self._tensors:
            lengths = torch.tensor([length for _, length in cluster.suffixes], device=device)
            starts = torch.tensor([start for start, _ in cluster.suffixes], device=device)
            longest = int(lengths.max())
            step = torch.arange(longest, device=device)
            index = starts[:, None] + torch.minimum(step[None, :], lengths[:, None] - 1)
            own = (step[None, None, :] <= step[None, :, None]) & (step[None, None, :] < lengths[:, None, None])
            prefix = torch.ones(len(lengths), longest, cluster.prefix, dtype=torch.bool, device=device)
            self._tensors[key] = index, torch.cat([prefix, own], dim=2).unsqueeze(1)
        return self._tensors[key]

    def pairs(self) -> int:
        """Query-key pairs `segment_attention` computes, per head and layer (for the cost model)."""
        clusters = [c for row in self.rows for c in row]
        return sum(c.prefix * (c.prefix + 1) // 2 for c in clusters) + sum(map(_suffix_pairs, clusters))

    def mask_bytes(self) -> int:
        """Bytes of the suffixes' boolean masks (one per pair of a suffix batch), alive during one forward."""
        return sum(_suffix_pairs(c) for row in self.rows for c in row)


def _suffix_pairs(cluster: Cluster) -> int:
    """Pairs of a cluster's suffix batch: k suffixes padded to the longest, over the prefix and themselves."""
    if not cluster.suffixes:
        return 0
    longest = max(length for _, length in cluster.suffixes)
    return len(cluster.suffixes) * longest * (cluster.prefix + longest)


def _sdpa(query, key, value, groups: int, dropout: float, scaling, mask=None) -> torch.Tensor:
    """SDPA over (b, H, q, d) queries and (b, H/groups, k, d) keys and values: causal without a mask, else
    with `mask`. Grouped-query heads go to the kernel, except for a masked call off a CPU (keys repeated, as
    transformers does: CUDA's kernels that take a mask fall back to the unfused one for grouped heads; the
    CPU's fused kernel takes both, in a quarter of the repeated keys' memory at SmolLM2's 3 groups)."""
    if mask is None:
        return F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, scale=scaling, is_causal=True,
                                              enable_gqa=groups > 1)
    in_kernel = groups > 1 and query.device.type == "cpu"
    if groups > 1 and not in_kernel:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                          enable_gqa=in_kernel)


def _cluster(query, key, value, layout: SegmentLayout, cluster: Cluster, groups, dropout, scaling) -> list[torch.Tensor]:
    """The (H, ·, d) outputs of one cluster's prefix and suffixes, in row order."""
    start, end = cluster.offset, cluster.offset + cluster.prefix
    outputs = []
    if cluster.prefix:
        outputs.append(_sdpa(query[None, :, start:end], key[None, :, start:end], value[None, :, start:end],
                             groups, dropout, scaling)[0])
    if not cluster.suffixes:
        return outputs
    index, mask = layout.suffix_batch(cluster, query.device)
    count, longest = index.shape
    flat = index.reshape(-1)

    def batch(states):  # (heads, N, d) → the suffixes' (k, heads, L_max, d)
        return states[:, flat].reshape(states.size(0), count, longest, -1).transpose(0, 1)

    keys = torch.cat([key[None, :, start:end].expand(count, -1, -1, -1), batch(key)], dim=2)
    values = torch.cat([value[None, :, start:end].expand(count, -1, -1, -1), batch(value)], dim=2)
    suffix_out = _sdpa(batch(query), keys, values, groups, dropout, scaling, mask)
    outputs += [suffix_out[i, :, :length] for i, (_, length) in enumerate(cluster.suffixes)]
    return outputs


def segment_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: SegmentLayout,
                      groups: int = 1, dropout: float = 0.0, scaling: float | None = None) -> torch.Tensor:
    """Attention of packed rows laid out as `layout` (module docstring), equal to SDPA under the
    materialised mask of the same pattern (`shared_prefix.attention_mask_4d`).

    query: (C, H, N, d); key, value: (C, H / groups, N, d). Returns (C, H, N, d), zeros at padding.
    """
    heads, width, dim = query.size(1), query.size(2), value.size(-1)
    rows = []
    for r, clusters in enumerate(layout.rows):
        parts, cursor = [], 0
        for cluster in clusters:
            if cluster.offset > cursor:
                parts.append(query.new_zeros(heads, cluster.offset - cursor, dim))
            parts += _cluster(query[r], key[r], value[r], layout, cluster, groups, dropout, scaling)
            cursor = cluster.end
        if width > cursor:
            parts.append(query.new_zeros(heads, width - cursor, dim))
        rows.append(torch.cat(parts, dim=1))
    return torch.stack(rows)


def placeholder_mask(rows: int, device) -> torch.Tensor:
    """The packed forward's `attention_mask`: 4-D, so transformers passes it through unchanged, and of a
    shape SDPA cannot broadcast over a row's scores, so that a packed forward reaching transformers'
    own SDPA (outside `routed()`) fails instead of attending without the layout."""
    return torch.ones(rows, 1, 2, 3, dtype=torch.bool, device=device)


def route(sdpa: Callable) -> Callable:
    """transformers' attention function `sdpa`, or `segment_attention` for a call carrying a layout."""

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        layout = kwargs.pop(LAYOUT_KEYWORD, None)
        if layout is None:
            return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        unsupported = [name for name in _UNSUPPORTED if kwargs.get(name) is not None]
        if unsupported:
            raise ValueError(f"shared_prefix: this model's attention takes {unsupported}, which the packed layout "
                             "does not reproduce; set shared_prefix=false.")
        groups = getattr(module, "num_key_value_groups", 1)
        output = segment_attention(query, key, value, layout, groups, dropout, scaling)
        return output.transpose(1, 2).contiguous(), None

    attention.routes_shared_prefix = True
    return attention


def routing() -> bool:
    """Whether transformers' "sdpa" attention takes a layout now (inside `routed()`)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return getattr(ALL_ATTENTION_FUNCTIONS.get("sdpa"), "routes_shared_prefix", False)


@contextlib.contextmanager
def routed() -> Iterator[None]:
    """For the scope, transformers' "sdpa" attention takes a `shared_prefix_layout` (module docstring);
    transformers' own function comes back on exit. Nested scopes route once."""
    if routing():
        yield
        return
    with trl_compat.routed_attention("sdpa", route):
        yield
