"""Everything in the tree is written here: no file carries another project's licence or copyright header, and no
folder holds a vendored project's LICENSE / COPYING file (third-party models come from installed packages)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADERS = re.compile(r"copyright \(c\)|copyright \d{4}|permission is hereby granted|licensed under the apache license|"
                     r"spdx-license-identifier|gnu general public license|redistribution and use in source and binary",
                     flags=re.I)


def _tracked_files() -> list[Path]:
    try:
        names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        return [ROOT / n for n in names.splitlines()]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every file but caches and build output
        return [p for p in ROOT.rglob("*") if p.is_file() and not {".git", "__pycache__", "build"} & set(p.parts)]


def test_no_file_carries_a_licence_or_copyright_header():
    found = []
    for path in _tracked_files():
        if path.suffix in {".safetensors", ".gz", ".png", ".mp4"} or not path.is_file() or path == Path(__file__):
            continue
        text = path.read_text(errors="ignore")
        if HEADERS.search(text):
            found.append(str(path.relative_to(ROOT)))
    assert not found, f"files with another project's licence or copyright text: {found}"


def test_no_vendored_licence_files():
    found = [str(p.relative_to(ROOT)) for p in _tracked_files()
             if re.match(r"(licen[cs]e|copying|notice)(\.|$)", p.name, flags=re.I)]
    assert not found, f"licence files of vendored code: {found}"
