"""Benchmark-run helpers: one intra-op thread per benchmark, and a summary of goal figures and generated tables
printed in the terminal summary.

Benchmarks record results through the ``goal_report`` fixture; nothing here affects the test suite
(``testpaths = ["tests"]`` never collects this folder). The benchmark files are named ``bench_*.py``, which pytest's
default ``python_files`` does not match: :func:`pytest_collect_file` collects them when a directory is given
(``python -m pytest benchmarks/ --benchmark-only``); a file named on the command line is collected by pytest itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

_GOALS: list["GoalResult"] = []
_TEXTS: list[tuple[str, str]] = []


@dataclass(frozen=True)
class GoalResult:
    name: str
    measured: float  # seconds, or a plain ratio when unit == "x"
    goal: float | None
    unit: str  # "s" or "x"

    def _show(self, value: float) -> str:
        if self.unit == "x":
            return f"{value:.3f}x"
        if value >= 1e-3:
            return f"{value * 1e3:.3f} ms"
        return f"{value * 1e6:.2f} us"

    def line(self) -> str:
        if self.goal is None:
            verdict, goal = "(no goal)", "-"
        else:
            verdict, goal = ("met" if self.measured <= self.goal else "MISSED"), self._show(self.goal)
        return f"{self.name:<58} {self._show(self.measured):>12}   goal {goal:>10}   {verdict}"


def median_seconds(benchmark) -> float | None:
    """The median of a finished pytest-benchmark run, or None when benchmarking is disabled."""
    stats = getattr(benchmark, "stats", None)
    return None if stats is None else stats.stats.median


def record_goal(name: str, measured: float | None, goal: float | None, unit: str = "s") -> None:
    if measured is not None:
        _GOALS.append(GoalResult(name, measured, goal, unit))


def record_text(title: str, text: str) -> None:
    _TEXTS.append((title, text))


class GoalReport:
    """What a benchmark hands to the end-of-run summary."""

    median_seconds = staticmethod(median_seconds)
    goal = staticmethod(record_goal)
    text = staticmethod(record_text)


def pytest_collect_file(file_path, parent):
    """Collect ``benchmarks/bench_*.py`` as test modules (once: files named on the command line pytest collects)."""
    if file_path.suffix != ".py" or not file_path.name.startswith("bench_"):
        return None
    if parent.session.isinitpath(file_path):
        return None
    return pytest.Module.from_parent(parent, path=file_path)


@pytest.fixture(autouse=True)
def one_thread():
    """Every benchmark runs on one intra-op thread (comparable figures on a shared machine); restored after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def goal_report() -> GoalReport:
    return GoalReport()


def pytest_terminal_summary(terminalreporter):
    if not _GOALS and not _TEXTS:
        return
    if _GOALS:
        terminalreporter.section("winsp core benchmark medians against goals")
        for result in _GOALS:
            terminalreporter.write_line(result.line())
    for title, text in _TEXTS:
        terminalreporter.section(title)
        terminalreporter.write_line(text)
