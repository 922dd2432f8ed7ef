"""A step that fails in one process leaves nothing behind: the next step equals eager."""



def test_a_failed_step_in_one_process_leaves_nothing_behind():
    import copy

    import torch
    from longrun_cases import tokens
    from models import token_loss
    from rope import RopeLM

    import fxpipe

    model = RopeLM()
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 2, example_inputs=(tokens(0, 16)[0],), chunks=4, schedule="zb",
                          devices=["cpu"] * 2)

    def broken(logits, target):
        raise RuntimeError("broken loss")

    ids, target = tokens(1, 16)
    try:
        pipe.step(ids, target=target, loss_fn=broken)
    except RuntimeError:
        pass
    assert all(w.pending() == 0 for w in pipe._runtime.workers.values())
    for p in model.parameters():
        p.grad = None
    ids, target = tokens(2, 24)
    loss = pipe.step(ids, target=target, loss_fn=token_loss)
    expected = token_loss(eager(ids), target)
    expected.backward()
    assert torch.allclose(loss, expected, rtol=1e-5)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), name


def test_a_failed_call_in_training_mode_leaves_no_deferred_statistics_behind():
    # its micro-batches' batch-norm sums joined the next call's, one update of both calls' rows (3.7e-2 off)
    import copy

    import torch
    from torch import nn

    import fxpipe

    class Bomb(nn.Module):
        armed = False

        def forward(self, x):
            if Bomb.armed and x.shape[0] < 4:  # the last micro-batch
                raise RuntimeError("bomb")
            return x

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), Bomb(), nn.Linear(8, 2))
    twin = copy.deepcopy(model)
    kw = dict(example_inputs=(torch.randn(8, 4),), chunks=2, leaf_modules=[Bomb], deferred_batch_norm=True,
              devices=["cpu"] * 2)
    pipe, other = fxpipe.compile(model, 2, **kw), fxpipe.compile(twin, 2, **kw)
    Bomb.armed = True
    try:
        pipe(torch.randn(7, 4))
    except RuntimeError:
        pass
    Bomb.armed = False
    x = torch.randn(8, 4)
    pipe(x), other(x)
    assert torch.equal(model[1].running_mean, twin[1].running_mean)
    assert int(model[1].num_batches_tracked) == int(twin[1].num_batches_tracked) == 1
