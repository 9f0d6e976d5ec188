"""What ``restore`` works on: one file, several files, or a folder of videos and images, and where each output goes.

One input file keeps the single-file rules (``-o`` is the output file, default ``<input>_restored.<ext>`` beside
it). A folder, or several inputs, make a batch job: every video and image of a folder (its own files, sorted by
name, not its subfolders; hidden files and other extensions left out) and every file named is restored into the
output folder under the same name (an extension that cannot be written becomes ``.mp4`` for a video, ``.png`` for an
image). The output folder is ``-o`` (created if missing), else ``<folder>_restored`` beside a single input folder;
several files without ``-o`` are each written beside their input as ``<name>_restored.<ext>``. Pure path logic.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence

from .media import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS, MediaError, default_output_path

__all__ = ["Job", "INPUT_VIDEO_EXTENSIONS", "INPUT_IMAGE_EXTENSIONS", "media_in_folder", "plan_jobs"]

#: extensions a folder's files are picked by (what PyAV commonly decodes)
INPUT_VIDEO_EXTENSIONS = VIDEO_EXTENSIONS + (".webm", ".avi", ".m4v", ".mpg", ".mpeg", ".ts", ".wmv", ".flv")
INPUT_IMAGE_EXTENSIONS = IMAGE_EXTENSIONS + (".bmp", ".webp", ".tif", ".tiff")


@dataclass(frozen=True)
class Job:
    """The files a restore command works on: (input, output) pairs, and whether it is a batch (folder or several
    inputs: per-file failures are reported and the others continue) or the single-file command."""

    pairs: tuple[tuple[str, Optional[str]], ...]
    batch: bool
    output_dir: Optional[str] = None


def media_in_folder(folder: str) -> list[str]:
    """The videos and images directly inside ``folder``, sorted by name."""
    names = sorted(os.listdir(folder))
    wanted = INPUT_VIDEO_EXTENSIONS + INPUT_IMAGE_EXTENSIONS
    return [os.path.join(folder, n) for n in names
            if not n.startswith(".") and os.path.splitext(n)[1].lower() in wanted
            and os.path.isfile(os.path.join(folder, n))]


def output_name(input_path: str) -> str:
    """The name an input gets in the output folder: the same, with a writable extension."""
    name = os.path.basename(input_path)
    stem, ext = os.path.splitext(name)
    if ext.lower() in IMAGE_EXTENSIONS + VIDEO_EXTENSIONS:
        return name
    return stem + (".png" if ext.lower() in INPUT_IMAGE_EXTENSIONS else ".mp4")


def _looks_like_folder(path: Optional[str]) -> bool:
    return path is not None and (path.endswith(("/", os.sep)) or not os.path.splitext(path)[1])


def plan_jobs(inputs: Sequence[str], output: Optional[str]) -> Job:
    """The (input, output) pairs of a command line (outputs None: the single-file default, decided later).

    Raises :class:`MediaError` for a missing input of what looks like a folder command (the input or ``-o`` ends with
    ``/`` or has no extension), a folder without media, an output folder that is a file or one of the inputs' folders
    (the outputs would replace the inputs), and two inputs that would write the same output."""
    inputs = list(inputs)
    if len(inputs) == 1 and any(map(_looks_like_folder, (inputs[0], output))) and not os.path.lexists(inputs[0]):
        # a folder command whose folder is missing: said first, since what -o must be depends on it (a missing
        # file is found later, after the output's checks, like every input problem)
        what = "input folder" if inputs[0].endswith(("/", os.sep)) else "input"
        raise MediaError(f"{what} not found: {inputs[0]}")
    if len(inputs) == 1 and not os.path.isdir(inputs[0]):
        return Job(((inputs[0], output),), batch=False)
    files: list[str] = []
    for item in inputs:
        if os.path.isdir(item):
            found = media_in_folder(item)
            if not found:
                raise MediaError(f"the folder {item} has no videos or images (looked for "
                                 f"{', '.join(INPUT_VIDEO_EXTENSIONS + INPUT_IMAGE_EXTENSIONS)})")
            files += found
        else:
            files.append(item)  # a missing or unreadable file is that file's failure, reported in its turn
    if output is None and len(inputs) == 1:
        output = os.path.normpath(inputs[0]) + "_restored"
    if output is None:
        pairs = tuple((f, default_output_path(f)) for f in files)
        return Job(pairs, batch=True)
    if os.path.exists(output) and not os.path.isdir(output):
        raise MediaError(f"-o {output} is a file, but several inputs need an output folder; name a folder")
    parent = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(parent):
        raise MediaError(f"output folder's parent does not exist: {parent}")
    for f in files:
        if os.path.isdir(output) and os.path.samefile(os.path.dirname(os.path.abspath(f)), output):
            raise MediaError(f"-o {output} is the folder of the input {f}: the outputs would replace the inputs; "
                             f"choose another output folder")
    pairs = tuple((f, os.path.join(output, output_name(f))) for f in files)
    seen: dict[str, str] = {}
    for f, out in pairs:
        if out in seen:
            raise MediaError(f"{seen[out]} and {f} would both be written to {out}; restore them separately")
        seen[out] = f
    return Job(pairs, batch=True, output_dir=output)
