"""Argument types and shared argument groups for the command line.

Each type parses one string and raises ``argparse.ArgumentTypeError`` with a
message that names the value and what would be valid; the parser turns that
into one ``shardlang: error: ...`` line (exit 2). `add_model_arguments` and
`cost_model` are the cost model's knobs, shared by ``plan`` and ``diff``.

Example::

    >>> positive("a number of steps")("3")
    3
    >>> world_sizes("1,2,2,4")
    (1, 2, 4)
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import attrs

from ..compiler import COMPUTE_PRESETS, CostModel, LINK_PRESETS


def add_spec_argument(parser) -> None:
    """``--spec FILE``: a spec TOML file in place of the job's ``spec`` (``run``, ``plan``, ``check``, ``calibrate``)."""
    parser.add_argument("--spec", metavar="FILE", default=None,
                        help="a spec TOML file (its [shardlang] table, or the whole file; `shardlang tune` writes "
                             "one) used in place of the job file's spec")


def spec_path(args) -> str | None:
    """``--spec`` made absolute (ranks may start elsewhere), or None."""
    return str(Path(args.spec).resolve()) if args.spec else None


def positive(what: str):
    return _int_parser(what, 1)


def nonnegative_int(what: str):
    return _int_parser(what, 0)


def _int_parser(what: str, least: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < least:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}; expected an integer >= {least}")
        return value

    return parse


def positive_float(what: str):
    return _float_parser(what, lambda v: v > 0 and v != float("inf"), "a number > 0, e.g. 40e9")


def seconds(what: str):
    return _float_parser(what, lambda v: v > 0 and v != float("inf"), "a number of seconds > 0, e.g. 600")


def nonnegative_float(what: str):
    return _float_parser(what, lambda v: v >= 0 and v != float("inf"), "a number >= 0 in seconds, e.g. 5e-6")


def fraction(what: str):
    return _float_parser(what, lambda v: 0.0 <= v < 1.0, "a number in [0, 1), e.g. 0.01")


def _float_parser(what: str, ok, expected: str):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}; expected {expected}")
        return value

    return parse


def output_file(text: str) -> str:
    """A path to write to: its directory must exist (checked before any work, not after it)."""
    directory = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text) or not os.path.isdir(directory):
        why = "is a directory" if os.path.isdir(text) else f"is in {directory}, which does not exist"
        raise argparse.ArgumentTypeError(f"{text!r} {why}; expected a file path in an existing directory")
    return text


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def byte_size(text: str) -> int:
    """Bytes from ``"80GiB"``, ``"512MiB"``, ``"40GB"`` or a plain count. Example: ``byte_size("80GiB") == 80 * 2**30``."""
    stripped = text.strip().replace(" ", "")
    number = stripped.rstrip("KMGTBikmgtb")
    unit = stripped[len(number):].lower()
    try:
        value = float(number)
    except ValueError:
        value = None
    if value is None or unit not in _BYTE_UNITS or value <= 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a memory size; expected a number > 0 with a unit such as "
                                         "80GiB, 512MiB or 40GB (or a count of bytes)")
    return int(value * _BYTE_UNITS[unit])


def recompute_rule(text: str) -> tuple[str, str]:
    """``PATTERN=POLICY`` as a ``(pattern, policy)`` pair. Example: ``recompute_rule("layers.*=full")``."""
    from ..spec.recompute import to_policy
    from ..errors import SpecError

    pattern, sep, policy = text.partition("=")
    if not sep or not pattern.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not a recompute rule; expected PATTERN=POLICY such as "
                                         "'layers.*=full' (policies: none, full, selective)")
    try:
        return pattern.strip(), to_policy(policy.strip(), f"--recompute {text!r}").value
    except SpecError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def world_sizes(text: str) -> tuple[int, ...]:
    parts = [p.strip() for p in text.split(",")]
    try:
        sizes = tuple(int(p) for p in parts)
    except ValueError:
        sizes = ()
    if not sizes or any(n < 1 for n in sizes):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a list of world sizes; expected comma-separated integers >= 1, e.g. 1,2,4"
        )
    return tuple(dict.fromkeys(sizes))


@attrs.frozen
class LinkPresets:
    """``--link``: the preset of every axis not named, and (axis, preset) pairs. Example: ``tp=nvlink,infiniband``."""

    given: str | None  # the preset given without an axis
    axes: tuple[tuple[str, str], ...] = ()

    @property
    def default(self) -> str:
        """The preset of an axis not named: the one given without an axis, else the first axis's, else gloo's."""
        return self.given or (self.axes[0][1] if self.axes else "gloo-loopback")

    def __str__(self) -> str:
        return ",".join(([self.given] if self.given else []) + [f"{a}={p}" for a, p in self.axes])

    def check_axes(self, mesh_axes, where: str) -> None:
        """A `SpecError` for an axis that is not one of ``mesh_axes`` (the spec's, named by ``where``)."""
        from ..errors import SpecError

        for axis, _ in self.axes:
            if axis not in mesh_axes:
                raise SpecError(f"--link {self}: axis {axis!r} is not an axis of {where}'s mesh "
                                f"({', '.join(mesh_axes)}); name those axes, or give one preset for all")


def link_presets(text: str) -> LinkPresets:
    """Parse ``--link``: ``nvlink``, or ``tp=nvlink,fsdp=infiniband``, or both kinds (``infiniband,tp=nvlink``)."""
    default, axes = None, {}
    for part in (p.strip() for p in text.split(",")):
        axis, _, preset = part.rpartition("=")
        if preset not in LINK_PRESETS:
            raise argparse.ArgumentTypeError(f"{text!r}: {preset!r} is not a link preset; presets: "
                                             f"{', '.join(sorted(LINK_PRESETS))} (one for every axis, or "
                                             "axis=preset pairs, e.g. tp=nvlink,fsdp=infiniband)")
        if not axis:
            if default is not None:
                raise argparse.ArgumentTypeError(f"{text!r} gives two presets without an axis ({default!r} and "
                                                 f"{preset!r}); name the axis of each: tp=nvlink,fsdp=infiniband")
            default = preset
        elif axis in axes:
            raise argparse.ArgumentTypeError(f"{text!r} names axis {axis!r} twice")
        else:
            axes[axis] = preset
    return LinkPresets(default, tuple(axes.items()))


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The cost model's knobs (docs/plan.md, "The knobs")."""
    group = parser.add_argument_group("cost model")
    group.add_argument("--link", type=link_presets, default=LinkPresets("gloo-loopback"), metavar="PRESET",
                       help="link preset for the alpha-beta model (default gloo-loopback), or one per mesh axis: "
                            "tp=nvlink,fsdp=infiniband (an axis left out takes the preset given without an axis, "
                            f"else the first axis's); presets: {', '.join(sorted(LINK_PRESETS))}")
    group.add_argument("--compute", choices=sorted(COMPUTE_PRESETS), default="cpu",
                       help="compute preset for the roofline (default cpu)")
    group.add_argument("--alpha", metavar="SECONDS", type=nonnegative_float("a latency"), default=None,
                       help="latency of one ring step, overriding the link's")
    group.add_argument("--bandwidth", metavar="BYTES_PER_S", type=positive_float("a bandwidth"), default=None,
                       help="bytes per second a rank sends, overriding the link's (e.g. 40e9)")
    group.add_argument("--flops", metavar="FLOPS_PER_S", type=positive_float("a FLOP rate"), default=None,
                       help="matmul rate, overriding the compute preset's (e.g. 400e12)")
    group.add_argument("--calibration", metavar="FILE", default=None,
                       help="this machine's link and compute as `shardlang calibrate` measured them, in place of "
                            "--link and --compute")


def step_memory_budget(args) -> int | None:
    """``--memory-budget`` less the runtime's share a ``--calibration`` measured (Note [the runtime's share])."""
    budget = getattr(args, "memory_budget", None)
    if budget is None or not getattr(args, "calibration", None):
        return budget
    from ..tune.calibrate import step_budget

    return step_budget(budget, args.calibration)


def cost_model(args) -> CostModel:
    contention = 1.0
    if getattr(args, "calibration", None):
        from ..tune.calibrate import read_calibration

        calibrated = read_calibration(args.calibration)
        link, device, contention = calibrated.link, calibrated.compute, calibrated.contention
        axis_links = dict(calibrated.axis_links)
    else:
        link, device = LINK_PRESETS[args.link.default], COMPUTE_PRESETS[args.compute]
        axis_links = {axis: LINK_PRESETS[preset] for axis, preset in args.link.axes}
    if args.alpha is not None:  # the link of every axis --link does not name
        link = attrs.evolve(link, alpha_s=args.alpha)
    if args.bandwidth is not None:
        link = attrs.evolve(link, bandwidth=args.bandwidth)
    if args.flops is not None:
        device = attrs.evolve(device, flops_per_s=args.flops)
    return CostModel(link=link, compute=device, contention=contention, axis_links=axis_links)
