"""Issue 40: the README's install and test figures as a new user reads them. A CPU-only install names torch's CPU
index and a torchvision made for that torch; CI installs as the README says; the test counts are stated once and
stay close to what is collected."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest

from tests import conftest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CPU_INSTALL = re.compile(r"^pip install torch==2\.(\d+)\.(\d+) torchvision==0\.(\d+)\.(\d+) --index-url (\S+)", re.M)


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, re.S)


def test_the_cpu_install_names_torchs_cpu_index_and_a_matching_torchvision():
    """Both places a reader starts from (the first block and the install section) install the CPU builds first,
    from the CPU index, then the checkout (which keeps that torch); torchvision 0.(N + 15) is made for torch 2.N."""
    blocks = [b for b in _bash_blocks(README) if CPU_INSTALL.search(b)]
    assert len(blocks) >= 2, "the first commands and the install section"
    for block in blocks:
        found = CPU_INSTALL.search(block)
        torch_minor, _, vision_minor, _, index = found.groups()
        assert index == CPU_INDEX
        assert int(vision_minor) == int(torch_minor) + 15, found.group(0)
        assert re.search(r'^pip install -e "?\.', block[found.end():], re.M), "winsp after the CPU torch"


def test_the_pinned_pair_is_what_that_torchvision_requires():
    """Where the README's torchvision is installed (from PyPI or the CPU index: the same requirement), its own
    metadata names the README's torch."""
    torch_minor, torch_patch, vision_minor, vision_patch, _ = CPU_INSTALL.search(README).groups()
    try:
        installed = importlib.metadata.version("torchvision")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("torchvision is not installed")
    if installed.split("+")[0] != f"0.{vision_minor}.{vision_patch}":
        pytest.skip(f"torchvision {installed} is installed, the README pins 0.{vision_minor}.{vision_patch}")
    wanted = [r for r in importlib.metadata.requires("torchvision") if re.match(r"torch\b", r)]
    assert any(f"2.{torch_minor}.{torch_patch}" in r for r in wanted), wanted


def test_ci_installs_as_the_readme_says():
    ci = (ROOT / ".ci" / "run").read_text()
    install = re.search(r"^pip install .*$", ci, re.M).group(0)
    assert f"`{install}`" in README, f"the README does not show CI's install: {install}"


def test_the_test_counts_are_stated_once_and_match_the_collection(request):
    counts = re.findall(r"([\d,]{4,}) of the ([\d,]{4,}) tests", README)
    assert len(counts) == 1, counts
    assert len(re.findall(r"\b1,\d{3} tests\b", README.replace(" of the ", " "))) <= 2  # no other count elsewhere
    selected, total = (int(n.replace(",", "")) for n in counts[0])
    option = request.config.option
    whole = request.config.args in (["tests"], [str(ROOT / "tests")])
    narrowed = option.keyword or option.deselect or getattr(option, "lf", False) or getattr(option, "failedfirst", 0)
    if option.markexpr != "not large_world and not slow" or not whole or narrowed:
        pytest.skip("the figures are those of the default run of the whole suite (python -m pytest -q)")
    got_selected = conftest.COLLECTED["selected"]
    got_total = got_selected + conftest.COLLECTED["deselected"]
    for said, got in ((selected, got_selected), (total, got_total)):
        assert abs(said - got) <= 0.05 * got, (f"README says {selected:,} of {total:,} tests; this run collected "
                                               f"{got_selected:,} of {got_total:,}: update the README's figures")
