"""Graph passes over ``torch.fx`` GraphModules: annotate, profile, partition, split.

Reads a traced GraphModule (and example inputs on fake tensors); produces ``node.meta``
annotations (shapes, bytes, FLOPs, what backward keeps, measured times), a cut into stages
and the stage GraphModules with their skip routes. Each pass is a plain function; its module
docstring says which ``node.meta`` keys it reads and writes. The passes import torch,
torch.fx and networkx, and nothing of fxpipe outside ``fxpipe.passes``.
"""

from fxpipe.passes.annotate import (
                              TensorSpec,
                              annotate,
                              annotate_params,
                              bind_placeholders,
                              input_placeholders,
                              value_bytes,
)
from fxpipe.passes.batchrows import (
                              batch_coupled_outputs,
                              listed_batches,
                              micro_specs,
                              paired_inputs,
                              scalar_outputs,
                              sequence_first_splits,
)
from fxpipe.passes.bufferreads import BufferReads, route_buffer_reads
from fxpipe.passes.cost import comm_weights, cut_widths, memory_factors, node_costs
from fxpipe.passes.cut import NoFeasibleCut, group_costs, min_bottleneck_cut
from fxpipe.passes.fingerprint import fingerprint, first_difference, rename_like, state_signature, structure
from fxpipe.passes.flatids import flat_ids
from fxpipe.passes.gradreach import maybe_without_grad
from fxpipe.passes.gradsplit import GradSplit, split_weight_grads
from fxpipe.passes.groupkeys import group_keys
from fxpipe.passes.infer import Propagator, value_specs
from fxpipe.passes.inplace import Conflict, MutationPlan, copy_on_write, plan_mutations, static_mutations
from fxpipe.passes.modes import merge_modes
from fxpipe.passes.mutates import is_mutating, written_args
from fxpipe.passes.order import candidate_orders
from fxpipe.passes.partition import (
                              Partition,
                              assign_by_name,
                              assign_stages,
                              balanced_cut,
                              compute_nodes,
                              node_cost,
                              partition,
                              partition_at,
                              stage_costs,
)
from fxpipe.passes.profile import profile
from fxpipe.passes.retain import retain
from fxpipe.passes.rnnstate import state_inputs
from fxpipe.passes.scalarrows import Outputs, classify_outputs, coupled_scalars
from fxpipe.passes.spec import differentiable
from fxpipe.passes.split import SkipRoute, StagePlan, split

__all__ = [
                              "BufferReads",
                              "Conflict",
                              "GradSplit",
                              "MutationPlan",
                              "NoFeasibleCut",
                              "Outputs",
                              "Partition",
                              "Propagator",
                              "SkipRoute",
                              "StagePlan",
                              "TensorSpec",
                              "annotate",
                              "annotate_params",
                              "assign_by_name",
                              "assign_stages",
                              "balanced_cut",
                              "batch_coupled_outputs",
                              "bind_placeholders",
                              "candidate_orders",
                              "classify_outputs",
                              "comm_weights",
                              "compute_nodes",
                              "copy_on_write",
                              "coupled_scalars",
                              "cut_widths",
                              "differentiable",
                              "fingerprint",
                              "first_difference",
                              "flat_ids",
                              "group_costs",
                              "group_keys",
                              "input_placeholders",
                              "is_mutating",
                              "listed_batches",
                              "maybe_without_grad",
                              "memory_factors",
                              "merge_modes",
                              "micro_specs",
                              "min_bottleneck_cut",
                              "node_cost",
                              "node_costs",
                              "paired_inputs",
                              "partition",
                              "partition_at",
                              "plan_mutations",
                              "profile",
                              "rename_like",
                              "retain",
                              "route_buffer_reads",
                              "scalar_outputs",
                              "sequence_first_splits",
                              "split",
                              "split_weight_grads",
                              "stage_costs",
                              "state_inputs",
                              "state_signature",
                              "static_mutations",
                              "structure",
                              "value_bytes",
                              "value_specs",
                              "written_args",
]
