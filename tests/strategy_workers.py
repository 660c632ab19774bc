"""Worker functions for test_strategies.py and test_hybrid.py: train a case under any spec, on every rank.

A module of its own (not a test file) because the local launcher's workers
import worker functions by name. Specs travel as their plain-dict form.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import shardlang as sl
from shardlang.step.batch import split_batch

import parity
from models import CASES
from parity import DTYPES, OPTIMIZERS


def train_with_spec(ctx, case_name: str, optimizer: str, spec_dict: dict, steps: int = 3, dtype: str = "float64"):
    """Train ``steps`` steps under ``Spec.from_dict(spec_dict)``; every rank returns (losses, params, buffers).

    The spec's mesh may name any sizes that multiply to the world size (``-1``
    fills the rest); the case's units apply unless the spec names its own.
    """
    case, dt = CASES[case_name], DTYPES[dtype]
    spec = sl.Spec.from_dict(_with_units(case, spec_dict))
    losses, step = parity.run_steps(ctx, case, dt, spec, optimizer, steps)
    return losses, step.full_parameters(), {k: v.clone() for k, v in step.full_buffers().items()}


def _with_units(case, spec_dict: dict) -> dict:
    return {"units": list(case.units), **spec_dict} if case.units and "units" not in spec_dict else spec_dict


def held_bytes_and_traffic(ctx, case_name: str, spec_dict: dict):
    """One step under ``spec_dict``, counting the bytes each c10d collective moves on this rank, by kind and group size.

    Returns ``(counts, schedule dict)`` where ``counts`` maps ``(kind, group size)`` to payload bytes (the
    bigger of a collective's input and output), measured by a dispatch mode that sees the functional ops.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    case = CASES[case_name]
    model = case.build(torch.float64)
    spec = sl.Spec.from_dict(_with_units(case, spec_dict))
    example = split_batch(case.make_batch(0, torch.float64), ctx.world_size, ctx.rank)
    step = sl.compile(model, case.loss_fn, spec, optimizer=OPTIMIZERS["adamw"][0](), example_batch=example,
                      dist_context=ctx)
    counts: dict[tuple[str, int], int] = {}
    # On gloo a reduce-scatter is bound as an all-to-all plus a local sum (Note [reduce-scatter as all-to-all]);
    # a freshly packed gradient is all-reduced in place (Note [reductions in place]).
    kinds = {"all_gather_into_tensor": "all_gather", "all_gather_into_tensor_out": "all_gather",
             "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "reduce_scatter",
             "all_reduce": "all_reduce", "all_reduce_": "all_reduce"}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            name = func.__name__.split(".")[0]
            if func.namespace == "_c10d_functional" and name in kinds:
                group = dist.distributed_c10d._resolve_process_group(args[-1])
                size = dist.get_world_size(group)
                payload = max(args[0].numel() * args[0].element_size(), out.numel() * out.element_size())
                key = (kinds[name], size)
                counts[key] = counts.get(key, 0) + payload
            return out

    with Count():
        step(split_batch(case.make_batch(0, torch.float64), ctx.world_size, ctx.rank))
    return counts, step.schedule.to_dict()
