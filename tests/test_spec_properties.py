"""Property tests of the spec language: random parameter trees, shapes, meshes and rule sets.

The central property: `Spec(...).resolve(model, world)` either succeeds, with
every parameter placed by the first rule that matches it and the mesh bound to
the world size, or raises `SpecError`; never another exception. A small oracle
written independently of `shardlang.spec.spec` predicts which, so a wrong accept or a
wrong reject both fail. Shapes include prime and size-1 dims, 0-d scalars and
empty tensors; models live on the meta device, so every example is cheap.
"""

from __future__ import annotations

import math
import sys
from fnmatch import fnmatchcase

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn

from shardlang.errors import SpecError
from shardlang.compiler.layout.placement import LayoutKind
from shardlang.spec.layout import replicate, shard
from shardlang.spec.mesh import Mesh
from shardlang.spec.spec import Options, Spec

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SEGMENTS = ["a", "b", "ln", "w", "0", "1", "10"]
SIZES = [0, 1, 2, 3, 5, 7, 11, 13]
AXES = ["fsdp", "dp", "rep"]  # data axes: "tp" names the tensor axis (tests/test_tensor_parallel.py)
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

names_st = st.lists(st.sampled_from(SEGMENTS), min_size=1, max_size=3).map(".".join)
shape_st = st.lists(st.sampled_from(SIZES), max_size=3).map(tuple)
pattern_st = st.lists(st.sampled_from([*SEGMENTS, "*", "?", ".", "*.", ".*"]), min_size=1, max_size=4).map("".join)


@st.composite
def param_trees(draw) -> dict[str, tuple[int, ...]]:
    """Parameter names -> shapes, with no name a module on the path of another."""
    params: dict[str, tuple[int, ...]] = {}
    for name in draw(st.lists(names_st, min_size=1, max_size=8, unique=True)):
        prefixes = {".".join(name.split(".")[:k]) for k in range(1, name.count(".") + 1)}
        if prefixes & params.keys() or any(p.startswith(name + ".") for p in params):
            continue
        params[name] = draw(shape_st)
    return params


def build(params: dict[str, tuple[int, ...]], frozen: frozenset[str] = frozenset()) -> nn.Module:
    """A tree of plain modules with these parameters, on the meta device."""
    root = nn.Module()
    for name, shape in params.items():
        *path, leaf = name.split(".")
        module = root
        for seg in path:
            if not hasattr(module, seg):
                module.add_module(seg, nn.Module())
            module = getattr(module, seg)
        p = nn.Parameter(torch.empty(shape, device="meta"), requires_grad=name not in frozen)
        module.register_parameter(leaf, p)
    return root


@st.composite
def meshes(draw) -> Mesh:
    axes = draw(st.lists(st.sampled_from(AXES), min_size=1, max_size=2, unique=True))
    sizes = draw(st.lists(st.sampled_from([-1, 1, 2, 3, 4, 5, 7]), min_size=len(axes), max_size=len(axes)))
    if sizes.count(-1) > 1:
        sizes = [1 if s == -1 else s for s in sizes]
    return Mesh(**dict(zip(axes, sizes)))


layouts_st = st.one_of(
    st.just(replicate()),
    st.builds(shard, st.sampled_from(AXES), st.one_of(st.none(), st.integers(-4, 3))),
)
rules_st = st.lists(st.tuples(pattern_st, layouts_st), min_size=1, max_size=5)


def layouts_for(mesh: Mesh) -> st.SearchStrategy:
    """Layouts over the mesh's axes, with a rare axis the mesh lacks."""
    axes = st.sampled_from(list(mesh.axis_names) * 20 + AXES)
    return st.just(replicate()) | st.builds(shard, axes, st.none() | st.integers(-4, 3))


def patterns_for(params: dict[str, tuple[int, ...]]) -> st.SearchStrategy:
    """Random globs, plus names and globbed pieces of real parameter names, which often match."""
    pieces = st.sampled_from(sorted(params)).flatmap(
        lambda n: st.sampled_from([n, n.split(".")[0] + "*", "*" + n.split(".")[-1], "*." + n.split(".")[-1]])
    )
    return st.sampled_from([True, True, True, False]).flatmap(lambda real: pieces if real else pattern_st)


def worlds_for(mesh: Mesh) -> st.SearchStrategy:
    """World sizes that fit the mesh, and arbitrary ones."""
    known = math.prod(s for _, s in mesh.axes if s != -1)
    fitting = st.integers(1, 4).map(lambda k: known * k) if not mesh.is_bound else st.just(known)
    return st.sampled_from([True, True, True, False]).flatmap(lambda fit: fitting if fit else st.integers(1, 16))


def oracle(mesh: Mesh, rules, params: dict[str, tuple[int, ...]], world: int) -> str | None:
    """Why resolve must fail, or None when it must succeed; independent of shardlang.spec.spec."""
    if any(getattr(layout, "axis", None) not in (None, *mesh.axis_names) for _, layout in rules):
        return "axis"
    known = math.prod(s for _, s in mesh.axes if s != -1)
    if (world % known) if -1 in dict(mesh.axes).values() else (known != world):
        return "mesh"
    firsts = {}
    for name in params:
        hits = [i for i, (pattern, _) in enumerate(rules) if fnmatchcase(name, pattern)]
        if not hits:
            return "unmatched"
        firsts[name] = hits[0]
    if set(firsts.values()) != set(range(len(rules))):
        return "dead rule"
    for name, i in firsts.items():
        dim = getattr(rules[i][1], "dim", None)
        if dim is not None and not -len(params[name]) <= dim < len(params[name]):
            return "dim"
    return None


@SETTINGS
@given(params=param_trees(), mesh=meshes(), data=st.data())
def test_resolve_succeeds_exactly_when_the_oracle_says_so(params, mesh, data):
    rules = data.draw(st.lists(st.tuples(patterns_for(params), layouts_for(mesh)), min_size=1, max_size=3))
    if data.draw(st.sampled_from([True, True, True, False])):  # usually end with a catch-all
        rules.append(("*", data.draw(layouts_for(mesh))))
    world = data.draw(worlds_for(mesh))
    frozen = frozenset(data.draw(st.sets(st.sampled_from(sorted(params)))))
    model = build(params, frozen)
    expected_failure = oracle(mesh, rules, params, world)
    event(f"oracle: {expected_failure}")
    try:
        resolved = Spec(mesh, rules=rules, units=[]).resolve(model, world)
    except SpecError:
        assert expected_failure is not None, "resolve rejected a valid spec"
        return
    assert expected_failure is None, f"resolve accepted a spec that should fail ({expected_failure})"
    assert resolved.mesh.size == world and resolved.mesh.names == mesh.axis_names
    assert [p.name for p in resolved.params] == [name for name, _ in model.named_parameters()]
    assert sorted(p.name for p in resolved.params) == sorted(params)
    for p in resolved.params:
        i = next(i for i, (pattern, _) in enumerate(rules) if fnmatchcase(p.name, pattern))
        layout = rules[i][1]
        assert p.placement == layout.to_placement(params[p.name], p.name)
        assert p.shape == params[p.name] and p.trainable == (p.name not in frozen) and p.unit == ""
        if p.placement.kind is LayoutKind.SHARD_DIM:
            assert 0 <= p.placement.dim < len(p.shape)


@SETTINGS
@given(params=param_trees(), mesh=meshes(), data=st.data())
def test_a_rule_per_parameter_always_resolves(params, mesh, data):
    rules = []
    for name in data.draw(st.permutations(sorted(params))):
        ndim = len(params[name])
        dims = st.none() | (st.integers(-ndim, ndim - 1) if ndim else st.none())
        layout = data.draw(st.just(replicate()) | st.builds(shard, st.sampled_from(mesh.axis_names), dims))
        rules.append((name, layout))
    world = data.draw(worlds_for(mesh).filter(lambda w: oracle(mesh, [], {}, w) is None))
    resolved = Spec(mesh, rules=rules).resolve(build(params), world)
    layouts = dict(rules)
    for p in resolved.params:
        assert p.placement == layouts[p.name].to_placement(params[p.name], p.name)


@SETTINGS
@given(params=param_trees(), data=st.data())
def test_units_are_modules_and_each_param_gets_its_deepest(params, data):
    model = build(params)
    modules = {name for name, _ in model.named_modules() if name}
    module_patterns = st.sampled_from(sorted(modules)).flatmap(lambda m: st.sampled_from([m, m + "*", m + ".*"]))
    units = data.draw(st.lists(module_patterns | pattern_st if modules else pattern_st, max_size=3))
    spec = Spec(Mesh(fsdp=-1), units=units)
    if any(not any(fnmatchcase(m, u) for m in modules) for u in units):
        try:
            spec.resolve(model, 2)
        except SpecError:
            return
        raise AssertionError("a unit pattern that matches no module was accepted")
    chosen = set()
    overlap = False
    for u in units:  # per pattern, the matched modules with no matched ancestor
        matched = {m for m in modules if fnmatchcase(m, u)}
        outermost = {m for m in matched if not any(m.startswith(a + ".") for a in matched)}
        overlap |= bool(chosen & outermost)
        chosen |= outermost
    if overlap:  # two patterns that pick the same module: an error naming both
        try:
            spec.resolve(model, 2)
        except SpecError as e:
            assert str(e).count("units[") == 2, str(e)
            return
        raise AssertionError(f"units {units} pick one module twice and were accepted")
    resolved = spec.resolve(model, 2)
    event(f"units: {len(set(p.unit for p in resolved.params))}")
    for p in resolved.params:
        containing = [m for m in chosen if p.name.startswith(m + ".")]
        if p.unit == "":
            assert not containing
        else:
            assert p.unit in containing and all(len(p.unit) >= len(m) for m in containing)


@SETTINGS
@given(sizes=st.lists(st.sampled_from([-1, 1, 2, 3, 5, 7, 11]), min_size=1, max_size=3), world=st.integers(1, 30))
def test_mesh_bind_either_fits_the_world_or_raises(sizes, world):
    if sizes.count(-1) > 1:
        try:
            Mesh(**{f"ax{i}": s for i, s in enumerate(sizes)})
        except SpecError:
            return
        raise AssertionError("two -1 axes were accepted")
    mesh = Mesh(**{f"ax{i}": s for i, s in enumerate(sizes)})
    try:
        bound = mesh.bind(world)
    except SpecError as e:
        assert str(world) in str(e) and repr(mesh) in str(e)
        return
    assert bound.size == world and bound.axis_names == mesh.axis_names
    assert all(s == b for (_, s), (_, b) in zip(mesh.axes, bound.axes) if s != -1)


@SETTINGS
@given(
    mesh=meshes(),
    rules=rules_st,
    units=st.one_of(st.none(), st.lists(pattern_st, max_size=3)),
    options=st.builds(Options, st.booleans(), st.integers(0, 4)),
    table=st.sampled_from([None, "shardlang", "tool.shardlang"]),
)
def test_dict_and_toml_forms_round_trip(mesh, rules, units, options, table):
    rules = [(p, shard(mesh.axis_names[0], getattr(l, "dim", None)) if hasattr(l, "axis") else l) for p, l in rules]
    spec = Spec(mesh, rules=rules, units=units, options=options)
    assert Spec.from_dict(spec.to_dict()) == spec
    doc = tomllib.loads(spec.to_toml(table=table))
    for key in table.split(".") if table else ():
        doc = doc[key]
    assert Spec.from_dict(doc) == spec


KEYS = ["mesh", "rules", "units", "options", "pattern", "layout", "axis", "dim", "fsdp", "prefetch"]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 5),
    st.floats(allow_nan=False),
    st.sampled_from(["*", "", "shard", "replicate", "fsdp", "a.b"]),
)
toml_like = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(KEYS), inner, max_size=4),
    max_leaves=12,
)


@SETTINGS
@given(
    d=st.fixed_dictionaries(
        {"mesh": st.one_of(toml_like, st.dictionaries(st.sampled_from(AXES), st.integers(-2, 4), max_size=2))},
        optional={"rules": toml_like, "units": toml_like, "options": toml_like},
    )
)
def test_from_dict_on_arbitrary_data_gives_a_spec_or_a_spec_error(d):
    try:
        spec = Spec.from_dict(d)
    except SpecError as e:
        assert str(e).startswith("the spec dict: ")
        return
    assert Spec.from_dict(spec.to_dict()) == spec


toml_values = st.recursive(
    st.one_of(st.booleans(), st.integers(-3, 70), st.sampled_from(["*", "", "shard", "replicate", "fsdp", "a.b"])),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(KEYS), inner, min_size=1, max_size=3),
    max_leaves=10,
)


def _toml(value) -> str:
    """A TOML rendering of a value: inline tables and arrays."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return '"' + value + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"


@SETTINGS
@given(table=st.dictionaries(st.sampled_from(["mesh", "rules", "units", "options", "param_groups", "other"]),
                             toml_values, max_size=5),
       wrapped=st.booleans(), noise=st.one_of(st.none(), st.text(max_size=40), st.binary(max_size=40)))
def test_from_toml_on_arbitrary_files_gives_a_spec_or_a_spec_error(tmp_path_factory, table, wrapped, noise):
    path = tmp_path_factory.mktemp("toml") / "spec.toml"
    body = "".join(f"{key} = {_toml(value)}\n" for key, value in table.items())
    if wrapped:
        body = "[shardlang]\n" + body
    if isinstance(noise, bytes):
        path.write_bytes(body.encode() + noise)
    else:
        path.write_text(body + (noise or ""))
    try:
        spec = Spec.from_toml(path)
    except SpecError as e:
        assert str(path) in str(e) or "the spec" in str(e), str(e)
        return
    assert isinstance(spec, Spec)
    assert Spec.from_dict(spec.to_dict()) == spec
