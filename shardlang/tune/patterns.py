"""Few glob patterns for a per-unit choice: ``layers.[0-9]`` rather than ten ``layers.N`` tables.

The budget search chooses a recompute policy per unit, and ``tune`` writes the
choice into a spec. Eighty ``[[recompute]]`` tables for a 70B model hide what
was chosen; the same choice reads at a glance as a few patterns:
``layers.[0-9]``, ``layers.[1-4][0-9]``, ``layers.5[0-8]``. Patterns are
`fnmatch` globs over unit names, matched first-to-last as the spec matches its
rules, so `unit_patterns` checks its answer against every unit and falls back
to the units' own names when the patterns would decide any unit differently.

Example::

    unit_patterns({"layers.0": "full", "layers.1": "full"}, ["layers.0", "layers.1", "layers.2"])
    # [("layers.[0-1]", "full")]
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from fnmatch import fnmatchcase

_NUMBERED = re.compile(r"^(.*?)(\d+)$")


def unit_patterns(chosen: dict[str, str], units: Sequence[str]) -> list[tuple[str, str]]:
    """``(pattern, value)`` pairs that give exactly the units in ``chosen`` their value and match no other unit."""
    pairs: list[tuple[str, str]] = []
    for value in dict.fromkeys(chosen.values()):
        named = [u for u in units if chosen.get(u) == value]
        pairs += [(p, value) for p in _patterns(named, units)]
    if _decides(pairs, units) != {u: v for u, v in chosen.items() if u in units}:
        return [(_literal(u), v) for u, v in chosen.items()]
    return pairs


def _patterns(named: Sequence[str], units: Sequence[str]) -> list[str]:
    """Patterns for ``named``: its numbered units by prefix and decade, the others by name."""
    numbers: dict[str, set[int]] = {}
    out = []
    for unit in named:
        match = _NUMBERED.match(unit)
        if match is None or match.group(2) != str(int(match.group(2))):  # "layers.07" keeps its name
            out.append(_literal(unit))
        else:
            numbers.setdefault(match.group(1), set()).add(int(match.group(2)))
    for prefix, chosen in numbers.items():
        out += _numbered_patterns(_literal(prefix), chosen)
    return out


def _numbered_patterns(prefix: str, chosen: set[int]) -> list[str]:
    """``prefix`` followed by the numbers in ``chosen``: whole decades as ``[a-b][0-9]``, the rest by last digit."""
    by_decade: dict[int, list[int]] = {}
    for n in sorted(chosen):
        by_decade.setdefault(n // 10, []).append(n % 10)
    full = [d for d, digits in by_decade.items() if 1 <= d <= 9 and len(digits) == 10]  # 10..99, all ten
    out = [(lo * 10, f"{prefix}{_digit_class(lo, hi)}[0-9]") for lo, hi in _runs(full)]
    for decade, digits in by_decade.items():
        if decade not in full:
            lead = "" if decade == 0 else str(decade)
            out += [(decade * 10 + lo, f"{prefix}{lead}{_digit_class(lo, hi)}") for lo, hi in _runs(digits)]
    return [pattern for _, pattern in sorted(out)]


def _literal(name: str) -> str:
    """A glob that matches ``name`` alone: its own ``*``, ``?`` and ``[`` each in a class (``x[1]`` -> ``x[[]1]``)."""
    return re.sub(r"([*?\[])", r"[\1]", name)


def _runs(values: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted integers as runs of consecutive values: [0, 1, 2, 5] -> [(0, 2), (5, 5)]."""
    runs: list[list[int]] = []
    for v in sorted(values):
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return [(lo, hi) for lo, hi in runs]


def _digit_class(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"[{lo}-{hi}]"


def _decides(pairs: Sequence[tuple[str, str]], units: Sequence[str]) -> dict[str, str]:
    """What the pairs give each unit, the first matching pattern winning, as a spec's rules do."""
    out = {}
    for unit in units:
        for pattern, value in pairs:
            if fnmatchcase(unit, pattern):
                out[unit] = value
                break
    return out
