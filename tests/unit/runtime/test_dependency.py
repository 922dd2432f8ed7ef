"""Fork/join: a phony dependency forces one backward before another."""

import torch

from fxpipe.runtime.stage.dependency import depend, fork, join


def test_join_links_backward_to_the_fork():
    # In backward, the gradient of `after` reaches the Join node, whose phony edge feeds the
    # Fork node of `before`: `before`'s producer cannot run until `after`'s consumer has.
    x = torch.randn(3, requires_grad=True)
    (a,), (b,) = depend((x * 2,), (x * 3,))
    fork_node = a.grad_fn
    join_node = b.grad_fn
    assert type(fork_node).__name__ == "ForkBackward"
    assert type(join_node).__name__ == "JoinBackward"
    assert fork_node in [fn for fn, _ in join_node.next_functions]
    order = []
    fork_node.register_prehook(lambda grads: order.append("fork"))
    join_node.register_prehook(lambda grads: order.append("join"))
    (a.sum() + b.sum()).backward()
    assert order == ["join", "fork"]


def test_depend_is_transparent_in_values_and_grads():
    x = torch.randn(4, requires_grad=True)
    y = torch.randn(4, requires_grad=True)
    (x2,), (y2,) = depend((x * 1,), (y * 1,))
    assert torch.equal(x2, x) and torch.equal(y2, y)
    (x2 * 3 + y2 * 5).sum().backward()
    assert torch.equal(x.grad, torch.full((4,), 3.0)) and torch.equal(y.grad, torch.full((4,), 5.0))


def test_no_autograd_no_change():
    x = torch.randn(2)
    phony = fork(x)[1]
    assert phony.numel() == 0
    assert join(x, phony) is x
    with torch.no_grad():
        a, b = torch.randn(2, requires_grad=True), torch.randn(2)
        assert depend((a,), (b,)) == ((a,), (b,))
