"""TOML text for a spec's plain-dict form (`Spec.to_toml`); `tomllib` reads it back."""

from __future__ import annotations

__all__ = ["to_toml_text"]


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)  # finite (validated); TOML reads Python's repr of a float back exactly
    if isinstance(value, str):
        escaped = "".join(c if c.isprintable() and c not in '"\\' else _toml_escape(c) for c in value)
        return f'"{escaped}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table: a rule's per-axis layouts
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML form for {value!r}")  # internal: to_dict gives only the types above


def _toml_escape(c: str) -> str:
    simple = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
    return simple.get(c) or (f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}")


def to_toml_text(d: dict[str, object], table: str | None) -> str:
    """TOML text for a dict of scalars, lists of scalars, tables (nested too: ``[options.mixed_precision]``),
    and lists of tables (to_dict's output)."""
    head = [f"[{table}]"] if table else []
    body: list[str] = []
    for key, value in d.items():
        name = f"{table}.{key}" if table else key
        if isinstance(value, dict):
            body += ["", to_toml_text(value, name).rstrip("\n")]
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for item in value:
                body += ["", f"[[{name}]]"] + [f"{k} = {_toml_value(v)}" for k, v in item.items()]
        else:
            head.append(f"{key} = {_toml_value(value)}")
    return "\n".join(head + body).strip("\n") + "\n"
