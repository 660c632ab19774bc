"""shardlang's compiler: trace -> annotate -> passes -> schedule -> analyse -> lower.

This is its public surface: what the front end, the runtime and the command
line import (`shardlang/` imports nothing deeper). Each stage is a folder
(docs/architecture.md has the map): `ir/` (the traced graph, its node tags and
collectives), `layout/` (flat parameters and optimizers), `passes/`,
`schedule/`, `analysis/` (memory, cost, budget, reports) and `lower/` (process
groups and backends). Of the front end it reads only `shardlang.spec.vocabulary`
and `shardlang.errors`; it consumes a `StepConfig` and produces a
`CompiledStep`: the graph, its `Schedule` and its memory plan.

Example::

    from shardlang.compiler import StepConfig, compile_step
    compiled = compile_step(model, loss_fn, resolved.config, optimizer, batch)
    print(compiled.schedule.table())
"""

from .analysis.budget import fit_budget
from .analysis.cost import COMPUTE as COMPUTE_PRESETS, LINKS as LINK_PRESETS, CostModel, op_name
from .analysis.memory import Category
from .analysis.plan_diff import diff_plans
from .analysis.plan_report import make_plan
from .analysis.timeline import write_chrome_trace
from .collection import collection_paused
from .compile import CompiledStep, compile_step, with_buffer_pool
from .config import Precision, Scheduling, StepConfig, TensorAxis
from .evaluate import compile_eval
from .ir.collectives import local_shard
from .ir.rng import has_random_ops
from .ir.torch_logs import VERBOSE_ENV, drop_no_action_warnings, verbose
from .ir.trace import TensorShape, tied_parameters
from .ir.training import Training, per_rank_seed
from .layout.flat import FlatParam, Member, member_piece, member_span, shard_of, slice_spans, unpack_member
from .layout.optim import GROUP_KEYS, SGD, Adam, AdamW, hyper_name, hyper_tensors, init_state
from .layout.placement import WORLD, LayoutKind, MeshShape, ParamInfo, Placement
from .lower.backend import compile_graph
from shardlang.spec.vocabulary import StepBackend
from .lower.emit import WORLD_AXIS, bind, failing_node, group_keys, is_bound_collective
from .passes._norm import norm_flat_order
from .schedule.schedule import COLLECTIVE_KINDS, OpKind, Schedule, ScheduleOp
from .schedule.schedule_format import human_bytes
from .schedule.verify import verify

__all__ = [
    # the entry points and what they take and give
    "StepConfig", "TensorAxis", "Precision", "Scheduling", "Training", "ParamInfo", "Placement", "LayoutKind", "MeshShape", "WORLD",
    "compile_step", "with_buffer_pool", "compile_eval", "CompiledStep", "collection_paused", "TensorShape", "tied_parameters",
    "has_random_ops", "per_rank_seed",
    # flat parameters and optimizers: what a rank holds and updates
    "FlatParam", "Member", "member_piece", "member_span", "shard_of", "slice_spans", "unpack_member",
    "SGD", "Adam", "AdamW", "GROUP_KEYS", "hyper_name", "hyper_tensors", "init_state",
    # the schedule and its analyses
    "Schedule", "ScheduleOp", "OpKind", "COLLECTIVE_KINDS", "verify", "human_bytes", "norm_flat_order",
    "Category", "CostModel", "COMPUTE_PRESETS", "LINK_PRESETS", "op_name", "make_plan", "diff_plans",
    "fit_budget", "write_chrome_trace",
    # lowering: process groups and backends
    "bind", "group_keys", "WORLD_AXIS", "local_shard", "failing_node", "is_bound_collective", "StepBackend",
    "compile_graph",
    # torch's logs while compiling
    "VERBOSE_ENV", "drop_no_action_warnings", "verbose",
]
