"""``unbatched=``: inputs without a batch dimension go whole to every micro-batch (Flux's ``img_ids``)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.testing import max_relative_error


class Positions(nn.Module):
    """Add a table of positions (no batch dim) before and after a block, as rotary ids are read by every layer."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, pos):
        h = torch.tanh(self.a(x + pos))
        h = torch.tanh(self.b(h))
        return self.c(h * pos.sum(-1, keepdim=True))


def _inputs(rows=6):
    torch.manual_seed(0)
    return torch.randn(rows, 5, 8), torch.randn(5, 8)


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
def test_an_unbatched_input_reaches_every_micro_batch_whole(tracer, schedule):
    model, (x, pos) = Positions(), _inputs()
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 3, example_inputs=(x, pos), chunks=3, tracer=tracer, schedule=schedule,
                          devices=["cpu"] * 3, unbatched=["pos"])
    torch.testing.assert_close(pipe(x, pos), eager(x, pos))
    target = torch.randn(6, 5, 8)
    loss = pipe.step(x, pos, target=target, loss_fn=F.mse_loss)
    expected = F.mse_loss(eager(x, pos), target)
    expected.backward()
    assert max_relative_error(loss, expected) < 1e-5
    grads = dict(eager.named_parameters())
    for name, p in model.named_parameters():
        assert max_relative_error(p.grad, grads[name].grad) < 1e-5, name
    x7 = torch.randn(7, 5, 8)  # another batch size, uneven micro-batches: pos still whole
    torch.testing.assert_close(pipe(x7, pos), eager(x7, pos))


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_without_unbatched_the_batch_mismatch_names_the_option(tracer):
    model, (x, pos) = Positions(), _inputs()
    with pytest.raises(fxpipe.PipelineInputError, match=r"'pos.*has 5.*unbatched=\[\.\.\.\]"):
        pipe = fxpipe.compile(model, 2, example_inputs=(x, pos), chunks=2, tracer=tracer)
        pipe(x, pos)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_unbatched_names_must_be_inputs(tracer):
    model, (x, pos) = Positions(), _inputs()
    with pytest.raises(ValueError, match=r"names \['position'\].*inputs are \['x', 'pos'\]"):
        fxpipe.compile(model, 2, example_inputs=(x, pos), chunks=2, tracer=tracer, unbatched=["pos", "position"])
    with pytest.raises(TypeError, match="unbatched= must be a list of the forward's input names"):
        fxpipe.compile(model, 2, example_inputs=(x, pos), unbatched="pos")
    with pytest.raises(TypeError, match="unbatched= must be a list .*got None"):  # was 'NoneType' is not iterable
        fxpipe.compile(model, 2, example_inputs=(x, pos), unbatched=None)


class Rotary(nn.Module):
    """Take rotary tables as a tuple and a dict (HunyuanDiT's ``image_rotary_emb=(cos, sin)``), none with a batch dim."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, rope, extra):
        cos, sin = rope
        h = torch.tanh(self.a(x) * cos + sin)
        return self.b(h + extra["shift"])


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_tuple_or_dict_input_named_unbatched_goes_whole_to_every_micro_batch(tracer):
    # torch.export flattens rope into rope_0 and rope_1: unbatched=["rope"] was refused as no input of the graph,
    # and the graph's names as none of the forward's, so no spelling worked
    torch.manual_seed(0)
    model, x = Rotary(), torch.randn(6, 5, 8)
    rope, extra = (torch.randn(5, 8), torch.randn(5, 8)), {"shift": torch.randn(5, 8)}
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 2, example_inputs=(x, rope, extra), chunks=3, tracer=tracer, devices=["cpu"] * 2,
                          unbatched=["rope", "extra"])
    target = torch.randn(6, 5, 8)
    loss = pipe.step(x, rope, extra, target=target, loss_fn=F.mse_loss)
    expected = F.mse_loss(eager(x, rope, extra), target)
    expected.backward()
    assert max_relative_error(loss, expected) < 1e-5
    grads = dict(eager.named_parameters())
    for name, p in model.named_parameters():
        assert max_relative_error(p.grad, grads[name].grad) < 1e-5, name
    with pytest.raises(fxpipe.PipelineInputError, match=r"name 'rope' in fxpipe.compile\(..., unbatched=\['rope'\]\) "
                                                        r"to give all of it whole"):  # was: pass rope[0] on its own
        fxpipe.compile(Rotary(), 2, example_inputs=(x, rope, extra), chunks=3, tracer=tracer, unbatched=["extra"])(
            x, rope, extra)
    with pytest.raises(ValueError, match=r"names \['rot'\].*inputs are \['x', 'rope', 'extra'\]"):
        fxpipe.compile(Rotary(), 2, example_inputs=(x, rope, extra), chunks=3, tracer=tracer, unbatched=["rot"])


class _Message(nn.Module):
    """One round of message passing over an edge list ``[2, E]``, which is no per-row input."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x, edge_index):
        h = self.a(x)
        return self.b(torch.relu(torch.zeros_like(h).index_add_(0, edge_index[1], h[edge_index[0]]) + h))


def test_an_export_of_an_input_with_other_rows_names_unbatched():
    # before: "the model must not depend on the batch size ... use tracer='fx'", the fix left unnamed
    x, edges = torch.randn(10, 8), torch.randint(0, 10, (2, 30))
    with pytest.raises(fxpipe.TraceError, match=r"input 'edge_index' has 2 rows on dim 0 where 'x' has 10.*"
                                                r"unbatched=\['edge_index'\]"):
        fxpipe.compile(_Message(), 2, example_inputs=(x, edges), chunks=1, devices=["cpu"] * 2, tracer="export")
    model = _Message()
    pipe = fxpipe.compile(model, 2, example_inputs=(x, edges), chunks=1, devices=["cpu"] * 2, tracer="export",
                          unbatched=["edge_index"])
    with torch.no_grad():
        torch.testing.assert_close(pipe(x, edges), model(x, edges))


class DictInput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, batch):
        return self.lin(batch["x"]) + batch["table"].sum()


def test_a_table_inside_a_dict_input_is_named_and_unbatching_every_input_is_warned_of():
    # the refusal said to name the leaf in unbatched=, which takes whole inputs; unbatched=["batch"] then ran the
    # whole batch as one micro-batch, silently
    batch = {"x": torch.randn(6, 8), "table": torch.randn(8, 3)}
    with pytest.raises(fxpipe.PipelineInputError, match=r"pass 'batch\['table'\]' to the forward as an argument of "
                                                        r"its own, named in fxpipe.compile\(..., unbatched="):
        fxpipe.compile(DictInput(), 2, example_inputs=(batch,), chunks=3, devices=["cpu"] * 2)
    with pytest.warns(UserWarning, match=r"unbatched=\['batch'\] leaves no input to split into micro-batches"):
        fxpipe.compile(DictInput(), 2, example_inputs=(batch,), chunks=3, devices=["cpu"] * 2, unbatched=["batch"])


class _Looked(nn.Module):
    """Rows of a table input picked by index inputs (a codebook)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, ids, table):
        return self.b(torch.relu(self.a(table[ids])))


def test_a_table_split_because_its_rows_equal_the_batch_s_is_noted_with_unbatched():
    # its dim 0 equals the batch size, so it was split like the batch: a bare "index 7 is out of bounds"
    ids, table = torch.arange(8) % 8, torch.randn(8, 4)
    pipe = fxpipe.compile(_Looked(), 2, example_inputs=(ids, table), chunks=2, devices=["cpu"] * 2)
    with pytest.raises(IndexError) as info:
        pipe(ids, table)
    assert any("compile with unbatched=['<that input>']" in n for n in info.value.__notes__), info.value.__notes__
    model = _Looked()
    pipe = fxpipe.compile(model, 2, example_inputs=(ids, table), chunks=2, devices=["cpu"] * 2, unbatched=["table"])
    with torch.no_grad():
        torch.testing.assert_close(pipe(ids, table), model(ids, table))
