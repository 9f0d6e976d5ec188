"""Text from files made safe to print on a terminal.

Checkpoint keys, GGUF tensor names, metadata keys and file names come from files the user did not write. Printed
raw, an escape sequence in one of them reaches the terminal: it can retitle the window, clear the screen or draw
fake text over the real message. :func:`printable` shows every character that is not printable as a Python escape
(``\\x1b``, ``\\u202e``), the same spelling ``repr`` uses, so the message still names the thing exactly.
"""

from __future__ import annotations

__all__ = ["printable"]


def printable(text: str) -> str:
    """``text`` with each non-printable character (control characters, ESC, bidirectional overrides, unpaired
    surrogates) written as its ``\\x`` / ``\\u`` / ``\\U`` escape; a backslash is kept as it is."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(c) for c in text)


def _escape(c: str) -> str:
    code = ord(c)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"
