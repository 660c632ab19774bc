"""Process-group set-up: who am I, how many are we, and which backend joins us.

A `DistContext` is the plain-data answer a rank gets once its process group is up
(or once it knows it needs none). It comes from one of two places:

- `init_from_env()` under torchrun (or any launcher that sets torchrun's variables
  RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT);
- `init_process_group(...)`, called by shardlang's local launcher
  (`shardlang.runtime.launcher`) in each worker it starts.

Note [world size 1]: a world of one rank never creates a process group. Every
collective on one rank is the identity, so the emitted step skips them, and the
same program runs in a plain Python process with `torch.distributed` untouched.
`DistContext.has_process_group` is False there, and `backend` is None.

Note [backend and device]: NCCL on ``cuda:LOCAL_RANK`` when CUDA is available,
gloo on the CPU otherwise. An explicit backend overrides the choice; the device
follows the backend (NCCL -> that rank's GPU, gloo -> CPU).

Example::

    >>> ctx = init_from_env({})            # no torchrun variables: a world of one
    >>> ctx.world_size, ctx.has_process_group
    (1, False)
"""

from __future__ import annotations

import datetime
import enum
import os
from collections.abc import Mapping

import attrs
import torch
import torch.distributed as dist

from shardlang.errors import ShardlangRuntimeError

ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
#: How long a collective may wait for its peers before it fails (NCCL's default; torch's gloo default is 30 min).
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0


class Backend(enum.Enum):
    """A torch.distributed backend that shardlang runs on.

    Example::

        >>> Backend.parse("GLOO")
        <Backend.GLOO: 'gloo'>
    """

    GLOO = "gloo"
    NCCL = "nccl"

    @classmethod
    def parse(cls, value: Backend | str) -> Backend:
        """The backend named by ``value`` (a Backend or its name, any case)."""
        if isinstance(value, Backend):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            valid = ", ".join(repr(b.value) for b in cls)
            raise ShardlangRuntimeError(f"unknown backend {value!r}; valid backends are {valid}") from None

    @classmethod
    def default(cls) -> Backend:
        """NCCL when CUDA is available, gloo otherwise (Note [backend and device])."""
        return cls.NCCL if torch.cuda.is_available() else cls.GLOO


@attrs.frozen
class DistContext:
    """Where this process stands in the world of ranks running one program.

    ``backend`` is None exactly when there is no process group (Note [world size 1]).
    ``timeout_s`` is how long each collective may wait for its peers (Note [collective timeout]
    in `shardlang.runtime.watch`); subgroups are made with the same limit.

    Example::

        >>> DistContext.single()
        DistContext(rank=0, world_size=1, local_rank=0, backend=None, device=device(type='cpu'))
    """

    rank: int
    world_size: int
    local_rank: int
    backend: Backend | None
    device: torch.device = attrs.field(converter=torch.device)
    timeout_s: float = attrs.field(default=DEFAULT_COLLECTIVE_TIMEOUT_S, repr=False)

    @property
    def has_process_group(self) -> bool:
        """True when collectives go through torch.distributed's default group."""
        return self.backend is not None

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that prints and writes files."""
        return self.rank == 0

    @classmethod
    def single(cls, local_rank: int = 0) -> DistContext:
        """The context of a world of one: no process group, this machine's default device.

        Example::

            >>> DistContext.single().has_process_group
            False
        """
        return cls(0, 1, local_rank, None, _device_for(Backend.default(), local_rank))


@attrs.frozen
class EnvConfig:
    """torchrun's variables, parsed and checked, before any process group exists.

    Example::

        >>> read_env({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500"})
        EnvConfig(rank=1, world_size=2, local_rank=1, master_addr='h', master_port=29500)
    """

    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int | None


def read_env(env: Mapping[str, str] | None = None) -> EnvConfig:
    """Parse torchrun's variables from ``env`` (default ``os.environ``) without side effects.

    WORLD_SIZE absent means a world of one; then RANK and LOCAL_RANK default to 0 and
    MASTER_ADDR/MASTER_PORT are not needed. With more ranks, RANK, MASTER_ADDR and
    MASTER_PORT are required, and LOCAL_RANK defaults to RANK (one machine).
    Raises ShardlangRuntimeError naming the variable and its value when one is bad.

    Example::

        >>> read_env({"WORLD_SIZE": "1"}).world_size
        1
    """
    env = os.environ if env is None else env
    world_size = _int_var(env, "WORLD_SIZE", default=1, minimum=1)
    rank = _int_var(env, "RANK", default=0 if world_size == 1 else None, minimum=0)
    if rank >= world_size:
        raise ShardlangRuntimeError(
            f"environment variable RANK={env['RANK']!r} is out of range for WORLD_SIZE={world_size}; "
            f"valid ranks are 0..{world_size - 1}"
        )
    local_rank = _int_var(env, "LOCAL_RANK", default=rank, minimum=0)
    if world_size == 1:
        return EnvConfig(rank, world_size, local_rank, env.get("MASTER_ADDR"), None)
    master_addr = env.get("MASTER_ADDR", "").strip()
    if not master_addr:
        raise ShardlangRuntimeError(
            f"environment variable MASTER_ADDR={env.get('MASTER_ADDR')!r} must name rank 0's host "
            f"when WORLD_SIZE={world_size}; launch with torchrun, which sets it"
        )
    master_port = _int_var(env, "MASTER_PORT", default=None, minimum=1)
    _check_port(master_port, "environment variable MASTER_PORT")
    return EnvConfig(rank, world_size, local_rank, master_addr, master_port)


def init_from_env(env: Mapping[str, str] | None = None, *, backend: Backend | str | None = None,
                  timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> DistContext:
    """Join the process group that torchrun's environment describes; none for a world of one.

    ``timeout_s`` bounds each collective's wait for its peers (default 10 minutes).

    Example (under ``torchrun --nproc-per-node 2 train.py``)::

        ctx = init_from_env()        # DistContext(rank=0, world_size=2, ..., backend=<Backend.GLOO: 'gloo'>)
        ...
        shutdown()
    """
    config = read_env(env)
    if config.world_size == 1:
        return DistContext.single(config.local_rank)
    return init_process_group(
        config.rank,
        config.world_size,
        config.master_addr,
        config.master_port,
        backend,
        local_rank=config.local_rank,
        timeout_s=timeout_s,
    )


def init_process_group(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    backend: Backend | str | None = None,
    *,
    local_rank: int | None = None,
    timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
) -> DistContext:
    """Create torch.distributed's default process group over TCP rendezvous at rank 0's address.

    World size 1 creates nothing (Note [world size 1]). Calling it again with the same
    rank and world size returns the context of the group that already exists.
    ``timeout_s`` bounds each collective's wait for its peers, in seconds (default 10 minutes,
    as NCCL's; gloo honours it in every wait, functional collectives' included).

    Example (in each of two processes, rank 0 and rank 1)::

        ctx = init_process_group(rank, 2, "127.0.0.1", 29500)
        torch.distributed.all_reduce(torch.ones(1))   # tensor([2.])
    """
    _check_rank(rank, world_size)
    check_timeout(timeout_s, "timeout_s")
    local_rank = rank if local_rank is None else local_rank
    chosen = Backend.default() if backend is None else Backend.parse(backend)
    if world_size == 1:
        return DistContext(0, 1, local_rank, None, _device_for(chosen, local_rank), timeout_s)
    _check_port(master_port, "master_port")
    device = _device_for(chosen, local_rank)
    if dist.is_initialized():
        return _existing_context(rank, world_size, local_rank, chosen, device, timeout_s)
    if chosen is Backend.NCCL:
        torch.cuda.set_device(device)  # before any CUDA work: each rank owns its GPU
    dist.init_process_group(
        backend=chosen.value,
        init_method=f"tcp://{_url_host(master_addr)}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if chosen is Backend.NCCL else None,  # binds NCCL's communicator to this GPU now
    )
    return DistContext(rank, world_size, local_rank, chosen, device, timeout_s)


def init_with_store(rank: int, world_size: int, store: dist.Store, *, timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S
                    ) -> DistContext:
    """Create torch.distributed's default gloo group over ``store`` (the local launcher's: Note [loopback
    rendezvous] in `shardlang.runtime.rendezvous`); the context of this rank.

    Example (in each worker of a local pool)::

        ctx = init_with_store(rank, 2, join_store(port, 0, 60.0))
    """
    _check_rank(rank, world_size)
    check_timeout(timeout_s, "timeout_s")
    if world_size == 1:  # Note [world size 1]: no process group
        return DistContext(0, 1, 0, None, torch.device("cpu"), timeout_s)
    dist.init_process_group(backend=Backend.GLOO.value, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return DistContext(rank, world_size, rank, Backend.GLOO, torch.device("cpu"), timeout_s)


def check_timeout(value: object, where: str) -> None:
    """``value`` must be a positive number of seconds; the error names ``where`` it came from.

    Example::

        >>> check_timeout(2.5, "--timeout")
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ShardlangRuntimeError(f"{where}={value!r} is not a timeout; expected a positive number of seconds")


def shutdown() -> None:
    """Destroy the default process group if there is one; safe to call twice or with none.

    Example::

        >>> shutdown()      # no process group: nothing to do
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def world_group_name() -> str:
    """The registered name of the default group, as functional collectives take it.

    Example (with a process group up)::

        torch.ops._c10d_functional.all_reduce(t, "sum", world_group_name())
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ShardlangRuntimeError(
            "world_group_name() needs a process group, and none is initialised; "
            "a world of one runs without one (call init_from_env or init_process_group with world_size > 1)"
        )
    return dist.group.WORLD.group_name


def _int_var(env: Mapping[str, str], name: str, *, default: int | None, minimum: int) -> int:
    """The integer in environment variable ``name``, at least ``minimum``; ``default`` when absent."""
    raw = env.get(name)
    if raw is None:
        if default is None:
            raise ShardlangRuntimeError(
                f"environment variable {name} is not set; torchrun sets {', '.join(ENV_VARS)} for each rank"
            )
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ShardlangRuntimeError(
            f"environment variable {name}={raw!r} is not a valid value; expected an integer >= {minimum}"
        )
    return value


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ShardlangRuntimeError(
            f"rank={rank!r}, world_size={world_size!r} is not a valid pair; "
            "world_size must be >= 1 and rank in 0..world_size-1"
        )


def _check_port(port: int | None, where: str) -> None:
    if not isinstance(port, int) or not 1 <= port <= 65535:
        raise ShardlangRuntimeError(f"{where}={port!r} is not a TCP port; expected an integer in 1..65535")


def _device_for(backend: Backend, local_rank: int) -> torch.device:
    """Note [backend and device]: the rank's GPU for NCCL, the CPU for gloo."""
    if backend is not Backend.NCCL:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ShardlangRuntimeError("backend 'nccl' needs CUDA, and torch.cuda.is_available() is False; use 'gloo'")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ShardlangRuntimeError(
            f"LOCAL_RANK={local_rank} has no GPU: this machine has {count} (cuda:0..cuda:{count - 1}); "
            "start at most one rank per GPU"
        )
    return torch.device("cuda", local_rank)


def _existing_context(
    rank: int, world_size: int, local_rank: int, backend: Backend, device: torch.device, timeout_s: float
) -> DistContext:
    """The context of the already initialised default group, if it is the one asked for."""
    have = (dist.get_rank(), dist.get_world_size())
    if have != (rank, world_size):
        raise ShardlangRuntimeError(
            f"a process group already exists as rank {have[0]} of {have[1]}, not rank {rank} of {world_size}; "
            "call shutdown() first"
        )
    return DistContext(rank, world_size, local_rank, backend, device, timeout_s)


def _url_host(host: str) -> str:
    """``host`` as it goes into a tcp:// URL (IPv6 literals in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
