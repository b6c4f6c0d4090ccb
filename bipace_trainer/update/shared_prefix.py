"""Train each shared prefix once: the update's forward passes compute a token prefix that several
rows share one time, and a chat episode, whose turns each extend the one before, as one sequence.

    forward = SharedPrefixForward.for_trainer(trainer)     # None where it is off (the reason logged once)
    with forward.scope():                                   # BiPACETrainer.train runs inside it
        logps, entropies = forward.logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, ...)
        pieces = forward.pieces(inputs, plain_pieces)       # the update's micro-batch pieces, or None

`GRPOAdapter._get_per_token_logps_and_entropies` (`update/adapter.py`; the update, the old and the
reference log-prob passes all go through it) calls it in place of TRL's row-by-row forward, and
returns the same (B, logits_to_keep) log-probs and entropies, so TRL's loss, clipping, KL,
importance ratio and metrics run unchanged on them.

**Layout.** Each row's real tokens (prompt mask, then completion mask) form a sequence. A row whose
sequence is a prefix of another row's (turn k of a chat episode inside turn k+1's prompt, or two
equal rows) is not forwarded at all: attention is causal, so its log-probs are the longer row's at
the same positions (*absorbed*). The remaining rows (*leaves*) are sorted; consecutive leaves that
share a prefix form a *cluster* (chosen to forward the fewest tokens: `_partition`), laid out as::

    [ shared prefix (positions 0..P-1) | suffix 1 (P..L1-1) | suffix 2 (P..L2-1) | ... ]

(clusters shorter than the longest share a packed row, side by side: `_bins`) with each suffix
attending to the prefix and causally to itself, and carrying its own position ids. Labels are passed
pre-shifted (`shift_labels` of TRL's fused LM head), so each position is scored against the next token
*of its own row*; where two leaves branch at a token some row scores, the prefix stops one token short
and each suffix repeats it. Log-probs and entropies are then gathered back into TRL's (B, T) layout,
zero where the plain path gives zero (padding, masked completions).

**Attention without an N × N mask.** On SDPA models the layout reaches the attention itself
(`packed_attention`): the prefix is one causal SDPA call, a cluster's suffixes one batched call over the
prefix's keys and their own, so the pairs computed are the rows' own (P²/2 + Σ L(P + L)), not N² of the
packed row, and no mask larger than the plain path's padding masks exists. Eager attention (kept for
models whose eager code does what SDPA cannot, e.g. soft-capping) takes the materialised (C, 1, N, N)
additive mask (`attention_mask_4d`), and the cost model below charges it. Not FlexAttention: torch
2.13 has no FlexAttention backward on a CPU, and on a GPU its block masks need a compile per shape.
Not the prefix's keys and values computed once and reused by each suffix across the model: under
gradient checkpointing transformers drops any KV cache inside a checkpointed layer, and an episode
forwarded as one sequence needs none; the segment attention does that reuse inside each layer.

**The cost model** (`worth_packing`). A forward's FLOPs are its tokens × 2 × the parameters a token
passes (`ModelShape`) plus its attention pairs × 4 × heads × head_dim × layers; its peak memory is its
tokens × the activations a token keeps plus its quadratic bytes (masks; eager's score matrices). Rows
are packed only where that forwards at most (1 − `MIN_SAVING`) of the plain path's FLOPs and peaks
within the plain path's estimate × `MEMORY_MARGIN`; else TRL's own forward runs them. Each call decides
per forward (a plain forward's `batch_size` rows, or, without gradients, runs cut in token order); the
update decides per micro-batch (`pieces`).

**Pieces.** The update runs a micro-batch in pieces (`micro_batches`). Here the rows are cut in the
order of their token sequences (so an episode's turns and a group's rows share a piece) into pieces
whose packed tokens stay within what the plain path's largest piece forwards
(`per_device_train_batch_size` × the longest row), where the cost model says so. The plain path's
pieces, each packed where it pays, are kept on several processes (TRL's loss gathers once per piece, so
every rank must make as many) and under the entropy bonus (`entropy_coef`, `use_adaptive_entropy`: a mean
over a piece's tokens); that is logged once. Under a `top_entropy_quantile` below 1 the update's forward is
not packed at all (`applies`: its threshold is one of the entropies, so ties break on float rounding).
What the loss logs per piece is combined over the micro-batch (`micro_batches.combine_metrics`), so logged
metrics do not depend on the pieces.

**Exactness.** The same tokens at the same relative positions: log-probs, entropies, the loss, the
gradients and every logged metric equal the plain path's to float rounding under every loss setting
(tests/update/test_shared_prefix.py, tests/update/test_shared_prefix_settings.py, and 2 processes in
tests/trainer/test_shared_prefix_distributed.py). A left-padded row sits at other absolute positions
in the plain path; for rotary positions only relative ones count. The first packed forward is checked
against the plain path on its rows (at most a plain forward's, eval mode, no gradients), and a mismatch
turns the feature off with a warning, so a model whose attention cannot take the layout never trains on
it. Which rows go together never depends on whether that check has run yet in this process, so a resumed
run cuts the same pieces as the run it continues (tests/reliability/test_interruption.py); were the check
to fail on an update piece cut for packing, that one piece is forwarded plain with its extra rows. It is off, with the reason logged once, for attention that takes no custom mask (flash attention),
sliding-window layers, ZeRO-3 and FSDP (not verified equal), a model that trains with dropout
(`active_dropout`: the packed forward would draw one mask for a shared prefix where the plain path draws one
per row; TRL's `disable_dropout=True` keeps the feature on), MoE auxiliary losses and vision inputs,
and the pass that captures hidden states by position (vLLM with a `hidden` preset). See
docs/performance.md for the measured gain.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from . import packed_attention
from .packed_attention import Cluster, SegmentLayout

__all__ = ["SharedPrefixForward", "Plan", "plan_layout", "plan_rows", "packed_logps", "ModelShape", "Cost",
           "plain_cost", "packed_cost", "worth_packing", "group_rows", "active_dropout"]

logger = logging.getLogger(__name__)

# A packed position's segment is cluster × _BLOCK + (0 for the cluster's prefix, k for its k-th suffix); -1 pads.
_BLOCK = 1 << 20
# How each attention implementation sees a packed row's clusters; anything else runs the plain path.
_ATTENTION = {"sdpa": "segments", "eager": "additive"}
# torch's dropout modules (LoRA's `lora_dropout` is a `Dropout`): `active_dropout`
_DROPOUT = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.AlphaDropout,
            torch.nn.FeatureAlphaDropout)
# The inputs of TRL's loss that go to a vision model's forward (`GRPOTrainer._compute_loss`): none is packed.
_VISION_INPUTS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                  "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


@dataclass
class _Group:
    """One packed row: the shared prefix's length and its leaves (indices into the leaf list)."""

    prefix: int
    leaves: list[int]


@dataclass
class Plan:
    """How a call's B rows are forwarded.

    input_ids, position_ids, shift_labels: (C, N) packed rows (C clusters, N the longest);
    segment: (C, N) cluster × `_BLOCK` + (0 for its prefix, k for its suffix k), -1 for padding (several
        clusters share a packed row where they fit: `_bins`);
    index: (B, K) flat index into the (C, N) outputs of each completion column's score; valid: (B, K);
    layout: the same clusters as `packed_attention.SegmentLayout` (segment attention reads it, not `segment`).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    shift_labels: torch.Tensor
    segment: torch.Tensor
    index: torch.Tensor
    valid: torch.Tensor
    layout: SegmentLayout
    tokens: int = 0  # tokens forwarded (without padding), for the bench
    stats: dict[str, int] = field(default_factory=dict)


def row_sequences(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int):
    """Each row's real tokens and its number of real prompt tokens, or None where the plain path
    would not equal a packed one: a mask with a gap (real tokens must be the prompt's last ones, then the
    completion's first ones), or a scored completion with no prompt token before it."""
    width = input_ids.size(1)
    prompt_width = width - logits_to_keep
    ids, mask = input_ids.tolist(), attention_mask.bool().tolist()
    sequences, prompt_lengths = [], []
    for row_ids, row_mask in zip(ids, mask):
        prompt_real = sum(row_mask[:prompt_width])
        completion_real = sum(row_mask[prompt_width:])
        if not all(row_mask[prompt_width - prompt_real : prompt_width]) or not all(
            row_mask[prompt_width : prompt_width + completion_real]
        ):
            return None
        if completion_real and not prompt_real:
            return None
        sequences.append(row_ids[prompt_width - prompt_real : prompt_width + completion_real])
        prompt_lengths.append(prompt_real)
    return sequences, prompt_lengths


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix, by bisection on slice equality (compared in C, not a Python loop)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def _absorb(sequences: list[list[int]]) -> tuple[list[int], list[int]]:
    """(leaf rows, carrier of each row): in lexicographic order a row is a prefix of another exactly when
    it is a prefix of the next one, so each row's carrier is the end of its run of prefixes."""
    order = sorted(range(len(sequences)), key=lambda r: sequences[r])
    carrier = list(range(len(sequences)))
    leaves = []
    for position in range(len(order) - 1, -1, -1):
        row = order[position]
        if position + 1 < len(order):
            after = order[position + 1]
            seq, nxt = sequences[row], sequences[after]
            if len(seq) <= len(nxt) and nxt[: len(seq)] == seq:
                carrier[row] = carrier[after]
                continue
        leaves.append(row)
    leaves.reverse()  # lexicographic order
    return leaves, carrier


def _partition(leaves: list[int], sequences, min_shared: int) -> list[tuple[int, int, int]]:
    """Split the sorted leaves into consecutive clusters that forward the fewest tokens: a cluster of k
    leaves sharing P tokens saves (k-1)·P. Dynamic programming over where the last cluster starts (a
    group's long task prefix beats the short system text every group shares). Returns (start, end, P)."""
    count = len(leaves)
    lcp = [_common_prefix(sequences[leaves[i]], sequences[leaves[i + 1]]) for i in range(count - 1)]
    best, start_of, shared_of = [0] * (count + 1), [0] * (count + 1), [0] * (count + 1)
    for end in range(1, count + 1):
        best[end], start_of[end], shared_of[end] = best[end - 1], end - 1, len(sequences[leaves[end - 1]])
        shared = math.inf
        for begin in range(end - 2, -1, -1):  # the cluster leaves[begin:end]
            shared = min(shared, lcp[begin])
            if shared < min_shared:
                break
            if best[begin] + (end - begin - 1) * shared > best[end]:
                best[end], start_of[end], shared_of[end] = best[begin] + (end - begin - 1) * shared, begin, shared
    spans, end = [], count
    while end > 0:
        spans.append((start_of[end], end, shared_of[end]))
        end = start_of[end]
    return spans[::-1]


def _clusters(leaves: list[int], sequences, scored: dict[int, set[int]], min_shared: int) -> list[_Group]:
    """The packed rows (`_partition`); a cluster's prefix stops one token short of where its leaves
    branch if some leaf scores the token after it (that position's label differs between them)."""
    clusters = []
    for begin, end, shared in _partition(leaves, sequences, min_shared):
        members = list(range(begin, end))
        # a prefix position p predicts token p+1: the same for every leaf unless p+1 == prefix (they branch)
        if len(members) > 1 and any(shared in scored[leaves[i]] for i in members):
            shared -= 1
        clusters.append(_Group(prefix=shared, leaves=members))
    return clusters


def plan_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                min_shared: int = 1) -> Plan | None:
    """The packed layout of one forward of TRL's (B, L) rows (prompt left-padded, completion right-padded,
    the last `logits_to_keep` columns scored); None where it cannot equal the plain path (`row_sequences`)."""
    rows = row_sequences(input_ids, attention_mask, logits_to_keep)
    if rows is None:
        return None
    return plan_rows(*rows, logits_to_keep, input_ids.device, min_shared)


def plan_rows(sequences: list[list[int]], prompt_lengths: list[int], logits_to_keep: int, device,
              min_shared: int = 1) -> Plan:
    """`plan_layout` of rows given as their real token sequences and prompt lengths (`row_sequences`)."""
    leaves, carrier = _absorb(sequences)
    # the token indices each leaf must score: its own and its absorbed rows' completions
    scored: dict[int, set[int]] = {leaf: set() for leaf in leaves}
    for row, length in enumerate(prompt_lengths):
        scored[carrier[row]].update(range(length, len(sequences[row])))
    clusters = _clusters(leaves, sequences, scored, min_shared)
    return _pack(sequences, prompt_lengths, leaves, carrier, scored, clusters, logits_to_keep, device)


def _bins(lengths: list[int]) -> tuple[int, list[tuple[int, int]]]:
    """First-fit decreasing of the clusters into packed rows as wide as the longest cluster, so that short
    clusters share a row instead of being padded to it. Returns (width, (row, offset) per cluster)."""
    width = max(lengths)
    free: list[int] = []
    placed = [(0, 0)] * len(lengths)
    for c in sorted(range(len(lengths)), key=lambda c: -lengths[c]):
        row = next((r for r, room in enumerate(free) if room >= lengths[c]), None)
        if row is None:
            row = len(free)
            free.append(width)
        placed[c] = (row, width - free[row])
        free[row] -= lengths[c]
    return width, placed


def _pack(sequences, prompt_lengths, leaves, carrier, scored, clusters, logits_to_keep, device) -> Plan:
    """Lay the clusters out in packed rows (`_bins`) and map each row's completion columns into them."""
    lengths = [c.prefix + sum(len(sequences[leaves[i]]) - c.prefix for i in c.leaves) for c in clusters]
    width, placed = _bins(lengths)
    count = 1 + max(row for row, _ in placed)
    ids, positions = [[0] * width for _ in range(count)], [[0] * width for _ in range(count)]
    labels, segment = [[-100] * width for _ in range(count)], [[-1] * width for _ in range(count)]
    where: dict[int, tuple[int, int, int, int]] = {}  # leaf → (row, cluster's offset, suffix start, prefix length)
    layout: list[list[Cluster]] = [[] for _ in range(count)]
    for c, cluster in enumerate(clusters):
        row, offset = placed[c]
        first, block = sequences[leaves[cluster.leaves[0]]], c * _BLOCK
        ids[row][offset : offset + cluster.prefix] = first[: cluster.prefix]
        positions[row][offset : offset + cluster.prefix] = range(cluster.prefix)
        segment[row][offset : offset + cluster.prefix] = [block] * cluster.prefix
        cursor, suffixes = cluster.prefix, []
        for k, i in enumerate(cluster.leaves, start=1):
            leaf = leaves[i]
            seq, suffix = sequences[leaf], len(sequences[leaf]) - cluster.prefix
            ids[row][offset + cursor : offset + cursor + suffix] = seq[cluster.prefix :]
            positions[row][offset + cursor : offset + cursor + suffix] = range(cluster.prefix, len(seq))
            segment[row][offset + cursor : offset + cursor + suffix] = [block + k] * suffix
            where[leaf] = (row, offset, cursor, cluster.prefix)
            for token in scored[leaf]:  # token t is scored at the position of token t-1
                labels[row][offset + _packed(token - 1, cursor, cluster.prefix)] = seq[token]
            suffixes += [(offset + cursor, suffix)] if suffix else []
            cursor += suffix
        layout[row].append(Cluster(offset, cluster.prefix, tuple(suffixes)))
    rows, keep = len(sequences), logits_to_keep
    index, valid = [[0] * keep for _ in range(rows)], [[False] * keep for _ in range(rows)]
    for r in range(rows):
        row, offset, start, prefix = where[carrier[r]]
        for j in range(min(len(sequences[r]) - prompt_lengths[r], keep)):
            index[r][j] = row * width + offset + _packed(prompt_lengths[r] + j - 1, start, prefix)
            valid[r][j] = True
    as_long = dict(dtype=torch.long, device=device)
    return Plan(
        input_ids=torch.tensor(ids, **as_long), position_ids=torch.tensor(positions, **as_long),
        shift_labels=torch.tensor(labels, **as_long), segment=torch.tensor(segment, **as_long),
        index=torch.tensor(index, **as_long), valid=torch.tensor(valid, dtype=torch.bool, device=device),
        layout=SegmentLayout([sorted(row, key=lambda c: c.offset) for row in layout], width), tokens=sum(lengths),
        stats={"rows": rows, "leaves": len(leaves), "clusters": len(clusters)},
    )


def _packed(token: int, suffix_start: int, prefix: int) -> int:
    """Packed position of a leaf's token index: in the shared prefix, or in the leaf's own suffix."""
    return token if token < prefix else suffix_start + token - prefix



def attention_mask_4d(segment: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """(C, 1, N, N) mask of packed rows, for attention that takes no layout (eager): a token sees its cluster's
    prefix's and its own suffix's earlier tokens; padding sees itself only (a query row that sees nothing
    would give NaN and poison the backward). `kind` "bool" (True: attend) or "additive" (0 or the dtype's min)."""
    n = segment.size(1)
    query, key = segment.unsqueeze(2), segment.unsqueeze(1)
    causal = torch.ones(n, n, dtype=torch.bool, device=segment.device).tril()
    same_cluster = (query // _BLOCK) == (key // _BLOCK)
    allowed = causal & (query >= 0) & (key >= 0) & same_cluster & ((key % _BLOCK == 0) | (key == query))
    allowed |= torch.eye(n, dtype=torch.bool, device=segment.device)
    allowed = allowed.unsqueeze(1)
    if kind == "bool":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=segment.device).masked_fill(~allowed, torch.finfo(dtype).min)


def packed_logps(model, plan: Plan, attention: str, dtype: torch.dtype, compute_entropy: bool,
                 autocast) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward of a plan through TRL's fused LM head; (B, K) log-probs and entropies in TRL's layout.
    `attention`: "segments" (SDPA models, inside `packed_attention.routed()`: no N × N mask) or
    "additive" (eager attention: the materialised (C, 1, N, N) mask, `attention_mask_4d`)."""
    if attention == "segments":
        extra = {"attention_mask": packed_attention.placeholder_mask(plan.input_ids.size(0), plan.input_ids.device),
                 packed_attention.LAYOUT_KEYWORD: plan.layout}
    else:
        extra = {"attention_mask": attention_mask_4d(plan.segment, attention, dtype)}
    with autocast():
        outputs = model(input_ids=plan.input_ids, position_ids=plan.position_ids, shift_labels=plan.shift_labels,
                        fused_lm_head=True, **extra)

    def gather(values: torch.Tensor) -> torch.Tensor:
        picked = values.reshape(-1)[plan.index]
        return torch.where(plan.valid, picked, torch.zeros((), dtype=picked.dtype, device=picked.device))

    return gather(outputs.log_probs), gather(outputs.entropy) if compute_entropy else None


# ---------------------------------------------------------------------------------------------- the cost model


@dataclass(frozen=True)
class ModelShape:
    """A model's cost constants (the same factor for the backward pass on both sides, so left out):
    token_flops = 2 × the parameters a token passes through (embeddings and LM head aside);
    pair_flops = 4 × heads × head_dim × layers (the scores QKᵀ and the weighted sum of V, per query-key pair);
    token_bytes = activations a token keeps ((4 × hidden + 3 × intermediate) × layers × dtype bytes: an
    estimate, compared only with the attention's quadratic bytes, since packed forwards never hold more tokens)."""

    token_flops: float
    pair_flops: float
    token_bytes: float
    heads: int

    @classmethod
    def of(cls, model) -> "ModelShape":
        config = model.config.get_text_config()
        layers, hidden, heads = config.num_hidden_layers, config.hidden_size, config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
        heads_and_tails = [m for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None]
        skipped = {id(p) for m in heads_and_tails for p in m.parameters()}
        params = sum(p.numel() for p in model.parameters() if id(p) not in skipped)
        dtype_bytes = next(model.parameters()).element_size()
        return cls(2.0 * params, 4.0 * heads * head_dim * layers,
                   float(dtype_bytes * layers * (4 * hidden + 3 * intermediate)), heads)


@dataclass(frozen=True)
class Cost:
    """What some rows' forwards cost: tokens and attention pairs over all of them (FLOPs), and the tokens and
    quadratic bytes (masks, eager's score matrices) of the largest single forward (peak memory)."""

    tokens: int
    pairs: int
    peak_tokens: int
    peak_quadratic_bytes: int

    def flops(self, shape: ModelShape) -> float:
        return self.tokens * shape.token_flops + self.pairs * shape.pair_flops

    def memory(self, shape: ModelShape) -> float:
        return self.peak_tokens * shape.token_bytes + self.peak_quadratic_bytes


def plain_cost(lengths: list[int], width: int, chunk: int, attention: str, heads: int) -> Cost:
    """TRL's row-by-row forward of rows of these real lengths, `chunk` rows at a time, each padded to `width`.
    Pairs: width² per row where a mask is needed (a padded row, eager attention: a masked kernel computes the
    whole square), else the causal width (width + 1) / 2 of SDPA's fused causal kernel. Quadratic bytes:
    SDPA's (chunk, 1, width, width) boolean padding mask, or eager's additive mask with its (chunk, heads,
    width, width) scores and their softmax."""
    rows, chunk = len(lengths), min(chunk, len(lengths))
    square = chunk * width * width
    if attention == "additive":
        return Cost(rows * width, rows * width * width, chunk * width, square * (4 + 8 * heads))
    if any(length != width for length in lengths):
        return Cost(rows * width, rows * width * width, chunk * width, square)
    return Cost(rows * width, rows * width * (width + 1) // 2, chunk * width, 0)


def packed_cost(plan: Plan, attention: str, heads: int) -> Cost:
    """One packed forward of a plan: segment attention's pairs and suffix masks (`SegmentLayout`), or
    eager's full (C, N, N) pairs, additive mask (and its boolean temporaries) and scores."""
    rows, width = plan.input_ids.shape
    if attention == "segments":
        return Cost(rows * width, plan.layout.pairs(), rows * width, plan.layout.mask_bytes())
    square = rows * width * width
    return Cost(rows * width, square, rows * width, square * (4 + 3 + 8 * heads))


# Packed forwards are used where they forward at most this share of the plain path's FLOPs (planning, gathers
# and the extra attention calls cost the rest) and peak within the plain path's estimate times this margin.
MIN_SAVING = 0.05
MEMORY_MARGIN = 1.05


def worth_packing(packed: Cost, plain: Cost, shape: ModelShape) -> bool:
    """The per-batch decision: fewer FLOPs by `MIN_SAVING` and within the plain path's peak × `MEMORY_MARGIN`."""
    return (packed.flops(shape) <= (1 - MIN_SAVING) * plain.flops(shape)
            and packed.memory(shape) <= MEMORY_MARGIN * plain.memory(shape))


# ---------------------------------------------------------------------------------------------- which rows together


def _cost(sequences: list[list[int]]) -> int:
    """Packed tokens of rows forwarded together (`_absorb`, `_partition`), for sizing forwards."""
    leaves, _ = _absorb(sequences)
    total = sum(len(sequences[leaf]) for leaf in leaves)
    return total - sum((end - begin - 1) * shared for begin, end, shared in _partition(leaves, sequences, 1))


def group_rows(sequences: list[list[int]], budget: int, count: int | None = None) -> list[list[int]]:
    """Rows cut, in the order of their token sequences, into runs whose packed tokens stay within
    `budget` (a run always takes at least one row); with `count`, the runs with most rows are split in
    halves until there are `count` of them (DDP: every rank forwards as many times)."""
    order = sorted(range(len(sequences)), key=lambda r: sequences[r])
    runs: list[list[int]] = []
    for row in order:
        if runs and _cost([sequences[r] for r in runs[-1] + [row]]) <= budget:
            runs[-1].append(row)
        else:
            runs.append([row])
    while count is not None and len(runs) < count:
        largest = max(range(len(runs)), key=lambda i: len(runs[i]))
        run = runs[largest]
        if len(run) < 2:
            break
        runs[largest : largest + 1] = [run[: len(run) // 2], run[len(run) // 2 :]]
    return runs


@dataclass
class _Run:
    """Rows of one call forwarded together: packed along `plan`, or (plan None) TRL's own forward."""

    rows: list[int]
    plan: Plan | None = None


@dataclass
class _Rows:
    """A call's rows: their real token sequences, prompt lengths, and the call's width."""

    sequences: list[list[int]]
    prompt_lengths: list[int]
    width: int
    keep: int
    device: Any

    def take(self, rows: list[int]) -> tuple[list[list[int]], list[int]]:
        return [self.sequences[r] for r in rows], [self.prompt_lengths[r] for r in rows]

    def lengths(self, rows: list[int]) -> list[int]:
        return [len(self.sequences[r]) for r in rows]


def _total(costs: list[Cost], together: bool) -> Cost:
    """Several forwards' cost: their tokens and pairs add up; the peak is the largest one's, or (`together`:
    forwards whose activations all wait for one backward) their sum."""
    peak = sum if together else max
    return Cost(sum(c.tokens for c in costs), sum(c.pairs for c in costs), peak(c.peak_tokens for c in costs),
                peak(c.peak_quadratic_bytes for c in costs))


class SharedPrefixForward:
    """The shared-prefix forward of one trainer: which rows go together, whether packing them pays
    (the cost model), and the first-use check (see the module docstring)."""

    def __init__(self, trainer, attention: str, shape: ModelShape, min_shared: int = 1):
        self.trainer = trainer
        self.attention = attention  # "segments" (SDPA) or "additive" (eager)
        self.shape = shape
        self.min_shared = min_shared
        self.checked = False
        self.enabled = True
        self.stats = {"calls": 0, "packed_forwards": 0, "plain_forwards": 0, "rows": 0, "tokens_plain": 0,
                      "tokens_shared": 0, "regrouped": 0, "flops_plain": 0.0, "flops_shared": 0.0}
        self._said: set[str] = set()

    @classmethod
    def for_trainer(cls, trainer) -> "SharedPrefixForward | None":
        """The trainer's shared-prefix forward, or None (with the reason logged) where it is off."""
        if not getattr(trainer.args, "shared_prefix", False):
            return None
        reason = off_reason(trainer)
        if reason:
            logger.warning(f"shared_prefix is off: {reason}")
            return None
        model = trainer.accelerator.unwrap_model(trainer.model)
        return cls(trainer, _ATTENTION[model.config._attn_implementation], ModelShape.of(model))

    def scope(self):
        """What the packed forwards need around the run (`BiPACETrainer.train`): SDPA models' routed attention."""
        return packed_attention.routed() if self.attention == "segments" else contextlib.nullcontext()

    def applies(self, compute_aux_loss: bool, extra: dict[str, Any], compute_entropy: bool = False) -> bool:
        """Whether this call can take the packed layout (no vision inputs, no MoE auxiliary loss, not the
        old-logprob pass that captures hidden states by position under vLLM, not the update's forward under
        a `top_entropy_quantile` below 1, and, for SDPA models, inside `scope()`)."""
        if not self.enabled or compute_aux_loss or any(v is not None for v in extra.values()):
            return False
        quantile = self.trainer.args.top_entropy_quantile
        if compute_entropy and quantile < 1.0:
            # The entropy mask keeps the tokens at or above a quantile of the piece's entropies: a threshold that
            # is one of those values, so equal tokens (rows with the same prefix and reply) tie with it exactly,
            # and the packed forward's entropies, equal to TRL's to float rounding only, can break such a tie
            # the other way (seen on TRL tool episodes: another loss).
            self._say(f"shared_prefix is off for the update's forward: top_entropy_quantile={quantile} selects "
                      "tokens by comparing entropies, which the packed forward gives to float rounding only")
            return False
        if self.attention == "segments" and not packed_attention.routing():
            return False
        capturing = self.trainer.hidden_plan.source == "old_logprobs"  # the run's `HiddenPlan`
        return not (capturing and not torch.is_grad_enabled())

    def logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                            plain) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        """TRL's `_get_per_token_logps_and_entropies`, its rows packed where the cost model says it pays.
        `plain(model, input_ids, attention_mask)` is TRL's own with this call's other arguments (its defaults:
        this call's): for rows left unpacked, and for the first-use check."""
        parsed = row_sequences(input_ids, attention_mask, logits_to_keep)
        if parsed is None:
            return plain()
        rows = _Rows(*parsed, input_ids.size(1), logits_to_keep, input_ids.device)
        chunk = batch_size or self.trainer.args.per_device_train_batch_size
        runs = self._runs(rows, chunk)
        if not any(run.plan is not None for run in runs):
            self._count(rows, runs, chunk)
            return plain()
        parts = []
        for run in runs:
            index = torch.tensor(run.rows, device=input_ids.device)
            if run.plan is not None and not self.checked:  # on at most a plain forward's rows
                first = index[:chunk]
                self._check(model, input_ids[first], attention_mask[first], self._plan(rows, run.rows[:chunk]), plain)
            if run.plan is None or not self.enabled:
                run.plan = None
                parts.append((index, *plain(model, input_ids[index], attention_mask[index])[:2]))
                continue
            parts.append((index, *packed_logps(model, run.plan, self.attention, self._dtype(model), compute_entropy,
                                               self.trainer.accelerator.autocast)))
        self._count(rows, runs, chunk)
        return _unsort(parts, input_ids.size(0), compute_entropy) + (None,)

    def _runs(self, rows: _Rows, chunk: int) -> list[_Run]:
        """How a call's rows are forwarded. A call with gradients and more rows than a plain forward takes is
        an update piece cut for packing (`pieces`): packed whole. Without gradients, many rows are cut in
        token order within a plain forward's tokens, packed where that pays over all of them. Otherwise TRL's
        chunks of `chunk` rows, each packed where it pays (`worth_packing`)."""
        every = list(range(len(rows.sequences)))
        if len(every) > chunk and torch.is_grad_enabled():
            return [_Run(every, self._plan(rows, every))]
        if len(every) > chunk:
            grouped = [_Run(run, self._plan(rows, run)) for run in group_rows(rows.sequences, chunk * rows.width)]
            packed = _total([packed_cost(run.plan, self.attention, self.shape.heads) for run in grouped], False)
            if worth_packing(packed, self._plain_cost(rows, every, chunk), self.shape):
                return grouped
        runs = []
        for start in range(0, len(every), chunk):
            run = _Run(every[start : start + chunk], self._plan(rows, every[start : start + chunk]))
            if not worth_packing(packed_cost(run.plan, self.attention, self.shape.heads),
                                 self._plain_cost(rows, run.rows, chunk), self.shape):
                run.plan = None
            runs.append(run)
        return runs

    def _plain_cost(self, rows: _Rows, which: list[int], chunk: int) -> Cost:
        return plain_cost(rows.lengths(which), rows.width, chunk, self.attention, self.shape.heads)

    def _plan(self, rows: _Rows, which: list[int]) -> Plan:
        return plan_rows(*rows.take(which), rows.keep, rows.device, self.min_shared)

    def pieces(self, inputs: dict[str, Any], plain_pieces: list[list[int]]) -> list[list[int]] | None:
        """Row indices of the update's pieces cut in token order (`group_rows`: rows that share a prefix in
        one piece, within the tokens of the plain path's largest piece), where packing them forwards fewer
        FLOPs than the plain path's pieces (`plain_pieces`, `micro_batches.length_order`) within its peak;
        None for the plain pieces, each then packed where it pays (`_plain_pieces_reason` says when always), or
        none packed (`applies`)."""
        extra = {key: inputs.get(key) for key in _VISION_INPUTS}
        if not self.applies(self.trainer.aux_loss_enabled, extra, compute_entropy=True):
            return None  # a piece cut for packing must be packed: its rows exceed a plain piece's
        if self.trainer.accelerator.num_processes > 1:
            # Several processes keep the plain pieces: TRL's loss gathers once per piece, and regrouped pieces
            # could number differently on each rank (a gloo size mismatch, seen on 2 processes).
            return None
        reason = self._plain_pieces_reason()
        if reason is not None:
            self._say(f"shared_prefix packs within the plain path's pieces: {reason}")
            return None
        size = self.trainer.args.per_device_train_batch_size
        parsed = row_sequences(torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
                               torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
                               inputs["completion_ids"].size(1))
        if parsed is None:
            return None
        rows = _Rows(*parsed, 0, inputs["completion_ids"].size(1), inputs["prompt_ids"].device)
        plain = _total([self._piece_cost(rows, piece) for piece in plain_pieces], False)
        grouped = group_rows(rows.sequences, size * max(map(len, rows.sequences)))
        packed = _total([packed_cost(self._plan(rows, run), self.attention, self.shape.heads) for run in grouped], False)
        if not worth_packing(packed, plain, self.shape):
            return None
        self.stats["regrouped"] += 1
        return grouped

    def estimate(self, pieces: list[dict[str, Any]], packed: bool) -> dict[str, float]:
        """The cost model's view of an update's pieces (`micro_batches.take_rows`), forwarding nothing (the
        bench's `--plan-only`, and its estimates beside what it measures): tokens and FLOPs over all forwards
        and the largest forward's peak memory, of TRL's forward (`packed` False) or of the forwards this one
        would run (True: as `_runs` decides, with gradients enabled)."""
        size, costs = self.trainer.args.per_device_train_batch_size, []
        for piece in pieces:
            keep = piece["completion_ids"].size(1)
            ids = torch.cat([piece["prompt_ids"], piece["completion_ids"]], dim=1)
            parsed = row_sequences(ids, torch.cat([piece["prompt_mask"], piece["completion_mask"]], dim=1), keep)
            if parsed is None:
                raise ValueError("estimate: a piece's mask has a gap; the shared-prefix forward would not pack it")
            rows = _Rows(*parsed, ids.size(1), keep, ids.device)
            runs = self._runs(rows, size) if packed else [_Run(list(range(len(rows.sequences))))]
            costs += [packed_cost(run.plan, self.attention, self.shape.heads) if run.plan is not None
                      else self._plain_cost(rows, run.rows, size) for run in runs]
        total = _total(costs, False)
        return {"tokens": total.tokens, "flops": total.flops(self.shape), "memory": total.memory(self.shape)}

    def _piece_cost(self, rows: _Rows, piece: list[int]) -> Cost:
        """A plain piece's one forward, its columns trimmed to its own rows (`micro_batches.take_rows`)."""
        prompts = [rows.prompt_lengths[r] for r in piece]
        width = max(prompts) + max(len(rows.sequences[r]) - p for r, p in zip(piece, prompts))
        return plain_cost(rows.lengths(piece), max(width, 1), len(piece), self.attention, self.shape.heads)

    def _plain_pieces_reason(self) -> str | None:
        """Why the update keeps the plain path's pieces whatever they cost: a setting that TRL's loss
        aggregates over a piece's tokens, so that only the same pieces give the same loss."""
        args = self.trainer.args
        if args.entropy_coef or args.use_adaptive_entropy:
            return "the entropy bonus (entropy_coef, use_adaptive_entropy) is a mean over a piece's tokens"
        return None

    def _say(self, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            logger.warning(message)

    def _count(self, rows: _Rows, runs: list[_Run], chunk: int) -> None:
        """What a call forwarded, and the cost model's FLOPs for it against TRL's forward (for the bench)."""
        packed = [run for run in runs if run.plan is not None]
        chosen = [packed_cost(run.plan, self.attention, self.shape.heads) if run.plan is not None
                  else self._plain_cost(rows, run.rows, chunk) for run in runs]
        self.stats["calls"] += 1
        self.stats["packed_forwards"] += len(packed)
        self.stats["plain_forwards"] += len(runs) - len(packed)
        self.stats["rows"] += len(rows.sequences)
        self.stats["tokens_plain"] += len(rows.sequences) * rows.width
        self.stats["tokens_shared"] += sum(cost.tokens for cost in chosen)
        self.stats["flops_plain"] += self._plain_cost(rows, list(range(len(rows.sequences))), chunk).flops(self.shape)
        self.stats["flops_shared"] += sum(cost.flops(self.shape) for cost in chosen)

    def _dtype(self, model) -> torch.dtype:
        return next(self.trainer.accelerator.unwrap_model(model).parameters()).dtype

    @torch.no_grad()
    def _check(self, model, input_ids, attention_mask, plan: Plan, plain) -> bool:
        """Compare the packed layout with TRL's plain path on the rows of the first packed forward (at most a
        plain forward's rows, so within its memory) once, in eval mode (no dropout); on a mismatch, warn and
        turn the feature off on this rank for the rest of the run."""
        self.checked = True
        unwrapped = self.trainer.accelerator.unwrap_model(model)
        was_training = unwrapped.training
        unwrapped.eval()
        try:
            expected, _, _ = plain(unwrapped, input_ids, attention_mask)
            got, _ = packed_logps(unwrapped, plan, self.attention, self._dtype(model), False,
                                  self.trainer.accelerator.autocast)
        finally:
            unwrapped.train(was_training)
        error = float((got.float() - expected.float()).abs().max()) if got.numel() else 0.0
        tolerance = max(1e-3, 64 * torch.finfo(self._dtype(model)).eps)
        if math.isfinite(error) and error <= tolerance:  # each rank decides alone: both paths give the same numbers
            return True
        self.enabled = False
        logger.warning(
            f"shared_prefix is off: the packed forward's log-probs differ from the plain path's by {error:.3g} "
            f"(tolerance {tolerance:.3g}) on this model; training continues on the plain path."
        )
        return False


def _unsort(parts, rows: int, compute_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Put each run's (index, logps, entropies) back in the call's row order."""
    order = torch.cat([index for index, _, _ in parts])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(rows, device=order.device)
    logps = torch.cat([lp for _, lp, _ in parts])[inverse]
    entropies = torch.cat([e for _, _, e in parts])[inverse] if compute_entropy else None
    return logps, entropies


def off_reason(trainer) -> str | None:
    """Why the shared-prefix forward cannot run for this trainer, or None."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    config = model.config
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in _ATTENTION:
        return (f"attention implementation {implementation!r} takes no custom mask (use sdpa or eager, "
                "attn_implementation in model_init_kwargs)")
    text = config.get_text_config()
    kinds = set(getattr(text, "layer_types", None) or ()) - {"full_attention"}
    if kinds or (not getattr(text, "layer_types", None) and getattr(text, "sliding_window", None) is not None
                 and getattr(text, "use_sliding_window", True)):
        return f"attention layers of kinds {sorted(kinds) or ['sliding_window']} are not packed (full attention only)"
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    if (plugin is not None and plugin.zero_stage == 3) or getattr(trainer, "is_fsdp_enabled", False):
        return "ZeRO-3 and FSDP are not verified equal to the plain path (docs/performance.md)"
    dropout = active_dropout(model)
    if dropout:
        return ("the model trains with dropout, and the packed forward would draw one mask for a prefix its rows "
                "share where the plain path draws one per row, so its gradients would not be the plain path's; to "
                "keep it on: " + "; ".join(dropout))
    return None


def active_dropout(model: torch.nn.Module) -> list[str]:
    """What in `model` drops activations in training, each with how to turn it off (empty for nothing):
    dropout modules with p > 0 (LoRA's `lora_dropout` among them) and the attention's `attention_dropout`."""
    said = []
    modules = [(name, module.p) for name, module in model.named_modules()
               if isinstance(module, _DROPOUT) and module.p > 0]
    if modules:
        said.append(f"{len(modules)} dropout module{'s' * (len(modules) > 1)} (p up to "
                    f"{max(p for _, p in modules):g}, e.g. {modules[0][0]}): set disable_dropout=True (TRL's flag, "
                    "which zeroes LoRA's dropout too)")
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    attention = getattr(text, "attention_dropout", 0.0)
    if isinstance(attention, (int, float)) and attention > 0:
        said.append(f"attention_dropout={attention:g} in the model's config: load it with attention_dropout=0 "
                    "(model_init_kwargs)")
    return said
