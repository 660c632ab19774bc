"""What a long run shows while it trains: a progress bar, plain log lines, and a metrics file.

`RunReporter` is called once per step by the training loop (``shardlang run``).
On the steps it reports, every rank contributes its local loss, its step time,
its peak memory and the number of items in its batch (one all-gather of four
float64 numbers per rank); rank 0 then

- prints the plain line ``step k/n  loss L  time T ms`` (the format tests and
  scripts parse: keep it) every ``log_every`` steps, and always the first and
  the last step;
- updates a tqdm bar when its output is a terminal: step, loss, throughput, step
  time, peak memory per rank and ETA;
- writes one JSON object per logged step to ``metrics`` (under a bar with no
  ``log_every``, per step) (docs/cli.md, "Metrics").

Throughput (Note [items]): a batch *has a token dimension* when one of its
leaves is an integer tensor of at least two dimensions (token ids: batch x
sequence); its items are then that leaf's elements, and throughput is
tokens/s. Otherwise its items are the first leaf's size along dim 0, and
throughput is samples/s. The global count is the sum over ranks (ranks may
hold batches of different shapes), over the slowest rank's step time.

Peak memory per rank: ``torch.cuda.max_memory_allocated`` on a GPU; on the CPU
the process's peak resident set size (``ru_maxrss``: everything the process
holds, the torch library included, so it is an upper bound of what training
needs).

Example::

    reporter = RunReporter(ctx, steps=100, options=ProgressOptions(log_every=10, metrics="m.jsonl"))
    for k in range(100):
        ...
        reporter.step(k + 1, loss, elapsed_s, batch)
    reporter.close()
"""

from __future__ import annotations

import io
import json
import os
import sys
import time
from typing import IO, Any

import attrs
import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from ..runtime.dist import DistContext
from ..runtime.worker import LineStream, is_terminal

MIB = 2**20
FALLBACK_COLUMNS, FALLBACK_ROWS = 100, 24  # the size assumed for a terminal that reports none
BAR_REFRESH_S = 0.1  # at most ten redraws a second (tqdm's default): a fast run does not flood the terminal


@attrs.frozen
class ProgressOptions:
    """How a run reports: ``log_every`` (None: 1 when no bar is shown, no plain lines under a bar),
    ``metrics`` (a path for JSON lines, or None) and ``bar`` (None: when rank 0's output is a terminal).

    Example: ``ProgressOptions(log_every=50, metrics="runs/a.jsonl")``.
    """

    log_every: int | None = None
    metrics: str | None = None
    bar: bool | None = None


def batch_items(batch: Any) -> tuple[int, str]:
    """``(count, unit)`` of one per-rank batch: its tokens or its samples (Note [items] in the module docs).

    Example::

        >>> batch_items(torch.zeros(8, 33, dtype=torch.long))
        (264, 'tokens')
        >>> batch_items((torch.zeros(16, 8), torch.zeros(16, 4)))
        (16, 'samples')
    """
    leaves = [x for x in pytree.tree_leaves(batch) if isinstance(x, torch.Tensor)]
    for leaf in leaves:
        if not leaf.is_floating_point() and not leaf.is_complex() and leaf.dtype != torch.bool and leaf.dim() >= 2:
            return leaf.numel(), "tokens"
    if leaves and leaves[0].dim() >= 1:
        return leaves[0].shape[0], "samples"
    return 1, "samples"


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory so far: CUDA's allocator peak on a GPU, the peak resident set on the CPU.

    Example::

        >>> peak_memory_bytes(torch.device("cpu")) > 0
        True
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        import resource
    except ImportError:  # not a Unix
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


class RunReporter:
    """Once per step, on every rank: the plain line, the bar and the metrics file (rank 0 shows them).

    Every rank must call `step` for every step and `close` at the end (reported steps
    gather from every rank). ``out`` is rank 0's stream (default ``sys.stdout``).

    Example::

        reporter = RunReporter(ctx, 3, ProgressOptions())
        reporter.step(1, loss, 0.012, batch)      # prints "step 1/3  loss 0.693147  time 12.0 ms"
    """

    def __init__(self, ctx: DistContext, steps: int, options: ProgressOptions = ProgressOptions(),
                 out: IO[str] | None = None, first: int = 0):
        self._ctx = ctx
        self._steps = steps
        self._first = first  # steps done before this run (resumed from a checkpoint)
        self._out = out if out is not None else sys.stdout
        self._bar_shown = self._agree(options.bar if options.bar is not None else is_terminal(self._out))
        self._log_every = options.log_every if options.log_every is not None else (None if self._bar_shown else 1)
        self._started = time.perf_counter()
        self._metrics = open(options.metrics, "w", buffering=1) if options.metrics and ctx.is_main else None  # noqa: SIM115
        self._bar = self._make_bar() if self._bar_shown and ctx.is_main else None
        self._streams = self._above_the_bar() if self._bar is not None else None
        self.last: dict[str, Any] | None = None  # the last reported step's record (every rank)

    def step(self, k: int, loss: torch.Tensor, elapsed_s: float, batch: Any, note: str = "") -> None:
        """Report step ``k`` (1-based) of ``steps``: ``loss`` is the local loss, ``elapsed_s`` its time on this rank."""
        logged = self._logs(k)
        if not (logged or self._bar_shown):
            return
        record = self._gather(k, loss, elapsed_s, batch)
        self.last = record
        if not self._ctx.is_main:
            return
        if logged:
            line = f"step {k}/{self._steps}  loss {record['loss']:.6f}  time {elapsed_s * 1e3:.1f} ms" + \
                (f"  {note}" if note else "")
            self._print(line)
        if self._metrics is not None and (logged or self._log_every is None):  # under a bar alone: every step
            self._metrics.write(json.dumps(record) + "\n")
        if self._bar is not None:
            self._bar.set_postfix_str(_bar_text(record), refresh=False)
            self._bar.update(1)

    def evaluation(self, k: int, loss: float, line: str) -> None:
        """Print an evaluation's ``line`` on rank 0, and write ``{"step": k, "val_loss": loss}`` to the metrics."""
        self.warn(line)
        if self._metrics is not None:
            self._metrics.write(json.dumps({"step": k, "val_loss": loss}) + "\n")

    def warn(self, line: str) -> None:
        """Print ``line`` on rank 0 (above the bar, if there is one)."""
        if self._ctx.is_main:
            self._print(line)

    def close(self) -> None:
        """Close the bar and the metrics file; the job's ``print`` and stderr write straight through again."""
        if self._streams is not None:
            for stream in (sys.stdout, sys.stderr):
                if isinstance(stream, _AboveTheBar):
                    stream.flush_line()
            sys.stdout, sys.stderr = self._streams
            self._streams = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None

    def _logs(self, k: int) -> bool:
        every = self._log_every
        return every is not None and (k == self._first + 1 or k % every == 0 or k == self._steps)

    def _agree(self, shown: bool) -> bool:
        """Rank 0's choice for every rank: whether a step is reported must be the same everywhere (a collective)."""
        if not self._ctx.has_process_group:
            return shown
        flag = torch.tensor([1.0 if shown else 0.0], dtype=torch.float64, device=self._ctx.device)
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    def _gather(self, k: int, loss: torch.Tensor, elapsed_s: float, batch: Any) -> dict[str, Any]:
        items, unit = batch_items(batch)
        mine = torch.tensor([float(loss.detach().to(torch.float64).reshape(())), elapsed_s,
                             float(peak_memory_bytes(self._ctx.device)), float(items)], dtype=torch.float64)
        if self._ctx.has_process_group:
            mine = mine.to(self._ctx.device)
            rows = mine.new_empty(self._ctx.world_size * 4)
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
            gather(rows, mine)
            rows = rows.cpu().reshape(self._ctx.world_size, 4)
        else:
            rows = mine.reshape(1, 4)
        slowest = float(rows[:, 1].max())
        done = time.perf_counter() - self._started
        return {
            "step": k,
            "steps": self._steps,
            "loss": float(rows[:, 0].sum() / len(rows)),  # the global batch's loss (equal per-rank batches)
            "step_time_s": slowest,
            f"{unit}_per_s": float(rows[:, 3].sum()) / slowest if slowest > 0 else 0.0,
            unit: int(rows[:, 3].sum()),
            "peak_memory_bytes": [int(b) for b in rows[:, 2]],
            "elapsed_s": done,
            "eta_s": done / (k - self._first) * (self._steps - k),
        }

    def _print(self, line: str) -> None:
        try:
            if self._bar is not None:
                self._bar.write(line, file=self._out)
            else:
                print(line, file=self._out, flush=True)
        except BrokenPipeError:  # the reader is gone (`shardlang run ... | head`): train on, print nothing more
            self._out = _silenced(self._out)

    def _above_the_bar(self) -> tuple[Any, Any]:
        """Note [lines above the bar]: while the bar is drawn, what rank 0 prints (the job's ``print``, warnings,
        the lines of the processes it started: Note [children's output]) goes above the bar, a line at a time, as
        tqdm's ``write`` puts it, not after the bar's text on its line. Returns the streams to put back."""
        streams = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _AboveTheBar(self._print, sys.stdout), _AboveTheBar(self._print, sys.stderr)
        return streams

    def _make_bar(self):
        from tqdm import tqdm

        # A terminal that reports no size (a pseudo-terminal nobody sized, as `script` or an IDE gives)
        # reads as 0 columns and 0 rows, and tqdm then draws nothing at all: follow the size only where
        # there is one.
        sized = _terminal_columns(self._out) > 0
        return tqdm(total=self._steps, initial=self._first, unit="step", file=self._out, leave=True,
                    dynamic_ncols=sized, ncols=None if sized else FALLBACK_COLUMNS,
                    nrows=None if sized else FALLBACK_ROWS,
                    mininterval=BAR_REFRESH_S,
                    bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]")


class _AboveTheBar(LineStream):
    """A text stream whose complete lines go to ``print_line`` (the bar's write): Note [lines above the bar].

    A partial line waits for its newline, or for `flush_line` when the bar closes: a line above the bar is
    written whole. Example::

        >>> lines = []; s = _AboveTheBar(lines.append, sys.stdout); _ = s.write("a\\nb"); _ = s.write("c\\n")
        >>> lines
        ['a', 'bc']
    """

    def __init__(self, print_line, inner: IO[str]):
        super().__init__(inner)
        self._print_line = print_line

    def _write_lines(self, lines: list[str]) -> None:
        for line in lines:
            self._print_line(line)

    def flush_line(self) -> None:
        if partial := self._take_partial():
            self._print_line(partial)


def _bar_text(record: dict[str, Any]) -> str:
    unit = "tokens" if "tokens" in record else "samples"
    rate = record[f"{unit}_per_s"]
    peaks = [b / MIB for b in record["peak_memory_bytes"]]
    peak = f"{peaks[0]:.0f}" if len(set(round(p) for p in peaks)) == 1 else f"{min(peaks):.0f}-{max(peaks):.0f}"
    return (f"loss {record['loss']:.4f}, {_si(rate)} {'tok' if unit == 'tokens' else 'samples'}/s, "
            f"{record['step_time_s'] * 1e3:.0f} ms/step, peak {peak} MiB/rank")


def _si(value: float) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.1f}{suffix}"
    return f"{value:.1f}"


def _terminal_columns(stream: IO[str]) -> int:
    """The width of the terminal behind ``stream``; 0 when it reports none."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
        return 0


def print_while_read(*args, **kwargs) -> None:
    """``print``, flushed; once the reader of the stream has gone (`shardlang run ... | head`), nothing: the
    run goes on without its console rather than fail on a closed pipe."""
    try:
        print(*args, **kwargs, flush=True)
    except BrokenPipeError:
        _silenced(kwargs.get("file") or sys.stdout)


def _silenced(out):
    """A stream to devnull in place of ``out``, whose reader closed the pipe; ``out``'s own descriptor, when it has
    one, points at devnull too, so no later flush (the interpreter's at exit) raises again."""
    devnull = open(os.devnull, "w")  # noqa: SIM115 - it lives as long as the process
    try:
        os.dup2(devnull.fileno(), out.fileno())
    except (AttributeError, OSError, ValueError):  # no descriptor of its own: a StringIO, a closed stream
        pass
    return devnull
