"""The runtime process layer: process-group set-up and the local launcher.

The worker functions below are at module level so that the spawned ranks can
import them (as ``test_launcher.<name>``; see conftest.py). Spawning dominates
the cost, so most tests share the session pools; three start their own
processes: `launch` itself, a hang, and a rank that dies.
"""

from __future__ import annotations

import doctest
import functools
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist

from shardlang.errors import ShardlangRuntimeError
from shardlang.runtime.dist import DEFAULT_COLLECTIVE_TIMEOUT_S
from shardlang.runtime import (
    Backend,
    DistContext,
    FailureKind,
    PoolState,
    WorkerError,
    WorkerPool,
    dist as sl_dist,
    failures,
    init_from_env,
    launcher,
    read_env,
    rendezvous,
    worker,
    worker_pool,
    world_group_name,
)

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def describe(ctx: DistContext, tag: str) -> tuple:
    print(f"hello from {ctx.rank}")
    return ctx.rank, ctx.world_size, ctx.backend, tag, torch.get_num_threads(), dist.is_initialized()


def sum_of_ranks(ctx: DistContext) -> tuple[float, float]:
    """The sum of the ranks, once by c10d's all_reduce and once by the functional collective."""
    eager = torch.tensor([float(ctx.rank)])
    dist.all_reduce(eager)
    functional = torch.ops._c10d_functional.all_reduce(torch.tensor([float(ctx.rank)]), "sum", world_group_name())
    functional = torch.ops._c10d_functional.wait_tensor(functional)
    return eager.item(), functional.item()


def process_id(ctx: DistContext) -> int:
    return os.getpid()


def fail_on_rank(ctx: DistContext, bad_rank: int) -> int:
    if ctx.rank == bad_rank:
        raise ValueError(f"bad value on rank {ctx.rank}")
    return ctx.rank


def die_while_peer_waits(ctx: DistContext) -> None:
    """Rank 1 exits abruptly; rank 0 waits for it in an all-reduce that never completes."""
    if ctx.rank == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))


def sleep_forever(ctx: DistContext) -> None:
    time.sleep(3600)


def listening_addresses(pid: int | str = "self") -> list[str]:
    """The local addresses of the TCP sockets process ``pid`` listens on (Linux: /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table, width in (("tcp", 4), ("tcp6", 16)):
        with open(f"/proc/{pid}/net/{table}") as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and inode in inodes:  # LISTEN
                    address, port = local.split(":")
                    raw = bytes.fromhex(address)
                    # /proc prints each 32-bit word in host (little-endian) order
                    words = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
                    host = socket.inet_ntop(socket.AF_INET if width == 4 else socket.AF_INET6, words)
                    found.append(f"{host}:{int(port, 16)}")
    return found


def rank_listening_addresses(ctx: DistContext) -> list[str]:
    dist.barrier()  # every pair of ranks connected: gloo's listeners are open
    return listening_addresses()


def test_launch_returns_results_in_rank_order_and_prefixes_output(capfd):
    results = launcher.launch(describe, 2, "x", timeout=120)
    assert results == [(0, 2, Backend.GLOO, "x", 1, True), (1, 2, Backend.GLOO, "x", 1, True)]
    out = capfd.readouterr().out
    assert "[rank 0] hello from 0\n" in out and "[rank 1] hello from 1\n" in out


def test_pool_reuses_its_processes_and_keeps_rank_order(pools):
    pool = pools.get(2)
    first, second = pool.run(process_id), pool.run(process_id)
    assert first == second and len(set(first)) == 2 and os.getpid() not in first
    assert pool.run(describe, "y") == [(0, 2, Backend.GLOO, "y", 1, True), (1, 2, Backend.GLOO, "y", 1, True)]


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce_sums_over_ranks(run_on, world_size):
    total = float(sum(range(world_size)))
    assert run_on(world_size, sum_of_ranks) == [(total, total)] * world_size


def test_error_on_one_rank_names_it_and_the_pool_recovers(pools):
    pool = pools.get(2)
    with pytest.raises(WorkerError, match="rank 1 raised ValueError: bad value on rank 1") as caught:
        pool.run(fail_on_rank, 1)
    error = caught.value
    assert isinstance(error, ShardlangRuntimeError)
    assert error.ranks == (1,) and error.finished == (0,)
    assert "in fail_on_rank" in error.failures[0].traceback and "in fail_on_rank" in str(error)
    assert pool.state is PoolState.READY and error.pool_state is PoolState.READY
    assert pool.run(sum_of_ranks) == [(1.0, 1.0)] * 2  # same ranks, consistent process group


def test_job_that_cannot_be_pickled_is_refused_before_it_starts(pools):
    pool = pools.get(2)
    with pytest.raises(ShardlangRuntimeError, match="module level"):
        pool.run(lambda ctx: ctx.rank)
    assert pool.state is PoolState.READY
    assert pool.run(functools.partial(fail_on_rank, bad_rank=5)) == [0, 1]


def test_rank_that_dies_breaks_the_pool_and_pools_replace_it(pools):
    pool = pools.get(2)
    with pytest.raises(WorkerError, match="rank 1 died with exit code 3") as caught:
        pool.run(die_while_peer_waits)
    rank1, rank0 = caught.value.failures
    assert (rank1.rank, rank1.kind, rank0.rank) == (1, FailureKind.DIED, 0)
    assert rank0.kind in (FailureKind.RAISED, FailureKind.STOPPED)  # gloo may notice the lost peer first
    assert str(caught.value).startswith("job test_launcher.die_while_peer_waits failed: rank 1 died")
    assert pool.state is PoolState.BROKEN
    with pytest.raises(ShardlangRuntimeError, match="cannot run jobs"):
        pool.run(process_id)
    fresh = pools.get(2)
    assert fresh is not pool and fresh.run(sum_of_ranks) == [(1.0, 1.0)] * 2


def test_hang_is_stopped_by_the_timeout():
    with WorkerPool(2, grace=0.5) as pool:
        started = time.monotonic()
        with pytest.raises(WorkerError, match="rank 0 timed out after 1 s; rank 1 timed out") as caught:
            pool.run(sleep_forever, timeout=1.0)
        assert time.monotonic() - started < 10
        assert caught.value.ranks == (0, 1) and pool.state is PoolState.BROKEN
        if hasattr(os, "kill"):
            assert "in sleep_forever" in caught.value.failures[0].traceback  # the stack dumped on SIGUSR1


def test_world_size_one_runs_in_process_without_process_group(run_on):
    assert run_on(1, describe, "z") == [(0, 1, None, "z", torch.get_num_threads(), False)]
    assert not dist.is_initialized()
    with pytest.raises(WorkerError, match="rank 0 raised ValueError") as caught:
        run_on(1, fail_on_rank, 0)
    assert isinstance(caught.value.__cause__, ValueError)


def test_init_from_env_reads_torchrun_environment(monkeypatch):
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29500"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = read_env()
    assert (config.rank, config.world_size, config.local_rank) == (3, 4, 1)
    assert (config.master_addr, config.master_port) == ("10.0.0.7", 29500)
    calls = []
    monkeypatch.setattr(sl_dist, "init_process_group", lambda *a, **k: calls.append((a, k)) or "ctx")
    assert init_from_env() == "ctx"
    assert calls == [((3, 4, "10.0.0.7", 29500, None), {"local_rank": 1, "timeout_s": DEFAULT_COLLECTIVE_TIMEOUT_S})]


@pytest.mark.parametrize("world_size", [None, "1"])
def test_init_from_env_world_of_one_has_no_process_group(monkeypatch, world_size):
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    if world_size is not None:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    ctx = init_from_env()
    assert (ctx.rank, ctx.world_size, ctx.backend, ctx.has_process_group) == (0, 1, None, False)
    assert not dist.is_initialized()
    with pytest.raises(ShardlangRuntimeError, match="needs a process group"):
        world_group_name()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two'"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0'"),
        ({"WORLD_SIZE": "-2"}, "WORLD_SIZE='-2'"),
        ({"WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK is not set"),
        ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK='2' is out of range"),
        ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_PORT": "1"}, "MASTER_ADDR=None"),
        ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "70000"}, "MASTER_PORT=70000"),
        ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "x"}, "MASTER_PORT='x'"),
    ],
)
def test_init_from_env_rejects_bad_values_naming_them(monkeypatch, env, message):
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ShardlangRuntimeError, match=message):
        init_from_env()
    assert not dist.is_initialized()


@pytest.mark.skipif(not os.path.isdir("/proc/self/net"), reason="reads listening sockets from Linux's /proc")
def test_every_listening_socket_is_on_loopback():
    # Note [loopback rendezvous]: the parent's store and gloo's connections between ranks; also after the pool
    # recovered from a failed job (a fresh process group over the same store).
    loopback = ("127.", "::1:")
    before = set(listening_addresses())  # this process's listeners so far (the session's pools)
    with WorkerPool(2) as pool:
        parent = listening_addresses()
        ranks = pool.run(rank_listening_addresses)
        with pytest.raises(WorkerError):
            pool.run(fail_on_rank, 1)
        recovered = pool.run(rank_listening_addresses)
    assert parent and all(a.startswith(loopback) for a in parent), parent
    for addresses in (*ranks, *recovered):
        assert addresses and all(a.startswith(loopback) for a in addresses), (ranks, recovered)
    assert set(listening_addresses()) <= before  # the pool's store stopped listening with the pool


def test_a_pool_of_one_rank_has_no_process_group():
    # Note [world size 1]: the launcher's rank of a world of one runs without a process group, as in-process.
    with WorkerPool(1) as pool:
        rank, world, backend, _tag, _threads, initialised = pool.run(describe, "one")[0]
    assert (rank, world, backend, initialised) == (0, 1, None, False)


def test_bad_arguments_name_the_value():
    with pytest.raises(ShardlangRuntimeError, match="nproc=0"):
        WorkerPool(0)
    with pytest.raises(ShardlangRuntimeError, match="unknown backend 'mpi'"):
        Backend.parse("mpi")


def test_docstring_examples_hold():
    for module in (sl_dist, launcher, failures, rendezvous, worker, worker_pool):
        assert doctest.testmod(module).failed == 0, module.__name__
