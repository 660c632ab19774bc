"""Tests of the spec language: mesh, layouts, rules, units, Spec, and its dict / TOML forms.

Every error test asserts that the message names the offending value and what
would be valid; none of them starts a process or allocates a real model (the
models live on the meta device where size matters).
"""

from __future__ import annotations

import doctest
import pickle
import sys

import pytest
import torch
from torch import nn

from shardlang.errors import ShardlangError, SpecError
from shardlang.compiler.layout.placement import LayoutKind, MeshShape, Placement
from shardlang.errors import SpecError as ReexportedSpecError
from shardlang.spec.layout import Replicate, Shard, layout_from_dict, replicate, shard
from shardlang.spec.mesh import Mesh
from shardlang.spec.rules import Rule, first_match, rule_from_dict, to_rules
from shardlang.spec.spec import Options, ResolvedSpec, Spec
from shardlang import MixedPrecision
from shardlang.spec.units import ROOT_UNIT, assign_units, default_units, find_units, unit_label, unit_of

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class Block(nn.Module):
    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = nn.Linear(d, 3 * d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))


class TinyGPT(nn.Module):
    """Embedding, ModuleList of blocks, a frozen projection, a head tied to the embedding."""

    def __init__(self, n_layer: int = 2, vocab: int = 11, d: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_layer))
        self.proj = nn.Linear(d, d)
        self.proj.requires_grad_(False)
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.scale = nn.Parameter(torch.ones(()))


@pytest.fixture
def gpt() -> TinyGPT:
    with torch.device("meta"):
        return TinyGPT()


def raises(match_all: list[str], fn, *args, **kwargs) -> SpecError:
    """Call fn, expect SpecError, and check that every string in match_all is in its message."""
    with pytest.raises(SpecError) as info:
        fn(*args, **kwargs)
    for s in match_all:
        assert s in str(info.value), f"{s!r} not in {str(info.value)!r}"
    return info.value


# -- errors -----------------------------------------------------------------------------------------


def test_errors_reexport_the_compiler_hierarchy():
    assert ReexportedSpecError is SpecError
    assert issubclass(SpecError, ShardlangError) and issubclass(SpecError, ValueError)


@pytest.mark.parametrize("module", ["spec.mesh", "spec.layout", "spec.rules", "spec.units", "spec.spec", "errors"])
def test_docstring_examples_run(module):
    mod = __import__(f"shardlang.{module}", fromlist=["_"])
    failed, _ = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert failed == 0


# -- mesh -------------------------------------------------------------------------------------------


def test_mesh_is_an_ordered_value_with_a_constructor_repr():
    mesh = Mesh(replicate=2, fsdp=4)
    assert repr(mesh) == "Mesh(replicate=2, fsdp=4)"
    assert mesh.axis_names == ("replicate", "fsdp")
    assert mesh.size == 8 and mesh.shape == MeshShape((("replicate", 2), ("fsdp", 4)))
    assert mesh == Mesh(replicate=2, fsdp=4) and mesh != Mesh(fsdp=4, replicate=2)
    assert hash(mesh) == hash(Mesh(replicate=2, fsdp=4))
    assert pickle.loads(pickle.dumps(mesh)) == mesh
    assert eval(repr(mesh)) == mesh


def test_mesh_bind_fills_the_rest_of_the_world():
    assert Mesh(fsdp=-1).bind(4) == Mesh(fsdp=4)
    assert Mesh(replicate=2, fsdp=-1).bind(8) == Mesh(replicate=2, fsdp=4)
    assert Mesh(fsdp=-1).bind(1).shape == MeshShape((("fsdp", 1),))
    assert Mesh(fsdp=4).bind(4) == Mesh(fsdp=4)
    assert not Mesh(fsdp=-1).is_bound and Mesh(fsdp=4).is_bound


def test_mesh_bind_mismatch_names_both_numbers_and_the_mesh():
    raises(["Mesh(fsdp=4)", "4 devices", "world size is 8"], Mesh(fsdp=4).bind, 8)
    raises(["Mesh(replicate=3, fsdp=-1)", "8", "multiple of 3"], Mesh(replicate=3, fsdp=-1).bind, 8)
    raises(["world_size is 0", "positive int"], Mesh(fsdp=-1).bind, 0)
    raises(["world_size is True"], Mesh(fsdp=-1).bind, True)


@pytest.mark.parametrize(
    ("axes", "named"),
    [
        ({}, ["no axes", "Mesh(fsdp=4)"]),
        ({"fsdp": 0}, ["'fsdp' has size 0", "positive int, or -1"]),
        ({"fsdp": -2}, ["size -2"]),
        ({"fsdp": 2.0}, ["size 2.0"]),
        ({"fsdp": True}, ["size True"]),
        ({"a": -1, "b": -1}, ["['a', 'b']", "at most one axis may be -1"]),
        ({"not-a-name": 2}, ["'not-a-name'", "letters, digits and underscores"]),
    ],
)
def test_mesh_rejects_bad_axes(axes, named):
    raises(named, Mesh, **axes)


def test_unbound_mesh_has_no_size_or_shape():
    raises(["Mesh(fsdp=-1)", "bind(world_size)"], lambda: Mesh(fsdp=-1).size)
    raises(["Mesh(fsdp=-1)", "shape"], lambda: Mesh(fsdp=-1).shape)
    raises(["'tp'", "['fsdp']"], Mesh(fsdp=2).axis_size, "tp")


# -- layouts ----------------------------------------------------------------------------------------


def test_layouts_are_values_with_constructor_reprs():
    assert repr(shard("fsdp")) == "shard('fsdp')"
    assert repr(shard("fsdp", dim=0)) == "shard('fsdp', dim=0)"
    assert repr(shard("fsdp", dim=-1)) == "shard('fsdp', dim=-1)"
    assert repr(replicate()) == "replicate()"
    assert shard("fsdp", 0) == Shard("fsdp", 0) and replicate() == Replicate()
    assert eval(repr(shard("fsdp", dim=-1))) == shard("fsdp", dim=-1)


def test_to_placement_normalises_dims():
    assert shard("fsdp").to_placement((3, 5), "w") == Placement(LayoutKind.SHARD_FLAT, axis="fsdp")
    assert shard("fsdp").to_placement((), "s") == Placement(LayoutKind.SHARD_FLAT, axis="fsdp")
    assert shard("fsdp", dim=-1).to_placement((3, 5), "w") == Placement(LayoutKind.SHARD_DIM, "fsdp", 1)
    assert shard("fsdp", dim=0).to_placement((3, 5), "w").dim == 0
    assert replicate().to_placement((3,), "b") == Placement(LayoutKind.REPLICATE)


def test_to_placement_missing_dim_names_param_shape_dim_and_range():
    raises(["'blocks.0.bias'", "(4,)", "dim 1", "-1..0"], shard("fsdp", dim=1).to_placement, (4,), "blocks.0.bias")
    raises(["'w'", "(2, 3)", "dim -3", "-2..1"], shard("fsdp", dim=-3).to_placement, (2, 3), "w")
    raises(["'scale'", "()", "0-d scalar", "shard('fsdp')"], shard("fsdp", dim=0).to_placement, (), "scale")


@pytest.mark.parametrize(
    ("args", "named"), [(("",), ["''"]), ((3,), ["3"]), (("fsdp", 1.5), ["1.5"]), (("fsdp", True), ["True"])]
)
def test_shard_rejects_bad_arguments(args, named):
    raises(named, shard, *args)


def test_layout_dict_form():
    assert layout_from_dict({"layout": "shard", "axis": "fsdp", "dim": 0}, "x") == shard("fsdp", 0)
    assert layout_from_dict({"layout": "replicate"}, "x") == replicate()
    assert shard("fsdp", 1).to_dict() == {"layout": "shard", "axis": "fsdp", "dim": 1}
    assert shard("fsdp").to_dict() == {"layout": "shard", "axis": "fsdp"}
    raises(["rules[2]", "'tile'", "'shard' and 'replicate'"], layout_from_dict, {"layout": "tile"}, "rules[2]")
    raises(["'axis'", "replicate"], layout_from_dict, {"layout": "replicate", "axis": "fsdp"}, "r")
    raises(["missing key 'layout'"], layout_from_dict, {"axis": "fsdp"}, "r")
    raises(["'dims'", "valid keys"], layout_from_dict, {"layout": "shard", "axis": "a", "dims": 0}, "r")


# -- rules ------------------------------------------------------------------------------------------


def test_star_crosses_dots_and_first_match_wins():
    rules = to_rules([("blocks.*.ln*.*", replicate()), ("*.bias", replicate()), ("*", shard("fsdp"))])
    assert first_match(rules, "blocks.10.ln2.weight") == 0
    assert first_match(rules, "blocks.0.attn.bias") == 1
    assert first_match(rules, "ln_f.weight") == 2
    assert to_rules([("a?", shard("x"))])[0].matches("ab") and not Rule("a?", shard("x")).matches("abc")
    assert not Rule("Blocks.*", replicate()).matches("blocks.0.w")  # case-sensitive
    assert first_match(to_rules([("x", replicate())]), "y") is None


def test_rules_convert_to_a_tuple_of_rules_that_unpack():
    rules = to_rules([["*", shard("fsdp")], Rule("b", replicate())])
    assert rules == (Rule("*", shard("fsdp")), Rule("b", replicate()))
    pattern, layout = rules[0]
    assert (pattern, layout) == ("*", shard("fsdp"))
    assert repr(rules[1]) == "Rule('b', replicate())"


@pytest.mark.parametrize(
    ("rules", "named"),
    [
        ([("", shard("f"))], ["rules[0]", "''", "non-empty glob"]),
        ([("*", shard("f")), (3, replicate())], ["rules[1]", "pattern is 3"]),
        ([("*", "shard")], ["rules[0]", "'shard'", "replicate()"]),
        ([("*", replicate)], ["rules[0]", "not called: write replicate()"]),
        ([("*", shard("f")), "*"], ["rules[1]", "'*'", "(pattern, layout) pair"]),
        ([("*", shard("f"), 0)], ["rules[0]", "(pattern, layout) pair"]),
        ([], ["rules is empty"]),
        ("*", ["rules is '*'", "list of (pattern, layout) pairs"]),
        ({"*": replicate()}, ["rules is {", "list of (pattern, layout) pairs"]),
    ],
)
def test_bad_rules_name_index_and_value(rules, named):
    raises(named, to_rules, rules)


def test_rule_validates_when_built_directly():
    raises(["Rule", "pattern is None"], Rule, None, replicate())
    raises(["Rule", "layout is 'replicate'"], Rule, "*", "replicate")


def test_rule_dict_form():
    assert rule_from_dict({"pattern": "ln*", "layout": "replicate"}, "r") == Rule("ln*", replicate())
    assert Rule("*", shard("f", 0)).to_dict() == {"pattern": "*", "layout": "shard", "axis": "f", "dim": 0}
    raises(["rules[1]", "missing key 'pattern'"], rule_from_dict, {"layout": "replicate"}, "rules[1]")
    raises(["rules[0]", "'*'", "a rule is a table"], rule_from_dict, "*", "rules[0]")
    typo = {"pattern": "*", "patern": "x", "layout": "replicate"}
    raises(["'patern'", "valid keys", "'pattern'"], rule_from_dict, typo, "r")


# -- units ------------------------------------------------------------------------------------------


def test_outermost_match_per_pattern(gpt):
    assert find_units(gpt, ("blocks.*",)) == ("blocks.0", "blocks.1")
    assert find_units(gpt, ("*",)) == ("emb", "blocks", "proj", "ln_f", "head")
    assert find_units(gpt, ("blocks.*.mlp",)) == ("blocks.0.mlp", "blocks.1.mlp")
    assert find_units(gpt, ()) == ()


def test_param_belongs_to_deepest_unit(gpt):
    units = assign_units(gpt, ("blocks.*", "blocks.*.mlp", "head"))
    assert units["blocks.0.ln.weight"] == "blocks.0"
    assert units["blocks.0.mlp.0.weight"] == "blocks.0.mlp"
    assert units["blocks.1.mlp.2.bias"] == "blocks.1.mlp"
    assert units["emb.weight"] == ROOT_UNIT  # tied with head.weight, listed once under its first name
    assert "head.weight" not in units
    assert units["scale"] == ROOT_UNIT
    assert unit_of("blocks.10.w", {"blocks.1"}) == ROOT_UNIT  # prefix by whole dotted names only
    assert unit_label(ROOT_UNIT) == "<root>" and unit_label("blocks.0") == "blocks.0"


def test_default_units_are_repeated_children_of_containers(gpt):
    # Only the outermost repeated children: layers inside a block belong to the block's unit.
    assert default_units(gpt) == ("blocks.0", "blocks.1")
    assert default_units(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == ()
    assert default_units(nn.Linear(2, 2)) == ()
    assert find_units(gpt, None) == default_units(gpt)


def test_unit_pattern_matching_no_module_lists_module_names(gpt):
    raises(["units[1]", "'block.*'", "TinyGPT", "'blocks.0'", "'emb'"], find_units, gpt, ("head", "block.*"))


@pytest.mark.parametrize(
    ("units", "named"),
    [("blocks.*", ["units is 'blocks.*'"]), (["ok", ""], ["units[1]", "''"]), ([3], ["units[0] is 3"])],
)
def test_bad_unit_patterns(units, named):
    raises(named, Spec, Mesh(fsdp=2), units=units)


# -- Spec construction ------------------------------------------------------------------------------


def test_spec_defaults_and_canonical_form():
    spec = Spec(Mesh(replicate=2, fsdp=-1))
    assert spec.rules == (Rule("*", shard("fsdp")),)  # the last (innermost) axis: hybrid sharding by default
    assert spec.units is None and spec.options == Options()
    spec = Spec(Mesh(fsdp=4), rules=[("*", shard("fsdp"))], units=["blocks.*"])
    assert spec.rules == (Rule("*", shard("fsdp")),) and spec.units == ("blocks.*",)
    assert spec == Spec(Mesh(fsdp=4), rules=(Rule("*", shard("fsdp")),), units=("blocks.*",))
    assert hash(spec) == hash(Spec(Mesh(fsdp=4), units=["blocks.*"]))
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert Spec(Mesh(fsdp=4), rules=None) == Spec(Mesh(fsdp=4))
    assert Spec(Mesh(fsdp=4), source="a.toml") == Spec(Mesh(fsdp=4))  # source is not part of the value


def test_spec_repr_reads_as_the_constructor_call():
    spec = Spec(Mesh(fsdp=4), rules=[("ln*", replicate()), ("*", shard("fsdp", dim=0))], units=["blocks.*"])
    assert eval(repr(spec)) == spec


def test_rule_axis_must_be_a_mesh_axis():
    raises(
        ["rules[1]", "'tp'", "Mesh(fsdp=4)", "['fsdp']"],
        Spec, Mesh(fsdp=4), rules=[("ln*", replicate()), ("*", shard("tp"))],
    )  # fmt: skip


def test_spec_rejects_wrong_types():
    raises(["mesh is {'fsdp': 4}", "Mesh(fsdp=4)"], Spec, {"fsdp": 4})
    raises(["options is {}", "Options("], Spec, Mesh(fsdp=2), options={})


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"prefetch": -1}, ["prefetch is -1", ">= 0"]),
        ({"prefetch": 1.0}, ["prefetch is 1.0"]),
        ({"prefetch": True}, ["prefetch is True"]),
        ({"reshard_after_forward": 1}, ["reshard_after_forward is 1", "True or False"]),
    ],
)
def test_options_validate(kwargs, named):
    raises(named, Options, **kwargs)
    assert Options(prefetch=0, reshard_after_forward=False).prefetch == 0


# -- resolve ----------------------------------------------------------------------------------------


def test_resolve_assigns_placements_units_and_trainability(gpt):
    spec = Spec(
        Mesh(fsdp=-1),
        rules=[
            ("*ln*.*", replicate()),
            ("scale", replicate()),
            ("*.weight", shard("fsdp", dim=-1)),
            ("*", shard("fsdp")),
        ],
        units=["blocks.*", "head"],
    )
    resolved = spec.resolve(gpt, 4)
    assert isinstance(resolved, ResolvedSpec)
    assert resolved.mesh == MeshShape((("fsdp", 4),)) and resolved.options == Options()
    names = [p.name for p in resolved.params]
    assert names == [n for n, _ in gpt.named_parameters()] and "head.weight" not in names
    emb = resolved.param("emb.weight")
    assert emb.shape == (11, 4) and emb.unit == ROOT_UNIT and emb.dtype == torch.float32
    assert emb.placement == Placement(LayoutKind.SHARD_DIM, "fsdp", 1)
    assert resolved.param("blocks.1.ln.bias").placement.kind is LayoutKind.REPLICATE
    assert resolved.param("blocks.1.attn.bias").placement == Placement(LayoutKind.SHARD_FLAT, "fsdp")
    assert resolved.param("blocks.1.attn.bias").unit == "blocks.1"
    assert not resolved.param("proj.weight").trainable and resolved.param("proj.bias").unit == ROOT_UNIT
    assert resolved.param("scale").shape == () and resolved.param("blocks.0.ln.weight").trainable
    assert resolved.units == ("", "blocks.0", "blocks.1")
    assert "blocks.0.ln.weight" in resolved.describe() and "<root>" in resolved.describe()
    raises(["'nope'", "'emb.weight'"], resolved.param, "nope")


def test_resolve_mesh_must_fit_world(gpt):
    raises(["Mesh(fsdp=4)", "world size is 2"], Spec(Mesh(fsdp=4)).resolve, gpt, 2)
    raises(["world size is -1"], Spec(Mesh(fsdp=-1)).resolve, gpt, -1)
    raises(["needs a torch.nn.Module", "dict"], Spec(Mesh(fsdp=-1)).resolve, {}, 2)


def test_resolve_param_matching_no_rule_names_it_and_the_rules(gpt):
    spec = Spec(Mesh(fsdp=2), rules=[("blocks.*", shard("fsdp")), ("emb.*", replicate())])
    named = ["'proj.weight'", "'ln_f.bias'", "'scale'", "match no rule", "Rule('blocks.*', shard('fsdp'))"]
    err = raises(named, spec.resolve, gpt, 2)
    assert "'blocks.0.ln.weight'" not in str(err)


def test_resolve_rule_matching_no_param_lists_names(gpt):
    spec = Spec(Mesh(fsdp=2), rules=[("layers.*", replicate()), ("*", shard("fsdp"))])
    raises(["rules[0]", "'layers.*'", "matches no parameter", "'emb.weight'"], spec.resolve, gpt, 2)


def test_resolve_shadowed_rule_names_the_earlier_rule(gpt):
    spec = Spec(Mesh(fsdp=2), rules=[("*", shard("fsdp")), ("ln_f.*", replicate())])
    raises(["rules[1]", "'ln_f.*'", "'ln_f.weight'", "rules[0] = Rule('*'", "first match wins"], spec.resolve, gpt, 2)


def test_resolve_unit_pattern_matching_no_module(gpt):
    raises(["units[0]", "'layers.*'", "'blocks.0'"], Spec(Mesh(fsdp=2), units=["layers.*"]).resolve, gpt, 2)


def test_resolve_missing_dim_names_rule_param_shape_and_range(gpt):
    spec = Spec(Mesh(fsdp=2), rules=[("*", shard("fsdp", dim=1))])
    raises(["rules[0]", "dim 1", "'scale'", "()", "0-d scalar", "more", "'blocks.0.ln.weight'"], spec.resolve, gpt, 2)
    spec = Spec(Mesh(fsdp=2), rules=[("*.bias", shard("fsdp", dim=1)), ("*", shard("fsdp"))])
    raises(["rules[0]", "dim 1", "'blocks.0.ln.bias'", "(4,)", "-1..0", "'proj.bias'"], spec.resolve, gpt, 2)


def test_resolve_works_on_a_2d_mesh_and_a_model_without_units(gpt):
    resolved = Spec(Mesh(replicate=2, fsdp=-1), rules=[("*", shard("fsdp"))], units=[]).resolve(gpt, 8)
    assert resolved.mesh == MeshShape((("replicate", 2), ("fsdp", 4)))
    assert {p.unit for p in resolved.params} == {ROOT_UNIT}


# -- dict and TOML forms ----------------------------------------------------------------------------

SPEC_DICT = {
    "mesh": {"fsdp": 4},
    "rules": [
        {"pattern": "*ln*", "layout": "replicate"},
        {"pattern": "*", "layout": "shard", "axis": "fsdp", "dim": 0},
    ],
    "units": ["blocks.*"],
    "options": {"reshard_after_forward": False, "prefetch": 2},
}


def test_from_dict_and_round_trip():
    spec = Spec.from_dict(SPEC_DICT)
    assert spec == Spec(
        Mesh(fsdp=4),
        rules=[("*ln*", replicate()), ("*", shard("fsdp", dim=0))],
        units=["blocks.*"],
        options=Options(reshard_after_forward=False, prefetch=2),
    )
    assert spec.to_dict() == SPEC_DICT
    assert Spec.from_dict(spec.to_dict()) == spec
    minimal = Spec.from_dict({"mesh": {"fsdp": -1}})
    assert minimal == Spec(Mesh(fsdp=-1)) and Spec.from_dict(minimal.to_dict()) == minimal


@pytest.mark.parametrize(
    ("d", "named"),
    [
        ({"mesh": {"fsdp": 4}, "rule": []}, ["unknown key 'rule'", "'rules'", "'mesh'"]),
        ({"rules": []}, ["missing key 'mesh'"]),
        ({"mesh": {}}, ["mesh is {}", "{fsdp = 4}"]),
        ({"mesh": {"fsdp": "4"}}, ["'fsdp' has size '4'"]),
        ({"mesh": {"fsdp": 4}, "rules": {"pattern": "*"}}, ["rules is {", "[[rules]]"]),
        ({"mesh": {"fsdp": 4}, "rules": [{"pattern": "*", "layout": "shard"}]}, ["rules[0]", "needs an 'axis'"]),
        (
            {"mesh": {"fsdp": 4}, "rules": [{"pattern": "*", "layout": "shard", "axis": "tp"}]},
            ["rules[0]", "'tp'", "['fsdp']"],
        ),
        ({"mesh": {"fsdp": 4}, "options": {"prefetch": 1, "overlap": True}}, ["unknown key 'overlap'", "'prefetch'"]),
        ({"mesh": {"fsdp": 4}, "options": {"prefetch": -3}}, ["prefetch is -3"]),
        ({"mesh": {"fsdp": 4}, "units": "blocks.*"}, ["units is 'blocks.*'"]),
        (["mesh"], ["the spec is ['mesh']"]),
    ],
)
def test_from_dict_errors_name_key_value_and_valid_keys(d, named):
    raises(["the spec dict:", *named], Spec.from_dict, d)


TOML_BODY = """
units = ["blocks.*"]

[mesh]
fsdp = 4

[[rules]]
pattern = "*ln*"
layout = "replicate"

[[rules]]
pattern = "*"
layout = "shard"
axis = "fsdp"
dim = 0

[options]
reshard_after_forward = false
prefetch = 2
"""


def test_from_toml_whole_file_and_table(tmp_path):
    whole = tmp_path / "spec.toml"
    whole.write_text(TOML_BODY)
    assert Spec.from_toml(whole) == Spec.from_dict(SPEC_DICT)
    nested = TOML_BODY.replace("[mesh]", "[shardlang.mesh]").replace("[[rules]]", "[[shardlang.rules]]")
    nested = nested.replace("[options]", "[shardlang.options]").replace('units = ["blocks.*"]', "")
    train = tmp_path / "train.toml"
    train.write_text('lr = 0.1\n[model]\nd = 4\n[shardlang]\nunits = ["blocks.*"]\n' + nested)
    assert Spec.from_toml(train) == Spec.from_dict(SPEC_DICT)
    tool = tmp_path / "pyproject.toml"
    tool.write_text(Spec.from_dict(SPEC_DICT).to_toml(table="tool.shardlang"))
    assert Spec.from_toml(tool, table="tool.shardlang") == Spec.from_dict(SPEC_DICT)


def test_to_toml_round_trips(tmp_path):
    spec = Spec.from_dict(SPEC_DICT)
    for table in ("shardlang", None):
        path = tmp_path / f"{table}.toml"
        path.write_text(spec.to_toml(table=table))
        assert Spec.from_toml(path) == spec
    weird = Spec(Mesh(fsdp=2), rules=[('a"b\\c\n\té\x7f', replicate()), ("*", shard("fsdp"))])
    assert Spec.from_dict(tomllib.loads(weird.to_toml())["shardlang"]) == weird
    # a table inside a table: options.mixed_precision, as tune writes it for a mixed-precision job
    mixed = Spec(Mesh(fsdp=2), options=Options(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                                             reduce_dtype=torch.float32)))
    text = mixed.to_toml(table="tool.shardlang")
    assert "[tool.shardlang.options.mixed_precision]" in text
    assert Spec.from_dict(tomllib.loads(text)["tool"]["shardlang"]) == mixed


def test_toml_errors_name_the_file_and_table(tmp_path, gpt):
    bad = tmp_path / "bad.toml"
    bad.write_text("[shardlang\nmesh = 1\n")
    raises(["bad.toml", "not valid TOML"], Spec.from_toml, bad)
    other = tmp_path / "other.toml"
    other.write_text("[model]\nd = 4\n")
    raises(["other.toml", "no [shardlang] table", "['model']"], Spec.from_toml, other)
    raises(["other.toml", "no table [tool.shardlang]", "['model']"], Spec.from_toml, other, table="tool.shardlang")
    typo = tmp_path / "typo.toml"
    typo.write_text('[shardlang]\nmesh = {fsdp = 2}\n[[shardlang.rules]]\npattern = "layers.*"\nlayout = "replicate"\n')
    spec = Spec.from_toml(typo)
    source = f"{typo} [shardlang]"
    raises(["typo.toml [shardlang]", "unknown key 'mesh_size'"], Spec.from_dict, {"mesh_size": 1}, source=source)
    raises([f"{typo} [shardlang]:", "'layers.*'", "match no rule"], spec.resolve, gpt, 2)
