"""The sharding rules of aten ops on one axis: ``strategies_of(call)`` lists how a call may run.

One module per family: `pointwise` (elementwise, the optimizer's updates),
`matmul` (products as einsum equations), `views` (reshapes and data movement),
`nn` (reductions, softmax, norms, embedding, attention), `loss` (log-softmax and
the negative log-likelihood, on vocabulary blocks under loss parallelism). An op with
no rule runs when all its arguments are replicated (every rank computes the
same thing); otherwise propagation stops with an error that names it.
"""

from __future__ import annotations

from ..strategy import OpCall, Strategy
from .loss import LOSS_RULES
from .matmul import EQUATIONS, WITH_BIAS, addmm_strategies, matmul_strategies
from .nn import NN_RULES
from .pointwise import POINTWISE, pointwise_strategies
from .views import VIEW_RULES

__all__ = ["has_rule", "strategies_of"]

RULES = {
    **{op: pointwise_strategies for op in POINTWISE},
    **{op: matmul_strategies for op in EQUATIONS},
    **{op: addmm_strategies for op in WITH_BIAS},
    **VIEW_RULES,
    **NN_RULES,
    **LOSS_RULES,
}


def has_rule(target) -> bool:
    """Whether ``target`` (an aten overload) has sharding rules."""
    return target in RULES


def strategies_of(call: OpCall) -> list[Strategy]:
    """The strategies under which ``call`` runs exactly on local values; [] when its rule has none that fits."""
    return RULES[call.node.target](call)
