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
