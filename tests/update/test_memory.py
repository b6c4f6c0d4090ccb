"""The CPU memory bounds (`bipace_trainer.update.memory`, through `bipace_trainer.trl_compat`): TRL's log-prob
tiles shrink on a CPU only, give the same log-probs and gradients in small tiles; only the labelled
positions are scored on a CPU, with the same log-probs and gradients; a CPU trainer applies them while
it trains and gives TRL its own values back after. The memory and time they save are measured by
`bench/memory.py` and `bench/memory_piece.py`, not here."""

from __future__ import annotations

import inspect
import platform

import pytest
import torch
import trl.kernels.chunked_logprob as kernel
import trl.trainer.utils as trl_utils
from trl.trainer.utils import add_fused_lm_head

from bipace_trainer import BiPACETrainer, trl_compat
from bipace_trainer.update import memory
from bipace_trainer.models import bpe_chat_tokenizer, tiny_qwen2

# TRL 1.16's own tile sizes, which the bound replaces on a CPU.
TRL_TOKEN_TILE, TRL_VOCAB_TILE = 4096, 32768


@pytest.fixture
def trl_tiles():
    """TRL's own tiles and choice of positions, checked before and after the test: nothing the
    bounds change may outlive their scope."""
    assert _tiles() == (TRL_TOKEN_TILE, TRL_VOCAB_TILE) and trl_utils._use_triton is kernel._use_triton
    yield
    assert _tiles() == (TRL_TOKEN_TILE, TRL_VOCAB_TILE) and trl_utils._use_triton is kernel._use_triton


def _tiles() -> tuple[int, int]:
    return kernel.TOKEN_CHUNK_SIZE, trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE


def _small_tiles(device):
    return trl_compat.logprob_tiles(device, memory.LOGPROB_TOKEN_TILE, memory.LOGPROB_VOCAB_TILE)


def test_the_tiles_shrink_on_a_cpu_and_nowhere_else_for_the_scope(trl_tiles, monkeypatch):
    with _small_tiles(torch.device("cuda")) as bounded:
        assert bounded is False and _tiles() == (TRL_TOKEN_TILE, TRL_VOCAB_TILE)
    with _small_tiles(torch.device("cpu")) as bounded:
        assert bounded is True and _tiles() == (memory.LOGPROB_TOKEN_TILE, memory.LOGPROB_VOCAB_TILE)
    assert _tiles() == (TRL_TOKEN_TILE, TRL_VOCAB_TILE)
    # 16 MB of float32 per tile, against TRL's 512 MB
    assert memory.LOGPROB_TOKEN_TILE * memory.LOGPROB_VOCAB_TILE * 4 <= 16 * 2**20
    monkeypatch.setattr(kernel, "TOKEN_CHUNK_SIZE", 100)  # never enlarged
    with _small_tiles("cpu"):
        assert kernel.TOKEN_CHUNK_SIZE == 100
    monkeypatch.undo()


def _fused_logps(model, input_ids, labels):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=input_ids, labels=labels, fused_lm_head=True)
    (out.log_probs.sum() + 0.1 * out.entropy.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.log_probs.detach(), out.entropy.detach(), grads


def test_small_tiles_give_the_log_probs_entropies_and_gradients_of_one_tile(trl_tiles, monkeypatch):
    tokenizer = bpe_chat_tokenizer(["craft 4 oak planks from 1 oak logs", "get 2 jungle logs"] * 20, vocab_size=300)
    model = tiny_qwen2(tokenizer, hidden_size=32, layers=1)
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, len(tokenizer), (3, 25), generator=generator)
    labels = input_ids.clone()
    labels[:, :15] = -100  # the prompt's positions are not scored

    one_tile = _fused_logps(model, input_ids, labels)  # 72 positions, a vocabulary of ~300: TRL's one tile
    with trl_compat.logprob_tiles("cpu", 7, 64):
        assert _tiles() == (7, 64)
        small_tiles = _fused_logps(model, input_ids, labels)  # 11 × 5 tiles

    with torch.no_grad():  # and both against the plain log-softmax of the full logits
        logits = model(input_ids=input_ids).logits[:, :-1] / 0.7
        reference = logits.log_softmax(-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    scored = labels[:, 1:] != -100
    torch.testing.assert_close(one_tile[0][scored], reference[scored], rtol=1e-5, atol=1e-5)
    for a, b in zip(one_tile[:2], small_tiles[:2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert one_tile[2].keys() == small_tiles[2].keys() and one_tile[2]
    for name in one_tile[2]:
        torch.testing.assert_close(small_tiles[2][name], one_tile[2][name], rtol=1e-4, atol=1e-6)


def _tiny_fused_model():
    tokenizer = bpe_chat_tokenizer(["craft 4 oak planks from 1 oak logs", "get 2 jungle logs"] * 20, vocab_size=300)
    model = tiny_qwen2(tokenizer, hidden_size=32, layers=1)
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    return model, len(tokenizer)


class _RowsSeen:
    """TRL's tile function, recording how many positions each call projects."""

    def __init__(self, function):
        self.function, self.rows = function, []

    def apply(self, hidden, *args):
        self.rows.append(hidden.shape[0])
        return self.function.apply(hidden, *args)


def test_only_the_labelled_positions_are_scored_on_a_cpu(trl_tiles, monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert trl_utils._use_triton(cpu) is False  # TRL's own answer: every position on a CPU
    with trl_compat.labelled_positions_on_cpu(cuda) as changed:
        assert changed is False and trl_utils._use_triton(cpu) is False
    model, vocab = _tiny_fused_model()
    seen = _RowsSeen(trl_utils._ChunkedLogProbFunction)
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", seen)
    input_ids = torch.randint(0, vocab, (3, 25), generator=torch.Generator().manual_seed(1))
    labels = input_ids.clone()
    labels[:, :15] = -100
    labels[2, 20:] = -100  # a shorter completion (padding)
    with trl_compat.labelled_positions_on_cpu(cpu) as changed:
        assert changed is True and trl_utils._use_triton(cpu) is True
        assert trl_utils._use_triton(cuda) == inspect.unwrap(trl_utils._use_triton)(cuda)  # a GPU keeps TRL's answer
        model(input_ids=input_ids, labels=labels, fused_lm_head=True)
    assert seen.rows == [int((labels[:, 1:] != -100).sum())] == [10 + 10 + 5]
    model(input_ids=input_ids, labels=labels, fused_lm_head=True)  # out of the scope: TRL's own path
    assert seen.rows[1] == 3 * 24  # TRL's CPU path: every shifted position
    monkeypatch.undo()


def test_labelled_positions_give_the_log_probs_entropies_and_gradients_of_all_positions(trl_tiles):
    model, vocab = _tiny_fused_model()
    generator = torch.Generator().manual_seed(2)
    input_ids = torch.randint(0, vocab, (4, 30), generator=generator)
    labels = input_ids.clone()
    labels[:, :18] = -100
    labels[1, 25:] = -100
    labels[3] = -100  # a row with nothing to score

    every_position = _fused_logps(model, input_ids, labels)
    with trl_compat.labelled_positions_on_cpu("cpu"):
        labelled_only = _fused_logps(model, input_ids, labels)
    for a, b in zip(every_position[:2], labelled_only[:2]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert (labelled_only[0][3] == 0).all() and (labelled_only[0][0] != 0).any()
    assert every_position[2].keys() == labelled_only[2].keys() and every_position[2]
    for name in every_position[2]:
        torch.testing.assert_close(labelled_only[2][name], every_position[2][name], rtol=1e-4, atol=1e-6)

    # a piece with no label at all still gives a differentiable zero
    model.zero_grad(set_to_none=True)
    with trl_compat.labelled_positions_on_cpu("cpu"):
        out = model(input_ids=input_ids, labels=torch.full_like(labels, -100), fused_lm_head=True)
    out.log_probs.sum().backward()
    assert (out.log_probs == 0).all()


def test_a_cpu_trainer_bounds_the_tiles_while_it_trains_only(trl_tiles, tmp_path):
    from transformers import TrainerCallback

    from tests.trainer.tiny_setup import make_model, make_tokenizer, tiny_args

    class Seen(TrainerCallback):
        tiles = positions = None

        def on_step_end(self, args, state, control, **kwargs):
            Seen.tiles, Seen.positions = _tiles(), trl_utils._use_triton(torch.device("cpu"))

    tokenizer = make_tokenizer()
    trainer = BiPACETrainer(
        model=make_model(tokenizer), args=tiny_args(tmp_path, max_steps=1, eval_tasks=0), processing_class=tokenizer,
        callbacks=[Seen()],
    )
    assert _tiles() == (TRL_TOKEN_TILE, TRL_VOCAB_TILE)  # building the trainer changes nothing of TRL's
    trainer.train()
    assert (Seen.tiles, Seen.positions) == ((memory.LOGPROB_TOKEN_TILE, memory.LOGPROB_VOCAB_TILE), True)
    trainer.close_envs()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_the_mmap_threshold_is_set_on_glibc_unless_the_user_set_it(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert memory.return_freed_memory() is True
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "33554432")
    assert memory.return_freed_memory() is False
