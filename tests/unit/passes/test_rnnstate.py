"""An RNN's initial state given as an input, batch on dim 1: refused even where its layers number the rows."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.passes.rnnstate import state_inputs


class Recurrent(nn.Module):
    def __init__(self, batch_first_state: bool = False):
        super().__init__()
        self.batch_first_state = batch_first_state
        self.inp, self.head = nn.Linear(8, 16), nn.Linear(32, 5)
        self.rnn = nn.LSTM(16, 16, num_layers=2, batch_first=True, bidirectional=True)

    def forward(self, x, h0, c0):
        if self.batch_first_state:  # the documented way: the state batch-first, its dims moved here
            h0, c0 = h0.transpose(0, 1).contiguous(), c0.transpose(0, 1).contiguous()
        h, _ = self.rnn(self.inp(x), (h0, c0))
        return self.head(h[:, -1])


def _inputs():
    x, h0, c0 = torch.randn(4, 7, 8), torch.randn(4, 4, 16), torch.randn(4, 4, 16)  # 2 layers x 2 directions = 4 rows
    return x, h0, c0


def test_a_state_whose_layers_number_the_rows_is_refused_under_fx_naming_it_and_the_fix():
    # before: nothing said at compile; the step failed inside the LSTM (Expected hidden[0] size (4, 2, 16))
    with pytest.raises(fxpipe.PipelineInputError, match=r"\['h0', 'c0'\] are an RNN's initial state.*"
                                                         r"h0.transpose\(0, 1\).contiguous\(\)"):
        fxpipe.compile(Recurrent(), 2, example_inputs=_inputs(), chunks=2, devices=["cpu"] * 2)


def test_under_export_the_refusal_names_the_rnn_state_fix():
    with pytest.raises(fxpipe.TraceError, match=r"initial state \(h0, c0\).*h0.transpose\(0, 1\)"):
        fxpipe.compile(Recurrent(), 2, example_inputs=_inputs(), chunks=2, devices=["cpu"] * 2, tracer="export")


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_the_state_passed_batch_first_runs_as_eager(tracer):
    torch.manual_seed(0)
    model, (x, h0, c0), y = Recurrent(batch_first_state=True), _inputs(), torch.randint(0, 5, (4,))
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 2, example_inputs=(x, h0, c0), chunks=2, devices=["cpu"] * 2, tracer=tracer)
    assert state_inputs(pipe._gm) == []
    loss = pipe.step(x, h0, c0, target=y, loss_fn=F.cross_entropy)
    torch.testing.assert_close(loss, F.cross_entropy(eager(x, h0, c0), y))
