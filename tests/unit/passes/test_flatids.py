"""Flat ids with offsets (a jagged batch) given as inputs: refused, even where the ids number the rows."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe


class LengthsBag(nn.Module):
    """TorchRec's layout: flat ids and per-sample lengths; the offsets made in the forward."""

    def __init__(self, functional: bool = False):
        super().__init__()
        self.functional = functional
        self.dense, self.bag = nn.Linear(8, 16), nn.EmbeddingBag(20, 16, mode="sum")
        self.head = nn.Linear(32, 1)

    def forward(self, dense, values, lengths):
        offsets = torch.cumsum(lengths, 0) - lengths
        pooled = F.embedding_bag(values, self.bag.weight, offsets, mode="sum") if self.functional \
            else self.bag(values, offsets)
        return self.head(torch.cat([self.dense(dense), pooled], 1)).squeeze(1)


class FlattenedBag(nn.Module):
    """2-D ids flattened inside the forward, offsets by the row length: split by sample, and right."""

    def __init__(self):
        super().__init__()
        self.bag, self.head = nn.EmbeddingBag(20, 16, mode="mean"), nn.Linear(16, 1)

    def forward(self, ids):
        rows, per = ids.shape
        offsets = torch.arange(rows, device=ids.device) * per
        return self.head(self.bag(ids.flatten(), offsets)).squeeze(1)


def _jagged():
    torch.manual_seed(0)  # 8 ids for 8 samples: the sizes agree and nothing else tells
    return torch.randn(8, 8), torch.randint(0, 20, (8,)), torch.tensor([2, 2, 0, 0, 1, 1, 1, 1])


@pytest.mark.parametrize("tracer, functional", [("fx", False), ("fx", True), ("export", False)])
def test_flat_ids_whose_count_equals_the_batch_are_refused_naming_the_fix(tracer, functional):
    # before: split by rows, micro-batch k got ids 2k..2k+1 of other samples: loss 0.708 against eager's 0.705
    with pytest.raises(fxpipe.PipelineInputError, match=r"takes flat ids with offsets.*\['lengths', 'values'\].*"
                                                         r"2-D tensor .* padded with the bag's padding_idx.*chunks=1"):
        fxpipe.compile(LengthsBag(functional), 2, example_inputs=_jagged(), chunks=4, devices=["cpu"] * 2,
                       tracer=tracer)


def test_flat_ids_named_unbatched_are_refused_too_and_one_chunk_runs():
    # unbatched=['values'] gave every micro-batch all ids with its own lengths' offsets: refused as well
    with pytest.raises(fxpipe.PipelineInputError, match=r"\['lengths'\]"):
        fxpipe.compile(LengthsBag(), 2, example_inputs=_jagged(), chunks=4, devices=["cpu"] * 2, unbatched=["values"])
    model = LengthsBag()
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 2, example_inputs=_jagged(), chunks=1, devices=["cpu"] * 2)
    torch.testing.assert_close(pipe(*_jagged()), eager(*_jagged()))


def test_a_batch_that_disagrees_with_flat_ids_names_the_jagged_fix():
    dense, values, lengths = _jagged()
    with pytest.raises(fxpipe.PipelineInputError, match=r"batch sizes disagree.*If 'values' holds offsets, lengths or "
                                                        r"indices into rows.*chunks=1, which splits nothing"):
        fxpipe.compile(LengthsBag(), 2, example_inputs=(dense, torch.cat([values, values[:3]]), lengths), chunks=4,
                       devices=["cpu"] * 2)


def test_ids_flattened_inside_the_forward_are_split_by_sample_and_equal_eager():
    torch.manual_seed(0)
    model, ids, y = FlattenedBag(), torch.randint(0, 20, (8, 3)), torch.randn(8)
    eager = copy.deepcopy(model)
    F.mse_loss(eager(ids), y).backward()
    pipe = fxpipe.compile(model, 2, example_inputs=(ids,), chunks=4, devices=["cpu"] * 2)
    pipe.step(ids, target=y, loss_fn=F.mse_loss)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


class OnePerSample(nn.Module):
    """One id per sample, 1-D, the offsets from the ids' own length: split by sample already."""

    def __init__(self):
        super().__init__()
        self.bag, self.head = nn.EmbeddingBag(50, 16), nn.Linear(16, 4)

    def forward(self, ids):
        return self.head(self.bag(ids, torch.arange(ids.shape[0], device=ids.device)))


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_one_id_per_sample_with_offsets_from_its_own_length_is_not_refused(tracer):
    torch.manual_seed(0)
    model, ids, y = OnePerSample(), torch.randint(0, 50, (8,)), torch.randn(8, 4)
    eager = copy.deepcopy(model)
    F.mse_loss(eager(ids), y).backward()
    pipe = fxpipe.compile(model, 2, example_inputs=(ids,), chunks=4, devices=["cpu"] * 2, tracer=tracer)
    pipe.step(ids, target=y, loss_fn=F.mse_loss)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
