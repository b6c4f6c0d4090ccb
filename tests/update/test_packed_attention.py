"""Segment attention (`bipace_trainer.update.packed_attention`) equals SDPA under the materialised mask of the same
packed layout, outputs and gradients, without building that mask; it reaches a model only inside `routed()`."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bipace_trainer.update import packed_attention
from bipace_trainer.update.packed_attention import Cluster, SegmentLayout, segment_attention
from bipace_trainer.update.shared_prefix import attention_mask_4d, plan_layout
from tests.update.test_shared_prefix import group_rows_of_a_task, layout, tiny_model, tool_episodes


def reference(query, key, value, segment, groups):
    """SDPA under the (C, 1, N, N) boolean mask of the layout, keys repeated over the query heads."""
    mask = attention_mask_4d(segment, "bool", query.dtype)
    repeat = lambda states: states.repeat_interleave(groups, dim=1)  # noqa: E731
    return torch.nn.functional.scaled_dot_product_attention(query, repeat(key), repeat(value), attn_mask=mask)


def random_plan(seed: int):
    rng = random.Random(seed)
    prompts, completions = tool_episodes(rng, episodes=rng.randrange(1, 4), turns=rng.randrange(1, 4))
    for _ in range(rng.randrange(0, 3)):
        more = group_rows_of_a_task(rng, rows=rng.randrange(1, 5), shared=rng.randrange(1, 20))
        prompts, completions = prompts + more[0], completions + more[1]
    if rng.random() < 0.5:
        prompts, completions = prompts + [[5]], completions + [[]]  # a padding row
    return plan_layout(*layout(prompts, completions))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), groups=st.sampled_from([1, 2, 3]))
def test_segment_attention_equals_sdpa_under_the_materialised_mask(seed, groups):
    plan = random_plan(seed)
    rows, width = plan.input_ids.shape
    generator = torch.Generator().manual_seed(seed)
    shape = lambda heads: (rows, heads, width, 8)  # noqa: E731
    query = torch.randn(shape(2 * groups), generator=generator, dtype=torch.float64, requires_grad=True)
    key = torch.randn(shape(2), generator=generator, dtype=torch.float64, requires_grad=True)
    value = torch.randn(shape(2), generator=generator, dtype=torch.float64, requires_grad=True)
    real = (plan.segment >= 0)[:, None, :, None]  # padding positions: no row reads them
    expected = reference(query, key, value, plan.segment, groups) * real
    got = segment_attention(query, key, value, plan.layout, groups)
    torch.testing.assert_close(got * real, expected, rtol=1e-10, atol=1e-12)
    assert (got * ~real).abs().max() == 0  # padding gives zeros
    weights = torch.randn(expected.shape, generator=generator, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad((expected * weights).sum(), (query, key, value)),
                    torch.autograd.grad((got * real * weights).sum(), (query, key, value))):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


def test_the_pairs_and_masks_of_a_layout_are_the_rows_own_not_the_packed_rows_square():
    # one packed row of width 14: a cluster of prefix 4 and suffixes of 3 and 2, then a lone sequence of 5
    layout_ = SegmentLayout([[Cluster(0, 4, ((4, 3), (7, 2))), Cluster(9, 5)]], width=14)
    assert layout_.pairs() == 4 * 5 // 2 + 2 * 3 * (4 + 3) + 5 * 6 // 2  # prefix causal, suffix batch, lone causal
    assert layout_.mask_bytes() == 2 * 3 * (4 + 3)  # only the suffix batch has a mask
    index, mask = layout_.suffix_batch(layout_.rows[0][0], "cpu")
    assert index.tolist() == [[4, 5, 6], [7, 8, 8]]  # the shorter suffix padded with its last position
    assert mask[1, 0].tolist() == [[True] * 4 + [True, False, False], [True] * 4 + [True, True, False],
                                   [True] * 4 + [True, True, False]]


def test_a_packed_forward_outside_routed_fails_instead_of_attending_without_the_layout():
    from bipace_trainer.update.shared_prefix import packed_logps

    rng = random.Random(3)
    plan = plan_layout(*layout(*group_rows_of_a_task(rng, rows=3)))
    model = tiny_model()
    assert not packed_attention.routing()
    with pytest.raises(RuntimeError):
        packed_logps(model, plan, "segments", torch.float32, False, contextlib.nullcontext)
    with packed_attention.routed():
        with packed_attention.routed():  # nested scopes route once
            assert packed_attention.routing()
        assert packed_attention.routing()
    assert not packed_attention.routing()


def test_attention_the_layout_cannot_reproduce_is_refused_by_name():
    attention = packed_attention.route(lambda *args, **kwargs: None)
    query = torch.zeros(1, 2, 3, 4)
    layout_ = SegmentLayout([[Cluster(0, 3)]], width=3)
    with pytest.raises(ValueError, match="sliding_window"):
        attention(torch.nn.Module(), query, query, query, None, sliding_window=2, shared_prefix_layout=layout_)
