"""Whether a restore resumes from the finished batches kept beside its output, and the settings that decide it.

A run writes a manifest of everything that shapes its output's pixels (:func:`run_settings`): the input's identity
(size, modification time and a hash of its first and last MiB), the model and its weights (the same identity for
checkpoint files), the text embedding, the sizes, the seed, the temporal batching, the dtype, the VAE's mode, the
colour fix and the SP size (a different number of ranks sharing a batch sums in another order: other bits). A later
run of the same command compares its own manifest with the kept one (:func:`resume_point`):

* the same store format, version and settings: it continues after the last batch kept whole (a damaged batch file is
  said in one line and restored again);
* a store of another format or version, or any setting changed: refused, in one line naming what differs and both
  values, and the store is left as it was (``--restart`` starts over and removes it).

What does not change the pixels (the output's encoding: ``--crf``, the container; the memory limit; the way ranks
share the work of one batch) is left out, so it may change between the runs.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Optional

from .batch_store import STORE_FORMAT, BatchStore, StoreError, store_bytes

__all__ = ["SETTING_NAMES", "file_identity", "run_settings", "manifest_for", "ResumeRefused", "Resume",
           "resume_point", "check_disk", "store_version"]

_MIB = 2**20

#: the settings of a manifest, in the order they are compared, with the words a message uses for each
SETTING_NAMES = {
    "input": "the input file", "model": "the model", "weights": "the weights", "text_embeds": "the text embedding",
    "output_size": "the output size", "work_size": "the model's working size", "frames": "the clip's frame count",
    "seed": "--seed", "batch_frames": "--batch-frames", "overlap": "--overlap", "dtype": "--dtype",
    "vae_parallel": "--vae-parallel", "vae_tile": "--vae-tile", "color_fix": "--color-fix",
    "sp_size": "the SP size (--ranks / --sp-size)",
}


def store_version() -> str:
    """The version a store is stamped with (winsp's: the example ships with it)."""
    from winsp import __version__

    return str(__version__)


def file_identity(path: str) -> str:
    """``<bytes> bytes, modified <ns>, blake2b <hex>`` of ``path``: its size, modification time and a hash of its
    first and last MiB (reading two MiB, whatever its size)."""
    st = os.stat(path)
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        digest.update(f.read(_MIB))
        if st.st_size > _MIB:
            f.seek(max(_MIB, st.st_size - _MIB))
            digest.update(f.read(_MIB))
    return f"{st.st_size} bytes, modified {st.st_mtime_ns}, blake2b {digest.hexdigest()}"


def run_settings(*, input_path: str, model: str, weights: str, text_embeds: Optional[str], output_size, work_size,
                 frames: int, seed: int, batch_frames: int, overlap: int, dtype: str, vae_parallel: str,
                 vae_tile: Optional[int], color_fix: str, sp_size: int) -> dict:
    """The manifest's settings (plain strings and numbers, JSON-able) of a run; see the module docstring."""
    return {
        "input": file_identity(input_path), "model": model, "weights": weights,
        "text_embeds": "the built-in embedding" if not text_embeds else file_identity(text_embeds),
        "output_size": f"{output_size[1]}x{output_size[0]}", "work_size": f"{work_size[1]}x{work_size[0]}",
        "frames": int(frames), "seed": int(seed), "batch_frames": int(batch_frames), "overlap": int(overlap),
        "dtype": dtype, "vae_parallel": vae_parallel, "vae_tile": None if vae_parallel != "tiled" else vae_tile,
        "color_fix": color_fix, "sp_size": int(sp_size),
    }


def manifest_for(settings: dict) -> dict:
    """The whole manifest: the store's format, the version writing it, and ``settings``."""
    return {"format": STORE_FORMAT, "version": store_version(), "settings": settings}


class ResumeRefused(ValueError):
    """The kept batches belong to another run (a changed setting, another version): not resumed, left in place."""


@dataclass
class Resume:
    """Where a run starts: ``batches`` finished batches reused (0: from the start), ``frames`` output frames they
    hold, and one-line ``notes`` for the user (a damaged batch file, the batches reused)."""

    batches: int = 0
    frames: int = 0
    notes: list[str] = field(default_factory=list)


def _show(value) -> str:
    return "none" if value is None else str(value)


def resume_point(store: BatchStore, manifest: dict, plan_length: int, *, restart: bool, output_name: str) -> Resume:
    """Read ``store`` against this run's ``manifest``: a :class:`Resume` (and the store made ready for this run: a
    fresh one, or the kept one less anything after its resume point), or :class:`ResumeRefused` naming the mismatch.

    ``restart`` ignores (removes) a kept store. Called on the writing rank only; the others learn the point from it.
    A fresh store is created with its first batch (see :attr:`.batch_store.BatchStore.pending`).
    """
    where = os.path.basename(store.directory)
    if restart or not store.exists():
        store.remove()  # with --restart; or a folder without a manifest: killed while creating it
        store.pending = manifest  # created with the first finished batch
        return Resume(notes=[f"note: --restart: the kept batches in {where} were removed"] if restart else [])
    try:
        kept = store.read_manifest()
    except StoreError as exc:
        raise ResumeRefused(f"{where} is not a store this program can read ({exc}); remove it or run with --restart "
                            f"to start over") from None
    mine = (manifest["format"], manifest["version"])
    theirs = (kept.get("format"), kept.get("version"))
    if theirs != mine:
        raise ResumeRefused(
            f"the kept batches in {where} were written by seedvr2 of winsp {_show(theirs[1])} (store format "
            f"{_show(theirs[0])}); this is winsp {mine[1]} (store format {mine[0]}): they are not resumed; run with "
            f"--restart to start over (it removes them)")
    old = kept.get("settings") or {}
    for key, label in SETTING_NAMES.items():
        new = manifest["settings"].get(key)
        if old.get(key) != new:
            raise ResumeRefused(
                f"cannot resume {output_name} from {where}: {label} changed (kept batches: {_show(old.get(key))}; "
                f"this run: {_show(new)}); run the same settings again to resume, or --restart to start over (it "
                f"removes the kept batches)")
    store.clear_temporaries()
    store.remove_noted_partial(os.path.dirname(store.directory))  # the killed run's temporary output
    done, notes = store.finished(plan_length)
    notes = [f"note: {note}: that batch is restored again" for note in notes]
    store.drop_from(done)
    frames = store.read_batch(done - 1).frames_out if done else 0
    return Resume(batches=done, frames=frames, notes=notes)


def check_disk(store: BatchStore, frames: int, height: int, width: int, overlap: int, batches: int, *,
               already: int = 0) -> None:
    """The refusal before the start: :class:`ResumeRefused` when the store's file system has less free space than
    the store may grow to (``already``: bytes of it kept from an earlier run)."""
    need = store_bytes(frames, height, width, overlap, batches) - already
    free = store.free_bytes()
    if free is not None and need > free:
        raise ResumeRefused(
            f"the finished batches kept for resuming need up to {need / 2**30:.2f} GiB beside the output "
            f"({os.path.basename(store.directory)}), and its disk has {free / 2**30:.2f} GiB free; free some space, "
            f"write the output elsewhere, or pass --no-resume-store (a fault then loses the whole clip)")
