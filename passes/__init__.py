"""Graph passes over ``torch.fx`` GraphModules: annotate, partition, split.

Each pass is a plain function; its module docstring says which ``node.meta`` keys it reads
and writes. The passes import torch, torch.fx and networkx, never fxpipe's runtime.
"""

from passes.annotate import TensorSpec, annotate, annotate_params, bind_placeholders, value_bytes
from passes.inplace import Conflict, MutationPlan, copy_on_write, plan_mutations, static_mutations
from passes.partition import (balanced_cut, compute_nodes, node_cost, partition, partition_at,
                              stage_costs)
from passes.split import Route, StageGraph, split

__all__ = [
    "Conflict",
    "MutationPlan",
    "Route",
    "StageGraph",
    "TensorSpec",
    "annotate",
    "annotate_params",
    "balanced_cut",
    "bind_placeholders",
    "compute_nodes",
    "copy_on_write",
    "node_cost",
    "partition",
    "partition_at",
    "plan_mutations",
    "split",
    "stage_costs",
    "static_mutations",
    "value_bytes",
]
