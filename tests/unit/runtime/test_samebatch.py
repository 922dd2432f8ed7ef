"""The digest the ranks of one pipeline compare on a first call: equal for one batch, apart for another's rows."""

import torch

from fxpipe.runtime.transport.samebatch import _differs, digest


def test_one_batch_agrees_and_another_s_rows_or_order_differ():
    x = torch.randn(8, 4)
    assert _differs(digest([x, 3, "s", None]), digest([x.clone(), 3, "s", None])) is None
    assert _differs(digest([x.t().contiguous().t()]), digest([x])) is None  # another layout, the same values
    assert _differs(digest([x.double()]), digest([x])) is None  # another dtype, the same rows
    ids = torch.randint(0, 9, (8, 3))
    assert _differs(digest([ids.int()]), digest([ids])) is None
    assert _differs(digest([x]), digest([torch.randn(8, 4)])) == 0  # another shard's rows
    assert _differs(digest([x]), digest([x.flip(0)])) == 0  # the same rows in another order pair other targets
    assert _differs(digest([x, 1]), digest([x, 2])) == 1
    assert _differs(digest([x]), digest([x, x])) == -1  # another structure


def test_values_without_a_plain_sum_are_left_out_not_refused():
    odd = [torch.randn(2, 2).to_sparse(), torch.empty(3, 2, device="meta"), torch.randn(0, 3), torch.randn(3, 0),
           torch.tensor(2.0), torch.randn(3, 2, dtype=torch.complex64), torch.ones(2, dtype=torch.bool), object()]
    fingerprint = digest(odd)
    assert fingerprint[0] is None and fingerprint[1] is None and fingerprint[-1] is None
    assert _differs(fingerprint, digest(odd)) is None
    nan = torch.tensor([[float("nan")], [1.0]])
    assert _differs(digest([nan]), digest([nan.clone()])) is None  # NaN inputs agree with themselves
