"""Where in the user's code a traced op, or a tracing failure, came from.

A trace or compile error is only useful if it points at the user's line and
module, not at fake-tensor internals. Three sources feed a `UserSite`:

- a failure during `make_fx`: the exception's traceback, whose innermost frame
  outside torch, shardlang and the standard library is the user's line, and
  whose innermost frame with a ``self`` among the model's modules names the
  module (`site_of_exception`);
- a node of the traced graph: ``meta["stack_trace"]`` and
  ``meta["custom"]["module"]``, which `tracing_sites` sets while tracing from
  a torch function mode and a global forward pre-hook (`site_of_node`);
- a pass that failed while visiting a node: the innermost frame of its
  traceback with a local ``node`` of the graph (`failing_node`).

`advice_for` turns the common causes into what to do. Example::

    site = site_of_exception(exc, module_names(model))
    print(site)   # model.py:42 in forward, module 'blocks.0.attn' (Attention)
"""

from __future__ import annotations

import contextlib
import functools
import linecache
import os
import re
import sys
import sysconfig
import traceback
import types
from collections.abc import Iterator

import attrs
import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch.overrides import TorchFunctionMode

#: ``meta["custom"]`` keys set by `tracing_sites` on every node made inside a module's forward.
MODULE_KEY = "module"
MODULE_TYPE_KEY = "module_type"

_HERE = os.path.dirname(os.path.abspath(__file__))
_PARENT = os.path.dirname(_HERE)
#: torch, the compiler and the front end (installed around the compiler, or next to it in a checkout).
_LIBRARY_DIRS = tuple(
    os.path.realpath(d) + os.sep
    for d in (
        os.path.dirname(torch.__file__),
        _HERE,
        _PARENT if os.path.basename(_PARENT) == "shardlang" else os.path.join(_PARENT, "shardlang"),
    )
)
#: The standard library; installed packages below it (site-packages) count as user code: models live there.
_STDLIB_DIRS = tuple({os.path.realpath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib")})


@attrs.frozen
class UserSite:
    """A line of the user's code and the module running it.

    ``module`` is the name in ``model.named_modules()`` ('' for the model
    itself), None when the line ran outside any of the model's modules (in
    ``loss_fn``, say).

    Example::

        UserSite("model.py", 42, "forward", "if h.sum() > 0:", "blocks.0", "Block")
        # model.py:42 in forward, module 'blocks.0' (Block)
    """

    file: str | None
    line: int | None
    function: str | None = None
    code: str | None = None
    module: str | None = None
    module_type: str | None = None

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.file else "an unknown line"
        if self.function:
            where += f" in {self.function}"
        if self.module is not None:
            where += f", module {self.module!r}" if self.module else ", the model's root module"
            if self.module_type:
                where += f" ({self.module_type})"
        else:
            where += ", outside the model's modules"
        return where + (f"\n    {self.code}" if self.code else "")


@functools.lru_cache(maxsize=4096)
def is_user_file(filename: str) -> bool:
    """True unless ``filename`` is part of torch, shardlang or the standard library, or generated code."""
    if not filename or filename.startswith("<"):
        return False
    path = os.path.realpath(filename)
    if path.startswith(_LIBRARY_DIRS):
        return False
    return not any(path.startswith(d) and "site-packages" not in path[len(d):] for d in _STDLIB_DIRS)


def module_names(model: torch.nn.Module) -> dict[int, tuple[str, str]]:
    """``id(module) -> (name, type name)`` for every module of ``model``."""
    return {id(m): (name, type(m).__name__) for name, m in model.named_modules(remove_duplicate=False)}


def site_of_exception(exc: BaseException, modules: dict[int, tuple[str, str]]) -> UserSite | None:
    """The innermost user line in ``exc``'s traceback, with the innermost module of ``modules`` running there."""
    frames = [frame for frame, _ in traceback.walk_tb(exc.__traceback__)]
    return _site_of_frames(frames, modules) or site_of_backward_failure(exc)


def partial_graph(exc: BaseException) -> fx.Graph | None:
    """The graph make_fx had recorded when it raised ``exc``, from the tracer on the traceback."""
    return next((v.graph for frame, _ in traceback.walk_tb(exc.__traceback__) for v in frame.f_locals.values()
                 if isinstance(v, fx.Tracer) and isinstance(getattr(v, "graph", None), fx.Graph)), None)


def site_of_backward_failure(exc: BaseException) -> UserSite | None:
    """For an error raised inside autograd's backward (no user frame): the forward op it is about.

    The partial graph is read from the make_fx tracer on the traceback; the
    op is the one the message names (an op without a backward formula), or the
    in-place op that overwrote "output 0 of Exp" that backward needed.
    """
    graph = partial_graph(exc)
    if graph is None:
        return None
    text = str(exc)
    overwritten = re.search(r"modified by an inplace operation: .* output \d+ of (\w+?)(?:Backward\d*)?,", text)
    for node in reversed(list(graph.nodes)):
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if overwritten:
            base = _written_base(node)
            if base is not None and _op_matches(base, overwritten[1]):
                return site_of_node(node)
        elif str(node.target) in text or node.target.name().replace("::", ".") in text:
            return site_of_node(node)
    return None


def _written_base(node: fx.Node) -> fx.Node | None:
    arguments = node.target._schema.arguments
    if not arguments or arguments[0].alias_info is None or not arguments[0].alias_info.is_write:
        return None
    base = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    while base is not None and base.op == "call_function" and isinstance(base.target, torch._ops.OpOverload) \
            and base.target.is_view and isinstance(base.args[0], fx.Node):
        base = base.args[0]
    return base


def _op_matches(node: fx.Node, autograd_name: str) -> bool:
    """``autograd_name`` is autograd's name for the op (``Exp``, ``Addmm``): the op name without underscores."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return False
    return node.target._opname.replace("_", "").lower() == autograd_name.lower()


def site_of_stack(modules: dict[int, tuple[str, str]], skip: int = 1) -> UserSite | None:
    """The innermost user line of the current call stack (for hooks that fire during tracing)."""
    frames, frame = [], sys._getframe(skip)
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return _site_of_frames(frames[::-1], modules)


def _site_of_frames(frames: list[types.FrameType], modules) -> UserSite | None:
    """``frames`` outermost first."""
    user = next((f for f in reversed(frames) if is_user_file(f.f_code.co_filename)), None)
    if user is None:
        return None
    module = next((modules[id(f.f_locals["self"])] for f in reversed(frames)
                   if id(f.f_locals.get("self")) in modules), (None, None))
    line = user.f_lineno
    code = _source_line(user.f_code.co_filename, line)
    return UserSite(user.f_code.co_filename, line, user.f_code.co_name, code, *module)


def _source_line(filename: str, line: int) -> str | None:
    return linecache.getline(filename, line).strip() or None


_STACK_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)\n(?P<code>[^\n]*)')


def site_of_node(node: fx.Node) -> UserSite | None:
    """The user line that made ``node`` (from its recorded stack trace) and the module it ran in."""
    custom = node.meta.get("custom", {})
    frames = [m for m in _STACK_FRAME.finditer(node.meta.get("stack_trace") or "") if is_user_file(m["file"])]
    if not frames and MODULE_KEY not in custom:
        return None
    last = frames[-1] if frames else None
    return UserSite(
        last["file"] if last else None, int(last["line"]) if last else None, last["function"] if last else None,
        last["code"].strip() or None if last else None, custom.get(MODULE_KEY), custom.get(MODULE_TYPE_KEY),
    )


def failing_node(exc: BaseException, graph: fx.Graph) -> fx.Node | None:
    """The node of ``graph`` a pass was visiting when it raised ``exc``: the innermost frame's local ``node``."""
    for frame, _ in reversed(list(traceback.walk_tb(exc.__traceback__))):
        for name in ("node", "n"):
            value = frame.f_locals.get(name)
            if isinstance(value, fx.Node) and value.graph is graph:
                return value
    return None


@attrs.define
class TracingSites:
    """What `tracing_sites` saw: the modules built while tracing (type, parameter names, the user line)."""

    built: dict[int, tuple[str, list[str], UserSite | None]] = attrs.field(factory=dict)

    def add(self, module_id: int, kind: str, parameter: str | None, site: UserSite | None) -> None:
        entry = self.built.setdefault(module_id, (kind, [], site))
        if parameter is not None:
            entry[1].append(parameter)

    @property
    def first_site(self) -> UserSite | None:
        return next(iter(self.built.values()))[2] if self.built else None

    def describe_built(self) -> str | None:
        """What to do about the modules built under the tracer; None when there were none."""
        if not self.built:
            return None
        kind, names, site = next(iter(self.built.values()))
        if names:
            kind += f" (parameters {', '.join(map(repr, names))})"
        if len(self.built) > 1:
            kind += f" (and {len(self.built) - 1} more modules)"
        return ("build modules once, outside loss_fn (in the model's __init__, or before sl.compile), and call "
                f"them from the model. A {kind} was built while the step was being traced, at {site}\n"
                "Everything that runs under the tracer is repeated at every step, so a module built there gets "
                "fresh random weights at each step and is never trained")


class _UserLines(TorchFunctionMode):
    """Sets ``meta["stack_trace"]`` for the nodes a torch call makes to the user line that made the call.

    Cheaper than make_fx's ``record_stack_traces`` (one short frame walk per
    torch call, not a formatted stack per node), and it keeps lines in
    ``loss_fn``, which make_fx's filter (frames named ``forward`` only) drops.
    Nested torch calls run with this mode off, so the outermost call's line wins.
    """

    def __init__(self):
        super().__init__()
        # frames that were running when tracing began: the caller of sl.compile is not a line of the step
        self._outside = set()
        frame = sys._getframe(1)
        while frame is not None:
            self._outside.add(id(frame))
            frame = frame.f_back

    def __torch_function__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)
        while frame is not None and id(frame) not in self._outside and not is_user_file(frame.f_code.co_filename):
            frame = frame.f_back
        if frame is not None and id(frame) in self._outside:
            frame = None
        meta = fx_traceback.current_meta
        old = meta.get("stack_trace")
        if frame is not None:
            code = _source_line(frame.f_code.co_filename, frame.f_lineno) or ""
            meta["stack_trace"] = (f'File "{frame.f_code.co_filename}", line {frame.f_lineno}, in '
                                   f"{frame.f_code.co_name}\n    {code}")
        else:
            meta.pop("stack_trace", None)
        try:
            return func(*args, **(kwargs or {}))
        finally:
            if old is None:
                meta.pop("stack_trace", None)
            else:
                meta["stack_trace"] = old


@contextlib.contextmanager
def tracing_sites(model: torch.nn.Module) -> Iterator[TracingSites]:
    """While tracing ``model``: tag nodes with the user line and module that made them; record modules built.

    Global module hooks, removed on exit: a forward pre-hook sets
    ``meta["custom"]["module"]`` and the forward hook puts back what was there
    (after an exception, the enclosing ``annotate`` restores the meta).
    """
    modules = module_names(model)
    sites = TracingSites()
    # the module keys each running forward replaced; restored by hand, not by annotate(), whose generator, left
    # open by an exception, would restore stale meta whenever it is garbage-collected
    replaced: list[dict] = []

    def enter(module, args):
        if id(module) in modules:
            custom = fx_traceback.current_meta.setdefault("custom", {})
            replaced.append({k: custom[k] for k in (MODULE_KEY, MODULE_TYPE_KEY) if k in custom})
            custom[MODULE_KEY], custom[MODULE_TYPE_KEY] = modules[id(module)]

    def leave(module, args, output):
        if id(module) in modules and replaced:
            custom = fx_traceback.current_meta.setdefault("custom", {})
            custom.pop(MODULE_KEY, None)
            custom.pop(MODULE_TYPE_KEY, None)
            custom.update(replaced.pop())

    def built(module, name, param):
        if param is not None:
            sites.add(id(module), type(module).__name__, name, site_of_stack(modules, skip=2))

    handles = [
        torch.nn.modules.module.register_module_forward_pre_hook(enter),
        torch.nn.modules.module.register_module_forward_hook(leave),
        torch.nn.modules.module.register_module_parameter_registration_hook(built),
    ]
    try:
        with _UserLines():
            yield sites
    finally:
        for handle in handles:
            handle.remove()


def advice_for(exc: BaseException) -> str | None:
    """What to do about ``exc``, for the common causes of a failed trace; None when it is not one of them."""
    text = f"{type(exc).__name__}: {exc}"
    for pattern, advice in _ADVICE:
        if re.search(pattern, text):
            return advice
    return None


_ADVICE = (
    (r"DataDependentOutputException|_local_scalar_dense|GuardOnDataDependentSymNode|data-dependent",
     "the step reads a tensor's value in Python (.item(), .tolist(), float(t), int(t), `if t:` or a loop on a "
     "tensor) while it is traced with fake tensors, which have shapes but no values. Keep the decision in "
     "tensor ops (torch.where, a multiplied mask, clamp), or compute the value outside loss_fn and pass it in "
     "as a Python constant or in the batch"),
    (r"DynamicOutputShapeException",
     "an op's output shape depends on tensor values (nonzero, boolean-mask indexing x[mask], masked_select, "
     "unique), and the step is traced once for fixed shapes. Use a fixed-shape form: torch.where(mask, x, 0), "
     "x * mask, or a padded index"),
    (r"a leaf Variable that requires grad is being used in an in-place operation",
     "the model changes a parameter in place (w.mul_(...), w.copy_(...)) inside the step. Parameters are "
     "inputs of the traced step and are sharded: compute a new tensor instead (w = w * s), or change the "
     "parameter outside the step"),
    (r"modified by an inplace operation",
     "an in-place op overwrote a value that backward still needs. Use the out-of-place form (x = x * 2 "
     "instead of x.mul_(2), inplace=False on activations)"),
    (r"\.numpy\(\) is not supported|Cannot access data pointer|data_ptr",
     "the step converts a tensor to numpy or reads its memory while it is traced with fake tensors, which have "
     "no data. Keep the computation in torch ops, or do it outside loss_fn"),
    (r"UnsupportedOperatorException|[Nn]o (fake|meta) (impl|kernel)|Meta' backend|not implemented for 'Meta'",
     "an op in the step has no fake-tensor (meta) implementation, so it cannot be traced. Register one with "
     "torch.library.register_fake, or replace the op with supported torch ops"),
    (r"derivative for .* is not implemented|no autograd formula",
     "an op in the step has no backward formula. Replace it with differentiable torch ops, or wrap it in a "
     "torch.autograd.Function with a backward"),
    (r"not linked with support for cuda|Expected all tensors to be on the same device",
     "the step moves tensors between devices itself. Leave placement to shardlang: drop .cuda() / .to(device) "
     "from the model's forward and loss_fn; the step places the batch on the rank's device"),
)


def _module_under_construction(exc: BaseException, modules) -> tuple[str, UserSite | None] | None:
    """The outermost ``nn.Module.__init__`` on ``exc``'s traceback, and the user line that called it."""
    frames = [frame for frame, _ in traceback.walk_tb(exc.__traceback__)]
    for i, frame in enumerate(frames):
        if frame.f_code.co_name == "__init__" and isinstance(frame.f_locals.get("self"), torch.nn.Module):
            return type(frame.f_locals["self"]).__name__, _site_of_frames(frames[:i], modules)
    return None


def trace_error(exc: BaseException, model: torch.nn.Module, sites: TracingSites):
    """A `TraceError` for ``exc`` raised under make_fx: the user's line and module, the cause, what to do."""
    from shardlang.errors import TraceError

    modules = module_names(model)
    site = site_of_exception(exc, modules)
    building = _module_under_construction(exc, modules)
    if building is not None:  # the failure itself happened while building: name that module first
        sites.built = {0: (building[0], [], building[1]), **sites.built}
    where = f" at {site}" if site else ""
    advice = sites.describe_built() or advice_for(exc)
    message = f"tracing the training step failed{where}\n{type(exc).__name__}: {exc}"
    if advice:
        message += f"\nwhat to do: {advice}"
    return TraceError(message, site=site)
