"""A restore's finished batches, kept as it runs and reused when the same command runs again (the CLI's side).

:func:`open_kept_batches` runs before the models load: on the writing rank it reads the store beside the output
against this run's settings (:mod:`.resume`) and checks the disk; then every rank meets once (through winsp's world
group, the CLI's ``gather_rows``) and takes the writer's resume point, or stops with the writer's refusal. The
returned :class:`KeptBatches` then

* replays the kept frames into the output's encoder, so the output is encoded in one pass over all frames, and hands
  the cross-fade the kept blend state (:class:`ResumableBlender`);
* keeps each batch as its frames become final (:meth:`KeptBatches.keep`, on the writer's thread), and says in one
  line when the disk fills (the restore goes on, keeping no more);
* removes the store once the output is complete (:meth:`KeptBatches.complete`).
"""

from __future__ import annotations

import os
import re
import stat
import threading
from typing import Callable, Iterator, Optional

import numpy as np
import torch

from .batch_store import BatchRecord, BatchStore, StoreError, store_path
from .resume import Resume, ResumeRefused, check_disk, manifest_for, resume_point
from .temporal import TemporalBatch, TemporalBlender

__all__ = ["ResumableBlender", "KeptBatches", "open_kept_batches", "agree_on_resume", "kept_folder"]

_ACTIVE: list[str] = []  # the store folder of the run in progress in this process (for the stop signal's line)


def kept_folder() -> Optional[str]:
    """The folder of finished batches the run in progress has kept (None when none yet): what a stop leaves."""
    return _ACTIVE[0] if _ACTIVE and os.path.isfile(os.path.join(_ACTIVE[0], "manifest.json")) else None


class ResumableBlender(TemporalBlender):
    """:class:`TemporalBlender` whose held frames can be read (to keep them) and set (to resume after a batch)."""

    @property
    def held(self) -> torch.Tensor:
        """The frames held back for the next batch (``[0, ...]`` when none)."""
        return self._tail if self._tail is not None else torch.zeros(0, dtype=torch.uint8)

    @property
    def next_index(self) -> int:
        return self._next_index

    @classmethod
    def resumed(cls, next_index: int, held: torch.Tensor, frames_out: int) -> "ResumableBlender":
        """A blender that continues after batch ``next_index - 1``, holding ``held``."""
        blender = cls()
        blender._next_index, blender.frames_out = next_index, frames_out
        blender._tail = held if next_index else None
        return blender


class KeptBatches:
    """The kept batches of one restore on the writing rank (see the module docstring); a disabled one (``store``
    None: ``--no-resume-store``, or a rank that does not write) keeps nothing and resumes nothing."""

    def __init__(self, store: Optional[BatchStore], resume: Resume, plan: tuple[TemporalBatch, ...],
                 say: Callable[[str], None] = lambda line: None, folder: Optional[str] = None) -> None:
        self.store, self.resume, self.plan, self.say = store, resume, plan, say
        self.folder = folder if folder is not None else store.directory if store is not None else None
        self._partial: Optional[str] = None  # this run's temporary output file, noted with its first kept batch
        self.created = False  # whether this run made the store folder (a run that loses its output removes it)
        self._handled = resume.batches - 1  # the last batch the writer has kept (or given up on)
        self._changed = threading.Condition()
        _ACTIVE[:] = [store.directory] if store is not None else []

    @property
    def first(self) -> int:
        """The first batch to compute (the batches before it are reused)."""
        return self.resume.batches

    def blender(self) -> ResumableBlender:
        """The cross-fade, holding the kept blend state when resuming."""
        if not self.resume.batches or self.store is None:
            return ResumableBlender()
        record = self.store.read_batch(self.resume.batches - 1, tail=True)
        return ResumableBlender.resumed(self.resume.batches, torch.from_numpy(record.tail.copy()), record.frames_out)

    def replay(self) -> Iterator[np.ndarray]:
        """The kept final frames, in order (each batch's file read and checked again as it is replayed)."""
        if self.store is None:
            return
        for index in range(self.resume.batches):
            try:
                record = self.store.read_batch(index)
            except (OSError, StoreError) as exc:  # changed on disk since the resume point was read: not trusted
                raise RuntimeError(f"the kept batch {index} in {self.store.directory} changed during the run ({exc}); "
                                   f"run the command again") from None
            yield from record.final

    def note_partial(self, path: Optional[str]) -> None:
        """This run's temporary output file: noted in the store, so that the run resuming it removes it (a killed
        process leaves it)."""
        self._partial = path
        if path is not None and self.store is not None and self.store.exists():
            self.store.note_partial(path)

    def keep(self, batch: TemporalBatch, final: list[torch.Tensor], blender: ResumableBlender) -> None:
        """Keep batch ``batch`` now that it is final: ``final`` (the frames the cross-fade released for it) and the
        blender's held frames. A write that fails (a full disk, a file size limit, an I/O error) stops the keeping,
        with one line; the restore goes on."""
        if self.store is None or self.store.full:
            return
        frames = torch.stack(final).numpy() if final else blender.held[:0].numpy()
        if frames.ndim != 4:  # no frame released and nothing held yet: an empty batch of the right rank
            frames = frames.reshape((0, 0, 0, 3))
        held = blender.held.numpy()
        if held.ndim != 4:
            held = frames[:0]
        following = self.plan[batch.index + 1].start if batch.index + 1 < len(self.plan) else batch.stop
        created = self.store.pending is not None
        try:
            if created:  # the store is made with this batch (and the partial output noted first)
                self.store.create(self.store.pending)
                self.store.pending = None
                self.created = True
                if self._partial is not None:
                    self.store.note_partial(self._partial)
            self.store.write_batch(BatchRecord(index=batch.index, next_start=following,
                                               frames_out=blender.frames_out, final=frames, tail=held))
        except FileExistsError:
            if not created:
                raise
            self.store.full = True  # the folder is another run's: left to it, and this run keeps nothing
            self.folder = None  # nor removes it when its own output is complete
            _ACTIVE.clear()  # nor names it when stopped: the batches there are not this run's
            self.say(f"note: {os.path.basename(self.store.directory)} appeared while this run worked (another run "
                     f"writing the same output?): it is left as it is, and this run keeps no batches for resuming")
        except OSError as exc:  # keeping serves a fault to come: a store it cannot write never stops the restore
            self.store.full = True
            if self.created and created:  # made for this batch, which it could not keep: no folder left
                self.store.remove()
                self.created = False
            what = "the disk filled while keeping" if BatchStore.disk_full(exc) else "could not keep"
            after = "starts over" if created else f"resumes after batch {batch.index}"
            self.say(f"note: {what} batch {batch.index + 1} of {len(self.plan)} for resuming "
                     f"({exc.strerror or exc}): no more batches are kept, the restore goes on (a fault now {after})")

    def mark_handled(self, index: int) -> None:
        """The writer is done keeping batch ``index`` (kept, or failed: its error is the writer's to raise)."""
        with self._changed:
            self._handled = max(self._handled, index)
            self._changed.notify_all()

    def wait(self, index: int, failed: Callable[[], bool]) -> None:
        """Until batch ``index`` is kept (or the writer ``failed``), so that the next batch starts only once every
        finished one is on disk: a kill then costs the batch in progress alone. Keeping writes the batch's 8-bit frames
        with a checksum each (no sync to the disk); encoding them stays on the writer's thread, beside the compute."""
        if self.store is None or self.store.full:
            return
        with self._changed:
            while self._handled < index and not failed():
                self._changed.wait(0.1)

    def discard_own(self) -> None:
        """This run's output was not written (another run's appeared there first): a store this run made is of no
        use and is removed; one it found or one another run made is left."""
        _ACTIVE.clear()
        if self.created and self.store is not None:
            self.store.remove()

    def complete(self) -> None:
        """The output is complete: the store is removed (not one another run made while this one worked)."""
        _ACTIVE.clear()
        if self.folder is not None:  # also an earlier run's, left by a run with --no-resume-store: now of no use
            BatchStore(self.folder).remove()


def agree_on_resume(error: Optional[Exception], batches: int,
                    gather_rows: Optional[Callable[[list[float]], list[list[float]]]]) -> int:
    """Every rank's meeting on the resume point: the writer's (rank 0's) number of reused batches, or the writer's
    refusal raised on every rank (``error`` on the writer; the others raise ``PeerRefused``). ``gather_rows`` is
    the CLI's all-gather of one row per rank (None: one rank)."""
    if gather_rows is None:
        if error is not None:
            raise error
        return batches
    rows = gather_rows([1.0 if error is not None else 0.0, float(batches)])
    if rows[0][0]:
        raise error if error is not None else PeerRefused("rank 0 refused to resume")
    return int(rows[0][1])


class PeerRefused(ValueError):
    """Rank 0 refused to resume (it says why); this rank stops quietly."""


def open_kept_batches(*, output: str, settings: dict, plan: tuple[TemporalBatch, ...], frame_hw: tuple[int, int],
                      overlap: int, writer: bool, enabled: bool, restart: bool,
                      gather_rows: Optional[Callable[[list[float]], list[list[float]]]],
                      say: Callable[[str], None], start_over: bool = False) -> KeptBatches:
    """The kept batches of this run, agreed by every rank (see the module docstring). ``settings``: this run's
    :func:`.resume.run_settings`; ``frame_hw``: the output frames' size; ``writer``: this rank writes the output and
    keeps the batches; ``enabled``: False for ``--no-resume-store`` (nothing is read or kept; an earlier run's batches
    are removed once the output is complete, or at once with ``restart``). Raises
    :class:`.resume.ResumeRefused` (on the writer) or :class:`PeerRefused` (on the others); with ``start_over``
    (``serve``'s jobs: nobody is there to run ``--restart``) a store that cannot be resumed is said in one line and
    removed, and the run starts over; a disk too small for the store is said in one line and nothing is kept."""
    shape = (*frame_hw, 3)
    store = BatchStore(store_path(output), shape, max(b.num_frames for b in plan)) if writer else None
    resume, error = Resume(), None
    if store is not None:
        try:
            if not enabled:
                if restart:
                    store.remove()
                store = None
            else:
                resume, store = _read_or_start_over(store, settings, plan, output, restart, start_over, say)
                if store is not None:
                    kept = _kept_bytes(store.directory) if resume.batches else 0
                    try:
                        check_disk(store, plan[-1].stop, *frame_hw, overlap, len(plan), already=kept)
                    except ResumeRefused as exc:
                        if not start_over:
                            raise
                        say(f"note: {exc}: this job keeps no batches (a fault now starts it over)")
                        store.remove()
                        resume, store = Resume(), None
        except ResumeRefused as exc:
            error = exc
    batches = agree_on_resume(error, resume.batches, gather_rows)
    if store is None:
        resume = Resume(batches=batches)
    for note in resume.notes:
        say(note)
    if resume.batches:
        say(f"note: resuming: {resume.frames} of {plan[-1].stop} frames reused ({resume.batches} of {len(plan)} "
            f"batches kept in {os.path.basename(store_path(output))}); --restart starts over")
    return KeptBatches(store, resume, plan, say, folder=store_path(output) if writer else None)


def _read_or_start_over(store: BatchStore, settings: dict, plan: tuple[TemporalBatch, ...], output: str,
                        restart: bool, start_over: bool, say: Callable[[str], None]):
    """The writer's resume point (and its store); with ``start_over``, a refusal is one line and a fresh store."""
    manifest = manifest_for(settings)
    try:
        return resume_point(store, manifest, len(plan), restart=restart,
                            output_name=os.path.basename(output)), store
    except ResumeRefused as exc:
        if not start_over:
            raise
        why = re.split(r"; (?:run|remove it) ", str(exc))[0]
        say(f"note: {why}: the kept batches were removed and the job starts over")
        store.remove()
        store.pending = manifest  # created with the first finished batch
        return Resume(), store


def _kept_bytes(directory: str) -> int:
    total = 0
    for name in os.listdir(directory) if os.path.isdir(directory) else ():
        try:
            info = os.lstat(os.path.join(directory, name))  # a link is counted as itself, never followed
            total += info.st_size if stat.S_ISREG(info.st_mode) else 0
        except OSError:
            pass
    return total
