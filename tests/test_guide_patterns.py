"""The guide's complete scripts for the patterns of models that reshape their own batches and of a hierarchical
encoder feeding a decoder (docs/adopting_a_model.md) run as written and print a difference at float64 rounding."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
SECTIONS = ("### Models that reshape their own batches between space and time",
            "### A hierarchical encoder feeding a decoder: a region that ends with a grid change, and skips")


def _script(heading: str) -> str:
    text = (ROOT / "docs" / "adopting_a_model.md").read_text()
    section = text[text.index(heading):]
    section = section[:section.index("\n### ", len(heading))]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.parametrize("heading", SECTIONS, ids=["space_time", "skips"])
def test_the_guides_script_runs_and_equals_the_original(heading):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(_script(heading), heading, "exec"), {"__name__": "__main__"})  # noqa: S102 - the guide's script
    difference = float(re.search(r"max \|parallel - original\| = (\S+)", printed.getvalue()).group(1))
    assert difference < 1e-12
