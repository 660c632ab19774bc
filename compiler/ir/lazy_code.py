"""GraphModules that write their Python code when it is first read or run, not on every ``recompile()``.

Note [lazy code]: planning never runs a graph, and writing the Python code of a
30k-node step (what ``GraphModule.recompile`` does, then ``compile()`` of the
source) takes seconds each time; a compile did it about ten times (the trace,
two copies, most passes). The step's GraphModules are torch's
``_LazyGraphModule``: passes still call ``recompile()`` after changing the
graph, which only marks the code stale, and ``gm.code``, ``print(gm)`` or
calling ``gm`` write it once. Running a step is unchanged (its code is written
at the first call).

Example::

    gm = graph_module(traced, new_graph)    # no code written yet
    gm.code                                 # written now
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx as fx

try:  # private to torch.fx (torch >= 2.3); without it every recompile writes the code
    from torch.fx._lazy_graph_module import _LazyGraphModule, _use_lazy_graph_module
except ImportError:  # pragma: no cover
    _LazyGraphModule, _use_lazy_graph_module = fx.GraphModule, None


def graph_module(root: torch.nn.Module, graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule over ``graph`` (attributes from ``root``) whose code is written lazily."""
    return _LazyGraphModule(root, graph)


def lazy_code():
    """A context in which make_fx's GraphModules write their code lazily."""
    return _use_lazy_graph_module(True) if _use_lazy_graph_module is not None else contextlib.nullcontext()
