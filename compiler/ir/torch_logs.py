"""torch's own log records while shardlang traces and compiles: kept back, shown with ``--verbose``.

When tracing fails on a user's shape bug, torch logs the failure itself (fake
tensors log "failed while attempting to run meta for aten.mm.default" with a
traceback through torch's internals) before the exception reaches shardlang,
which then reports it as one clear `TraceError` naming the user's line. The
user needs the second, not the first. Some warnings carry no action for a user
either: inductor's "No CUDA runtime is found" on a CPU machine with a CUDA
toolkit installed.

Note [torch's logs]: inside `captured_torch_logs()`, every record that a
logger of torch's tree would print is kept in a list instead, unless verbose
(``SHARDLANG_VERBOSE=1``, which ``shardlang --verbose`` sets for every rank):
then it prints as usual. Outside it, the no-action warnings of
`NO_ACTION_WARNINGS` are dropped (verbose keeps them). The filters sit on the
handlers that print (torch's own, the root logger's and logging's last resort),
so loggers created later are covered too. A record at warning level that is
not in the list still prints: it may carry an action.

Example::

    with captured_torch_logs() as kept:
        gm = make_fx(step_fn, tracing_mode="fake")(*example)
    kept.records            # what torch logged meanwhile (empty when verbose: it printed)
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator

VERBOSE_ENV = "SHARDLANG_VERBOSE"

#: Warnings that tell a CPU user nothing to do (matched against the formatted message).
NO_ACTION_WARNINGS = (
    re.compile(r"^No CUDA runtime is found"),
)


def verbose() -> bool:
    """True when ``SHARDLANG_VERBOSE`` asks for torch's own logs and full tracebacks.

    Example: ``SHARDLANG_VERBOSE=1 shardlang run job.py`` (as ``shardlang --verbose run job.py``).
    """
    return os.environ.get(VERBOSE_ENV, "").strip().lower() not in ("", "0", "false", "no")


class KeptLogs(logging.Filter):
    """A handler filter that keeps torch's records instead of letting them print (Note [torch's logs])."""

    def __init__(self, keep_all: bool):
        super().__init__()
        self.keep_all = keep_all
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if verbose() or not _from_torch(record):
            return True
        if self.keep_all or _no_action(record):
            if not any(kept is record for kept in self.records[-1:]):  # one record meets every handler in turn
                self.records.append(record)
            return False
        return True


@contextlib.contextmanager
def captured_torch_logs() -> Iterator[KeptLogs]:
    """Keep torch's log records back while the block runs (Note [torch's logs]).

    Example::

        >>> with captured_torch_logs() as kept:
        ...     logging.getLogger("torch._subclasses.fake_tensor").error("failed while attempting to run meta")
        >>> [r.getMessage() for r in kept.records] if not verbose() else []
        ['failed while attempting to run meta']
    """
    kept = KeptLogs(keep_all=True)
    handlers = _printing_handlers()
    for handler in handlers:
        handler.addFilter(kept)
    try:
        yield kept
    finally:
        for handler in handlers:
            handler.removeFilter(kept)


def drop_no_action_warnings() -> None:
    """From now on, drop the warnings of `NO_ACTION_WARNINGS` (unless verbose); idempotent.

    Called once by the command line and by each launched rank.
    """
    for handler in _printing_handlers():
        if not any(isinstance(f, KeptLogs) and not f.keep_all for f in handler.filters):
            handler.addFilter(KeptLogs(keep_all=False))


def _printing_handlers() -> list[logging.Handler]:
    """The handlers a torch record can reach: those on torch's loggers, the root's, and the last resort."""
    found: list[logging.Handler] = []
    loggers = [logging.getLogger("torch")]
    loggers += [logger for name, logger in list(logging.root.manager.loggerDict.items())
                if name.startswith("torch.") and isinstance(logger, logging.Logger)]
    for logger in (*loggers, logging.root):
        found += [h for h in logger.handlers if h not in found]
    if logging.lastResort is not None and logging.lastResort not in found:
        found.append(logging.lastResort)
    return found


def _from_torch(record: logging.LogRecord) -> bool:
    return record.name == "torch" or record.name.startswith("torch.")


def _no_action(record: logging.LogRecord) -> bool:
    try:
        message = record.getMessage()
    except Exception:  # a record whose arguments do not format: let its handler report that
        return False
    return any(pattern.search(message) for pattern in NO_ACTION_WARNINGS)
