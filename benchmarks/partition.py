"""Partition quality against the usual baselines, and compile time against torch.fx's trace.

    PYTHONPATH=$PWD python benchmarks/partition.py [--skip-scaling] [--skip-balance]

1. Bottleneck ratio (max stage / mean stage, forward + backward FLOPs) of fxpipe's cut against
   a parameter-count greedy split (PiPPy's ``split_into_equal_size``), an equal-node-count
   split, and the best contiguous split of the traced node order; on the example models and,
   when torchvision imports, a few torchvision models.
2. The same models cut for 4 GPUs: the modelled stage cost (FLOPs plus bytes crossing the
   cuts, weighed as in ``passes.cost``) of fxpipe's communication-aware cut against its own
   FLOP-only cut.
3. Compile time of 1k, 4k and 16k node models: ``torch.fx.symbolic_trace`` against
   ``fxpipe.compile`` (trace + annotate + partition + split + codegen).

Every ratio is against a baseline measured in the same run. Nothing here is a test.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "support"), os.path.join(ROOT, "examples")]

import fxpipe  # noqa: E402
from fxpipe import passes  # noqa: E402
from models import FACTORIES  # noqa: E402
from unet import factory as unet_factory  # noqa: E402


# -- baselines over the traced node order ------------------------------------------------------

def param_greedy(gm: torch.fx.GraphModule, k: int) -> list[int]:
    """Cut like PiPPy's ``split_into_equal_size``: fill stages up to total parameters / k, in order."""
    compute = passes.compute_nodes(gm)
    index = {n: i for i, n in enumerate(compute)}
    total = sum(p.numel() for p in gm.parameters()) + sum(b.numel() for b in gm.buffers())
    threshold = total // k
    state = gm.state_dict()
    sizes: dict = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in state:
            for user in node.users:
                sizes.setdefault(user, {})[node.target] = state[node.target].numel()
        if node.op == "call_module":
            params = {n: p.numel() for n, p in gm.get_submodule(node.target).named_parameters()}
            if params:
                sizes.setdefault(node, params)
    cuts: list[torch.fx.Node] = []
    acc, seen = 0, {}
    for node in gm.graph.nodes:
        if node not in sizes:
            continue
        new = {n: s for n, s in sizes[node].items() if node.op == "call_module" or n not in seen}
        repeated = {n: s for n, s in sizes[node].items() if n not in new}
        size = sum(new.values())
        if acc + size <= threshold:
            acc += size
            seen.update(new)
        elif acc == 0 and size > threshold:
            cuts.append(node.next)
        else:
            cuts.append(node)
            acc = size + sum(repeated.values())
            seen = {**repeated, **new}
    starts = [0]
    for node in cuts[: k - 1]:
        while node.op not in passes.cost.COMPUTE_OPS and node.op != "output":
            node = node.next
        if node.op != "output" and index[node] > starts[-1]:
            starts.append(index[node])
    return starts  # may hold fewer than k stages: PiPPy itself would refuse the model then


def equal_nodes(n: int, k: int) -> list[int]:
    """Cut ``n`` nodes into ``k`` groups whose sizes differ by at most one."""
    return [j * n // k for j in range(k)]


def ratio(costs: list[float], starts: list[int], k: int) -> float:
    """Return max stage / mean stage over ``k`` stages (missing stages count as empty)."""
    bounds = list(starts) + [len(costs)]
    stages = [sum(costs[bounds[j]:bounds[j + 1]]) for j in range(len(starts))]
    return max(stages) / (sum(costs) / k)


# FLOPs per crossing byte: 50 TFLOP/s GPUs over PCIe 4.0 x16 (25 GB/s, fxpipe's default for
# two CUDA devices, passes.cost) or over NVLink (300 GB/s)
LINKS = {"PCIe": 50e12 / 25e9, "NVLink": 50e12 / 300e9}


# -- models --------------------------------------------------------------------------------------

def models() -> list[tuple[str, nn.Module, tuple]]:
    """Return (name, model, example inputs): the test models, the U-Net example, torchvision."""
    out = []
    for name, factory in FACTORIES.items():
        model, args, kwargs = factory()
        if not kwargs:
            out.append((name, model, args))
    model, args = unet_factory()
    out.append(("unet (example)", model.eval(), args))
    try:
        import torchvision.models as tvm
    except ImportError:
        print("note: torchvision is not importable here; its rows are skipped "
              "(see benchmarks/README.md for the environment that runs them)")
        return out
    x = torch.randn(8, 3, 224, 224)
    for name in ("resnet18", "resnet50", "mobilenet_v2", "densenet121", "vit_b_16", "convnext_tiny"):
        out.append((name, getattr(tvm, name)().eval(), (x,)))
    return out


def balance_table(stage_counts=(2, 4, 8)) -> None:
    """Print bottleneck ratios of fxpipe and the baselines, and the communication-aware rows."""
    rows, comm_rows = [], []
    for name, model, args in models():
        gm = passes.annotate(fxpipe.trace(model), args)
        compute = passes.compute_nodes(gm)
        costs = passes.node_costs(compute, "flops")
        for k in stage_counts:
            if len(compute) < 4 * k:
                continue
            pipe = fxpipe.compile(model, k, example_inputs=args, devices=["cpu"] * k)
            ours = pipe.plan.bottleneck("flops")
            best = ratio(costs, passes.balanced_cut(costs, k), k)
            greedy = ratio(costs, param_greedy(gm, k), k)
            even = ratio(costs, equal_nodes(len(compute), k), k)
            target = max(1.10, 1.02 * best)
            rows.append([name, len(compute), k, f"{ours:.3f}", f"{best:.3f}", f"{greedy:.3f}",
                         f"{even:.3f}", f"{greedy / ours:.2f}x", f"{even / ours:.2f}x",
                         "yes" if ours <= target + 1e-9 else "NO"])
        k = 4
        if len(compute) >= 4 * k:
            flop_cut = passes.partition(gm, k, balance_by="flops")
            flop_costs = passes.node_costs(flop_cut.order, "flops")
            row = [name, f"{sum(flop_cut.widths[s] for s in flop_cut.starts[1:]) / 1e6:.2f}"]
            for link, per_byte in LINKS.items():
                comm = [per_byte] * (k - 1)
                flop_model = max(passes.group_costs(flop_costs, flop_cut.widths, flop_cut.starts, comm))
                aware = passes.partition(gm, k, balance_by="flops", comm=comm)
                row += [f"{flop_model / max(aware.costs):.2f}x",
                        f"{sum(aware.widths[s] for s in aware.starts[1:]) / 1e6:.2f}",
                        f"{ratio(passes.node_costs(aware.order, 'flops'), aware.starts, k):.3f}"]
            comm_rows.append(row)
    print("\nFLOP bottleneck (max/mean stage, forward + backward FLOPs; lower is better)\n")
    print(tabulate(rows, headers=["model", "nodes", "stages", "fxpipe", "best traced", "param greedy",
                                  "equal nodes", "greedy/fxpipe", "equal/fxpipe", "target met"],
                   tablefmt="github"))
    print("\n4 GPUs: the FLOP-only cut against the communication-aware cut, stage cost = FLOPs + "
          "weight x bytes crossing its cuts\n")
    headers = ["model", "MB crossing, FLOP-only"]
    for link in LINKS:
        headers += [f"{link}: modelled bottleneck, FLOP-only / aware", f"{link}: MB crossing, aware",
                    f"{link}: FLOP ratio, aware"]
    print(tabulate(comm_rows, headers=headers, tablefmt="github"))


# -- compile-time scaling -----------------------------------------------------------------------

class Block(nn.Module):
    """A pre-norm MLP block with a residual: six graph nodes."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x)))) * 0.5


class Deep(nn.Module):
    """``n`` blocks in a row."""

    def __init__(self, n: int, d: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(d) for _ in range(n)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _best_of(fn, repeats: int) -> float:
    """Return the least wall time of ``repeats`` calls of ``fn``, in seconds, each from a collected heap."""
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def scaling_table(sizes=(1000, 4000, 16000), repeats: int = 3, stages: int = 4) -> None:
    """Print trace and compile times for models of about ``sizes`` nodes, and their ratios."""
    x = torch.randn(8, 16)
    fxpipe.compile(Deep(2), 2, example_inputs=(x,), devices=["cpu"] * 2)  # warm up fake tensors
    rows, per_node = [], []
    for size in sizes:
        model = Deep(round((size - 2) / 6))
        nodes = len(torch.fx.symbolic_trace(model).graph.nodes)
        trace = _best_of(lambda: torch.fx.symbolic_trace(model), repeats)
        comp = _best_of(lambda: fxpipe.compile(model, stages, example_inputs=(x,), devices=["cpu"] * stages).code,
                        repeats)
        per_node.append(comp / nodes)
        rows.append([nodes, f"{trace:.2f}", f"{comp:.2f}", f"{comp / trace:.2f}",
                     f"{comp / nodes * 1e6:.0f}", f"{per_node[-1] / per_node[0]:.2f}"])
    print(f"\nCompile time ({stages} stages, best of {repeats}; compile = trace + annotate + partition + "
          "split + codegen)\n")
    print(tabulate(rows, headers=["nodes", "symbolic_trace s", "fxpipe.compile s", "compile/trace",
                                  "us per node", "us per node vs smallest"], tablefmt="github"))
    model = Deep(round((sizes[-1] - 2) / 6))
    phases = {}
    t0 = time.perf_counter()
    gm = fxpipe.trace(model)
    phases["trace"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    passes.annotate(gm, (x,))
    phases["annotate"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    passes.batch_coupled_outputs(gm, x.shape[0], x.shape[0] // 4)  # what chunks=4 adds: outputs coupling rows
    phases["coupled-output check"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    passes.partition(gm, stages)
    phases["partition"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    passes.split(gm, stages)
    phases["split"] = time.perf_counter() - t0
    print("\nphases at the largest size: " + ", ".join(f"{k} {v:.2f} s" for k, v in phases.items()))
    print(f"the coupled-output check (compile with chunks > 1) against annotation: "
          f"{phases['coupled-output check'] / phases['annotate']:.2f}x")


def main() -> None:
    """Run the benchmarks picked on the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-balance", action="store_true")
    parser.add_argument("--skip-scaling", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    opts = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if not opts.skip_balance:
        balance_table()
    if not opts.skip_scaling:
        scaling_table(repeats=opts.repeats)


if __name__ == "__main__":
    main()
