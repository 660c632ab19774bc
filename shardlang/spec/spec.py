"""`Spec`: how a model's parameters are laid out over a mesh; `Spec.resolve` meets it with a model.

A spec has four parts: the mesh (`shardlang.spec.mesh`), the rules that give each
parameter a layout (`shardlang.spec.rules`), the units that are gathered together
(`shardlang.spec.units`), and `Options`; optionally, per unit, a strategy
(`shardlang.spec.strategy`) and a recompute policy (`shardlang.spec.recompute`). It is written in Python::

    spec = Spec(
        mesh=Mesh(fsdp=4),
        rules=[("*.ln*.*", replicate()), ("*", shard("fsdp"))],
        units=["blocks.*"],
    )

or read from a dict or TOML file (`Spec.from_dict`, `Spec.from_toml`; the format
is in docs/spec.md). A spec checks itself when built; `Spec.resolve` checks it
against a model and a world size and gives the compiler plain `ParamInfo` data.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import attrs
from torch import nn

from shardlang.errors import CompileError, SpecError
from ..compiler import MeshShape, ParamInfo, TensorAxis
from ..compiler.placement.placements import Shard as TensorShard, local_shape
from shardlang.spec.vocabulary import Recompute, Strategy
from shardlang.spec.layout import Shard, shard
from shardlang.spec.mesh import Mesh, check_world_size
from shardlang.spec.tensor_axes import default_data_axis, is_tensor_axis, split_layout
from shardlang.spec.options import Options, options_from_dict
from shardlang.spec.resolved import ResolvedSpec
from shardlang.spec.toml_text import to_toml_text
from shardlang.spec.rules import Rule, first_match, rule_from_dict, to_rules
from shardlang.spec import training
from shardlang.spec.recompute import RecomputeRule, recompute_rule_from_dict, to_recompute
from shardlang.spec.strategy import StrategyRule, strategy_rule_from_dict, to_strategies
from shardlang.spec.units import ROOT_UNIT, find_units, some_names, to_units, unit_label, unit_of

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

__all__ = ["Options", "ResolvedSpec", "Spec"]

_SPEC_KEYS = ("mesh", "rules", "units", "strategies", "recompute", "options", "param_groups")
def _check_mesh(_instance: object, _attribute: object, mesh: object) -> None:
    if not isinstance(mesh, Mesh):
        raise SpecError(f"Spec mesh is {mesh!r}; it must be a Mesh, e.g. Mesh(fsdp=4) or Mesh(fsdp=-1)")


def _check_rule_axes(spec: Spec, _attribute: object, rules: tuple[Rule, ...] | None) -> None:
    for i, rule in enumerate(rules or ()):
        for layout in rule.layout if isinstance(rule.layout, tuple) else (rule.layout,):
            if isinstance(layout, Shard) and layout.axis not in spec.mesh.axis_names:
                raise SpecError(
                    f"rules[{i}] = {rule!r} shards over axis {layout.axis!r}, which is not an axis of "
                    f"{spec.mesh!r}; valid axes are {list(spec.mesh.axis_names)}"
                )
        split_layout(rule.layout, spec.mesh.axis_names, f"rules[{i}] = {rule!r}")


def _check_options(_instance: object, _attribute: object, options: object) -> None:
    if not isinstance(options, Options):
        raise SpecError(f"Spec options is {options!r}; it must be an Options, e.g. Options(prefetch=1)")


def _rules_or_default(value: object) -> tuple[Rule, ...] | None:
    return None if value is None else to_rules(value)


def _check_tensor_divides(name: str, shape: tuple[int, ...], dim: int, axis: str, ranks: int, rule: int) -> None:
    """A tensor axis splits a dim evenly or not at all (`local_shape`'s check): an uneven split would mis-shape
    every op it reaches."""
    try:
        local_shape(shape, TensorShard(dim), ranks, f"parameter {name!r} on axis {axis!r}")
    except CompileError as exc:
        raise SpecError(f"rules[{rule}]: {exc}; give {axis} a degree that divides {shape[dim]}, or replicate "
                        f"{name!r} over {axis}") from None


@attrs.frozen
class Spec:
    """A sharding spec: mesh, rules (first match wins), units and options.

    ``rules`` defaults to ``[("*", shard(<last mesh axis>))]``: every parameter
    sharded flat. ``units`` defaults to None: the repeated children of every
    ModuleList / Sequential. ``strategies`` and ``recompute`` are
    ``(unit pattern, value)`` pairs, first match wins (`shardlang.spec.strategy`,
    `shardlang.spec.recompute`), e.g. ``recompute=[("blocks.*", "full")]``. Lists
    become tuples; everything is checked here, and again against the model in `resolve`. ``source`` says where the spec came from
    (a file, a table) for error messages; it is not part of the value. Example::

        >>> from shardlang.spec.layout import replicate, shard
        >>> spec = Spec(Mesh(fsdp=4), rules=[("ln*", replicate()), ("*", shard("fsdp"))], units=["blocks.*"])
        >>> spec.rules
        (Rule('ln*', replicate()), Rule('*', shard('fsdp')))
        >>> spec.units, spec.options == Options()
        (('blocks.*',), True)
        >>> Spec(Mesh(fsdp=-1)).rules
        (Rule('*', shard('fsdp')),)
    """

    mesh: Mesh = attrs.field(validator=_check_mesh)
    rules: tuple[Rule, ...] = attrs.field(default=None, converter=_rules_or_default, validator=_check_rule_axes)
    units: tuple[str, ...] | None = attrs.field(default=None, converter=to_units)
    options: Options = attrs.field(factory=Options, validator=_check_options)
    param_groups: tuple[training.ParamGroup, ...] = attrs.field(default=(), converter=training.to_param_groups)
    strategies: tuple[StrategyRule, ...] | None = attrs.field(default=None, converter=to_strategies)
    recompute: tuple[RecomputeRule, ...] | None = attrs.field(default=None, converter=to_recompute)
    source: str = attrs.field(default="the spec", kw_only=True, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.rules is None:
            object.__setattr__(self, "rules", (Rule("*", shard(default_data_axis(self.mesh.axis_names))),))

    # -- plain-dict and TOML forms ------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: Mapping[str, object], source: str = "the spec dict") -> Spec:
        """A spec from its plain-dict form, such as a parsed TOML table. ``source`` names it in errors.

        Keys: ``mesh`` (required; axis name -> size), ``rules`` (a list of tables with
        ``pattern``, ``layout`` = ``"shard"`` / ``"replicate"``, and for shard ``axis``
        and an optional ``dim``), ``units`` (a list of patterns), ``options``. Example::

            >>> from shardlang.spec.layout import replicate, shard
            >>> spec = Spec.from_dict({
            ...     "mesh": {"fsdp": 4},
            ...     "rules": [
            ...         {"pattern": "ln*", "layout": "replicate"},
            ...         {"pattern": "*", "layout": "shard", "axis": "fsdp"},
            ...     ],
            ...     "units": ["blocks.*"],
            ... })
            >>> spec == Spec(Mesh(fsdp=4), rules=[("ln*", replicate()), ("*", shard("fsdp"))], units=["blocks.*"])
            True
        """
        with _prefixed(source):
            if not isinstance(d, Mapping):
                raise SpecError(f"the spec is {d!r}; it must be a table with keys {list(_SPEC_KEYS)}")
            _check_keys(d, _SPEC_KEYS, "the spec")
            if "mesh" not in d:
                raise SpecError("missing key 'mesh', a table of axis sizes such as {fsdp = 4}")
            mesh = _mesh_from_dict(d["mesh"])
            rules = _tables(d, "rules", rule_from_dict, "rule tables ([[rules]] in TOML)")
            options = options_from_dict(d.get("options", {}))
            groups = d.get("param_groups", ())
            if not isinstance(groups, list | tuple):
                raise SpecError(f"param_groups is {groups!r}; it must be a list of tables ([[param_groups]] in TOML)")
            strategies = _tables(d, "strategies", strategy_rule_from_dict,
                                 "strategy tables ([[strategies]] in TOML)")
            recompute = _tables(d, "recompute", recompute_rule_from_dict, "recompute tables ([[recompute]] in "
                                "TOML: pattern = 'blocks.*', policy = 'full')")
            return cls(mesh, rules=rules, units=d.get("units"), options=options, param_groups=groups,
                       strategies=strategies, recompute=recompute, source=source)

    @classmethod
    def from_toml(cls, path: str | Path, table: str | None = None) -> Spec:
        """A spec from a TOML file: the ``[shardlang]`` table if there is one, else the whole file.

        ``table`` picks another (dotted) table, e.g. ``"tool.shardlang"``. Example::

            spec = Spec.from_toml("train.toml")          # [shardlang] mesh = {fsdp = 4} ...
        """
        path = Path(path)
        try:
            doc = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise SpecError(f"{path}: not valid TOML: {e}") from None
        except UnicodeDecodeError as e:
            raise SpecError(f"{path}: not valid TOML: byte {e.start} is not UTF-8 ({e.reason})") from None
        except OSError as e:
            raise SpecError(f"{path}: cannot be read: {e.strerror or e}") from None
        if table is None:
            table = "shardlang" if "shardlang" in doc else ""
            if not table and "mesh" not in doc:
                raise SpecError(
                    f"{path}: no [shardlang] table and no top-level 'mesh'; put the spec in a [shardlang] "
                    f"table, or make the whole file a spec (keys {list(_SPEC_KEYS)}); top-level keys are {sorted(doc)}"
                )
        node: object = doc
        for key in table.split(".") if table else ():
            if not isinstance(node, Mapping) or key not in node:
                found = sorted(node) if isinstance(node, Mapping) else []
                raise SpecError(f"{path}: no table [{table}] (missing {key!r}); top-level keys are {found}")
            node = node[key]
        source = f"{path} [{table}]" if table else str(path)
        return cls.from_dict(node, source=source)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, object]:
        """The plain-dict form; ``Spec.from_dict(spec.to_dict()) == spec``. ``units`` is left out when None.

        Example: ``Spec(Mesh(fsdp=2)).to_dict()["rules"] == [{"pattern": "*", "layout": "shard", "axis": "fsdp"}]``.
        """
        d: dict[str, object] = {"mesh": dict(self.mesh.axes), "rules": [r.to_dict() for r in self.rules]}
        if self.units is not None:
            d["units"] = list(self.units)
        d["options"] = self.options.to_dict()
        if self.param_groups:
            d["param_groups"] = [g.to_dict() for g in self.param_groups]
        if self.strategies is not None:
            d["strategies"] = [r.to_dict() for r in self.strategies]
        if self.recompute is not None:
            d["recompute"] = [r.to_dict() for r in self.recompute]
        return d

    def to_toml(self, table: str | None = "shardlang") -> str:
        """The TOML form, in table ``[table]`` (None: the whole file); `from_toml` reads it back.

        Example: ``Path("spec.toml").write_text(spec.to_toml())``.
        """
        return to_toml_text(self.to_dict(), table)

    # -- meeting the model ----------------------------------------------------------------------

    def resolve(self, model: nn.Module, world_size: int) -> ResolvedSpec:
        """Check this spec against ``model`` and ``world_size``; give every parameter its placement and unit.

        Walks ``model.named_parameters()`` (a tied parameter once, by its first name).
        Raises `SpecError` when the mesh does not fit the world size, a parameter
        matches no rule, a rule decides no parameter, a unit pattern matches no
        module, or a rule names a dim a parameter does not have. The model may live
        on the meta device. Example::

            resolved = spec.resolve(model, world_size=4)
            resolved.param("blocks.0.attn.qkv.weight").placement
        """
        if not isinstance(model, nn.Module):
            raise SpecError(f"{self.source}: resolve() needs a torch.nn.Module, got {type(model).__name__}")
        world_size = check_world_size(world_size, f"{self.source}: world size")
        with _prefixed(self.source):
            whole = self.mesh.bind(world_size).shape
            mesh = MeshShape(tuple((a, s) for a, s in whole.axes if not is_tensor_axis(a)))
            named = list(model.named_parameters())
            if not named:
                raise SpecError(f"the model ({type(model).__name__}) has no parameters, so there is nothing to shard "
                                "or train; pass the module that owns the parameters")
            winners = [first_match(self.rules, name) for name, _ in named]
            self._check_every_param_matches(named, winners)
            self._check_every_rule_decides(named, winners)
            units = frozenset(find_units(model, self.units))
            strategy_of = self._unit_strategies(units)
            recompute = self._unit_recompute(units)
            params, failures, tensor = [], [], {}
            sizes = dict(whole.axes)
            for (name, p), i in zip(named, winners):
                try:
                    data, on_tensor = split_layout(self.rules[i].layout, whole.names, f"rules[{i}]")  # type: ignore
                    placement = data.to_placement(tuple(p.shape), name)
                    splits = {axis: layout.to_placement(tuple(p.shape), name).dim for axis, layout in on_tensor.items()}
                except SpecError as e:
                    failures.append((i, name, e))
                    continue
                for axis, dim in splits.items():
                    _check_tensor_divides(name, tuple(p.shape), dim, axis, sizes[axis], i)
                    tensor[name] = TensorShard(dim)
                unit = unit_of(name, units)
                info = ParamInfo(
                    name=name, shape=p.shape, dtype=p.dtype, trainable=p.requires_grad, unit=unit, placement=placement,
                    strategy=strategy_of[unit],
                )
                params.append(info)
            self._check_no_failed_placements(failures)
            group_of = training.assign_groups([(name, p.requires_grad) for name, p in named], self.param_groups)
        tensor_axes = [(k, (a, s)) for k, (a, s) in enumerate(whole.axes) if is_tensor_axis(a)]
        if len(tensor_axes) > 1:
            raise SpecError(f"{self.source}: {self.mesh!r} has {len(tensor_axes)} tensor axes; one is supported")
        for option in ("sequence_parallel", "loss_parallel"):
            if getattr(self.options, option) and not tensor_axes:
                raise SpecError(f"{self.source}: Options.{option} splits activations over a tensor axis, and "
                                f"{self.mesh!r} has none; add one (sl.Mesh(fsdp=-1, tp=2)) or turn {option} off")
        axis = (TensorAxis(tensor_axes[0][1][0], tensor_axes[0][1][1], tensor_axes[0][0], tensor)
                if tensor_axes and tensor_axes[0][1][1] > 1 else None)
        if tensor_axes and axis is None:
            mesh = whole  # a tensor axis of one rank splits nothing: the data axes are the whole mesh
        return ResolvedSpec(mesh=mesh, params=tuple(params), options=self.options, param_groups=self.param_groups,
                            tensor=axis,
                            group_of=group_of, recompute={u: p for u, p in recompute.items() if u in
                                                          {info.unit for info in params}})

    def _unit_strategies(self, units: frozenset[str]) -> dict[str, Strategy]:
        """Each unit's strategy (first matching strategy rule, else the default); checks every rule decides one."""
        default = Strategy.ZERO3 if self.options.reshard_after_forward else Strategy.ZERO2
        winners = _first_rule_per_unit(self.strategies, "strategies", units)
        return {unit: default if i is None else self.strategies[i].strategy for unit, i in winners.items()}

    def _unit_recompute(self, units: frozenset[str]) -> dict[str, Recompute]:
        """Each unit's recompute policy (first matching rule, else NONE); checks every rule decides one."""
        winners = _first_rule_per_unit(self.recompute, "recompute", units)
        return {unit: Recompute.NONE if i is None else self.recompute[i].policy for unit, i in winners.items()}

    def _check_no_failed_placements(self, failures: list[tuple[int, str, SpecError]]) -> None:
        if not failures:
            return
        i, _, first = failures[0]
        others = [name for _, name, _ in failures[1:]]
        also = f"; {len(others)} more parameters ask for dims they lack: {some_names(others)}" if others else ""
        raise SpecError(f"rules[{i}] = {self.rules[i]!r}: {first}{also}")

    def _check_every_param_matches(self, named: list, winners: list[int | None]) -> None:
        missing = [name for (name, _), i in zip(named, winners) if i is None]
        if missing:
            what = "parameter" if len(missing) == 1 else f"{len(missing)} parameters"
            verb = "matches" if len(missing) == 1 else "match"
            raise SpecError(
                f"{what} {some_names(missing)} {verb} no rule; every parameter must match one. The rules are "
                f"{list(self.rules)}; add a rule for them, or end with a catch-all such as "
                f"('*', shard({self.mesh.axis_names[-1]!r}))"
            )

    def _check_every_rule_decides(self, named: list, winners: list[int | None]) -> None:
        decided = set(winners)
        names = [name for name, _ in named]
        for i, rule in enumerate(self.rules):
            if i in decided:
                continue
            matched = [name for name in names if rule.matches(name)]
            if not matched:
                raise SpecError(
                    f"rules[{i}] = {rule!r} matches no parameter; patterns match whole parameter names, "
                    f"such as {some_names(names) or '(the model has no parameters)'}"
                )
            earlier = sorted({first_match(self.rules, name) for name in matched})
            raise SpecError(
                f"rules[{i}] = {rule!r} decides no parameter: every one it matches ({some_names(matched)}) "
                f"is taken by an earlier rule ({', '.join(f'rules[{j}] = {self.rules[j]!r}' for j in earlier)}); "
                "the first match wins, so move it before them or remove it"
            )


# -- helpers --------------------------------------------------------------------------------------



@contextlib.contextmanager
def _prefixed(source: str) -> Iterator[None]:
    """Re-raise any `SpecError` inside with ``source:`` in front, so the message says where it came from."""
    try:
        yield
    except SpecError as e:
        raise SpecError(f"{source}: {e}") from None


def _check_keys(d: Mapping[str, object], valid: tuple[str, ...], where: str) -> None:
    for key in d:
        if key not in valid:
            raise SpecError(f"unknown key {key!r} in {where}; valid keys are {list(valid)}")


def _tables(d: Mapping[str, object], key: str, read, what: str) -> list | None:
    """The list of tables under ``key`` (None when absent), each read by ``read(table, "key[i]")``."""
    raw = d.get(key)
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise SpecError(f"{key} is {raw!r}; it must be a list of {what}")
    return [read(r, f"{key}[{i}]") for i, r in enumerate(raw)]


def _mesh_from_dict(raw: object) -> Mesh:
    if not isinstance(raw, Mapping) or not raw:
        raise SpecError(f"mesh is {raw!r}; it must be a table of axis sizes such as {{fsdp = 4}} or {{fsdp = -1}}")
    if not all(isinstance(k, str) for k in raw):
        raise SpecError(f"mesh is {raw!r}; its keys must be axis names (strings) such as 'fsdp'")
    return Mesh(**raw)


_RULE_NOUN = {"strategies": "strategy", "recompute": "recompute"}


def _first_rule_per_unit(rules, field: str, units: frozenset[str]) -> dict[str, int | None]:
    """Each unit's first matching rule index in ``rules`` (the spec's ``field``), None where none matches.

    Every rule must decide at least one unit: one that matches none, or only
    units earlier rules took, is an error naming it (the first match wins).
    """
    labels = [ROOT_UNIT, *sorted(units)]
    rules = rules or ()
    winners = {unit: next((i for i, r in enumerate(rules) if r.matches(unit_label(unit))), None) for unit in labels}
    for i, rule in enumerate(rules):
        if i in winners.values():
            continue
        matched = [unit_label(u) for u in labels if rule.matches(unit_label(u))]
        if not matched:
            raise SpecError(
                f"{field}[{i}] = {rule!r} matches no unit; {_RULE_NOUN[field]} "
                f"patterns match whole unit names such as {some_names([unit_label(u) for u in labels])} "
                "(units are modules; see units=)"
            )
        earlier = sorted({winners[u] for u in labels if unit_label(u) in matched})
        raise SpecError(
            f"{field}[{i}] = {rule!r} decides no unit: every one it matches ({some_names(matched)}) is taken by "
            f"an earlier rule ({', '.join(f'{field}[{j}] = {rules[j]!r}' for j in earlier)}); "
            "the first match wins, so move it before them or remove it"
        )
    return winners
