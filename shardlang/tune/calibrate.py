"""``shardlang calibrate``: measure this machine's link and compute for the cost model, and read the result back.

Note [calibration]: short probes on the real backend, N local ranks:

- the link: for each collective kind and payload (64 KiB to 16 MiB, or ``--max-payload``), the
  median of the quicker third of an issue + wait after a barrier, the slowest
  rank's; then the least-squares fit of the ring model ``steps * alpha +
  wire_bytes / bandwidth`` in relative error (each sample weighted by 1/t, so a
  64 KiB collective counts as much as a 16 MiB one). gloo runs a
  reduce-scatter as an all-reduce, and the fit and the model say so;
- the compute, on every rank at once (as ranks compute side by side in a
  step, sharing the machine's caches and memory bandwidth), with the threads
  one rank gets (cores / N): a 512^3 matmul's
  FLOP/s and an elementwise add's bytes/s give the roofline's shape; two GPT
  steps measured at world 1 (the tiny one, mostly per-node overhead, and the
  10M one, mostly arithmetic) fix its efficiency and the per-node overhead;
- the contention: on a CPU, gloo's copies run on the same cores as compute.
  A matmul loop is timed alone and while the other ranks' collectives run
  beside it on the same cores; the slowdown is recorded as
  ``compute_slowdown_under_comm`` (1.0: none), which the cost model applies
  to compute that overlaps a collective (`CostModel.contention`);
- the step at the calibrated world size: the probes above miss what N ranks
  training side by side cost each other beyond them (a 2-core machine's ranks
  and gloo's threads share cores, caches and memory bandwidth all step long).
  A step is compiled and run on the N ranks, as ``tune --measure`` runs one
  (the median of the slowest rank's steps), and the compute model is scaled
  (rates divided, per-node costs multiplied, by one factor) until the cost
  model predicts that step: ``step_fit`` records the job, the measured and the
  unscaled predicted step and the factor. The step is the 10M GPT's, or with
  ``--job`` the user's own job's (its spec, or ``--spec``'s): a model whose
  step is more arithmetic or more per-node overhead than the 10M GPT's is
  predicted better by a factor fitted on itself.

Note [links per axis] in `compiler.analysis.cost`: with a mesh (``--mesh fsdp=2,tp=2``) the link is
probed on every axis's own groups too (each rank in its group of that axis, all
groups at once, as a step's collectives of one axis run), and fitted per axis
over that axis's size. The calibration then holds a link per axis beside the
world's; ``plan`` and ``tune`` cost each collective on its axis's link.

Note [the runtime's share]: the memory plan counts the step's tensors; a
process running it holds more (the compiled graphs, gloo's buffers, Python's
and torch's own allocations). On that same step, one more step runs with
malloc's bytes in use sampled (`MallocPeak`, as ``tune --measure`` samples
them), and what was in use at the peak beyond the planned peak, on the rank
that held the most, is ``runtime_bytes``: about 33 MiB on this machine. A
``--memory-budget`` given with the calibration is the process's: ``plan`` and
``tune`` plan the step within the budget less ``runtime_bytes``
(`step_budget`). A larger step's plan can hold more than the bytes in use
(the 100M GPT's does), so this errs on the side of fitting.

The calibration is JSON (format ``shardlang.calibration``) that ``plan`` and
``tune`` take with ``--calibration FILE``; it is read as untrusted input: each
field checked, a bad one a `SpecError` naming the file and the field.

Example::

    calibration = calibrate(nproc=2)
    Path("machine.json").write_text(calibration.to_json())
    model = read_calibration("machine.json")        # a CostModel
    step_budget(150 * 2**20, "machine.json")        # the budget less the runtime's share
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from pathlib import Path

import attrs
import numpy as np
import torch
import torch.distributed as dist

from ..compiler import CostModel, human_bytes, make_plan
from ..compiler.analysis.cost import ComputeModel, LinkModel
from ..errors import SpecError
from ..runtime.peak_memory import malloc_in_use

FORMAT = "shardlang.calibration"
VERSION = 1
PAYLOADS = tuple(1 << k for k in range(16, 25, 2))  # 64 KiB .. 16 MiB: the default probes
MAX_PAYLOAD = 1 << 30
DEFAULT_STEP = "the 10M GPT"  # whose step fits the compute's factor without --job
KINDS = ("all_gather", "reduce_scatter", "all_reduce")
MATMUL = 512
SCALE_LIMITS = (0.25, 8.0)  # the step factor's range: a step outside it is not the compute's to explain


@attrs.frozen
class AxisLink:
    """One mesh axis's link as `calibrate` fitted it on that axis's groups of ``size`` ranks, and its samples."""

    axis: str
    size: int
    link: LinkModel
    samples: tuple[tuple[str, int, float], ...]

    def fit_error(self) -> float:
        """The largest relative error of the fit over its samples."""
        return max(abs(self.link.time(k, self.size, b) / t - 1) for k, b, t in self.samples)


@attrs.frozen
class Calibration:
    """What `calibrate` measured: the fitted link and compute models, the contention, and the raw samples."""

    link: LinkModel
    compute: ComputeModel
    contention: float
    world_size: int
    threads: int
    samples: tuple[tuple[str, int, float], ...]  # (kind, payload bytes, seconds)
    step_fit: dict | None = None  # {"job", "measured_s", "predicted_s" (unscaled), "scale"}: the step at world_size
    runtime_bytes: int = 0  # Note [the runtime's share]: bytes in use at the step's peak beyond its plan
    axes: tuple[AxisLink, ...] = ()  # Note [links per axis]: each axis's fitted link, with a mesh

    def cost_model(self) -> CostModel:
        return CostModel(link=self.link, compute=self.compute, contention=self.contention,
                         axis_links={a.axis: a.link for a in self.axes})

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "version": VERSION, "world_size": self.world_size,
                           "threads": self.threads, "link": attrs.asdict(self.link),
                           "compute": attrs.asdict(self.compute), "compute_slowdown_under_comm": self.contention,
                           "step_fit": self.step_fit, "runtime_bytes": self.runtime_bytes,
                           "samples": [list(s) for s in self.samples],
                           **({"axis_links": {a.axis: {**attrs.asdict(a.link), "ranks": a.size,
                                                       "samples": [list(x) for x in a.samples]}
                                              for a in self.axes}} if self.axes else {})}, indent=1) + "\n"

    def summary(self) -> str:
        lines = [f"link ({self.link.backend}, {self.world_size} ranks): alpha {self.link.alpha_s * 1e6:.1f} us per "
                 f"ring step, {self.link.bandwidth / 1e9:.2f} GB/s",
                 f"compute ({self.threads} thread{'s' if self.threads != 1 else ''} a rank): matmul "
                 f"{self.compute.flops_per_s / 1e9:.1f} GFLOP/s, elementwise {self.compute.bytes_per_s / 1e9:.1f} "
                 f"GB/s, {self.compute.op_overhead_s * 1e6:.1f} us a node, {self.compute.view_overhead_s * 1e6:.2f} "
                 "us a view",
                 f"contention: compute runs {self.contention:.2f}x as long while a collective runs beside it"]
        if self.step_fit:
            fit = self.step_fit
            at_limit = fit["scale"] in SCALE_LIMITS
            lines.append(f"{fit.get('job', DEFAULT_STEP)}'s step on {self.world_size} ranks: measured "
                         f"{fit['measured_s'] * 1e3:.1f} ms, predicted {fit['predicted_s'] * 1e3:.1f} ms by the "
                         f"probes alone; compute scaled by {fit['scale']:.3f} "
                         + ("to match" if not at_limit else
                            "(the fit's limit: scaling compute alone does not match this step; calibrate on a step "
                            "that is mostly compute)"))
        if self.runtime_bytes:
            lines.append(f"the runtime holds {human_bytes(self.runtime_bytes)} in use beyond the step's plan at its "
                         "peak: --memory-budget leaves it out of what the step may plan")
        fit = self.cost_model().link
        def error(sample) -> float:
            kind, payload, seconds = sample
            return abs(fit.time(kind, self.world_size, payload) / seconds - 1)

        kind, payload, seconds = worst = max(self.samples, key=error)
        lines.append(f"the link's fit is within {100 * error(worst):.0f}% of each of its {len(self.samples)} samples "
                     f"(the farthest: {kind} of {human_bytes(payload)}, measured {seconds * 1e3:.2f} ms, fitted "
                     f"{fit.time(kind, self.world_size, payload) * 1e3:.2f} ms)")
        for a in self.axes:
            lines.append(f"link of axis {a.axis!r} (its groups of {a.size} ranks): alpha {a.link.alpha_s * 1e6:.1f} us "
                         f"per ring step, {a.link.bandwidth / 1e9:.2f} GB/s; within {100 * a.fit_error():.0f}% of "
                         f"its {len(a.samples)} samples")
        return "\n".join(lines)


def probe_payloads(largest: int = PAYLOADS[-1]) -> tuple[int, ...]:
    """The link's probe sizes: 64 KiB, 256 KiB, ... (x4) up to ``largest`` bytes (64 KiB to 1 GiB)."""
    if not PAYLOADS[0] <= largest <= MAX_PAYLOAD:
        raise SpecError(f"--max-payload {human_bytes(largest)}: the link's probes run from "
                        f"{human_bytes(PAYLOADS[0])} to at most {human_bytes(MAX_PAYLOAD)} (each rank holds a "
                        "probe's input and output at once); give a size in that range")
    sizes = [PAYLOADS[0]]
    while sizes[-1] * 4 <= largest:
        sizes.append(sizes[-1] * 4)
    return tuple(sizes)


def calibrate(nproc: int = 2, reps: int = 9, job: StepJob | None = None,
              payloads: tuple[int, ...] = PAYLOADS, mesh: tuple[tuple[str, int], ...] = ()) -> Calibration:
    """Measure the link on ``nproc`` local ranks at ``payloads`` and the compute with the threads one of them
    gets; the step factor on ``job``'s step (default: the 10M GPT's). With ``mesh`` (axes and sizes whose
    product is ``nproc``), the link of each axis of more than one rank too (Note [links per axis])."""
    from ..cli.common import threads_per_rank
    from ..runtime.launcher import launch

    if nproc < 2:
        raise SpecError(f"--nproc {nproc}: measuring a link needs at least 2 ranks")
    if mesh and math.prod(size for _, size in mesh) != nproc:
        raise SpecError(f"--mesh {_mesh_text(mesh)} has {math.prod(size for _, size in mesh)} ranks and --nproc is "
                        f"{nproc}; give axes whose sizes multiply to {nproc}")
    job = job or StepJob()
    threads = threads_per_rank(nproc)
    results = launch(probe_rank, nproc, reps, payloads, mesh, timeout=None, threads=threads,
                     name="shardlang calibrate")
    backend = results[0]["backend"]

    def fitted(times: str, size: int, name: str) -> tuple[LinkModel, tuple]:
        samples = tuple((kind, payload, max(r[times][f"{kind}/{payload}"] for r in results))
                        for kind in KINDS for payload in payloads)
        alpha, bandwidth = fit_link(samples, size, gloo=backend == "gloo")
        return LinkModel(name, alpha_s=alpha, bandwidth=bandwidth, backend=backend,
                         reduce_scatter_as_all_reduce=backend == "gloo"), samples

    link, samples = fitted("link", nproc, f"calibrated-{backend}")
    axes = tuple(AxisLink(axis, size, *fitted(f"axis:{axis}", size, f"calibrated-{backend}-{axis}"))
                 for axis, size in mesh if size > 1)
    fields = ("flops_per_s", "bytes_per_s", "op_overhead_s", "view_overhead_s")
    compute = ComputeModel("calibrated-cpu", **{f: statistics.median(r["compute"][f] for r in results)
                                                for f in fields})
    contention = max(1.0, statistics.median(r["contention"] for r in results))
    probed = CostModel(link=link, compute=compute, contention=contention)
    fit = launch(step_rank, nproc, probed, reps, job, timeout=None, threads=threads,
                 name=f"shardlang calibrate: {job.name}'s step")[0]
    runtime = fit.pop("runtime_bytes")
    return Calibration(link, scaled_compute(compute, fit["scale"]), contention, nproc, threads, samples, fit, runtime,
                       axes)


def _mesh_text(mesh) -> str:
    return ",".join(f"{name}={size}" for name, size in mesh)


@attrs.frozen
class StepJob:
    """The job whose step fixes the calibration's step factor: a job file and an optional spec file in place of
    its spec (absolute paths: ranks load it), or None for the 10M GPT; ``name`` is how the summary calls it."""

    path: str | None = None
    spec_file: str | None = None
    name: str = DEFAULT_STEP

    def load(self):
        from ..cli.job import load_job

        return _gpt_job("10M") if self.path is None else load_job(self.path, self.spec_file)


def step_rank(ctx, model: CostModel, reps: int, step_job: StepJob | None = None) -> dict:
    """``step_job``'s step (default: the 10M GPT's) on this rank's world, measured as ``tune --measure`` does,
    and the compute scale that makes ``model`` predict it (module level: the launcher pickles it by reference)."""
    from ..cli.common import compile_job, rank_batch
    from ..cli.job import build

    from .measure import timed_steps

    step_job = step_job or StepJob()
    job = step_job.load()
    in_use_base = malloc_in_use()
    step = compile_job(job, build(job), rank_batch(job, 0, ctx.world_size, ctx.rank), ctx)
    times, sampled_peak = timed_steps(ctx, job, step, max(3, reps // 2), warmup=2)  # as tune --measure times it
    compiled = step.compiled
    planned = make_plan(compiled, cost_model=model).memory.peak
    beyond = 0.0 if sampled_peak is None or in_use_base is None else float(sampled_peak - in_use_base - planned)
    slowest = torch.tensor([*times, beyond], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    measured = statistics.median(slowest[:-1].tolist())
    predicted = model.predict(compiled.schedule, compiled.graph_module).step_time_s
    return {"job": step_job.name, "measured_s": measured, "predicted_s": predicted,
            "scale": compute_scale(model, lambda m: m.predict(compiled.schedule, compiled.graph_module).step_time_s,
                                   measured),
            "runtime_bytes": max(0, int(slowest[-1]))}


def scaled_compute(compute: ComputeModel, scale: float) -> ComputeModel:
    """``compute`` running ``scale`` times as long: rates divided, per-node costs multiplied."""
    return attrs.evolve(compute, flops_per_s=compute.flops_per_s / scale, bytes_per_s=compute.bytes_per_s / scale,
                        op_overhead_s=compute.op_overhead_s * scale, view_overhead_s=compute.view_overhead_s * scale)


def compute_scale(model: CostModel, predict, measured_s: float, low: float = SCALE_LIMITS[0],
                  high: float = SCALE_LIMITS[1]) -> float:
    """The factor on ``model``'s compute whose prediction (``predict(cost model)``) is ``measured_s``, by bisection.

    A prediction grows with the factor (compute only lengthens), so the bisection converges; a step outside
    what ``[low, high]`` can predict gets the nearer end.
    """
    at = lambda f: predict(attrs.evolve(model, compute=scaled_compute(model.compute, f)))  # noqa: E731
    if at(low) >= measured_s:
        return low
    if at(high) <= measured_s:
        return high
    for _ in range(40):
        middle = math.sqrt(low * high)
        low, high = (middle, high) if at(middle) < measured_s else (low, middle)
    return math.sqrt(low * high)


def probe_rank(ctx, reps: int, payloads: tuple[int, ...] = PAYLOADS, mesh: tuple[tuple[str, int], ...] = ()) -> dict:
    """One rank's probes (module level: the launcher pickles it by reference): link times (the world's, and
    with ``mesh`` each axis's, as ``"axis:<name>"``) and contention."""
    from ..compiler import MeshShape
    from ..runtime.groups import mesh_groups

    out = {"link": _link_times(ctx, dist.group.WORLD, ctx.world_size, reps, payloads)}
    shape = MeshShape(tuple(mesh)) if mesh else None
    for axis, size in mesh:
        if size > 1:
            group = mesh_groups(shape, [axis], ctx.rank, ctx.timeout_s)[axis]
            out[f"axis:{axis}"] = _link_times(ctx, group, size, reps, payloads)
    contention = _contention(ctx, reps)
    dist.barrier()  # every rank measures its compute at once, as ranks compute side by side in a step
    compute = calibrate_compute(torch.get_num_threads(), reps)
    return {**out, "contention": contention, "backend": ctx.backend.value, "compute": attrs.asdict(compute)}


def _link_times(ctx, group, n: int, reps: int, payloads: tuple[int, ...]) -> dict[str, float]:
    """``"<kind>/<payload>"`` -> seconds of one collective on ``group`` (``n`` ranks), every group at once: the
    median of the quicker third of ``reps`` issue + wait after a barrier of the world."""
    c10d = torch.ops._c10d_functional
    name = group.group_name
    times = {}
    for kind in KINDS:
        for payload in payloads:
            x = torch.randn(payload // 4 // (n if kind == "all_gather" else 1), device=ctx.device)
            runs = []
            for _ in range(reps + 2):
                dist.barrier()
                begin = time.perf_counter()
                y = (c10d.all_gather_into_tensor(x, n, name) if kind == "all_gather" else
                     c10d.reduce_scatter_tensor(x, "sum", n, name) if kind == "reduce_scatter" else
                     c10d.all_reduce(x, "sum", name))
                c10d.wait_tensor(y)
                runs.append(time.perf_counter() - begin)
            times[f"{kind}/{payload}"] = statistics.median(sorted(runs[2:])[: max(1, reps // 3)])
    return times


def _contention(ctx, reps: int) -> float:
    """How much longer a matmul loop takes while a collective is in flight on the same cores (1.0: no slowdown).

    Every rank issues a 16 MiB all-reduce asynchronously and computes while it runs, as a step computes
    while a prefetched gather or a reduce-scatter is in flight; then computes again with nothing in flight.
    """
    a, b = torch.randn(MATMUL, MATMUL), torch.randn(MATMUL, MATMUL)
    x = torch.randn(PAYLOADS[-1] // 4)

    def loop() -> float:
        begin = time.perf_counter()
        for _ in range(8):
            a @ b
        return time.perf_counter() - begin

    alone, beside = [], []
    for _ in range(max(3, reps // 3)):
        dist.barrier()
        alone.append(loop())
        dist.barrier()
        work = dist.all_reduce(x, async_op=True)
        beside.append(loop())
        work.wait()
    return min(beside) / min(alone)


def fit_link(samples, world: int, gloo: bool) -> tuple[float, float]:
    """Fit ``t = steps * alpha + wire / bandwidth`` in relative error, alpha >= 0 (Note [calibration])."""
    rows = []
    for kind, payload, t in samples:
        as_all_reduce = kind == "all_reduce" or (gloo and kind == "reduce_scatter")
        steps, share = (2 * (world - 1), 2 * (world - 1) / world) if as_all_reduce else (world - 1, (world - 1) / world)
        rows.append([steps / t, share * payload / t])
    a, b = np.array(rows), np.ones(len(rows))
    (alpha, beta), *_ = np.linalg.lstsq(a, b, rcond=None)
    if alpha < 0:  # no latency term fits better than a negative one: the bandwidth alone
        alpha, beta = 0.0, float(np.linalg.lstsq(a[:, 1:], b, rcond=None)[0][0])
    if beta <= 0:
        raise SpecError("the link's samples fit no positive bandwidth; calibrate again on a quieter machine")
    return float(alpha), float(1 / beta)


def calibrate_compute(threads: int, reps: int) -> ComputeModel:
    """The CPU roofline with ``threads`` threads, fitted to two GPT steps measured at world 1.

    A 512^3 matmul and a cache-resident add give the rates' shape; real steps run their kernels
    slower than those (larger operands, memory traffic). Two measured steps fix the two unknowns
    of ``step = roofline / efficiency + nodes * overhead + views * view``: the tiny GPT (its time is
    mostly per-node overhead) and the 10M GPT (mostly arithmetic). The rates are scaled by the
    efficiency; the per-node overhead is the fitted one.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(MATMUL, MATMUL), torch.randn(MATMUL, MATMUL)
        flops = 2 * MATMUL**3 / _best(lambda: a @ b, reps)
        x, y = torch.randn(1 << 18), torch.randn(1 << 18)
        bandwidth = 3 * x.numel() * 4 / _best(lambda: x + y, reps)
        view = _best(lambda: [x.view(-1) for _ in range(1000)], reps) / 1000
        steps = [_measured_step(size, flops, bandwidth, reps) for size in ("tiny", "10M")]
    finally:
        torch.set_num_threads(previous)
    # step_time - views * view = roofline * (1 / efficiency) + nodes * overhead, for both steps
    lhs = np.array([[roofline, nodes] for _, roofline, nodes, _ in steps])
    rhs = np.array([measured - views * view for measured, _, _, views in steps])
    try:
        inverse_efficiency, overhead = np.linalg.solve(lhs, rhs)
    except np.linalg.LinAlgError:
        inverse_efficiency, overhead = 1.0, -1.0
    if inverse_efficiency <= 0 or overhead < 0:  # the two steps disagree with the model: keep the raw rates
        measured, roofline, nodes, views = steps[0]
        inverse_efficiency, overhead = 1.0, max(0.0, (measured - roofline - view * views) / max(nodes, 1))
    efficiency = 1.0 / float(inverse_efficiency)
    return ComputeModel("calibrated-cpu", flops_per_s=flops * efficiency, bytes_per_s=bandwidth * efficiency,
                        op_overhead_s=float(overhead), view_overhead_s=view)


def _measured_step(size: str, flops: float, bandwidth: float, reps: int) -> tuple[float, float, int, int]:
    """examples/gpt.py at ``size``, one rank's batch of two ranks, at world 1: (measured s, roofline s, nodes,
    views)."""
    from ..cli.common import rank_batch
    from ..cli.job import build
    from ..compiler.analysis.cost import node_bytes, node_flops
    from ..compiler.ir.graph_utils import is_alias_op
    from ..runtime.dist import DistContext
    from .. import api

    job = _gpt_job(size)
    batch = rank_batch(job, 0, 2, 0)
    step = api.compile(build(job, 0), job.loss_fn, job.spec, optimizer=job.optimizer, example_batch=batch,
                       dist_context=DistContext.single())
    measured = _best(lambda: step(batch), max(3, reps // 2))
    nodes = [n for n in step.compiled.graph_module.graph.nodes if n.op == "call_function"]
    views = [n for n in nodes if is_alias_op(n)]
    work = [n for n in nodes if not is_alias_op(n)]
    roofline = sum(max(node_flops(n) / flops, node_bytes(n) / bandwidth) for n in work)
    return measured, roofline, len(work), len(views)


def _gpt_job(size: str):
    """examples/gpt.py of the source tree at ``GPT_SIZE=size``, the environment left as it was."""
    from ..cli.job import load_job

    job_file = Path(__file__).resolve().parents[2] / "examples" / "gpt.py"
    if not job_file.is_file():
        raise SpecError(f"calibrate measures examples/gpt.py of the source tree; {job_file} is not there")
    saved = os.environ.get("GPT_SIZE")
    os.environ["GPT_SIZE"] = size
    try:
        return load_job(job_file)
    finally:
        if saved is None:
            os.environ.pop("GPT_SIZE", None)
        else:
            os.environ["GPT_SIZE"] = saved


def _calibration_file(path: str | Path) -> dict:
    """A calibration file's JSON object, its format and version checked (it is untrusted input)."""
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as exc:
        raise SpecError(f"--calibration {str(path)!r} cannot be read ({exc.strerror or exc}); write one with "
                        "`shardlang calibrate --out machine.json`") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SpecError(f"--calibration {path}: not JSON ({exc})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT or raw.get("version") != VERSION:
        raise SpecError(f"--calibration {path}: not a {FORMAT} version {VERSION} file; write one with "
                        "`shardlang calibrate --out machine.json`")
    return raw


def read_calibration(path: str | Path) -> CostModel:
    """The cost model of a calibration file, every field checked (it is untrusted input)."""
    raw = _calibration_file(path)

    def number(table: dict, key: str, where: str, least: float = 0.0, strict: bool = False) -> float:
        value = table.get(key) if isinstance(table, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value < least or (strict and value <= least):
            raise SpecError(f"--calibration {path}: {where}.{key} is {value!r}; expected a finite number "
                            f"{'>' if strict else '>='} {least:g}")
        return float(value)

    def link_of(link: object, where: str) -> LinkModel:
        backend = link.get("backend") if isinstance(link, dict) else None
        if backend not in ("gloo", "nccl"):
            raise SpecError(f"--calibration {path}: {where}.backend is {backend!r}; expected 'gloo' or 'nccl'")
        return LinkModel(str(link.get("name", "calibrated")), alpha_s=number(link, "alpha_s", where),
                         bandwidth=number(link, "bandwidth", where, strict=True), backend=backend,
                         reduce_scatter_as_all_reduce=bool(link.get("reduce_scatter_as_all_reduce", False)))

    compute = raw.get("compute")
    link_model = link_of(raw.get("link"), "link")
    per_axis = raw.get("axis_links", {})
    if not isinstance(per_axis, dict) or not all(isinstance(a, str) and a for a in per_axis):
        raise SpecError(f"--calibration {path}: axis_links is {type(per_axis).__name__}; expected an object of "
                        "axis name -> link")
    axis_links = {axis: link_of(link, f"axis_links.{axis}") for axis, link in per_axis.items()}
    compute_model = ComputeModel(str(compute.get("name", "calibrated") if isinstance(compute, dict) else ""),
                                 flops_per_s=number(compute, "flops_per_s", "compute", strict=True),
                                 bytes_per_s=number(compute, "bytes_per_s", "compute", strict=True),
                                 op_overhead_s=number(compute, "op_overhead_s", "compute"),
                                 view_overhead_s=number(compute, "view_overhead_s", "compute"))
    contention = number(raw, "compute_slowdown_under_comm", "calibration", least=1.0)
    return CostModel(link=link_model, compute=compute_model, contention=contention, axis_links=axis_links)


def beyond_probes(largest: int, path: str | Path) -> str | None:
    """A note when a step's largest collective (``largest`` payload bytes) is larger than any the calibration
    at ``path`` probed: its time is the link fit's extrapolation, which can be far off (docs/tune.md)."""
    samples = _calibration_file(path).get("samples")
    payloads = [s[1] for s in samples if isinstance(s, list) and len(s) == 3 and isinstance(s[1], int)] \
        if isinstance(samples, list) else []
    if not payloads or largest <= max(payloads):
        return None
    wanted = next((size for size in probe_payloads(MAX_PAYLOAD) if size >= largest), MAX_PAYLOAD)
    size = f"{wanted >> 20}MiB" if wanted >= 1 << 20 else f"{wanted >> 10}KiB"  # as --max-payload reads it
    return (f"note: the largest collective moves {human_bytes(largest)}, and the calibration {path} probed the link "
            f"up to {human_bytes(max(payloads))}: its time is the fit's extrapolation (to probe that far: "
            f"shardlang calibrate --max-payload {size})")


def step_budget(budget: int, path: str | Path) -> int:
    """``budget`` (a process's bytes) less the calibration's ``runtime_bytes`` (Note [the runtime's share]).

    A calibration without the field (an older one) takes nothing off; its other fields are `read_calibration`'s.
    """
    runtime = _calibration_file(path).get("runtime_bytes", 0)
    if isinstance(runtime, bool) or not isinstance(runtime, int) or runtime < 0:
        raise SpecError(f"--calibration {path}: runtime_bytes is {runtime!r}; expected a whole number of bytes >= 0")
    if runtime >= budget:
        raise SpecError(f"--memory-budget {human_bytes(budget)}: the calibration {path} measured the runtime alone "
                        f"holding {human_bytes(runtime)}; a budget above that leaves room for the step")
    return budget - runtime


def _best(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(reps):
        begin = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - begin)
    return best
