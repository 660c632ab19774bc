"""shardlang's runtime process layer: process groups and the local launcher.

`dist` sets up torch.distributed (from torchrun's environment, or for the local
launcher); `launcher` starts ranks on this machine, once (`launch`) or as a
reusable pool (`WorkerPool`, `WorkerPools`, in `worker_pool`); `worker` is what
each spawned rank runs and `failures` how a job on them fails (`WorkerError`).

Example::

    from shardlang.runtime import launch

    def hello(ctx):                     # at module level, importable by the workers
        return f"rank {ctx.rank} of {ctx.world_size}"

    launch(hello, 2)                    # ['rank 0 of 2', 'rank 1 of 2']
"""

from shardlang.runtime.dist import (
    Backend,
    DistContext,
    EnvConfig,
    init_from_env,
    init_process_group,
    read_env,
    shutdown,
    world_group_name,
)
from shardlang.runtime.launcher import (
    FailureKind,
    PoolState,
    RankFailure,
    WorkerError,
    WorkerPool,
    WorkerPools,
    launch,
    run_in_process,
)
from shardlang.runtime.watch import CollectiveError, CollectiveTimeoutError

__all__ = [
    "Backend",
    "CollectiveError",
    "CollectiveTimeoutError",
    "DistContext",
    "EnvConfig",
    "FailureKind",
    "PoolState",
    "RankFailure",
    "WorkerError",
    "WorkerPool",
    "WorkerPools",
    "init_from_env",
    "init_process_group",
    "launch",
    "read_env",
    "run_in_process",
    "shutdown",
    "world_group_name",
]
