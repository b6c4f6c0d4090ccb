"""A micro-batch of env-step rows runs through TRL's loss in pieces of at most
`per_device_train_batch_size` rows, with the gradient of the whole micro-batch."""

from __future__ import annotations

import pytest
import torch

from bipace_trainer import BiPACETrainer
from bipace_trainer.update.micro_batches import piece_weights, split_rows

from tests.trainer.tiny_setup import make_model, make_tokenizer, tiny_args


def _batch(prompts, completions, pad=0, masked_rows=()):
    """Left-padded prompts, right-padded completions, as `batching.training_batch` lays them out."""
    width_p = max(map(len, prompts))
    width_c = max(map(len, completions))
    prompt_ids = torch.tensor([[pad] * (width_p - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p in prompts])
    completion_ids = torch.tensor([c + [pad] * (width_c - len(c)) for c in completions])
    completion_mask = torch.tensor(
        [[0 if i in masked_rows else 1] * len(c) + [0] * (width_c - len(c)) for i, c in enumerate(completions)]
    )
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "old_per_token_logps": -torch.rand(len(prompts), width_c),
        "advantages": torch.linspace(-1, 1, len(prompts)),
        "num_items_in_batch": completion_mask.sum(),
    }


def test_split_rows_keeps_every_row_once_with_only_the_columns_it_uses():
    prompts = [[5, 6, 7, 8, 9], [5], [5, 6], [5, 6, 7, 8], [5, 6, 7]]
    completions = [[1, 2], [1, 2, 3, 4, 3, 2], [1], [1, 2, 3], [4]]
    batch = _batch(prompts, completions)
    pieces = split_rows(batch, 2)

    assert [p["prompt_ids"].shape[0] for p in pieces] == [2, 2, 1]
    seen = []
    for piece in pieces:
        assert piece["num_items_in_batch"] is batch["num_items_in_batch"]
        width_p, width_c = piece["prompt_ids"].shape[1], piece["completion_ids"].shape[1]
        assert width_p == int(piece["prompt_mask"].sum(1).max())  # no all-padding prompt column
        assert width_c == int(piece["completion_mask"].sum(1).max())  # no all-padding completion column
        assert piece["old_per_token_logps"].shape[1] == width_c
        for row in range(piece["prompt_ids"].shape[0]):
            prompt = piece["prompt_ids"][row][piece["prompt_mask"][row].bool()].tolist()
            completion = piece["completion_ids"][row][piece["completion_mask"][row].bool()].tolist()
            original = prompts.index(prompt)
            assert completion == completions[original]
            assert float(piece["advantages"][row]) == float(batch["advantages"][original])
            torch.testing.assert_close(
                piece["old_per_token_logps"][row], batch["old_per_token_logps"][original, :width_c]
            )
            seen.append(original)
    assert sorted(seen) == list(range(len(prompts)))
    assert split_rows(batch, 5) == [batch]  # already fits: untouched


def test_piece_weights_follow_what_the_loss_averages_over():
    batch = _batch([[1], [1], [1]], [[2, 2, 2], [2], [2, 2]])
    pieces = split_rows(batch, 2)  # rows sorted by length: {1 token, 2 tokens}, {3 tokens}
    assert piece_weights(pieces, "dapo") == [1.0, 1.0]
    assert piece_weights(pieces, "grpo") == pytest.approx([2 / 3, 1 / 3])
    assert piece_weights(pieces, "bnpo") == pytest.approx([3 / 6, 3 / 6])
    with pytest.raises(ValueError, match="loss_type='new_loss'"):
        piece_weights(pieces, "new_loss")


def _gradient(trainer, inputs):
    model = trainer.model
    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(model, inputs)
    trainer.accelerator.backward(loss)
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo"])
def test_pieces_give_the_whole_micro_batch_gradient(tmp_path, loss_type):
    tokenizer = make_tokenizer()
    model = make_model(tokenizer)
    args = tiny_args(tmp_path, loss_type=loss_type, per_device_train_batch_size=4, beta=0.0)
    trainer = BiPACETrainer(model=model, args=args, processing_class=tokenizer)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps  # set by TRL's training loop
    generator = torch.Generator().manual_seed(0)
    lengths = [(3, 5), (7, 2), (2, 9), (5, 5), (9, 1), (4, 6), (6, 3)]
    prompts = [torch.randint(10, 200, (p,), generator=generator).tolist() for p, _ in lengths]
    completions = [torch.randint(10, 200, (c,), generator=generator).tolist() for _, c in lengths]
    inputs = _batch(prompts, completions, pad=tokenizer.pad_token_id, masked_rows={3})
    inputs["old_per_token_logps"] = None  # on-policy: TRL uses the current log-probs

    trainer.args.per_device_train_batch_size = len(lengths)  # one forward over every row
    whole_loss, whole = _gradient(trainer, inputs)
    trainer.args.per_device_train_batch_size = 2  # the same rows in 4 pieces
    assert len(split_rows(inputs, 2)) == 4
    pieces_loss, pieces = _gradient(trainer, inputs)

    assert whole.keys() == pieces.keys() and whole
    assert pieces_loss == pytest.approx(whole_loss, rel=1e-5, abs=1e-7)
    for name in whole:
        torch.testing.assert_close(pieces[name], whole[name], rtol=1e-4, atol=1e-6)
