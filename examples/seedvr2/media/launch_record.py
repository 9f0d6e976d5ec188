"""Under ``--ranks``, a rank's record of the temporary output files it creates, kept in the launcher's folder.

The launcher (:mod:`examples.seedvr2.cli.launcher`) starts the ranks with these variables set, and removes the files
recorded here should a rank be killed before it can remove them itself (the OOM killer's SIGKILL). No torch here:
the launcher process imports this.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

__all__ = ["LAUNCHED_ENV", "LAUNCH_DIR_ENV", "PARTIALS_FILE", "launched_rank", "launch_file", "record_partial"]

#: set in every rank the launcher starts, to the launcher's process id (see :func:`launched_rank`)
LAUNCHED_ENV = "SEEDVR2_LAUNCHED"
#: the launcher's folder, where ranks record their temporary output files and leave notes (see the module docstring)
LAUNCH_DIR_ENV = "SEEDVR2_LAUNCH_DIR"
#: the file in the launcher's folder that lists the ranks' temporary output files
PARTIALS_FILE = "partials"


def launched_rank(env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether this process is a rank started by the launcher: ``SEEDVR2_LAUNCHED`` names its parent process. A value
    inherited from a shell (or from a launcher further up) names another process and is ignored."""
    env = os.environ if env is None else env
    return bool(env.get(LAUNCHED_ENV)) and env.get(LAUNCHED_ENV) == str(os.getppid())


def launch_file(name: str) -> Optional[str]:
    """The path of ``name`` in the launcher's folder; None in a process the launcher did not start."""
    directory = os.environ.get(LAUNCH_DIR_ENV)
    return os.path.join(directory, name) if directory and launched_rank() else None


def record_partial(path: str) -> None:
    """Called by a rank as it creates a temporary output file: the launcher removes it should the rank be killed
    before it can (the OOM killer's SIGKILL). Nothing outside the launcher."""
    record = launch_file(PARTIALS_FILE)
    if record is None:
        return
    fd = os.open(record, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, os.fsencode(os.path.abspath(path)) + b"\0")  # one write: records of two ranks never interleave
    finally:
        os.close(fd)
