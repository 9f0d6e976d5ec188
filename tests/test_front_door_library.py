"""Issue 40, the library as a new user meets it: plan fields of the wrong type and a function the ranks cannot import
are one clear error each; ``swapped``'s own docstring says what ``m.index`` and ``m.request`` are; ``help(winsp)``
opens with the whole API; and a checkout folder named ``winsp`` next to the current directory is documented."""

from __future__ import annotations

import inspect
import os
import pydoc
import re
import subprocess
import sys
from pathlib import Path

import pytest

import winsp
from winsp.testing import run_ranks

ROOT = Path(__file__).resolve().parents[1]


def _plan(**changes):
    fields = dict(region=winsp.Region("", ""), attention="*", make_attention=lambda m, i: m,
                  stages=[winsp.Stage([winsp.FixedWindows((1, 2, 2))])])
    return winsp.ParallelPlan(**{**fields, **changes})


@pytest.mark.parametrize("field, value", [("layer_entry", None), ("layer_entry", ""), ("layer_entry", 3),
                                          ("attention", ("a", 1)), ("grid_changes", 5), ("per_sample", [""])])
def test_a_plan_field_that_is_no_glob_is_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"ParallelPlan\.{field} must be .*glob.*, got {re.escape(repr(value))}"):
        _plan(**{field: value})


def test_globs_and_parent_are_still_taken():
    assert _plan(layer_entry="parent").layer_entry == "parent"
    assert _plan(layer_entry=("blocks.*", "head")).layer_entry == ("blocks.*", "head")
    assert _plan(per_sample=None).per_sample is None


def _nested():
    def inner(rank, world_size):
        return rank
    return inner


@pytest.mark.parametrize("fn", [lambda rank, world_size: rank, _nested()], ids=["lambda", "nested"])
def test_run_ranks_says_the_function_must_be_importable(fn):
    with pytest.raises(TypeError, match="must be importable by the new rank processes") as refused:
        run_ranks(fn, 2, timeout=5)
    assert "top level of a module" in str(refused.value) and "Pickl" not in str(refused.value)


def test_swapped_docstring_explains_index_and_request():
    doc = inspect.getdoc(winsp.swapped)
    assert "m.index" in doc and "m.request" in doc
    assert "layer=m.index" in doc  # how the two are used together


def test_help_winsp_opens_with_every_public_name():
    """``help(winsp)`` is pydoc's page: its first screen (the module docstring) lists the whole API, every name of
    ``__all__`` and no other; the classes' full documentation follows it."""
    text = pydoc.plain(pydoc.render_doc(winsp))
    lines = text.splitlines()
    top = "\n".join(lines[:60])
    for name in winsp.__all__:
        assert re.search(rf"\b{name}\b", top), f"{name} is not in the first screen of help(winsp)"
    index = winsp.__doc__.split("subpackages.", 1)[1]
    named = set(re.findall(r"\b([A-Za-z_][A-Za-z0-9_]*)(?:\(|,|\s{2,}|$)", index, re.M))
    assert set(winsp.__all__) <= named


def test_the_checkout_root_on_the_path_wins_over_a_checkout_folder_named_winsp(tmp_path):
    """The README's note: from the folder holding a checkout named ``winsp``, Python's path finder takes that folder
    for a namespace package before an editable install's finder is asked; with the checkout root on the path
    (``PYTHONPATH``, or ``pip install -e . --config-settings editable_mode=compat``) the real package wins."""
    (tmp_path / "winsp").symlink_to(ROOT, target_is_directory=True)
    code = "import winsp; print(getattr(winsp, '__file__', None)); print(hasattr(winsp, 'parallelize'))"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    fixed = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                           env={**env, "PYTHONPATH": str(ROOT)})
    assert fixed.returncode == 0, fixed.stderr
    assert fixed.stdout.split() == [str(ROOT / "winsp" / "__init__.py"), "True"]
    plain = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                           env=env)
    assert plain.returncode == 0, plain.stderr
    # a finder-based editable install (as here): the namespace package, no __file__ and no API; a regular install or
    # a compat-mode editable one: a real package
    found, has_api = plain.stdout.split()
    assert (found, has_api) == ("None", "False") or (found.endswith("__init__.py") and has_api == "True")
