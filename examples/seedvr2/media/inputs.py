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

from .reading import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS, MediaError, default_output_path

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
    """The videos and images directly inside ``folder``, sorted by name (:class:`MediaError` naming the folder when
    it cannot be listed)."""
    try:
        names = sorted(os.listdir(folder))
    except OSError as exc:
        raise MediaError(f"cannot read the input folder {folder} ({exc.strerror or exc})") from None
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
    ``/`` or has no extension), a folder without media or that cannot be read, an output folder that is a file or one
    of the inputs' folders (the outputs would replace the inputs), two inputs that would write the same output (with
    ``-o`` or without: ``a.m4v`` and ``a.ts`` both become ``a_restored.mp4``), and an output that is one of the
    inputs. Decided here, before anything runs."""
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
        pairs = tuple((f, _default_output(f)) for f in files)
        _check_collisions(pairs)
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
    _check_collisions(pairs)
    return Job(pairs, batch=True, output_dir=output)


def _default_output(path: str) -> str:
    """Where a file of a batch without ``-o`` goes: ``<name>_restored.<ext>`` beside it, an image whose extension
    cannot be written as ``.png`` (as the single-file default does)."""
    out = default_output_path(path)
    if os.path.splitext(path)[1].lower() in INPUT_IMAGE_EXTENSIONS:
        out = os.path.splitext(out)[0] + os.path.splitext(output_name(path))[1]
    return out


def _key(path: str) -> str:
    return os.path.normcase(os.path.abspath(path))


def _check_collisions(pairs) -> None:
    """:class:`MediaError` when two inputs would write one output, or an output would replace an input."""
    seen: dict[str, str] = {}
    inputs = {_key(f): f for f, _ in pairs}
    files = {_identity(f): f for f, _ in pairs}  # the same file under another name: a link
    files.pop(None, None)
    for f, out in pairs:
        key = _key(out)
        if key in seen:
            raise MediaError(f"{seen[key]} and {f} would both be written to {out}; restore them separately or "
                             f"name an output folder with -o")
        other = inputs.get(key) or files.get(_identity(out))
        if other is not None:
            raise MediaError(f"the output {out} of {f} is the input {other}: it would be replaced; choose an output "
                             f"folder with -o")
        seen[key] = f


def _identity(path: str):
    """(device, inode) of an existing file, None otherwise."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino
