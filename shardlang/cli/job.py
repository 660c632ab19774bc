"""Job files: a model, its loss and its data in one plain Python file, loaded by path.

A job file defines these module-level names (docs/cli.md, "Job files")::

    def build_model() -> torch.nn.Module: ...        # after torch.manual_seed(seed); may build on torch.device('meta')
    def loss_fn(model, batch) -> torch.Tensor: ...   # scalar loss, mean-reduced over the (per-rank) batch
    def make_batch(step: int): ...                   # the GLOBAL batch for `step`: a tensor or pytree of tensors
    data = DataLoader(...)                           # or, instead of make_batch: an iterable of global batches
    spec = sl.Spec(mesh=sl.Mesh(fsdp=-1))            # optional (this is the default)
    optimizer = sl.AdamW(lr=1e-3)                    # optional (this is the default)
    dtype = torch.float32                            # optional: convert the model and floating batch leaves
    lr_schedule = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, f)   # optional (docs/training.md)
    def make_eval_batch(step: int): ...              # optional: the GLOBAL validation batch (`run --eval-every`)
    def init_weights(module) -> None: ...            # optional: initialise a meta-built model's modules
    weights = "checkpoints/model"                    # optional: safetensors file or HF checkpoint directory

`load_job` imports the file under a module name of its own (so two job files
with the same stem do not collide) and checks those names, and `build` and
`global_batch` apply the seed and the dtype the same way on every rank and in
the single-process reference. `reference_optimizer` maps shardlang's optimizer
descriptors to the `torch.optim` optimizer with the same semantics.

Example::

    job = load_job("examples/mlp.py")
    model = build(job, seed=0)
    loss = job.loss_fn(model, global_batch(job, 0))
"""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import re
import sys
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import attrs
import torch
from torch.utils import _pytree as pytree

from ..compiler import Adam, AdamW, SGD
from ..data.loaders import LoaderBatches
from ..errors import ShardlangError, SpecError
from ..step.materialize import Init, has_meta, materialize_module
from ..spec.mesh import Mesh
from ..step.ownership import convert_floating
from ..spec.spec import Spec

JOB_FORM = """\
a job file defines, at module level:
    def build_model() -> torch.nn.Module: ...
    def loss_fn(model, batch) -> torch.Tensor: ...
    def make_batch(step: int): ...            # the global batch for `step` (or sl.data.tokens(DIR, ...))
    data = DataLoader(...)                    # instead of make_batch: an iterable of global batches
    spec = sl.Spec(mesh=sl.Mesh(fsdp=-1))     # optional
    optimizer = sl.AdamW(lr=1e-3)             # optional
    dtype = torch.float32                     # optional
    def init_weights(module) -> None: ...     # optional (a model built on the meta device)
    weights = "model.safetensors"             # optional (pretrained weights)"""

# name -> (positional arguments it is called with, the form shown in errors)
_FUNCTIONS = {
    "build_model": (0, "def build_model() -> torch.nn.Module"),
    "loss_fn": (2, "def loss_fn(model, batch) -> torch.Tensor"),
    "make_batch": (1, "def make_batch(step: int)"),
}
_module_ids = itertools.count()


def default_spec() -> Spec:
    """The spec of a job file that defines none: every parameter sharded flat over all ranks."""
    return Spec(mesh=Mesh(fsdp=-1))


def default_optimizer() -> AdamW:
    """The optimizer of a job file that defines none."""
    return AdamW(lr=1e-3)


@attrs.frozen
class Job:
    """A loaded job file: what to build, what to minimise, on which data, sharded how.

    ``dtype`` is None when the file does not set one (the model keeps the dtype it is built in).

    Example::

        job = load_job("examples/gpt.py")
        job.spec        # Spec(mesh=Mesh(fsdp=-1), ...)
    """

    path: Path
    build_model: Callable[[], torch.nn.Module]
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]
    make_batch: Callable[[int], Any]
    spec: Spec = attrs.field(factory=default_spec)
    optimizer: SGD | Adam | AdamW = attrs.field(factory=default_optimizer)
    dtype: torch.dtype | None = None
    lr_schedule: Callable | None = None  # torch optimizer -> LRScheduler (`shardlang.step.lr`)
    init_weights: Callable[[torch.nn.Module], None] | None = None  # `shardlang.step.materialize.Init`
    weights: Path | None = None  # pretrained weights (`shardlang.step.weights`), resolved against the job's directory
    make_eval_batch: Callable[[int], Any] | None = None  # the global validation batch after `step` steps


def load_job(path: str | Path, spec_file: str | Path | None = None) -> Job:
    """Import the job file at ``path`` and check the names it must define.

    ``spec_file`` (the command line's ``--spec``, e.g. what ``shardlang tune`` wrote) is a TOML spec
    that replaces the job's ``spec``.

    Raises `SpecError` when the file does not exist, fails to import (the
    message carries the original error and the line of the job file it came
    from), or lacks a required name or defines one of the wrong kind.

    Example::

        >>> load_job("examples/mlp.py").optimizer
        SGD(lr=0.05, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False)
    """
    file = Path(path)
    if not file.is_file():
        where = "is a directory" if file.is_dir() else "does not exist"
        raise SpecError(f"job file {str(path)!r} {where} (looked at {file.resolve()}); "
                        "give the path of a Python file, e.g. examples/mlp.py")
    file = file.resolve()
    module = _import_file(file, shown=str(path))
    job = _job_from_module(module, file, shown=str(path))
    return job if spec_file is None else attrs.evolve(job, spec=read_spec_file(spec_file))


def read_spec_file(path: str | Path) -> Spec:
    """The spec of the TOML file ``path`` (its ``[shardlang]`` table, or the whole file); a `SpecError` names it."""
    file = Path(path)
    if not file.is_file():
        raise SpecError(f"--spec {str(path)!r} does not exist (looked at {file.resolve()}); give a spec TOML file, "
                        "e.g. one written by `shardlang tune` or by Spec.to_toml()")
    return Spec.from_toml(file)


def build(job: Job, seed: int = 0, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """``job.build_model()`` under ``torch.manual_seed(seed)``, converted to ``dtype`` (default: the job's).

    Every rank and the single-process reference build through here, so they start from
    the same weights. Raises `SpecError` when ``build_model`` returns something else
    than an ``nn.Module``.

    Example::

        model = build(load_job("examples/mlp.py"), seed=0, dtype=torch.float64)
    """
    torch.manual_seed(seed)
    model = _call(job, "build_model")
    if not isinstance(model, torch.nn.Module):
        raise SpecError(f"build_model() in {job.path} returned {type(model).__name__}, not a torch.nn.Module; "
                        f"expected: {_FUNCTIONS['build_model'][1]}")
    if dtype or job.dtype:
        convert_floating(model, dtype or job.dtype)
    check_vocabulary(job, model)
    return model


def init_of(job: Job, seed: int = 0, weights: str | Path | None = None) -> Init:
    """How ``job``'s model gets its initial values: the seed, its ``init_weights``, ``weights`` or its own.

    ``weights`` (the command line's ``--weights``) overrides the job file's.
    """
    return Init(seed=seed, init_weights=job.init_weights, weights=weights or job.weights)


def build_reference(job: Job, seed: int = 0, dtype: torch.dtype | None = None,
                    weights: str | Path | None = None) -> torch.nn.Module:
    """The model one process trains as the reference: `build`, then whole values where it has none.

    A model built on the meta device is materialised whole through the same
    per-module initialisation the ranks shard (Note [initial values]); with
    weights, the parameters are loaded from them. So ``check`` compares against
    the weights every rank starts from.

    Example::

        reference = build_reference(load_job("examples/gpt.py"), seed=0)   # real tensors, whole
    """
    model = build(job, seed, dtype)
    init = init_of(job, seed, weights)
    if has_meta(model) or init.weights is not None:
        materialize_module(model, init)
    return model


def global_batch(job: Job, step: int, dtype: torch.dtype | None = None, evaluation: bool = False):
    """``job.make_batch(step)`` with its floating-point leaves converted to ``dtype`` (default: the job's).

    Integer leaves (token ids, class labels) are left alone.

    Example::

        x, y = global_batch(load_job("examples/mlp.py"), 0, torch.float64)
    """
    return converted(job, _call(job, "make_eval_batch" if evaluation else "make_batch", step), dtype)


def converted(job: Job, batch, dtype: torch.dtype | None = None):
    """``batch`` with its floating-point leaves converted to ``dtype`` (default: the job's); integers left alone."""
    dtype = dtype or job.dtype
    if dtype is None:
        return batch
    return pytree.tree_map(
        lambda leaf: leaf.to(dtype) if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() else leaf, batch
    )


def check_vocabulary(job: Job, model: torch.nn.Module) -> None:
    """Refuse data whose vocabulary is larger than the model's input embedding (ids past its rows).

    The job's batch makers that know their vocabulary (``sl.data.tokens``: ``vocab_size``) are checked
    against the model's input embedding: ``get_input_embeddings()`` (Hugging Face), else its first
    ``nn.Embedding``. A model built on meta is checked by shape alone.
    """
    makers = [m for m in (job.make_batch, job.make_eval_batch) if isinstance(getattr(m, "vocab_size", None), int)]
    if not makers:
        return
    name, embedding = _input_embedding(model)
    if embedding is None:
        return
    for maker in makers:
        if maker.vocab_size > embedding.num_embeddings:
            where = getattr(maker, "path", None) or repr(maker)
            raise SpecError(f"job file {str(job.path)!r}: the data's vocabulary ({where}) has {maker.vocab_size} "
                            f"tokens, more than the {embedding.num_embeddings} rows of the model's input embedding "
                            f"{name!r}; ids up to {maker.vocab_size - 1} would index past it. Build the model with a "
                            f"vocabulary of at least {maker.vocab_size}, or prepare the data with a smaller tokenizer")


def _input_embedding(model: torch.nn.Module) -> tuple[str, torch.nn.Embedding | None]:
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        try:
            found = get()
        except (NotImplementedError, AttributeError):
            found = None
        if isinstance(found, torch.nn.Embedding):
            return next((n for n, m in model.named_modules() if m is found), "input embedding"), found
    return next(((n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)), ("", None))


def reference_optimizer(opt: SGD | Adam | AdamW, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The ``torch.optim`` optimizer with the semantics of shardlang's ``opt``, over ``params``.

    ``params`` are parameters, or torch param-group dicts (`shardlang.spec.training.torch_param_groups`).

    Used by ``shardlang check`` as the single-process reference.

    Example::

        model = build(job)
        torch_opt = reference_optimizer(job.optimizer, model.parameters())   # e.g. torch.optim.AdamW
    """
    params = list(params)
    kind = type(opt)  # exact type: AdamW is a subclass of Adam
    if kind is SGD:
        return torch.optim.SGD(params, lr=opt.lr, momentum=opt.momentum, dampening=opt.dampening,
                               weight_decay=opt.weight_decay, nesterov=opt.nesterov)
    if kind is Adam:
        return torch.optim.Adam(params, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)
    if kind is AdamW:
        return torch.optim.AdamW(params, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)
    raise SpecError(f"optimizer {opt!r} has no torch.optim reference; expected sl.SGD, sl.Adam or sl.AdamW")


def _call(job: Job, name: str, *args):
    """``job.<name>(*args)``; an exception it raises becomes a `SpecError` naming the job file's line."""
    try:
        return getattr(job, name)(*args)
    except ShardlangError:
        raise
    except Exception as exc:
        call = f"{name}({', '.join(map(repr, args))})"
        raise SpecError(f"job file {str(job.path)!r}: {call} raised {_describe(exc, job.path)}") from exc


def _import_file(file: Path, shown: str):
    """Execute ``file`` as a fresh module registered under a unique name (dataclasses and pickle look it up)."""
    stem = re.sub(r"\W", "_", file.stem)
    name = f"_shardlang_job_{stem}_{next(_module_ids)}"
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise SpecError(f"job file {shown!r} cannot be imported as Python (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    # Like `python FILE`: the file's directory is importable while it runs (helpers next to the job).
    directory = str(file.parent)
    added = directory not in sys.path
    if added:
        sys.path.insert(0, directory)
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:
        del sys.modules[name]
        if not isinstance(exc, Exception):
            raise  # KeyboardInterrupt, SystemExit
        raise SpecError(f"job file {shown!r} failed to import: {_describe(exc, file)}") from exc
    finally:
        if added:
            sys.path.remove(directory)
    return module


def _describe(exc: Exception, file: Path) -> str:
    """``Type: message`` plus the line of the job file the error came from."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, SyntaxError):
        return text  # its message already names the file and line
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename) == file]
    if frames:
        text += f" (at line {frames[-1].lineno}: {frames[-1].line})"
    return text


def _job_from_module(module, file: Path, shown: str) -> Job:
    data = getattr(module, "data", None)
    if data is not None and hasattr(module, "make_batch"):
        raise SpecError(f"job file {shown!r} defines both make_batch and data; define one: make_batch(step) gives "
                        "global batch `step`, data is an iterable of global batches (a DataLoader)")
    given = {*vars(module), *(["make_batch"] if data is not None else [])}
    missing = [name for name in _FUNCTIONS if name not in given]
    if missing:
        names = ", ".join(missing)
        raise SpecError(f"job file {shown!r} does not define {names}; {JOB_FORM}")
    make_batch = LoaderBatches(data, f"job file {shown!r}: data") if data is not None else module.make_batch
    for name, (nargs, form) in _FUNCTIONS.items():
        _check_function(make_batch if name == "make_batch" else getattr(module, name), name, nargs, form, shown)
    spec = getattr(module, "spec", None)
    if spec is None:
        spec = default_spec()
    elif not isinstance(spec, Spec):
        raise SpecError(f"job file {shown!r}: spec is {type(spec).__name__} {spec!r}, not a shardlang.Spec; "
                        "expected e.g. spec = sl.Spec(mesh=sl.Mesh(fsdp=-1))")
    optimizer = getattr(module, "optimizer", None)
    if optimizer is None:
        optimizer = default_optimizer()
    elif type(optimizer) not in (SGD, Adam, AdamW):
        raise SpecError(f"job file {shown!r}: optimizer is {type(optimizer).__name__} {optimizer!r}; "
                        "expected sl.SGD(...), sl.Adam(...) or sl.AdamW(...), e.g. optimizer = sl.AdamW(lr=1e-3)")
    dtype = getattr(module, "dtype", None)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise SpecError(f"job file {shown!r}: dtype is {dtype!r}; expected a floating torch.dtype, "
                        "e.g. dtype = torch.float32")
    lr_schedule = getattr(module, "lr_schedule", None)
    if lr_schedule is not None and not callable(lr_schedule):
        raise SpecError(f"job file {shown!r}: lr_schedule is {_short(lr_schedule)}, not a function; expected e.g. "
                        "lr_schedule = lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)")
    init_weights = getattr(module, "init_weights", None)
    if init_weights is not None:
        _check_function(init_weights, "init_weights", 1, "def init_weights(module: torch.nn.Module) -> None", shown)
    weights = getattr(module, "weights", None)
    if weights is not None:
        if not isinstance(weights, (str, Path)):
            raise SpecError(f"job file {shown!r}: weights is {_short(weights)}; expected the path of a safetensors "
                            "file or of a Hugging Face checkpoint directory, e.g. weights = 'checkpoints/gpt'")
        weights = file.parent / Path(weights).expanduser()
    make_eval_batch = getattr(module, "make_eval_batch", None)
    if make_eval_batch is not None:
        _check_function(make_eval_batch, "make_eval_batch", 1, "def make_eval_batch(step: int)", shown)
    return Job(file, module.build_model, module.loss_fn, make_batch, spec, optimizer, dtype, lr_schedule,
               init_weights, weights, make_eval_batch)


def _check_function(value, name: str, nargs: int, form: str, shown: str) -> None:
    """``value`` must be callable with ``nargs`` positional arguments."""
    if not callable(value):
        raise SpecError(f"job file {shown!r}: {name} is {type(value).__name__} {_short(value)}, not a function; "
                        f"expected: {form}")
    try:
        signature = inspect.signature(value)
    except (TypeError, ValueError):
        return  # a builtin or C callable: nothing to check
    try:
        signature.bind(*range(nargs))
    except TypeError:
        raise SpecError(f"job file {shown!r}: {name}{signature} cannot be called with {nargs} positional "
                        f"argument{'' if nargs == 1 else 's'}; expected: {form}") from None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
