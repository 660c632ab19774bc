"""Where the local launcher's ranks meet: a TCPStore on loopback, held by the parent process.

Note [loopback rendezvous]: the local launcher's ranks all live on this machine, so
nothing they open needs to be reachable from another host. The parent binds a
socket to 127.0.0.1 on a port the kernel picks (port 0) and hands that very
socket to `torch.distributed.TCPStore` (``master_listen_fd``): there is no
moment between finding a free port and listening on it, and torch's store,
which listens on every interface when it binds a port itself, never binds one.
The ranks connect to it as clients; each process group the pool forms
(the first, and one per recovery) lives under a key prefix of its own, so no key
of a failed job is read by the next. gloo's own connections between ranks
listen on the loopback interface (`loopback_interface`, set as
``GLOO_SOCKET_IFNAME`` in each rank).

Under torchrun none of this applies: torchrun's rendezvous is used as it is
(docs/cli.md, "Under torchrun", says what it exposes and how to restrict it).

Example::

    with LoopbackRendezvous(timeout_s=60) as rendezvous:
        rendezvous.port          # what the ranks connect to, on 127.0.0.1
"""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist

from shardlang.errors import ShardlangRuntimeError

LOCALHOST = "127.0.0.1"
LISTEN_BACKLOG = 1024  # every rank connects at once, more than once per process group


class LoopbackRendezvous:
    """A TCPStore listening on 127.0.0.1 only, on a socket bound here (Note [loopback rendezvous])."""

    def __init__(self, timeout_s: float):
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._socket.bind((LOCALHOST, 0))
            self._socket.listen(LISTEN_BACKLOG)
            self.port = self._socket.getsockname()[1]
            self.store = dist.TCPStore(LOCALHOST, self.port, None, True, datetime.timedelta(seconds=timeout_s),
                                       wait_for_workers=False, master_listen_fd=self._socket.fileno(),
                                       use_libuv=True)
        except (OSError, RuntimeError) as exc:
            self._socket.close()
            raise ShardlangRuntimeError(f"cannot listen on {LOCALHOST} for the ranks' rendezvous: {exc}") from exc
        self._socket.detach()  # the store's server owns the socket now, and closes it when it stops

    def close(self) -> None:
        """Stop listening (the store's server closes its socket); safe to call twice."""
        self.store = None

    def __enter__(self) -> LoopbackRendezvous:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def join_store(port: int, generation: int, timeout_s: float) -> dist.Store:
    """A rank's view of the pool's store: a client of the parent's TCPStore, under the prefix of
    process group number ``generation`` (Note [loopback rendezvous])."""
    client = dist.TCPStore(LOCALHOST, port, None, False, datetime.timedelta(seconds=timeout_s), use_libuv=True)
    return dist.PrefixStore(f"process-group-{generation}/", client)


def loopback_interface() -> str:
    """The name of this machine's loopback network interface (``lo`` on Linux, ``lo0`` on macOS/BSD).

    Example::

        >>> loopback_interface() in ("lo", "lo0")
        True
    """
    names = {name for _index, name in socket.if_nameindex()}
    for name in ("lo", "lo0"):
        if name in names:
            return name
    raise ShardlangRuntimeError(
        f"found no loopback network interface among {sorted(names)}; the local launcher keeps gloo's "
        "connections on loopback ('lo' or 'lo0'). Run under torchrun and set GLOO_SOCKET_IFNAME instead"
    )
