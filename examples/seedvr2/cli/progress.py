"""Live progress of a restore: a tqdm bar that moves with every VAE chunk and DiT step, with elapsed time and an ETA.

The bar counts the frames of the clip this rank's group restores, each once: a batch stands for the frames it adds
to the clip (its own, less those shared with the previous batch), so the total is the clip's length. Within a
temporal batch the work done advances as it is done: forward hooks on the VAE's encoder and decoder (called once per
causal chunk, per band or tile) and on the DiT (once per sampling step) move it by the batch's frames times the share
of the batch that step stands for (a quarter for encoding, a quarter for the DiT, half for decoding, split evenly
over the expected calls); the batch's end sets it exactly. The percentage, the speed, the ETA and the frame count
all follow the work done (the count in whole frames' worth, rounded down), so the count and the percentage agree:
``restore 4/9 frames 50%``, never ``0/9 frames 50%``.

On a terminal (and not ``--quiet``) the bar is drawn in place on stderr; when stderr is a file or a pipe, one plain
line is printed per finished batch, and within a batch one every :data:`LINE_INTERVAL_S` seconds (the
``SEEDVR2_PROGRESS_SECONDS`` environment variable overrides it), so a long batch is never silent; ``--quiet``
prints nothing. Only rank 0 reports.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from .terminal_text import printable

__all__ = ["RestoreProgress", "expected_calls", "format_seconds", "LINE_INTERVAL_S", "StageProgress", "STAGES"]

_SHARES = {"encode": 0.25, "dit": 0.25, "decode": 0.5}
#: seconds between progress lines within a batch when stderr is not a terminal
LINE_INTERVAL_S = 30.0
LINE_INTERVAL_ENV = "SEEDVR2_PROGRESS_SECONDS"


def format_seconds(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _chunks(frames: int, chunk: Optional[int]) -> int:
    if chunk is None or frames - 1 <= chunk:
        return 1
    return 1 + math.ceil((frames - 1 - chunk) / chunk)


def expected_calls(frames: int, *, steps: int, temporal_chunk: Optional[int] = 4, temporal_factor: int = 4,
                   tiles: int = 1) -> dict[str, int]:
    """How many encoder, DiT and decoder calls one batch of ``frames`` frames makes (the chunking of
    :mod:`~examples.seedvr2.models.vae.model`: the first frame and a chunk, then a chunk at a time; the decoder in
    latent frames)."""
    padded = 1 + math.ceil((frames - 1) / temporal_factor) * temporal_factor
    latent = 1 + (padded - 1) // temporal_factor
    latent_chunk = None if temporal_chunk is None else max(1, temporal_chunk // temporal_factor)
    return {"encode": tiles * _chunks(padded, temporal_chunk), "dit": steps,
            "decode": tiles * _chunks(latent, latent_chunk)}


def _line_interval() -> float:
    """:data:`LINE_INTERVAL_S`, or ``SEEDVR2_PROGRESS_SECONDS`` when it is a number of seconds >= 0."""
    try:
        seconds = float(os.environ.get(LINE_INTERVAL_ENV) or LINE_INTERVAL_S)
    except ValueError:
        return LINE_INTERVAL_S
    return seconds if seconds >= 0 else LINE_INTERVAL_S


class RestoreProgress:
    """The restore stage's progress over ``total`` frames (see the module docstring).

    ``mode``: ``"bar"`` (tqdm on ``stream``), ``"lines"`` (a line per batch and per ``line_interval`` seconds within
    one) or ``"off"``. ``total``: the frames of the clip the batches add, each once (see the module docstring).
    """

    def __init__(self, total: int, batches: int, mode: str, stream=None,
                 line_interval: Optional[float] = None) -> None:
        self.total, self.batches, self.mode = total, batches, mode
        self.stream = sys.stderr if stream is None else stream
        self.line_interval = _line_interval() if line_interval is None else line_interval
        self.done_frames = 0.0
        self.done_batches = 0
        self.work = 0.0  # frames' worth of work done, within the current batch too
        self.started = time.perf_counter()
        self._last_line = self.started
        self._batch_frames = 0
        self._expected: dict[str, int] = {}
        self._calls: dict[str, int] = {}
        self._hooks: list = []
        self.bar = None
        if mode == "bar":
            import shutil

            from tqdm import tqdm

            size = shutil.get_terminal_size((100, 24))  # a terminal that reports 0 x 0 (a bare pty): 100 x 24
            self.bar = tqdm(total=total, unit="frame", file=self.stream, leave=False, ncols=size.columns or 100,
                            nrows=size.lines or 24,
                            desc=f"restore {self._frames_done()}", smoothing=0.1,
                            bar_format="{desc} {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}, {rate_fmt}]")

    @classmethod
    def for_stream(cls, total: int, batches: int, *, enabled: bool, stream=None) -> "RestoreProgress":
        """A bar on a terminal, lines elsewhere, nothing when not ``enabled`` (``--quiet``, ranks other than 0)."""
        stream = sys.stderr if stream is None else stream
        tty = bool(getattr(stream, "isatty", lambda: False)())
        return cls(total, batches, "off" if not enabled else "bar" if tty else "lines", stream)

    def _frames_done(self) -> str:
        """The frames' worth of work done, in whole frames (rounded down, so 100 % only at the end)."""
        return f"{math.floor(max(self.work, self.done_frames) + 1e-9)}/{self.total} frames"

    def attach(self, vae, dit) -> "RestoreProgress":
        """Count the VAE encoder's / decoder's and the DiT's calls (forward hooks; removed by :meth:`close`)."""
        if self.mode == "off":
            return self
        for kind, module in (("encode", getattr(vae, "encoder", None)), ("decode", getattr(vae, "decoder", None)),
                             ("dit", dit)):
            if module is not None:
                self._hooks.append(module.register_forward_hook(lambda *_, k=kind: self._tick(k)))
        return self

    def begin_batch(self, frames: int, expected: dict[str, int]) -> None:
        """A batch starts that adds ``frames`` frames to the clip (less any it shares with the previous one)."""
        self._batch_frames, self._expected = frames, dict(expected)
        self._calls = {k: 0 for k in _SHARES}
        self._batch_base = self.done_frames

    def _tick(self, kind: str) -> None:
        if self.mode == "off" or not self._expected:
            return
        self._calls[kind] += 1
        share = sum(_SHARES[k] * min(1.0, self._calls[k] / max(1, self._expected.get(k, 1))) for k in _SHARES)
        self.work = max(self.work, self._batch_base + self._batch_frames * min(share, 0.999))
        if self.bar is not None:
            if self.work > self.bar.n:
                self.bar.set_description_str(f"restore {self._frames_done()}", refresh=False)
                self.bar.update(self.work - self.bar.n)
        elif time.perf_counter() - self._last_line >= self.line_interval:
            self._line(f"batch {self.done_batches + 1}/{self.batches} {min(share, 0.99):.0%} done")

    def end_batch(self) -> None:
        self.done_frames += self._batch_frames
        self.work = self.done_frames
        self.done_batches += 1
        self._expected = {}
        if self.bar is not None:
            self.bar.set_description_str(f"restore {self._frames_done()}", refresh=False)
            self.bar.update(self.done_frames - self.bar.n)
            self.bar.refresh()  # the finished count, even when the step was too small for tqdm to redraw
        elif self.mode == "lines":
            self._line(f"batch {self.done_batches}/{self.batches}")

    def _line(self, what: str) -> None:
        """One progress line for a log or a pipe: the batch, whole frames finished, elapsed time and the ETA (from
        the work done so far)."""
        now = time.perf_counter()
        elapsed = now - self.started
        left = elapsed / self.work * (self.total - self.work) if self.work else None
        self.stream.write(f"restore: {what}, {self._frames_done()}, {format_seconds(elapsed)} elapsed, ETA "
                          f"{'?' if left is None else format_seconds(left)}\n")
        self.stream.flush()
        self._last_line = now

    def projected_seconds(self) -> Optional[float]:
        """The whole stage's time at the speed measured so far (None before the first batch)."""
        if not self.done_frames:
            return None
        return (time.perf_counter() - self.started) / self.done_frames * self.total

    def write(self, line: str) -> None:
        """A message line that does not tear the bar."""
        if self.bar is not None:
            self.bar.clear()
            self.stream.write(line + "\n")
            self.bar.refresh()
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def summary_line(prog: str, output: str, size: tuple[int, int], frames: int, fps: Optional[str], *, weights: str,
                 dtype: str, device: str, world: int, sp: int, vae: str, batches: int, batch_frames: int,
                 overlap: int, seconds: float, peak_gib: float, color_fix: str = "none",
                 work: Optional[tuple[int, int]] = None, stages: Optional[dict] = None) -> str:
    """The one line a finished restore prints: what was written (its true size, ``size`` = (height, width) as
    encoded; ``work``, the size the model ran at, when it differs), how it ran and how long it took: ``seconds``, the
    whole command's wall time, then ``stages`` (name: seconds, in order) when given; about 240 characters plus the
    path."""
    what = f"{size[1]}x{size[0]}" + (f" (model at {work[1]}x{work[0]})" if work is not None and work != size else "")
    what += f", {frames} frames, {fps}" if fps is not None else ""
    ranks = "1 rank" if world == 1 else f"{world} ranks, SP {sp}"
    run = "1 batch" if batches == 1 else f"batches {batches}x{batch_frames}, overlap {overlap}"
    peak = f"peak {peak_gib:.1f} GiB" + ("/rank" if world > 1 else "")
    return (f"{prog}: wrote {output}: {what} | {weights} {dtype} {device}, {ranks}, VAE {vae}, colour "
            f"{color_fix} | {run} | "
            f"{seconds:.1f}s{_stage_times(stages)}, {frames / max(seconds, 1e-9):.2f} frames/s, {peak}")


def _stage_times(stages: Optional[dict]) -> str:
    """`` (start-up 1.2, read 0.1, load 0.3, restore 2.6)``: the stages' seconds after the total, or nothing."""
    if not stages:
        return ""
    return " (" + ", ".join(f"{name} {value:.1f}" for name, value in stages.items()) + ")"


STAGES = ("read", "load", "restore")


@dataclass
class StageProgress:
    """A tiny progress bar over named stages on stderr, and the seconds each stage took.

    On a terminal the bar is redrawn in place as stages start and finish (the restore stage's own bar, with an ETA,
    is :mod:`.progress`'s); otherwise (a log, a pipe) it draws nothing: the restore stage prints one line per batch.
    """

    stages: Sequence[str]
    enabled: bool = True
    stream: object = field(default_factory=lambda: sys.stderr)
    seconds: dict = field(default_factory=dict)
    _current: Optional[str] = None
    _started: float = 0.0
    _open_line: bool = False
    _last_done: int = 0

    def start(self, stage: str) -> None:
        self._finish_current()
        self._current, self._started = stage, time.perf_counter()
        if self._is_tty():
            self._draw(self.stages.index(stage), f"{stage} ...")

    def note(self, message: str) -> None:
        """Print a message line (even when the bar is disabled) without tearing the bar."""
        self.break_line()
        self.stream.write(f"{printable(message)}\n")  # loader notes name keys from the file
        self.stream.flush()

    def break_line(self) -> None:
        """End a bar line drawn in place, so that what follows starts on a fresh line."""
        if self._open_line:
            self.stream.write("\n")
            self._open_line = False

    def frames(self, done: int, total: int) -> None:  # kept for callers; the restore stage's bar is .progress
        """Show the frames of the whole clip written so far during the current stage (redrawn on a terminal; in a
        log, one line per tenth of the clip)."""
        if not self.enabled or self._current is None:
            return
        label = f"{self._current} {done}/{total} frames"
        if self._is_tty():
            self._draw(self.stages.index(self._current), label)
        elif done == total or done * 10 // total > (self._last_done * 10 // total if total else 0):
            self._draw(self.stages.index(self._current), label)
        self._last_done = done

    def done(self) -> None:
        self._finish_current()
        self.break_line()

    def _finish_current(self) -> None:
        if self._current is not None:
            spent = time.perf_counter() - self._started
            self.seconds[self._current] = spent
            self._draw(self.stages.index(self._current) + 1, f"{self._current} {spent:.2f}s")
            self._current = None

    def _is_tty(self) -> bool:
        return bool(getattr(self.stream, "isatty", lambda: False)())

    def _draw(self, finished: int, label: str) -> None:
        if not self.enabled or not self._is_tty():  # a log or a pipe gets the batches' lines (.progress) only
            return
        width = 24
        filled = round(width * finished / len(self.stages))
        line = f"[{'#' * filled}{'.' * (width - filled)}] {finished}/{len(self.stages)} {label}"
        if self._is_tty():
            self.stream.write(f"\r{line:<56}")
            self._open_line = True
        else:
            self.stream.write(f"{line}\n")
        self.stream.flush()
