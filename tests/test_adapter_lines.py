"""``examples.adapter_lines``, the measure behind every adapter's line budget: what it counts and what it skips."""

from __future__ import annotations

import textwrap

from examples.adapter_lines import model_specific_lines


def _count(tmp_path, source: str) -> int:
    path = tmp_path / "adapter.py"
    path.write_text(textwrap.dedent(source))
    return model_specific_lines(str(path))


def test_docstrings_comments_and_blank_lines_are_not_counted(tmp_path):
    assert _count(tmp_path, '''
        """Module docstring,
        two lines."""

        # a comment
        import winsp  # counted: imports are code


        class Plan:
            """Class docstring."""

            def forward(self, x):
                """Function docstring."""
                return x  # counted
        ''') == 4  # import, class, def, return


def test_every_line_a_statement_or_a_string_spans_is_counted(tmp_path):
    assert _count(tmp_path, '''
        PLAN = dict(a=1,
                    b=2)
        TEXT = """not a docstring
        # looks like a comment, but is inside a string

        """
        x = 1; y = 2
        ''') == 7  # two lines of PLAN, all four of TEXT (its blank line too), one for two statements
