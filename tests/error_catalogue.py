"""The catalogue of bad inputs: one table, from which docs/errors.md is written and the tests are drawn.

Each `BadInput` is something a user gets wrong, the code that tries it, the
error it must raise and the fragments its message must contain: the offending
value, where it came from, and what would be valid. `tests/test_errors.py`
runs every entry and checks that docs/errors.md lists exactly these ids with
messages that still contain the fragments. Rewrite the page after changing the
table or a message::

    python tests/error_catalogue.py > docs/errors.md

Job files are written to a temporary folder, shown as ``<tmp>`` in the page, so
their line numbers in messages are stable.
"""

from __future__ import annotations

import contextlib
import io
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import shardlang as sl
from shardlang.step.batch import split_batch
from shardlang.cli import main as cli_main
from shardlang.cli.job import load_job
from shardlang.runtime.dist import DistContext, init_from_env
from shardlang.runtime.worker_pool import WorkerPool


_ROOT = str(Path(__file__).resolve().parents[1]) + "/"  # the checkout, left out of paths in messages


class CommandLineError(Exception):
    """What ``shardlang ...`` printed on stderr when it exited with code 2 (bad input)."""


class TrainingStopped(Exception):
    """What ``shardlang run ...`` printed on stderr when training stopped with exit code 1."""


@dataclass(frozen=True)
class BadInput:
    id: str
    area: str
    tried: str  # the input: code, or words with the code in backticks
    run: Callable[[Path], object]  # tries it, given a fresh temporary folder
    error: type[BaseException]
    names: tuple[str, ...]  # what the message must name


def message_of(entry: BadInput, tmp: Path) -> str:
    """The message ``entry`` produces (``tmp`` shown as ``<tmp>``); AssertionError if it raises nothing or else."""
    try:
        entry.run(tmp)
    except entry.error as exc:
        return str(exc).replace(str(tmp), "<tmp>").replace(_ROOT, "").strip()
    raise AssertionError(f"{entry.id}: {entry.tried} raised no {entry.error.__name__}")


# ---- helpers the entries use --------------------------------------------------------------------------------------


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def mse(model, batch):
    x, y = batch
    return (model(x) - y).pow(2).mean()


BATCH = (torch.randn(6, 4, generator=torch.Generator().manual_seed(0)), torch.randn(6, 2, generator=torch.Generator().manual_seed(1)))


def plan(*, model=mlp, loss_fn=mse, batch=BATCH, spec=None, world=1):
    return sl.plan(model, loss_fn, spec or sl.Spec(sl.Mesh(fsdp=world)), optimizer=sl.SGD(lr=0.1),
                   example_batch=batch, world_size=world)


def step(*, d_in: int = 4, wider: bool = False, dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    layers = [nn.Linear(d_in, 8), nn.ReLU(), nn.Linear(8, 2)] + ([nn.Linear(2, 2)] if wider else [])
    batch = (torch.randn(6, d_in, dtype=dtype), BATCH[1].to(dtype))
    return sl.compile(nn.Sequential(*layers).to(dtype), mse, sl.Spec(sl.Mesh(fsdp=1)), optimizer=sl.SGD(lr=0.1),
                      example_batch=batch)


def _saved(tmp: Path) -> Path:
    """A checkpoint of `step()` after one step."""
    saving = step()
    saving(BATCH)
    saving.save(tmp / "step-1")
    return tmp / "step-1"


def _damaged(path: Path) -> Path:
    data = path / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-100])
    return path


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


class _Payload:
    """Unpickling this would run ``os.system``: what a crafted checkpoint file holds."""

    def __reduce__(self):
        import os

        return (os.system, ("echo this never runs",))


def _crafted(tmp: Path) -> Path:
    """A checkpoint whose .metadata is a crafted pickle, its manifest recomputed to match."""
    import json
    import pickle

    from shardlang.checkpoint import store

    path = _saved(tmp)
    (path / ".metadata").write_bytes(pickle.dumps(_Payload()))
    manifest = json.loads((path / store.MANIFEST).read_text())
    manifest["files"] = store.describe(sorted(p for p in path.iterdir() if p.is_file() and p.name != store.MANIFEST))
    (path / store.MANIFEST).write_text(json.dumps(manifest))
    return path


def _outside_manifest(tmp: Path) -> Path:
    import json

    from shardlang.checkpoint import store

    path = _saved(tmp)
    manifest = json.loads((path / store.MANIFEST).read_text())
    manifest["files"]["../../etc/passwd"] = {"bytes": 1, "xxh3_64": 0}
    (path / store.MANIFEST).write_text(json.dumps(manifest))
    return path


def _weights(tmp: Path, dtype: torch.dtype) -> str:
    """A safetensors file of `mlp()`'s tensors in ``dtype``."""
    from safetensors.torch import save_file

    save_file({k: (v * 100).to(dtype) for k, v in mlp().state_dict().items()}, str(tmp / "w.safetensors"))
    return str(tmp / "w.safetensors")


def _index(tmp: Path, weight_map: dict) -> str:
    import json

    _weights(tmp, torch.float32)
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return str(tmp)


def _meta_step(weights: str):
    with torch.device("meta"):
        model = mlp()
    return sl.compile(model, mse, sl.Spec(sl.Mesh(fsdp=1)), optimizer=sl.SGD(lr=0.1), example_batch=BATCH,
                      weights=weights)


def _file(path: Path) -> str:
    path.write_text("not a directory")
    return str(path)


def _with_checkpoints(tmp: Path) -> str:
    (tmp / "ckpt").mkdir()
    _saved(tmp / "ckpt").rename(tmp / "ckpt" / "step-00000001")
    return str(tmp / "ckpt")


JOB = '''\
import torch
from torch import nn
import shardlang as sl


def build_model():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def loss_fn(model, batch):
    x, y = batch
    return (model(x) - y).pow(2).mean()


def make_batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
'''


def job(tmp: Path, extra: str = "", name: str = "job") -> str:
    """A job file: the working one above, with ``extra`` appended (later definitions win)."""
    path = tmp / f"{name}.py"
    path.write_text(JOB + textwrap.dedent(extra))
    return str(path)


def cli(*argv: str) -> None:
    """``shardlang *argv`` in this process; raises `CommandLineError` with its stderr when it exits with 2."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli_main(list(argv))
        except SystemExit as exc:  # argparse's own errors
            code = exc.code
    if code == 2:
        raise CommandLineError(err.getvalue())
    raise AssertionError(f"shardlang {' '.join(argv)} exited {code}, not 2: {err.getvalue()}")


def cli_stopped(*argv: str) -> None:
    """``shardlang *argv`` in this process; raises `TrainingStopped` with its stderr when it exits with 1."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli_main(list(argv))
    if code == 1:
        raise TrainingStopped(err.getvalue())
    raise AssertionError(f"shardlang {' '.join(argv)} exited {code}, not 1: {err.getvalue()}")


NAN_AT_STEP_2 = """
def make_batch(step):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
    if step == 1:
        x[0, 0] = float("nan")
    return x, y
"""


ITEM_MODEL = '''
class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        return self.lin(x) * x.abs().max().item()


def build_model():
    return nn.Sequential(nn.Linear(4, 4), Scaled())
'''

BUILT_IN_LOSS = '''
def loss_fn(model, batch):
    x, y = batch
    head = nn.Linear(2, 2)
    return (head(model(x)) - y).pow(2).mean()
'''

CLAMP_MODEL = '''
class Clipped(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        with torch.no_grad():
            self.lin.weight.clamp_(-0.1, 0.1)
        return self.lin(x)


def build_model():
    return nn.Sequential(nn.Linear(4, 4), Clipped())
'''

BATCH_IN_PLACE = '''
def loss_fn(model, batch):
    x, y = batch
    x.sub_(x.mean())
    return (model(x) - y).pow(2).mean()
'''


# ---- the table ----------------------------------------------------------------------------------------------------

S = sl.SpecError
R = sl.ShardlangRuntimeError
T = sl.TraceError
C = CommandLineError
K = sl.CheckpointError
D = sl.DataError

CATALOGUE: tuple[BadInput, ...] = (
    # spec
    BadInput("spec-mesh-size-zero", "spec", "sl.Mesh(fsdp=0)", lambda tmp: sl.Mesh(fsdp=0), S,
             ("'fsdp'", "size 0", "positive int, or -1")),
    BadInput("spec-mesh-no-axes", "spec", "sl.Mesh()", lambda tmp: sl.Mesh(), S, ("Mesh()", "Mesh(fsdp=4)")),
    BadInput("spec-mesh-world-mismatch", "spec", "`sl.Spec(sl.Mesh(fsdp=4))` planned for world 2",
             lambda tmp: plan(spec=sl.Spec(sl.Mesh(fsdp=4)), world=2, batch=split_batch(BATCH, 2, 0)), S,
             ("Mesh(fsdp=4)", "4 devices", "world size is 2", "-1")),
    BadInput("spec-unknown-axis", "spec", "`rules=[('*', sl.shard('tp'))]` on `sl.Mesh(fsdp=1)`",
             lambda tmp: plan(spec=sl.Spec(sl.Mesh(fsdp=1), rules=[("*", sl.shard("tp"))])), S,
             ("rules[0]", "'tp'", "Mesh(fsdp=1)", "['fsdp']")),
    BadInput("spec-parameter-matches-no-rule", "spec", "`rules=[('0.*', sl.shard('fsdp'))]` (no rule for `'2.*'`)",
             lambda tmp: plan(spec=sl.Spec(sl.Mesh(fsdp=1), rules=[("0.*", sl.shard("fsdp"))])), S,
             ("'2.weight'", "'2.bias'", "match no rule", "('*', shard('fsdp'))")),
    BadInput("spec-rule-matches-nothing", "spec", "rules=[('encoder.*', sl.replicate()), ('*', sl.shard('fsdp'))]",
             lambda tmp: plan(spec=sl.Spec(sl.Mesh(fsdp=1), rules=[("encoder.*", sl.replicate()),
                                                                   ("*", sl.shard("fsdp"))])), S,
             ("rules[0]", "'encoder.*'", "matches no parameter", "'0.weight'")),
    BadInput("spec-unit-matches-nothing", "spec", "units=['encoder.*']",
             lambda tmp: plan(spec=sl.Spec(sl.Mesh(fsdp=1), units=["encoder.*"])), S,
             ("units[0]", "'encoder.*'", "matches no module", "'0', '1', '2'")),
    BadInput("spec-units-overlap", "spec", "units=['*', '0'] (both pick module `'0'`)",
             lambda tmp: plan(spec=sl.Spec(sl.Mesh(fsdp=1), units=["*", "0"])), S,
             ("units[0] = '*'", "units[1] = '0'", "module '0'", "one unit only")),
    BadInput("spec-toml-not-utf8", "spec", "`sl.Spec.from_toml(path)` on a file that is not UTF-8",
             lambda tmp: sl.Spec.from_toml(_bytes(tmp / "spec.toml", b"mesh = \x80")), S,
             ("<tmp>/spec.toml", "not valid TOML", "not UTF-8")),
    BadInput("spec-shard-dim-out-of-range", "spec", "`rules=[('*', sl.shard('fsdp', dim=3))]` on 2-d weights",
             lambda tmp: plan(spec=sl.Spec(sl.Mesh(fsdp=2), rules=[("*", sl.shard("fsdp", dim=3))]), world=2,
                              batch=split_batch(BATCH, 2, 0)), S,
             ("dim 3", "'0.weight'", "(8, 4)", "-2..1")),
    BadInput("spec-options-microbatches", "spec", "sl.Options(microbatches=0)",
             lambda tmp: sl.Options(microbatches=0), S, ("Options.microbatches is 0", "int >= 1")),
    BadInput("spec-options-random", "spec", "sl.Options(random='bogus')", lambda tmp: sl.Options(random="bogus"), S,
             ("'bogus'", "['per_rank', 'global']")),
    BadInput("spec-mixed-precision-dtype", "spec", "sl.MixedPrecision(param_dtype=torch.int8)",
             lambda tmp: sl.MixedPrecision(param_dtype=torch.int8), S,
             ("param_dtype is torch.int8", "floating torch dtype")),
    BadInput("spec-memory-budget-too-small", "spec", "`sl.Options(memory_budget=1000)` for a model that needs more",
             lambda tmp: plan(spec=sl.Spec(sl.Mesh(fsdp=1), options=sl.Options(memory_budget=1000))), S,
             ("memory_budget=1000", "planned peak")),
    BadInput("spec-not-a-spec", "spec", "`sl.compile(model, loss_fn, {'mesh': {'fsdp': 1}}, ...)`",
             lambda tmp: plan(spec={"mesh": {"fsdp": 1}}), S, ("dict", "{'mesh': {'fsdp': 1}}", "shardlang.Spec")),
    BadInput("spec-optimizer-lr", "spec", "sl.AdamW(lr=-1.0)", lambda tmp: sl.AdamW(lr=-1.0), S,
             ("lr=-1.0", "non-negative")),
    BadInput("spec-optimizer-betas", "spec", "sl.AdamW(lr=1e-3, betas=(0.9, 1.5))",
             lambda tmp: sl.AdamW(lr=1e-3, betas=(0.9, 1.5)), S, ("betas=(0.9, 1.5)", "[0, 1)")),
    # model and loss
    BadInput("model-not-a-module", "model", "sl.plan('gpt2', loss_fn, ...)", lambda tmp: plan(model="gpt2"), S,
             ("str 'gpt2'", "torch.nn.Module")),
    BadInput("model-build-returns-other", "model", "sl.plan(lambda: [nn.Linear(4, 2)], loss_fn, ...)",
             lambda tmp: plan(model=lambda: [nn.Linear(4, 2)]), S, ("returned list", "not a torch.nn.Module")),
    BadInput("model-no-parameters", "model", "sl.plan(nn.ReLU(), loss_fn, ...)", lambda tmp: plan(model=nn.ReLU()),
             S, ("(ReLU)", "no parameters")),
    BadInput("model-item-in-forward", "model", "forward reads `x.abs().max().item()`",
             lambda tmp: cli("plan", job(tmp, ITEM_MODEL), "--world", "2"), C,
             ("<tmp>/job.py:25 in forward", "module '1' (Scaled)", "DataDependentOutputException", ".item()")),
    BadInput("model-built-in-loss-fn", "model", "`loss_fn` builds `nn.Linear(2, 2)` at every call",
             lambda tmp: cli("plan", job(tmp, BUILT_IN_LOSS), "--world", "2"), C,
             ("Linear (parameters 'weight', 'bias')", "<tmp>/job.py:21 in loss_fn", "outside loss_fn")),
    BadInput("model-parameter-changed-in-place", "model", "forward clamps `self.lin.weight` in place under `no_grad`",
             lambda tmp: cli("plan", job(tmp, CLAMP_MODEL), "--world", "2"), C,
             ("parameter '1.lin.weight'", "aten.clamp_", "<tmp>/job.py:26 in forward", "module '1' (Clipped)")),
    BadInput("loss-not-scalar", "model", "`loss_fn` returns `model(x)`, of shape (6, 2)",
             lambda tmp: plan(loss_fn=lambda m, b: m(b[0])), T, ("shape (6, 2)", "scalar tensor")),
    BadInput("loss-returns-tuple", "model", "`loss_fn` returns `(loss, {'acc': acc})`",
             lambda tmp: plan(loss_fn=lambda m, b: (mse(m, b), {"acc": 1.0})), T,
             ("a tuple of 2 values", "return the loss alone")),
    BadInput("loss-wrong-signature", "model", "loss_fn = lambda batch: ...",
             lambda tmp: plan(loss_fn=lambda batch: batch[0].sum()), S,
             ("<lambda>(batch)", "loss_fn(model, batch)")),
    BadInput("loss-no-trainable-dependency", "model", "`loss_fn` returns `batch[1].sum() * 1.0`",
             lambda tmp: plan(loss_fn=lambda m, b: b[1].sum() * 1.0), T, ("does not depend on any trainable",)),
    # batch
    BadInput("batch-leaf-not-a-tensor", "batch", "example_batch=(x, 3)", lambda tmp: plan(batch=(BATCH[0], 3)), S,
             ("leaf 1", "int 3", "torch.Tensor")),
    BadInput("batch-numpy", "batch", "example_batch=(x.numpy(), y.numpy())",
             lambda tmp: plan(batch=(BATCH[0].numpy(), BATCH[1].numpy())), S,
             ("leaf 0 is ndarray", "torch.from_numpy")),
    BadInput("batch-zero-rows", "batch", "example_batch=(torch.randn(0, 4), torch.randn(0, 2))",
             lambda tmp: plan(batch=(torch.randn(0, 4), torch.randn(0, 2))), S, ("leaf 0", "0 rows", "(0, 4)")),
    BadInput("batch-indivisible", "batch", "`split_batch(batch, world_size=4, rank=0)` on a batch of 6 rows",
             lambda tmp: split_batch(BATCH, 4, 0), R, ("global batch size 6", "world size 4", "multiple of 4")),
    BadInput("batch-wrong-dims-at-step", "batch", "`step((x, y[..., None]))` after compiling for y of shape (6, 2)",
             lambda tmp: step()((BATCH[0], BATCH[1][..., None])), R, ("leaf 1", "(6, 2, 1)")),
    BadInput("batch-wrong-dtype-at-step", "batch", "`step((x.double(), y.double()))` after compiling for float32",
             lambda tmp: step()((BATCH[0].double(), BATCH[1].double())), R, ("torch.float64", "torch.float32")),
    BadInput("batch-structure-at-step", "batch", "`step((x,))` after compiling for `(x, y)`",
             lambda tmp: step()((BATCH[0],)), R, ("1 tensors", "compiled for")),
    BadInput("batch-step-in-the-wrong-world", "batch", "`sl.Step(compiled, ...)` with a plan for 2 ranks, in a world of 1",
             lambda tmp: sl.Step(plan(spec=sl.Spec(sl.Mesh(fsdp=2)), world=2, batch=split_batch(BATCH, 2, 0)), mlp(),
                                 sl.SGD(lr=0.1), DistContext.single()), R,
             ("compiled for a mesh of 2 ranks", "world of 1")),
    BadInput("batch-dtype-of-the-model", "batch", "a `float32` batch for a `float64` model",
             lambda tmp: plan(model=mlp().double()), T,
             ("aten.addmm.default", "torch.float32", "torch.float64", "module '0' (Linear)",
              "give the batch the model's dtype")),
    BadInput("batch-microbatches-indivisible", "batch", "`sl.Options(microbatches=4)` with 6 rows per rank",
             lambda tmp: plan(spec=sl.Spec(sl.Mesh(fsdp=1), options=sl.Options(microbatches=4))), T,
             ("6 rows", "microbatches=4", "multiple of 4")),
    BadInput("batch-changed-in-place", "batch", "`loss_fn` does `x.sub_(x.mean())`",
             lambda tmp: cli("plan", job(tmp, BATCH_IN_PLACE), "--world", "2"), C,
             ("batch leaf 0", "aten.sub_", "<tmp>/job.py:21 in loss_fn", "x = x * 2")),
    BadInput("spec-optimizer-nesterov", "spec", "sl.SGD(lr=0.1, nesterov=True)",
             lambda tmp: sl.SGD(lr=0.1, nesterov=True), S, ("nesterov needs momentum > 0",)),
    BadInput("spec-optimizer-eps", "spec", "sl.Adam(lr=1e-3, eps='tiny')", lambda tmp: sl.Adam(lr=1e-3, eps="tiny"), S,
             ("eps='tiny'", "non-negative number")),
    BadInput("step-set-lr", "spec", "step.set_lr(-1.0)", lambda tmp: step().set_lr(-1.0), S,
             ("lr=-1.0", "finite number >= 0")),
    # job file
    BadInput("job-missing-file", "job file", "shardlang plan no_such_job.py --world 2",
             lambda tmp: cli("plan", str(tmp / "no_such_job.py"), "--world", "2"), C,
             ("<tmp>/no_such_job.py", "does not exist")),
    BadInput("job-missing-function", "job file", "a job file without `make_batch`",
             lambda tmp: load_job(_write(tmp, "import torch\ndef build_model(): pass\ndef loss_fn(m, b): pass\n")),
             S, ("does not define make_batch", "def make_batch(step: int)")),
    BadInput("job-syntax-error", "job file", "a job file with `def build_model(:`",
             lambda tmp: load_job(_write(tmp, "def build_model(:\n    pass\n")), S,
             ("failed to import", "SyntaxError", "line 1")),
    BadInput("job-make-batch-raises", "job file", "`make_batch` raises `IndexError` at step 0",
             lambda tmp: cli("plan", job(tmp, "\ndef make_batch(step):\n    return [][step]\n"), "--world", "2"), C,
             ("make_batch(0) raised IndexError", "line 20", "return [][step]")),
    BadInput("job-spec-wrong-type", "job file", "spec = 'fsdp'",
             lambda tmp: cli("plan", job(tmp, "\nspec = 'fsdp'\n"), "--world", "2"), C,
             ("spec is str 'fsdp'", "sl.Spec(mesh=sl.Mesh(fsdp=-1))")),
    BadInput("job-dtype", "job file", "dtype = torch.int32",
             lambda tmp: cli("plan", job(tmp, "\ndtype = torch.int32\n"), "--world", "2"), C,
             ("dtype is torch.int32", "floating torch.dtype")),
    # checkpoint
    BadInput("checkpoint-missing", "checkpoint", "`step.load('nowhere')`", lambda tmp: step().load(tmp / "nowhere"),
             K, ("<tmp>/nowhere", "not a directory")),
    BadInput("checkpoint-another-model", "checkpoint", "loading a checkpoint of `mlp()` into a model with one more layer",
             lambda tmp: step(wider=True).load(_saved(tmp)), K, ("'model.3.weight'", "another model")),
    BadInput("checkpoint-another-shape", "checkpoint", "loading a checkpoint of `Linear(4, 8)` into `Linear(5, 8)`",
             lambda tmp: step(d_in=5).load(_saved(tmp)), K, ("'model.0.weight'", "(8, 4)", "(8, 5)")),
    BadInput("checkpoint-another-dtype", "checkpoint", "loading a float32 checkpoint into a float64 model",
             lambda tmp: step(dtype=torch.float64).load(_saved(tmp)), K,
             ("'model.0.weight'", "torch.float32", "torch.float64")),
    BadInput("checkpoint-truncated", "checkpoint", "a checkpoint whose data file lost its last 100 bytes",
             lambda tmp: step().load(_damaged(_saved(tmp))), K, ("__0_0.distcp", "truncated")),
    BadInput("checkpoint-crafted-metadata", "checkpoint",
             "a checkpoint whose `.metadata` is a pickle that calls `os.system`, its `shardlang.json` recomputed",
             lambda tmp: step().load(_crafted(tmp)), K, (".metadata", "posix.system", "refused, not run")),
    BadInput("checkpoint-manifest-outside", "checkpoint", "a `shardlang.json` that lists `../../etc/passwd`",
             lambda tmp: step().load(_outside_manifest(tmp)), K,
             ("shardlang.json", "'../../etc/passwd'", "plain file names only")),
    BadInput("checkpoint-export-out-directory", "checkpoint", "`shardlang export D --out <an existing directory>`",
             lambda tmp: cli("export", str(_saved(tmp)), "--out", str(_mkdir(tmp / "out"))), C,
             ("--out <tmp>/out", "is a directory", "model.safetensors")),
    BadInput("checkpoint-dir-is-a-file", "checkpoint", "`shardlang run JOB --checkpoint-dir FILE`, FILE a file",
             lambda tmp: cli("run", job(tmp), "--checkpoint-dir", _file(tmp / "f")), C,
             ("--checkpoint-dir <tmp>/f", "is a file", "name a directory")),
    BadInput("checkpoint-dir-holds-another-run", "checkpoint",
             "`shardlang run JOB --checkpoint-dir D` (no `--resume`), D holding checkpoints",
             lambda tmp: cli("run", job(tmp), "--checkpoint-dir", _with_checkpoints(tmp)), C,
             ("<tmp>/ckpt", "step-00000001", "--resume", "--overwrite")),
    BadInput("checkpoint-unfinished", "checkpoint", "`step.load('step-2.tmp')`, a save that never finished",
             lambda tmp: step().load(_mkdir(tmp / "step-2.tmp")), K, ("step-2.tmp", "unfinished save")),
    # weights
    BadInput("weights-integer-for-float", "weights", "`weights=` a safetensors file of int64 tensors for float32 "
             "parameters", lambda tmp: _meta_step(_weights(tmp, torch.int64)), S,
             ("'0.bias'", "w.safetensors", "integer values (I64)", "float32", "never cast")),
    BadInput("weights-index-outside", "weights", "an index whose `weight_map` names `../w.safetensors`",
             lambda tmp: _meta_step(_index(tmp, {"0.weight": "../w.safetensors"})), S,
             ("model.safetensors.index.json", "'../w.safetensors'", "outside", "its own directory")),
    BadInput("weights-index-not-a-name", "weights", "an index whose `weight_map` maps a tensor to `3`",
             lambda tmp: _meta_step(_index(tmp, {"0.weight": 3})), S,
             ("model.safetensors.index.json", "'0.weight'", "to 3", "name of a .safetensors file")),
    # launcher
    BadInput("launcher-nproc", "launcher", "WorkerPool(0)", lambda tmp: WorkerPool(0), R,
             ("nproc=0", "integer >= 1")),
    BadInput("launcher-timeout", "launcher", "WorkerPool(2, timeout=-1)", lambda tmp: WorkerPool(2, timeout=-1), R,
             ("timeout=-1", "positive number of seconds")),
    BadInput("launcher-threads", "launcher", "WorkerPool(2, threads=0)", lambda tmp: WorkerPool(2, threads=0), R,
             ("threads=0", "integer >= 1")),
    BadInput("launcher-env-world-size", "launcher", "`WORLD_SIZE=two` under torchrun",
             lambda tmp: init_from_env({"WORLD_SIZE": "two"}), R, ("WORLD_SIZE='two'", "integer >= 1")),
    BadInput("launcher-env-rank", "launcher", "`RANK=2` with `WORLD_SIZE=2`",
             lambda tmp: init_from_env({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}), R,
             ("RANK='2'", "0..1")),
    # command line
    BadInput("cli-world", "CLI", "shardlang plan JOB --world 0", lambda tmp: cli("plan", job(tmp), "--world", "0"),
             C, ("--world", "'0'", "integer >= 1")),
    BadInput("cli-world-sizes", "CLI", "shardlang check JOB --world-sizes 1,x",
             lambda tmp: cli("check", job(tmp), "--world-sizes", "1,x"), C, ("'1,x'", "e.g. 1,2,4")),
    BadInput("cli-world-indivisible", "CLI", "`shardlang plan JOB --world 3` with 8 rows per batch",
             lambda tmp: cli("plan", job(tmp), "--world", "3"), C,
             ("make_batch(0)", "global batch size 8", "world size 3")),
    BadInput("cli-unknown-command", "CLI", "shardlang train JOB", lambda tmp: cli("train", job(tmp)), C,
             ("'train'", "'run', 'plan', 'diff', 'check'")),
    BadInput("cli-output-directory", "CLI", "`shardlang plan JOB --world 2 --chrome-trace missing/t.json`",
             lambda tmp: cli("plan", job(tmp), "--world", "2", "--chrome-trace", str(tmp / "missing" / "t.json")), C,
             ("--chrome-trace", "<tmp>/missing/t.json", "does not exist")),
    BadInput("cli-resume-and-overwrite", "CLI", "shardlang run JOB --checkpoint-dir D --resume --overwrite",
             lambda tmp: cli("run", job(tmp), "--checkpoint-dir", str(tmp / "D"), "--resume", "--overwrite"), C,
             ("--resume", "--overwrite", "exclude each other")),
    BadInput("cli-run-nonfinite-loss", "CLI", "`shardlang run JOB --steps 4`, the batch of step 2 holding a nan",
             lambda tmp: cli_stopped("run", job(tmp, NAN_AT_STEP_2), "--steps", "4"), TrainingStopped,
             ("step 2", "not finite", "--max-nonfinite 1", "skip_nonfinite=True")),
    BadInput("cli-diff-not-a-plan", "CLI", "`shardlang diff other.json JOB`, other.json not a plan",
             lambda tmp: cli("diff", _write(tmp, '{"a": 1}', "other.json"), job(tmp)), C,
             ("<tmp>/other.json", "not a plan", "plan FILE --world N --json")),
    BadInput("cli-spec-file", "CLI", "shardlang plan JOB --world 2 --spec missing.toml",
             lambda tmp: cli("plan", job(tmp), "--world", "2", "--spec", str(tmp / "missing.toml")), C,
             ("--spec", "<tmp>/missing.toml", "does not exist", "shardlang tune")),
    BadInput("cli-calibration-field", "CLI", "`shardlang plan JOB --world 2 --calibration m.json`, m.json's link "
             "bandwidth -1", lambda tmp: cli("plan", job(tmp), "--world", "2", "--calibration", _write(
                 tmp, '{"format": "shardlang.calibration", "version": 1, "compute_slowdown_under_comm": 1.0, '
                 '"link": {"alpha_s": 1e-4, "bandwidth": -1, "backend": "gloo"}, "compute": {"flops_per_s": 1e11, '
                 '"bytes_per_s": 1e10, "op_overhead_s": 0, "view_overhead_s": 0}}', "m.json")), C,
             ("<tmp>/m.json", "link.bandwidth is -1", "> 0")),
    BadInput("cli-calibrate-max-payload", "CLI", "`shardlang calibrate --max-payload 2GiB --out m.json`",
             lambda tmp: cli("calibrate", "--max-payload", "2GiB", "--out", str(tmp / "m.json")), C,
             ("--max-payload 2.00 GiB", "from 64.00 KiB to at most 1.00 GiB", "give a size in that range")),
    BadInput("data-missing-index", "data", "`sl.data.tokens('<tmp>/data', seq_len=8, global_batch=2)`, never prepared",
             lambda tmp: sl.data.tokens(_mkdir(tmp / "data"), seq_len=8, global_batch=2), D,
             ("<tmp>/data", "has no index.json", "shardlang data prepare")),
    BadInput("data-damaged-shard", "data", "`sl.data.tokens(D, ...)`, a byte of D/train-00000.npy changed after "
             "preparing", lambda tmp: sl.data.tokens(_damaged_shard(tmp), seq_len=8, global_batch=2), D,
             ("train-00000.npy", "checksum", "differs", "prepare the data again")),
    BadInput("data-seq-len", "data", "`sl.data.tokens(D, seq_len=4096, global_batch=2)` on 48 tokens",
             lambda tmp: sl.data.tokens(_prepared(tmp), seq_len=4096, global_batch=2), D,
             ("split 'train'", "48 tokens", "seq_len + 1 = 4,097")),
    BadInput("data-vocabulary", "data", "`shardlang run JOB`, JOB's make_batch = sl.data.tokens(D, ...) over 256 byte "
             "tokens and an Embedding(16, 4)", lambda tmp: cli("run", _vocab_job(tmp)), C,
             ("256 tokens", "16 rows", "'emb'", "index.json")),
    BadInput("data-jsonl-field", "data", "`shardlang data prepare a.jsonl --out D`, a line without a text field",
             lambda tmp: cli("data", "prepare", _write(tmp, '{"body": "x"}\n', "a.jsonl"), "--out", str(tmp / "D")), C,
             ("<tmp>/a.jsonl:1", "no 'text' field", "['body']", "--text-field")),
    BadInput("data-tokenizer", "data", "shardlang data prepare a.txt --out D --tokenizer gpt2",
             lambda tmp: cli("data", "prepare", _write(tmp, "text", "a.txt"), "--out", str(tmp / "D"),
                             "--tokenizer", "gpt2"), C, ("'gpt2'", "byte", "train-bpe:VOCAB", "tokenizer.json")),
)


def _prepared(tmp: Path) -> Path:
    """48 byte tokens prepared in tmp/data (three documents)."""
    from shardlang.data import prepare

    (tmp / "in").mkdir()
    for i, text in enumerate(("fifteen letters", "and fifteen mor", "then fifteen ok")):
        (tmp / "in" / f"{i}.txt").write_text(text)
    prepare([str(tmp / "in")], tmp / "data", val_fraction=0.0, workers=1, progress=False)
    return tmp / "data"


def _damaged_shard(tmp: Path) -> Path:
    data = _prepared(tmp)
    shard = data / "train-00000.npy"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF
    shard.write_bytes(bytes(raw))
    return data


def _vocab_job(tmp: Path) -> str:
    data = _prepared(tmp)
    return _write(tmp, textwrap.dedent(f"""
        import torch
        import shardlang as sl

        class Tiny(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = torch.nn.Embedding(16, 4)

            def forward(self, x):
                return self.emb(x).sum()

        def build_model():
            return Tiny()

        def loss_fn(model, batch):
            return model(batch)

        make_batch = sl.data.tokens({str(data)!r}, seq_len=8, global_batch=2)
        """), "job.py")


def _bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _write(tmp: Path, text: str, name: str = "bad_job.py") -> str:
    path = tmp / name
    path.write_text(text)
    return str(path)


# ---- the page -----------------------------------------------------------------------------------------------------

AREAS = ("spec", "model", "batch", "job file", "checkpoint", "weights", "data", "launcher", "CLI")

INTRO = """\
# Errors: a catalogue of bad inputs

Every error shardlang raises on purpose is a `shardlang.errors.ShardlangError`
(`SpecError`, `TraceError`, `CompileError`, `ShardlangRuntimeError`, `DataError`), and its
message says three things: the offending value, where it came from, and what
would be valid. Trace and compile errors also name the line of your code and
the module (its name in `model.named_modules()`) they came from, and what to do
for the common causes: reading a tensor's value in Python (`.item()`, `if t:`),
shapes that depend on values, in-place changes to parameters, the batch or
values backward needs, ops without a fake-tensor kernel or a backward, and work
done under the tracer that belongs outside it (a module built inside
`loss_fn`). Checkpoint errors (`CheckpointError`) name the tensor or the file
to blame. On the command line each is a `shardlang: error: ...` line with
exit code 2 (a trace error adds the line of code and what to do beneath it).

Below, each bad input that was tried, and the message it gets (the real text,
produced by running it; `<tmp>` is the folder holding the job file). Each entry's
id is a test in `tests/test_errors.py` (`test_bad_input[<id>]`), which checks that
the message still names the value; `tests/error_catalogue.py` holds the table
and rewrites this page: `python tests/error_catalogue.py > docs/errors.md`.
"""


def page(tmp_root: Path) -> str:
    parts = [INTRO]
    for area in AREAS:
        parts.append(f"\n## {area[0].upper() + area[1:]}\n")
        for entry in (e for e in CATALOGUE if e.area == area):
            tmp = tmp_root / entry.id
            tmp.mkdir()
            message = message_of(entry, tmp)
            tried = entry.tried if "`" in entry.tried else f"`{entry.tried}`"  # an entry without backticks is code
            parts.append(f"\n### `{entry.id}`\n\nTried: {tried}\n\n```text\n{message}\n```\n")
    return "".join(parts)


def documented(text: str) -> dict[str, str]:
    """``id -> message`` of every entry in a page written by `page`."""
    entries = {}
    for block in text.split("\n### `")[1:]:
        entry_id, rest = block.split("`", 1)
        entries[entry_id] = rest.split("```text\n", 1)[1].split("\n```", 1)[0] if "```text\n" in rest else ""
    return entries


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        sys.stdout.write(page(Path(root)))
