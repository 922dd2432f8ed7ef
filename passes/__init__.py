"""Graph passes over ``torch.fx`` GraphModules: annotate, partition, split.

Each pass is a plain function; its module docstring says which ``node.meta`` keys it reads
and writes. The passes import torch, torch.fx and networkx, never fxpipe's runtime.
"""

from passes.annotate import TensorSpec, annotate, annotate_params, bind_placeholders, value_bytes
from passes.partition import (assign_by_name, assign_stages, balanced_cut, compute_nodes, node_cost,
                              partition, partition_at, stage_costs)
from passes.specs import value_specs
from passes.split import Route, StageGraph, split

__all__ = [
    "Route",
    "StageGraph",
    "TensorSpec",
    "annotate",
    "annotate_params",
    "assign_by_name",
    "assign_stages",
    "balanced_cut",
    "bind_placeholders",
    "compute_nodes",
    "node_cost",
    "partition",
    "partition_at",
    "split",
    "stage_costs",
    "value_bytes",
    "value_specs",
]
