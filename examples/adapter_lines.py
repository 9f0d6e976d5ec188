"""Count an adapter's model-specific lines: code lines, not docstrings, comments or blank lines.

    python -m examples.adapter_lines examples/swin3d/adapter.py
    python -m examples.adapter_lines          # every shipped adapter
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize

__all__ = ["model_specific_lines", "SHIPPED"]

# the shipped adapters, each the whole file a user writes for the model (imports included)
SHIPPED = ("examples/swin3d/adapter.py", "examples/swinv2/adapter.py", "examples/hourglass/adapter.py",
           "examples/natten_video/adapter.py", "examples/cogvideox/adapter.py", "examples/divided_video/adapter.py",
           "examples/hunyuanvideo15/adapter.py", "examples/latent_video/adapter.py", "examples/swin_seg3d/adapter.py")

_NOT_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}


def model_specific_lines(path: str) -> int:
    """Physical lines of ``path`` that hold code (imports included; every line a statement or a string literal spans),
    skipping docstrings (module, class, function), comments and blank lines."""
    source = open(path, encoding="utf-8").read()
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and ast.get_docstring(node) is not None:
            first = node.body[0]
            docstrings.update(range(first.lineno, first.end_lineno + 1))
    code: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in _NOT_CODE:
            code.update(range(token.start[0], token.end[0] + 1))
    return len(code - docstrings)


if __name__ == "__main__":
    for path in sys.argv[1:] or SHIPPED:
        print(f"{path}: {model_specific_lines(path)} lines")
