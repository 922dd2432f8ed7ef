import copy

import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe import passes
from fxpipe.passes.untouched import modules_untouched


class Cached(nn.Module):
    """Cache a tensor per device in eval mode, as timm's TinyViT and LeViT cache attention biases."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.bias = nn.Parameter(torch.randn(16))
        self.cache = {}

    def forward(self, x):
        key = str(x.device)
        if key not in self.cache:
            self.cache[key] = self.bias.detach().clone()
        return self.lin(x) + self.cache[key]


def test_a_module_caching_a_tensor_keeps_no_fake_tensor_from_compile():
    # the compile's shape propagation ran the leaf's forward on fake tensors and its cache kept
    # one: pipe.step returned a fake loss (across ranks: a fake tensor sent, a 300 s wait)
    torch.manual_seed(0)
    model = nn.Sequential(Cached(), nn.ReLU(), Cached(), nn.Linear(16, 4)).eval()
    eager = copy.deepcopy(model)
    x, y = torch.randn(4, 16), torch.randint(0, 4, (4,))
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, leaf_modules=[Cached])
    assert all(m.cache == {} for m in model.modules() if isinstance(m, Cached))
    loss = pipe.step(x, target=y, loss_fn=F.cross_entropy)
    assert type(loss) is torch.Tensor
    torch.testing.assert_close(loss, F.cross_entropy(eager(x), y))
    gm = pipe._runtime.binding.gm
    passes.Propagator(gm, [n.name for n in gm.graph.nodes if n.op == "call_module"][:1])([torch.randn(6, 16)])
    assert all(type(v) is torch.Tensor for m in model.modules() if isinstance(m, Cached) for v in m.cache.values())


def test_attributes_added_replaced_or_filled_in_the_block_are_put_back():
    module = Cached()  # a module of the model's own code (torch.nn's keep no Python state)
    module.table, module.items, module.flag = {"a": 1}, [1, 2], True
    table, items, weight = module.table, module.items, module.bias
    with modules_untouched(module):
        module.table["b"] = 2
        module.items.append(3)
        module.flag = False
        module.extra = torch.zeros(1)
        module.items = []
    assert module.table is table and module.table == {"a": 1}
    assert module.items is items and module.items == [1, 2]
    assert module.flag is True and not hasattr(module, "extra") and module.bias is weight
