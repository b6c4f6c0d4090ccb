"""Train each shared prefix once: the update's forward passes compute a token prefix that several
rows share one time, and a chat episode, whose turns each extend the one before, as one sequence.

    forward = SharedPrefixForward.for_trainer(trainer)     # None where it is off (the reason logged once)
    logps, entropies = forward.logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, ...)
    pieces = forward.pieces(inputs, size)                   # the update's micro-batch pieces

`GRPOAdapter._get_per_token_logps_and_entropies` (`trl_adapter.py`; the update, the old and the
reference log-prob passes all go through it) calls it in place of TRL's row-by-row forward, and
returns the same (B, logits_to_keep) log-probs and entropies, so TRL's loss, clipping, KL,
importance ratio and metrics run unchanged on them.

**Layout.** Each row's real tokens (prompt mask, then completion mask) form a sequence. A row whose
sequence is a prefix of another row's (turn k of a chat episode inside turn k+1's prompt, or two
equal rows) is not forwarded at all: attention is causal, so its log-probs are the longer row's at
the same positions (*absorbed*). The remaining rows (*leaves*) are sorted; consecutive leaves that
share a prefix form a *cluster* (chosen to forward the fewest tokens: `_partition`), laid out as::

    [ shared prefix (positions 0..P-1) | suffix 1 (P..L1-1) | suffix 2 (P..L2-1) | ... ]

(clusters shorter than the longest share a packed row, side by side and masked from each other: `_bins`)
with each suffix attending to the prefix and causally to itself (a boolean mask for SDPA, an
additive one for eager attention) and carrying its own position ids. Labels are passed pre-shifted
(`shift_labels` of TRL's fused LM head), so each position is scored against the next token *of its
own row*; where two leaves branch at a token some row scores, the prefix stops one token short and
each suffix repeats it. Log-probs and entropies are then gathered back into TRL's (B, T) layout,
zero where the plain path gives zero (padding, masked completions).

**Why this design and not the prefix's keys and values computed once and expanded over the
suffixes:** under gradient checkpointing transformers drops any KV cache inside a checkpointed layer
(`GradientCheckpointingLayer`: the replay would append to it twice), and the main job trains with
gradient checkpointing; a packed row needs no cache, so gradient checkpointing, LoRA (PEFT passes the
mask through), DDP and DeepSpeed's engine see an ordinary forward. It also forwards a whole episode
as one sequence, which an expanded prefix cannot. The cost: a packed row's attention is over all its
tokens (masked), which is small next to the linear layers at these lengths.

**Pieces.** The update runs a micro-batch in pieces (`micro_batches`). Here the rows are cut in the
order of their token sequences (so an episode's turns and a group's rows share a piece) into pieces
whose packed tokens stay within what the plain path's largest piece forwards
(`per_device_train_batch_size` × the longest row). On several processes the pieces are the plain
path's, each packed: TRL's loss gathers once per piece, so every rank must make as many.

**Exactness.** The same tokens at the same relative positions: log-probs, entropies, the loss and the
gradients equal the plain path's to float rounding (tests/test_shared_prefix.py, and 2 processes in
tests/trainer/test_shared_prefix_distributed.py). A left-padded row sits at other absolute
positions in the plain path; for rotary positions only relative ones count. The first call checks
the packed layout against the plain path on its batch (eval mode, no gradients), and turns the
feature off with a warning if they differ, so a model whose attention cannot take the layout never
trains on it. It is off, with the reason logged once, for attention that takes no custom mask
(flash attention), ZeRO-3 and FSDP (not verified equal), MoE auxiliary losses and vision inputs, and
the pass that captures hidden states by position (vLLM with a `hidden` preset). See
docs/performance.md for the measured gain.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

__all__ = ["SharedPrefixForward", "Plan", "plan_layout", "packed_logps", "plain_equivalent_rows"]

logger = logging.getLogger(__name__)

# A packed position's segment is cluster × _BLOCK + (0 for the cluster's prefix, k for its k-th suffix); -1 pads.
_BLOCK = 1 << 20
# Attention implementations that take a custom (batch, 1, query, key) mask; anything else runs the plain path.
_MASKED_ATTENTION = {"sdpa": "bool", "eager": "additive"}


@dataclass
class _Cluster:
    """One packed row: the shared prefix's length and its leaves (indices into the leaf list)."""

    prefix: int
    leaves: list[int]


@dataclass
class Plan:
    """How a call's B rows are forwarded.

    input_ids, position_ids, shift_labels: (C, N) packed rows (C clusters, N the longest);
    segment: (C, N) cluster × `_BLOCK` + (0 for its prefix, k for its suffix k), -1 for padding (several
        clusters share a packed row where they fit: `_bins`);
    index: (B, K) flat index into the (C, N) outputs of each completion column's score; valid: (B, K).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    shift_labels: torch.Tensor
    segment: torch.Tensor
    index: torch.Tensor
    valid: torch.Tensor
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


def _clusters(leaves: list[int], sequences, scored: dict[int, set[int]], min_shared: int) -> list[_Cluster]:
    """The packed rows (`_partition`); a cluster's prefix stops one token short of where its leaves
    branch if some leaf scores the token after it (that position's label differs between them)."""
    clusters = []
    for begin, end, shared in _partition(leaves, sequences, min_shared):
        members = list(range(begin, end))
        # a prefix position p predicts token p+1: the same for every leaf unless p+1 == prefix (they branch)
        if len(members) > 1 and any(shared in scored[leaves[i]] for i in members):
            shared -= 1
        clusters.append(_Cluster(prefix=shared, leaves=members))
    return clusters


def plan_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                min_shared: int = 1) -> Plan | None:
    """The packed layout of one forward of TRL's (B, L) rows (prompt left-padded, completion right-padded,
    the last `logits_to_keep` columns scored); None where it cannot equal the plain path (`row_sequences`)."""
    rows = row_sequences(input_ids, attention_mask, logits_to_keep)
    if rows is None:
        return None
    sequences, prompt_lengths = rows
    leaves, carrier = _absorb(sequences)
    # the token indices each leaf must score: its own and its absorbed rows' completions
    scored: dict[int, set[int]] = {leaf: set() for leaf in leaves}
    for row, length in enumerate(prompt_lengths):
        scored[carrier[row]].update(range(length, len(sequences[row])))
    clusters = _clusters(leaves, sequences, scored, min_shared)
    return _pack(sequences, prompt_lengths, leaves, carrier, scored, clusters, logits_to_keep,
                 input_ids.device)


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
    for c, cluster in enumerate(clusters):
        row, offset = placed[c]
        first, block = sequences[leaves[cluster.leaves[0]]], c * _BLOCK
        ids[row][offset : offset + cluster.prefix] = first[: cluster.prefix]
        positions[row][offset : offset + cluster.prefix] = range(cluster.prefix)
        segment[row][offset : offset + cluster.prefix] = [block] * cluster.prefix
        cursor = cluster.prefix
        for k, i in enumerate(cluster.leaves, start=1):
            leaf = leaves[i]
            seq, suffix = sequences[leaf], len(sequences[leaf]) - cluster.prefix
            ids[row][offset + cursor : offset + cursor + suffix] = seq[cluster.prefix :]
            positions[row][offset + cursor : offset + cursor + suffix] = range(cluster.prefix, len(seq))
            segment[row][offset + cursor : offset + cursor + suffix] = [block + k] * suffix
            where[leaf] = (row, offset, cursor, cluster.prefix)
            for token in scored[leaf]:  # token t is scored at the position of token t-1
                labels[row][offset + _packed(token - 1, cursor, cluster.prefix)] = seq[token]
            cursor += suffix
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
        tokens=sum(lengths), stats={"rows": rows, "leaves": len(leaves), "clusters": len(clusters)},
    )


def _packed(token: int, suffix_start: int, prefix: int) -> int:
    """Packed position of a leaf's token index: in the shared prefix, or in the leaf's own suffix."""
    return token if token < prefix else suffix_start + token - prefix


def attention_mask_4d(segment: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """(C, 1, N, N) mask of packed rows: a token sees its cluster's prefix's and its own suffix's earlier tokens;
    padding sees itself only (a query row that sees nothing would give NaN and poison the backward)."""
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


def packed_logps(model, plan: Plan, mask_kind: str, dtype: torch.dtype, compute_entropy: bool,
                 autocast) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward of a plan through TRL's fused LM head; (B, K) log-probs and entropies in TRL's layout."""
    mask = attention_mask_4d(plan.segment, mask_kind, dtype)
    with autocast():
        outputs = model(input_ids=plan.input_ids, attention_mask=mask, position_ids=plan.position_ids,
                        shift_labels=plan.shift_labels, fused_lm_head=True)

    def gather(values: torch.Tensor) -> torch.Tensor:
        picked = values.reshape(-1)[plan.index]
        return torch.where(plan.valid, picked, torch.zeros((), dtype=picked.dtype, device=picked.device))

    return gather(outputs.log_probs), gather(outputs.entropy) if compute_entropy else None


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


def plain_equivalent_rows(inputs: dict[str, Any]) -> list[list[int]]:
    """Each row's real token sequence (prompt, then completion) of a TRL micro-batch."""
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    rows = row_sequences(input_ids, attention_mask, inputs["completion_ids"].size(1))
    return rows[0] if rows is not None else [ids.tolist() for ids in input_ids]


class SharedPrefixForward:
    """The shared-prefix forward of one trainer, with its first-use check (see the module docstring)."""

    def __init__(self, trainer, mask_kind: str, min_shared: int = 1):
        self.trainer = trainer
        self.mask_kind = mask_kind
        self.min_shared = min_shared
        self.checked = False
        self.enabled = True
        self.stats = {"calls": 0, "rows": 0, "tokens_plain": 0, "tokens_shared": 0}

    @classmethod
    def for_trainer(cls, trainer) -> "SharedPrefixForward | None":
        """The trainer's shared-prefix forward, or None (with the reason logged) where it is off."""
        if not getattr(trainer.args, "shared_prefix", False):
            return None
        reason = off_reason(trainer)
        if reason:
            logger.warning(f"shared_prefix is off: {reason}")
            return None
        config = trainer.accelerator.unwrap_model(trainer.model).config
        return cls(trainer, _MASKED_ATTENTION[getattr(config, "_attn_implementation", None)])

    def applies(self, compute_aux_loss: bool, extra: dict[str, Any]) -> bool:
        """Whether this call can take the packed layout (no vision inputs, no MoE auxiliary loss, and not
        the old-logprob pass that captures hidden states by position under vLLM)."""
        if not self.enabled or compute_aux_loss or any(v is not None for v in extra.values()):
            return False
        trainer = self.trainer
        capturing = trainer.hidden_plan.source == "old_logprobs"  # the run's `HiddenPlan`
        return not (capturing and not torch.is_grad_enabled())

    def logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                            plain) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        """TRL's `_get_per_token_logps_and_entropies` on the packed layout. `plain(model, input_ids,
        attention_mask)` is TRL's own with this call's other arguments (its defaults: this call's), for the
        first-use check (on the first `batch_size` rows) and where a call cannot be packed."""
        rows = row_sequences(input_ids, attention_mask, logits_to_keep)
        if not self.checked and not self._check(model, input_ids[:batch_size], attention_mask[:batch_size],
                                                logits_to_keep, plain, rows):
            return plain()
        if rows is None:
            return plain()
        budget = (batch_size or input_ids.size(0)) * max(len(s) for s in rows[0])
        runs = group_rows(rows[0], budget) if batch_size and batch_size < input_ids.size(0) else [
            list(range(input_ids.size(0)))]
        parts = []
        for run in runs:
            index = torch.tensor(run, device=input_ids.device)
            plan = plan_layout(input_ids[index], attention_mask[index], logits_to_keep, self.min_shared)
            self._count(plan, attention_mask[index])
            parts.append((index, *packed_logps(model, plan, self.mask_kind, self._dtype(model), compute_entropy,
                                                 self.trainer.accelerator.autocast)))
        return _unsort(parts, input_ids.size(0), compute_entropy) + (None,)

    def pieces(self, inputs: dict[str, Any], size: int) -> list[list[int]] | None:
        """Row indices of the update's pieces (`group_rows`: rows that share a prefix forwarded together),
        or None for the plain pieces (`micro_batches.split_rows`; always on several processes)."""
        if not self.enabled or self.trainer.accelerator.num_processes > 1:
            # Several processes keep the plain pieces (as many on every rank, as the plain path makes
            # them) and pack within each: regrouped pieces could number differently on each rank, and
            # TRL's loss gathers once per piece (a gloo size mismatch, seen on 2 processes).
            return None
        sequences = plain_equivalent_rows(inputs)
        return group_rows(sequences, size * max(len(s) for s in sequences))

    def _count(self, plan: Plan, attention_mask: torch.Tensor) -> None:
        self.stats["calls"] += 1
        self.stats["rows"] += attention_mask.size(0)
        self.stats["tokens_plain"] += attention_mask.numel()
        self.stats["tokens_shared"] += plan.input_ids.numel()

    def _dtype(self, model) -> torch.dtype:
        return next(self.trainer.accelerator.unwrap_model(model).parameters()).dtype

    @torch.no_grad()
    def _check(self, model, input_ids, attention_mask, logits_to_keep, plain, rows) -> bool:
        """Compare the packed layout with TRL's plain path on this call's rows once, in eval mode (no
        dropout); on a mismatch, warn and turn the feature off on this rank for the rest of the run."""
        self.checked = True
        error = self._layout_error(model, input_ids, attention_mask, logits_to_keep, plain) if rows else 0.0
        tolerance = max(1e-3, 64 * torch.finfo(self._dtype(model)).eps)
        bad = not (math.isfinite(error) and error <= tolerance)
        if not bad:  # each rank decides alone: both paths give the same numbers, so ranks may differ
            return True
        self.enabled = False
        logger.warning(
            f"shared_prefix is off: the packed forward's log-probs differ from the plain path's by {error:.3g} "
            f"(tolerance {tolerance:.3g}) on this model; training continues on the plain path."
        )
        return False

    def _layout_error(self, model, input_ids, attention_mask, logits_to_keep, plain) -> float:
        """Largest absolute difference between the packed and the plain log-probs of these rows."""
        unwrapped = self.trainer.accelerator.unwrap_model(model)
        was_training = unwrapped.training
        unwrapped.eval()
        try:
            expected, _, _ = plain(unwrapped, input_ids, attention_mask)
            plan = plan_layout(input_ids, attention_mask, logits_to_keep, self.min_shared)
            got, _ = packed_logps(unwrapped, plan, self.mask_kind, self._dtype(model), False,
                                  self.trainer.accelerator.autocast)
        finally:
            unwrapped.train(was_training)
        return float((got.float() - expected.float()).abs().max()) if got.numel() else 0.0


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
    config = trainer.accelerator.unwrap_model(trainer.model).config
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in _MASKED_ATTENTION:
        return (f"attention implementation {implementation!r} takes no custom mask (use sdpa or eager, "
                "attn_implementation in model_init_kwargs)")
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    if (plugin is not None and plugin.zero_stage == 3) or getattr(trainer, "is_fsdp_enabled", False):
        return "ZeRO-3 and FSDP are not verified equal to the plain path (docs/performance.md)"
    return None
