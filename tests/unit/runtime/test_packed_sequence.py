"""A PackedSequence crossing stages (an LSTM over packed rows) trains as eager in one process."""

import copy

import pytest
import torch
import torch.nn.functional as F
from models import Pack, PackedLSTM, Unpack

import fxpipe
from fxpipe.testing import max_relative_error


@pytest.mark.parametrize("cut", ["rnn1", "rnn2", "head"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
def test_a_packed_sequence_crossing_stages_trains_as_eager(cut, schedule):
    # compile failed inside fxpipe: the spec of a PackedSequence was rebuilt through its __new__, which reads
    # batch_sizes.device; then its gradient (None for batch_sizes) failed the same way in backward
    torch.manual_seed(0)
    x, lengths, y = torch.randn(6, 5, 8), torch.tensor([5, 2, 4, 3, 5, 1]), torch.randn(6, 5, 4)
    model = PackedLSTM()
    eager = copy.deepcopy(model)
    F.mse_loss(eager(x, lengths), y).backward()
    pipe = fxpipe.compile(model, 2, example_inputs=(x, lengths), devices=["cpu"] * 2, chunks=3, schedule=schedule,
                          split_points=[cut], leaf_modules=(Pack, Unpack))
    pipe.step(x, lengths, target=y, loss_fn=F.mse_loss)
    for p, q in zip(model.parameters(), eager.parameters()):
        assert max_relative_error(p.grad, q.grad) < 1e-5
