"""Names that left winsp's top level raise an AttributeError that says where they went (``winsp/_moved.py``), and the
place each message names exists, so the table cannot rot."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import winsp
from winsp._moved import MOVED_MODULES, MOVED_NAMES, REMOVED


def _message(name: str) -> str:
    with pytest.raises(AttributeError) as caught:
        getattr(winsp, name)
    return str(caught.value)


def test_swapped_says_where_it_went():
    assert _message("Swapped") == ("winsp.Swapped moved to winsp.adoption.Swapped: from winsp.adoption import Swapped "
                                   "(the top level keeps what the README and guides call, winsp.__all__)")


@pytest.mark.parametrize("name", sorted(MOVED_NAMES))
def test_a_moved_name_is_where_its_message_says(name):
    home = MOVED_NAMES[name]
    assert name not in vars(winsp), f"winsp.{name} is on the top level again: drop it from the table"
    assert f"from {home} import {name}" in _message(name)
    assert hasattr(importlib.import_module(home), name)
    assert not hasattr(winsp, name)  # hasattr / getattr with a default still see an AttributeError


@pytest.mark.parametrize("name", sorted(MOVED_MODULES))
def test_a_moved_module_is_where_its_message_says(name):
    assert name not in vars(winsp)
    assert _message(name).endswith(f"import {MOVED_MODULES[name]}")
    importlib.import_module(MOVED_MODULES[name])


@pytest.mark.parametrize("name", sorted(REMOVED))
def test_a_removed_name_says_what_replaces_it(name):
    assert _message(name) == f"winsp.{name} was removed; use {REMOVED[name]}"


def test_other_names_get_pythons_own_message():
    assert _message("no_such_name") == "module 'winsp' has no attribute 'no_such_name'"
    assert getattr(winsp, "no_such_name", None) is None
    assert not set(MOVED_NAMES) & set(winsp.__all__) and not set(MOVED_MODULES) & set(winsp.__all__)


def test_the_changelog_counts_the_top_level_names_right():
    """Every count of winsp's top-level names in the unreleased notes is len(winsp.__all__)."""
    text = (Path(__file__).parents[1] / "CHANGELOG.md").read_text()
    unreleased = " ".join(text[text.index("## [Unreleased]"):text.index("\n## ", text.index("## [Unreleased]") + 1)]
                          .split())
    counts = re.findall(r"`winsp\.__all__` has (\d+) names", unreleased) + re.findall(
        r"one of the (\d+) top-level names", unreleased)
    assert counts and {int(c) for c in counts} == {len(winsp.__all__)}, (counts, len(winsp.__all__))
