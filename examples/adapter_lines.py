"""Count an adapter's model-specific lines: code lines, not docstrings, comments or blank lines.

    python -m examples.adapter_lines examples/swin3d/adapter.py
    python -m examples.adapter_lines          # every shipped adapter
"""

from __future__ import annotations

import ast
import sys

__all__ = ["model_specific_lines", "SHIPPED"]

# the shipped adapters, each the whole file a user writes for the model (imports included)
SHIPPED = ("examples/swin3d/adapter.py", "examples/swinv2/adapter.py", "examples/hourglass/adapter.py",
           "examples/natten_video/adapter.py", "examples/cogvideox/adapter.py")


def model_specific_lines(path: str) -> int:
    """Lines of ``path`` that are code (imports included), skipping docstrings, comments and blank lines."""
    source = open(path, encoding="utf-8").read()
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and ast.get_docstring(node) is not None:
            first = node.body[0]
            docstrings.update(range(first.lineno, first.end_lineno + 1))
    return sum(1 for number, line in enumerate(source.splitlines(), 1)
               if line.strip() and not line.strip().startswith("#") and number not in docstrings)


if __name__ == "__main__":
    for path in sys.argv[1:] or SHIPPED:
        print(f"{path}: {model_specific_lines(path)} lines")
