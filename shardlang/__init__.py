"""shardlang: declare how a model's parameters lie on a mesh; compile a sharded training step.

Example::

    import shardlang as sl

    spec = sl.Spec(
        mesh=sl.Mesh(fsdp=-1),                         # all ranks on one axis
        rules=[("*.ln*.*", sl.replicate()), ("*", sl.shard("fsdp"))],
        units=["blocks.*"],
    )
    step = sl.compile(model, loss_fn, spec, optimizer=sl.AdamW(lr=3e-4), example_batch=batch)
    print(step.schedule)                               # every gather / free / reduce-scatter, in order
    loss = step(batch)
"""

from . import data
from .api import compile, plan
from .step.batch import split_batch
from .compiler import Adam, AdamW, OpKind, Schedule, SGD, StepBackend, verify
from .errors import (
    CheckpointError,
    CompileError,
    DataError,
    ScheduleError,
    ShardlangError,
    ShardlangRuntimeError,
    SpecError,
    TraceError,
)
from .spec.layout import Replicate, Shard, replicate, shard
from .spec.mesh import Mesh
from .spec.precision import MixedPrecision
from .spec.recompute import Recompute, RecomputeRule
from .spec.rules import Rule
from .spec.options import Options
from .spec.resolved import ResolvedSpec
from .spec.spec import Spec
from .spec.strategy import DDP, Strategy, StrategyRule, ZeRO1, ZeRO2, ZeRO3
from .step.step import Step
from .spec.training import ParamGroup
from shardlang.spec.vocabulary import Accumulation, RandomScheme

__all__ = [
    "Adam", "AdamW", "CheckpointError", "CompileError", "DataError", "Mesh", "MixedPrecision", "OpKind", "Options", "Replicate", "ResolvedSpec",
    "Rule", "SGD", "Schedule",
    "ScheduleError", "Shard", "ShardlangError", "ShardlangRuntimeError", "Spec", "SpecError", "Step", "TraceError",
    "compile", "data", "plan", "replicate", "shard", "split_batch", "verify",
    "Accumulation", "ParamGroup", "RandomScheme", "StepBackend",
    "DDP", "Strategy", "StrategyRule", "ZeRO1", "ZeRO2", "ZeRO3",
    "Recompute", "RecomputeRule",
]
