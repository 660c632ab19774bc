"""Matrix products in the traced step must not mix dtypes, as eager PyTorch requires.

Fake tensors' meta kernels for ``mm`` / ``addmm`` / ``bmm`` / ``baddbmm`` do not
check that their operands share a dtype, so a float32 batch fed to a float64
model traces, and the step then fails on its first real run with
``RuntimeError: mat1 and mat2 must have the same dtype`` and no hint of where.
This check makes that a trace error at the user's line. Example::

    check_matmul_dtypes(gm.graph)   # TraceError: aten.addmm.default mixes torch.float32 and torch.float64 at ...
"""

from __future__ import annotations

import torch
import torch.fx as fx

from shardlang.errors import TraceError
from .provenance import site_of_node

_MATMULS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
}


def check_matmul_dtypes(graph: fx.Graph) -> None:
    """Raise `TraceError` at the first matrix product whose tensor operands have different dtypes."""
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in _MATMULS:
            continue
        dtypes = [a.meta["val"].dtype for a in node.args
                  if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
        if len(set(dtypes)) < 2:
            continue
        site = site_of_node(node)
        where = f" at {site}" if site else ""
        mixed = " and ".join(str(d) for d in dict.fromkeys(dtypes))
        raise TraceError(
            f"{node.target} (node {node.name}) mixes {mixed}{where}\n"
            "what to do: give the batch the model's dtype (convert its floating leaves, or set dtype = ... in a "
            "job file, which converts both), or use Options(mixed_precision=...), which casts the batch to "
            "param_dtype", site=site,
        )
