"""Split one of TRL's micro-batches into pieces of at most `per_device_train_batch_size` rows.

TRL sizes a micro-batch in *prompts*: a generation of `tasks_per_iteration ×
num_generations` prompts is split `steps_per_generation` ways. In a multi-turn rollout
every env step is a row, so one micro-batch holds up to `max_turns` times as many rows as
TRL planned for (32 rows of ~450 tokens for 4 rollouts × 8 turns). The trainer runs
TRL's loss on each piece and back-propagates it before the next, so activation memory
is bounded by `per_device_train_batch_size` rows whatever the horizon.

The pieces give the same gradient as the whole micro-batch: each piece's loss is
weighted by its share of what TRL's `loss_type` averages over (`piece_weights`). Rows
are ordered by length before they are cut (`length_order`), and each piece keeps only the
columns its own rows use, so short steps are not padded to the longest step of the
generation. What TRL's loss logs per piece is combined into one value per micro-batch
(`combine_metrics`), so the logs do not depend on how the rows were cut (the shared-prefix
update cuts other pieces: `update/shared_prefix.py`).
"""

from __future__ import annotations

from typing import Any

import torch

PROMPT_KEYS = ("prompt_ids", "prompt_mask")

# What each of TRL's loss types averages over (trl GRPOTrainer._compute_loss).
_ROW_MEAN = ("grpo", "sapo", "dr_grpo", "luspo")  # a mean over rows
_TOKEN_MEAN = ("bnpo",)  # a mean over the micro-batch's completion tokens
_GLOBAL_NORMALISER = ("dapo", "cispo", "vespo")  # divided by the generation's token count: pieces just add up


def split_rows(inputs: dict[str, Any], size: int) -> list[dict[str, Any]]:
    """Cut a TRL micro-batch (row tensors of B rows) into pieces of at most `size` rows.

    Row tensors are those whose first dimension is B; `prompt_ids`/`prompt_mask`
    (left-padded) keep their last `max prompt length` columns, and every (B, T) tensor
    aligned with `completion_ids` (right-padded: masks, old/ref/sampling log-probs,
    importance ratios) its first `max completion length` columns (at least one). Anything
    else (`num_items_in_batch`, scalars) is shared by every piece. Returns `[inputs]`
    when the micro-batch already fits.
    """
    if inputs["prompt_mask"].shape[0] <= size:
        return [inputs]
    return take_rows(inputs, length_order(inputs, size))


def length_order(inputs: dict[str, Any], size: int) -> list[list[int]]:
    """The row indices of `split_rows`' pieces: rows in order of their real length, `size` at a time."""
    if size < 1:
        raise ValueError(f"per_device_train_batch_size={size} must be at least 1.")
    prompt_mask, completion_mask = inputs["prompt_mask"], inputs["completion_mask"]
    order = torch.argsort(prompt_mask.sum(1) + completion_mask.sum(1), stable=True)
    return [order[start : start + size].tolist() for start in range(0, prompt_mask.shape[0], size)]


def take_rows(inputs: dict[str, Any], runs: list[list[int]]) -> list[dict[str, Any]]:
    """One piece per list of row indices in `runs`, each trimmed to the columns its own rows use
    (as `split_rows` describes); `[inputs]` for a single run of every row."""
    prompt_mask, completion_mask = inputs["prompt_mask"], inputs["completion_mask"]
    rows = prompt_mask.shape[0]
    if len(runs) == 1 and len(runs[0]) == rows:
        return [inputs]
    width = inputs["completion_ids"].shape[1]
    prompt_lengths = prompt_mask.sum(1)
    completion_lengths = completion_mask.sum(1)
    pieces = []
    for run in runs:
        index = torch.tensor(run, dtype=torch.long, device=prompt_mask.device)
        keep_prompt = max(int(prompt_lengths[index].max()), 1)
        keep_completion = max(int(completion_lengths[index].max()), 1)
        piece = {}
        for key, value in inputs.items():
            if not (isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == rows):
                piece[key] = value
                continue
            value = value[index.to(value.device)]
            if key in PROMPT_KEYS:
                value = value[:, -keep_prompt:]
            elif value.dim() == 2 and value.shape[1] == width:
                value = value[:, :keep_completion]
            piece[key] = value
        pieces.append(piece)
    return pieces


def piece_weights(pieces: list[dict[str, Any]], loss_type: str) -> list[float]:
    """The factor on each piece's TRL loss that makes their sum the whole micro-batch's loss.

    Row means (`grpo`, `dr_grpo`, …) weigh a piece by its rows, `bnpo` by its completion
    tokens, and the losses TRL already divides by the generation's token count (`dapo`,
    the default) need no weight. The entropy bonus, a token mean, is weighted like the
    policy loss: exact for `bnpo` and the global normalisers, by rows otherwise.
    """
    if len(pieces) == 1 or loss_type in _GLOBAL_NORMALISER:
        return [1.0] * len(pieces)
    if loss_type in _ROW_MEAN:
        counts = [float(p["completion_mask"].shape[0]) for p in pieces]
    elif loss_type in _TOKEN_MEAN:
        counts = [float(p["completion_mask"].sum()) for p in pieces]
    else:
        raise ValueError(
            f"loss_type={loss_type!r}: micro-batching does not know what it averages over; "
            f"use one of {_ROW_MEAN + _TOKEN_MEAN + _GLOBAL_NORMALISER}."
        )
    total = sum(counts)
    return [c / total if total else 0.0 for c in counts]


def loss_in_pieces(
    pieces: list[dict[str, Any]], weights: list[float], loss, backward, no_sync, grad: bool, device
) -> torch.Tensor:
    """The micro-batch's loss run piece by piece: every piece but the last is back-propagated here
    (`backward`) inside `no_sync()` (no gradient all-reduce), the last is returned with the others'
    detached sum added, for the Trainer's own backward, which syncs the gradients. Without `grad`
    (TRL's prediction step) the weighted sum of the pieces' losses. `loss(piece)` is TRL's loss of one piece.

    Every rank has as many pieces (rows are padded to the largest count over ranks), so collective
    calls inside forward passes stay aligned."""
    done = torch.zeros((), device=device)
    if not grad:
        return sum((loss(piece) * weight for piece, weight in zip(pieces, weights)), done)
    for piece, weight in zip(pieces[:-1], weights[:-1]):
        with no_sync():
            value = loss(piece) * weight
            backward(value)
        done = done + value.detach()
    return loss(pieces[-1]) * weights[-1] + done


# How TRL's loss logs each metric of one piece (`GRPOTrainer._compute_loss`): a mean over the piece's completion
# tokens (`global_masked_mean`), over its rows where the values are one per row (sequence-level importance
# ratios, VESPO's weights), a min or max over its rows, or the piece's loss; `entropy_coef` is a setting.
_TOKEN_MEANS = ("entropy", "kl")
_RATIO_MEANS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "cispo_clip_ratio")
_ROW_MEANS = ("vespo/phi_seq_mean",)
_EXTREMES = {"clip_ratio/low_min": min, "clip_ratio/high_max": max}


def combine_metrics(values: dict[str, list[float]], tokens: list[float], rows: list[float], weights: list[float],
                    sequence_level: bool) -> dict[str, float]:
    """One value per metric for the whole micro-batch from each piece's (`values[key][p]`), so that how the rows
    were cut into pieces changes nothing that is logged (the shared-prefix update cuts other pieces than the plain
    path): token means weighted by each piece's completion tokens `tokens[p]` (over all ranks), row means by its
    rows `rows[p]`, extremes over the pieces (NaN, a piece without completion tokens, left out), `policy_loss` by
    the pieces' loss weights (`piece_weights`). Keys not listed here are not returned (left as logged)."""
    combined = {}
    for key, per_piece in values.items():
        if key in _TOKEN_MEANS or (key in _RATIO_MEANS and not sequence_level):
            combined[key] = _weighted_mean(per_piece, tokens)
        elif key in _ROW_MEANS or key in _RATIO_MEANS:
            combined[key] = _weighted_mean(per_piece, rows)
        elif key in _EXTREMES:
            finite = [v for v in per_piece if v == v]
            combined[key] = _EXTREMES[key](finite) if finite else float("nan")
        elif key == "policy_loss":
            combined[key] = sum(v * w for v, w in zip(per_piece, weights))
        elif key == "entropy_coef":
            combined[key] = per_piece[-1]
    return combined


def _weighted_mean(values: list[float], counts: list[float]) -> float:
    """Σ v·n / Σ n: the mean over the union of the pieces whose means are `values` (0 over no item, as TRL's)."""
    total = sum(counts)
    return sum(v * n for v, n in zip(values, counts)) / total if total else 0.0
