"""Bad input gets a clear error naming the value, where it came from, and what would be valid.

The cases are the catalogue in `tests/error_catalogue.py`, which also writes
docs/errors.md; the page is checked against the table here so the two cannot
drift apart. Trace errors that point at the user's line: tests/test_trace_errors.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from error_catalogue import AREAS, BATCH, CATALOGUE, documented, message_of, mse, mlp
import shardlang as sl

PAGE = Path(__file__).resolve().parents[1] / "docs" / "errors.md"


@pytest.mark.parametrize("entry", CATALOGUE, ids=lambda entry: entry.id)
def test_bad_input(entry, tmp_path):
    message = message_of(entry, tmp_path)
    missing = [name for name in entry.names if name not in message]
    assert not missing, f"{entry.id}: the message does not name {missing}:\n{message}"


def test_the_catalogue_spans_every_area_with_unique_ids():
    ids = [entry.id for entry in CATALOGUE]
    assert len(ids) == len(set(ids)) >= 25
    assert {entry.area for entry in CATALOGUE} == set(AREAS)


def test_docs_errors_md_lists_every_entry_with_a_message_that_names_the_value():
    """Regenerate with ``python tests/error_catalogue.py > docs/errors.md`` when this fails."""
    page = documented(PAGE.read_text())
    in_order = [entry.id for area in AREAS for entry in CATALOGUE if entry.area == area]
    assert list(page) == in_order
    for entry in CATALOGUE:
        missing = [name for name in entry.names if name not in page[entry.id]]
        assert not missing, f"docs/errors.md, {entry.id}: the message shown does not name {missing}"


def test_lr_changes_without_retracing():
    model = mlp()
    step = sl.compile(model, mse, sl.Spec(sl.Mesh(fsdp=1)), optimizer=sl.SGD(lr=0.0), example_batch=BATCH)
    before = step.full_parameters()
    step(BATCH)
    assert all(torch.equal(before[k], v) for k, v in step.full_parameters().items())  # lr 0: nothing moves
    graph = step._graph
    step.set_lr(0.1)
    step(BATCH)
    assert step._graph is graph
    assert any(not torch.equal(before[k], v) for k, v in step.full_parameters().items())
