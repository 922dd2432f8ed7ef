"""Micro-batching: nested structures, None and non-tensors, uneven and small batches, gathering."""

import pytest
import torch

from fxpipe.errors import PipelineInputError
from fxpipe.runtime.microbatch import batch_size, gather, micro_sizes, scatter


def test_scatter_follows_nesting_and_broadcasts_non_tensors():
    x = torch.arange(10).reshape(5, 2)
    values = [x, {"a": (x * 2, None), "b": [x + 1, "mode"]}, 3.5, torch.tensor(7.0)]
    mbs = scatter(values, ["x", "d", "s", "t"], 2)
    assert len(mbs) == 2
    assert torch.equal(mbs[0][0], x[:3]) and torch.equal(mbs[1][0], x[3:])
    assert torch.equal(mbs[1][1]["a"][0], x[3:] * 2) and mbs[1][1]["a"][1] is None
    assert mbs[0][1]["b"][1] == "mode" and mbs[1][2] == 3.5
    assert mbs[0][3].item() == 7.0 and mbs[1][3].item() == 7.0  # 0-dim tensors go to every micro-batch


@pytest.mark.parametrize("batch, chunks, sizes", [
    (8, 4, [2, 2, 2, 2]), (7, 4, [2, 2, 2, 1]), (5, 4, [2, 1, 1, 1]), (2, 4, [1, 1]), (1, 3, [1]),
])
def test_uneven_and_small_batches(batch, chunks, sizes):
    assert micro_sizes(batch, chunks) == sizes
    mbs = scatter([torch.randn(batch, 3)], ["x"], chunks)
    assert [mb[0].shape[0] for mb in mbs] == sizes


def test_no_batched_tensor_gives_one_micro_batch():
    assert micro_sizes(None, 4) == [0]
    assert len(scatter([3, None], ["a", "b"], 4)) == 1


def test_disagreeing_batch_sizes_name_the_path():
    with pytest.raises(PipelineInputError, match=r"'x' has 4 rows on dim 0 but 'extra\['k'\]\[1\]' has 3"):
        batch_size([torch.randn(4, 2), {"k": (torch.randn(4), torch.randn(3))}], ["x", "extra"])


def test_an_rnn_state_with_its_batch_on_dim_1_is_told_to_go_batch_first():
    # the refusal offered unbatched=, which then failed inside the LSTM: h0 does have a batch, on dim 1
    with pytest.raises(PipelineInputError, match=r"'h0' has 1;.*pass it batch-first and move the dim inside "
                                                 r"the forward"):
        batch_size([torch.randn(6, 5, 8), torch.randn(1, 6, 16)], ["x", "h0"])


def test_batch_size_zero_is_refused():
    with pytest.raises(PipelineInputError, match="batch size 0"):
        batch_size([torch.randn(0, 3)], ["x"])


def test_gather_rebuilds_structure():
    outs = [{"y": (torch.ones(2, 1) * i, "mode", 10), "z": [torch.full((2,), float(i))]} for i in range(3)]
    merged = gather(outs)
    assert merged["y"][0].flatten().tolist() == [0, 0, 1, 1, 2, 2]
    assert merged["y"][1:] == ("mode", 10)
    assert merged["z"][0].tolist() == [0, 0, 1, 1, 2, 2]


def test_gather_refuses_scalar_outputs():
    with pytest.raises(ValueError, match="0-dim tensor"):
        gather([torch.tensor(1.0), torch.tensor(2.0)])
    assert gather([torch.tensor(1.0)]).item() == 1.0


def test_gather_refuses_non_tensors_that_depend_on_the_batch():
    with pytest.raises(ValueError, match=r"output leaf 1 is a int that differs between micro-batches "
                                         r"\(2 in the first, 1 in another\)"):
        gather([(torch.ones(2), 2), (torch.ones(1), 1)])


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_nested_tensor_input_is_refused_at_compile_and_at_the_step_naming_the_padded_fix(tracer):
    # before: torch's "self.shape_env must not be None" at compile, "slice(): not supported for NestedTensor" at step
    import fxpipe

    nt = torch.nested.nested_tensor([torch.randint(1, 20, (n,)) for n in (3, 5, 2, 6)], layout=torch.jagged)
    model = torch.nn.Sequential(torch.nn.Embedding(20, 4), torch.nn.Linear(4, 1))
    with pytest.raises(PipelineInputError, match=r"example_inputs\[0\] is a nested tensor .*to_padded_tensor"):
        fxpipe.compile(model, 2, example_inputs=(nt,), chunks=2, devices=["cpu"] * 2, tracer=tracer)
    with pytest.raises(PipelineInputError, match=r"input 'x'\['ids'\] is a nested tensor"):
        scatter([{"ids": nt}], ["x"], 2)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_sparse_tensor_input_is_refused_at_compile_naming_the_dense_fix(tracer):
    # before: torch's "Cannot access storage of SparseTensorImpl" (fx), a batch-size refusal (export)
    import fxpipe

    adj = (torch.rand(6, 6) < 0.4).float().to_sparse()
    model = torch.nn.Linear(6, 2)
    with pytest.raises(PipelineInputError, match=r"example_inputs\[1\] is a sparse tensor \(torch.sparse_coo\).*"
                                                 r"index_add_.*or pass it dense"):
        fxpipe.compile(model, 2, example_inputs=(torch.randn(6, 6), adj), chunks=1, devices=["cpu"] * 2, tracer=tracer)
    with pytest.raises(PipelineInputError, match=r"input 'adj' is a sparse tensor"):
        scatter([adj], ["adj"], 2)


class _MakesSparse(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        return self.b(h) + h.detach().relu().to_sparse().to_dense()


class _Jagged(torch.nn.Module):
    def forward(self, h):
        return torch.nested.as_nested_tensor(list(h.unbind(0)), layout=torch.jagged)


class _MakesNested(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.mk, self.b = torch.nn.Linear(8, 8), _Jagged(), torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        return self.b(h) + self.mk(h).to_padded_tensor(0.0)


def test_a_sparse_or_nested_tensor_made_inside_the_forward_is_refused_naming_the_node_and_the_dense_fix():
    # before: torch's "Cannot access storage of SparseTensorImpl"; for a nested tensor a PropagationError
    # blaming tracing and advising tracer='export', which refuses it too
    import fxpipe
    from fxpipe.errors import PropagationError

    kw = dict(chunks=3, split_points=["b"], devices=["cpu"] * 2)
    with pytest.raises(PropagationError, match=r"node 'to_sparse' .* makes a sparse tensor \(torch.sparse_coo\): .*"
                                               r"\.to_dense\(\)"):
        fxpipe.compile(_MakesSparse(), 2, example_inputs=(torch.randn(6, 8),), **kw)
    with pytest.raises(PropagationError, match=r"(?s)node 'mk' .*nested \(jagged\) tensor made in the node.*"
                                               r"to_padded_tensor"):
        fxpipe.compile(_MakesNested(), 2, example_inputs=(torch.randn(6, 4, 8),), leaf_modules=[_Jagged], **kw)


def test_a_block_mask_of_several_rows_is_refused_where_the_batch_is_split_and_one_of_none_goes_whole():
    # before: every micro-batch attended with the first rows' document masks, silently (0.34 off eager)
    from torch.nn.attention.flex_attention import create_block_mask

    doc = torch.tensor([[0] * 5 + [1] * 11, [0] * 16, [0] * 3 + [1] * 13, [0] * 16])
    per_row = create_block_mask(lambda b, h, q, k: doc[b, q] == doc[b, k], 4, None, 16, 16, device="cpu")
    with pytest.raises(PipelineInputError, match=r"input 'bm' is a flex attention BlockMask of 4 batch rows.*"
                                                 r"inside the forward.*chunks=1"):
        scatter([torch.randn(4, 16, 8), per_row], ["x", "bm"], 2)
    assert len(scatter([torch.randn(4, 16, 8), per_row], ["x", "bm"], 1)) == 1
    shared = create_block_mask(lambda b, h, q, k: q >= k, None, None, 16, 16, device="cpu")
    mbs = scatter([torch.randn(4, 16, 8), shared], ["x", "bm"], 2)
    assert mbs[0][1] is shared and mbs[1][1] is shared


def test_several_rows_per_sample_are_told_to_go_batch_first_not_unbatched():
    # the refusal offered unbatched=, which gave every micro-batch every sample's images: 11% off eager, silently
    ids, pixels = torch.randint(0, 9, (4, 6)), torch.randn(8, 3, 4, 4)
    with pytest.raises(PipelineInputError, match=r"If 'pixel_values' holds 2 rows per sample .*unbatched= is wrong "
                                                 r"for it too .*\(4, 2, \.\.\.\), and flatten it inside the forward"):
        batch_size([ids, pixels], ["input_ids", "pixel_values"])
