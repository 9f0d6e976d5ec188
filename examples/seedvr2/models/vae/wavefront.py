"""The temporal wavefront: the ranks of a window-SP group run consecutive causal chunks of one clip at once.

A chunked causal VAE run (``vae.set_temporal_chunking``) carries, from chunk ``c`` to chunk ``c + 1``, only the
last few input frames of every causal convolution (:class:`.context.CausalCache`); everything else is per frame.
So chunk ``c + 1`` can start its layer ``l`` as soon as chunk ``c`` has finished its layer ``l``. Here chunk ``c``
belongs to time rank ``c mod T``: while time rank ``r`` runs layer ``l`` of its chunk, time rank ``r - 1`` is
already at a later layer of the previous chunk, and every convolution's few cached frames travel forward, point
to point, as soon as they exist (:class:`RelayCache`). With many layers per chunk and at least ``T`` chunks, this
approaches ``T``-fold throughput; the chunks, their order and every chunk's arithmetic are the single-rank chunked
run's, so the result equals it bit for bit.

It combines with height sharding (:mod:`.sharding`): a :class:`VAESplit` of ``T x H = P`` ranks puts rank
``t * H + h`` on band ``h`` of time rank ``t``'s chunks; the ``H`` ranks of one time rank form a height group
(halos, norm statistics), and each rank relays its band's cache to band ``h`` of the next time rank.
:func:`choose_split` picks the split for a clip from a cost model fitted on measured wall time
(:func:`split_cost`). A rank that gets no chunk (``T`` larger
than the chunk count) only takes part in the final gather.

Nothing here calls ``torch.distributed``: communication goes through :class:`winsp.comm.group.SPGroup`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from winsp.comm.group import SPGroup
from winsp.comm.spatial import band_offsets, band_sizes, take_band
from winsp.utils.phases import plans

from .context import CausalCache, RunContext
from .model import CausalVideoVAE, _chunk_bounds, moments_to_latent
from .sharding import RowBands

__all__ = ["VAESplit", "RelayCache", "WaveStats", "HEIGHT_COMM", "HEIGHT_HALO", "TIME_COMM", "split_cost",
           "choose_split", "clip_chunk_frames", "clip_splits", "split_for_clip", "describe_splits",
           "encode_wavefront", "decode_wavefront"]

_ROWS = 3  # the height dim of [b, c, t, h, w]
#: The costs of splitting, as fractions of one rank's run. ``HEIGHT_COMM`` per extra height rank (halo exchanges and
#: norm statistics every layer); ``HEIGHT_HALO`` per edge of the busiest band over the square of its latent rows,
#: times its share of the work (thin bands cost more than their halo rows alone: at P = 2, bands of 4 latent rows ran
#: 24-39 % over an even split, of 6 rows 4-5 %, of 8 rows 2-7 %); ``TIME_COMM`` per extra time rank (the
#: wavefront's fill: a time rank waits for the previous chunk's first layers, and the relayed caches). Fitted
#: (``benchmarks/cost_model.py --fit-vae``) on the wall-time speed-ups over one rank on one thread that
#: ``benchmarks/bench_vae.py --scaling`` measured at P = 2 on the quiet 2-core machine (released VAE widths,
#: ``benchmarks/vae_split_walls.json``, 26 points). Refit on a new machine with
#: ``python benchmarks/bench_vae.py --scaling --json F`` then ``python benchmarks/cost_model.py --fit-vae F``.
HEIGHT_COMM = 0.011
HEIGHT_HALO = 4.2
TIME_COMM = 0.042
_HEIGHT_COMM = HEIGHT_COMM  # the name before the fit


@dataclass(frozen=True)
class VAESplit:
    """``time`` x ``height`` ranks: ``time`` ranks share the chunks, ``height`` ranks each chunk's rows."""

    time: int
    height: int

    def __post_init__(self) -> None:
        if self.time < 1 or self.height < 1:
            raise ValueError(f"VAESplit: time and height must be >= 1, got {self.time} x {self.height}")

    @property
    def size(self) -> int:
        return self.time * self.height

    def coords(self, rank: int) -> tuple[int, int]:
        """(time rank, height rank) of group rank ``rank``."""
        return divmod(rank, self.height)


@dataclass
class WaveStats:
    """Seconds one rank spent waiting for the previous time rank's cache, and messages sent / received."""

    wait_s: float = 0.0
    sent: int = 0
    received: int = 0


class RelayCache(CausalCache):
    """A chunk's causal cache whose frames come from the previous chunk's rank and go to the next chunk's rank.

    Each convolution with temporal look-back ``k`` exchanges one fixed-size message per chunk: room for ``k``
    frames of its input plus the number of frames actually carried (0 .. k), so the receiver needs no header.
    """

    def __init__(self, group: SPGroup, *, first: bool, last: bool, prev: int, next: int,
                 stats: WaveStats | None = None, carried: dict[nn.Module, int] | None = None) -> None:
        super().__init__(first=first)
        self.group, self.last, self.prev, self.next = group, last, prev, next
        self.stats = stats if stats is not None else WaveStats()
        self._pending: list[tuple[object, torch.Tensor]] = []
        # frames the previous chunk leaves at each convolution, known on the host (:func:`carried_frames`), so the
        # receiver never reads the count back from the device
        self.carried = carried

    @staticmethod
    def _frame_numel(conv: nn.Module, x: torch.Tensor) -> tuple[int, int]:
        b, c, _, h, w = x.shape
        return b * c * h * w, conv.time_lookback

    def take(self, conv: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        frame, lookback = self._frame_numel(conv, x)
        if lookback == 0:
            return None  # a one-frame kernel carries nothing
        buffer = x.new_empty(frame * lookback + 1)
        start = time.perf_counter()
        self.group.recv_(buffer, self.prev)
        self.stats.wait_s += time.perf_counter() - start
        self.stats.received += 1
        if self.carried is not None:
            frames = self.carried.get(conv, 0)
            if buffer.device.type == "cpu" and int(buffer[-1]) != frames:  # free to check on the host
                raise AssertionError(f"the previous chunk sent {int(buffer[-1])} frames, the plan says {frames}")
        else:
            frames = int(buffer[-1].item())
        if frames == 0:
            return None
        b, c, _, h, w = x.shape
        return buffer[: frame * frames].view(b, c, frames, h, w)

    def keep(self, conv: nn.Module, x: torch.Tensor, start: int) -> None:
        frame, lookback = self._frame_numel(conv, x)
        if self.last or lookback == 0:
            return
        frames = max(0, x.shape[2] - start)
        if frames > lookback:
            raise AssertionError(f"a causal convolution left {frames} frames, more than its look-back {lookback}")
        buffer = x.new_empty(frame * lookback + 1)
        buffer[: frame * frames] = x[:, :, start:].reshape(-1)
        buffer[-1] = frames
        self._pending.append((self.group.isend(buffer, self.next), buffer))
        self.stats.sent += 1

    def finish(self) -> None:
        """Wait until every message of this chunk has left (their buffers can then go)."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


def split_cost(split: VAESplit, chunk_frames: list[int], latent_rows: int, *, height_comm: float = HEIGHT_COMM,
               height_halo: float = HEIGHT_HALO, time_comm: float = TIME_COMM) -> float:
    """The modelled run time of ``split`` relative to one rank: the busiest rank's share of the work (the busiest
    time rank's share of the video frames, ``chunk_frames`` being each causal chunk's frames dealt round-robin, times
    the largest band's share of the ``latent_rows``), grown by ``height_halo`` per edge of that band (at most two)
    over the square of its rows, plus ``height_comm`` per extra height rank and ``time_comm`` per extra time rank."""
    total = float(sum(chunk_frames)) or 1.0
    busiest = max(sum(chunk_frames[c::split.time]) for c in range(split.time))
    rows = math.ceil(latent_rows / split.height)
    share = busiest / total * rows / latent_rows
    edges = min(split.height - 1, 2)
    return share * (1 + height_halo * edges / rows**2) + height_comm * (split.height - 1) + time_comm * (split.time - 1)


def choose_split(
    world: int, chunk_frames: list[int], latent_rows: int, *, height_comm: float = HEIGHT_COMM,
    height_halo: float = HEIGHT_HALO, time_comm: float = TIME_COMM,
) -> VAESplit:
    """The ``time x height`` split of ``world`` ranks with the lowest :func:`split_cost` for a clip.

    ``chunk_frames`` are the causal chunks' video frames (encode: each chunk's input frames, the first one longer;
    decode: each latent chunk's output frames, the first one shorter), ``latent_rows`` the latent height. A single
    image (one chunk) or a short clip gets height bands; a long clip whose rows split badly over the ranks, or into
    thin bands, gets time ranks. Ties go to more time ranks (no per-layer collectives).
    """
    if world < 1:
        raise ValueError(f"choose_split: world must be >= 1, got {world}")
    best, best_cost = None, math.inf
    for height in range(1, world + 1):
        if world % height or height > latent_rows:
            continue
        split = VAESplit(world // height, height)
        cost = split_cost(split, chunk_frames, latent_rows, height_comm=height_comm, height_halo=height_halo,
                          time_comm=time_comm)
        if cost < best_cost - 1e-12:
            best, best_cost = split, cost
    if best is None:
        raise ValueError(f"choose_split: no split of {world} ranks fits a latent height of {latent_rows} rows")
    return best


def _check_split(split: VAESplit | None, group: SPGroup, chunks: list[int], latent_rows: int) -> VAESplit:
    if split is None:
        return choose_split(group.size, chunks, latent_rows)
    if not isinstance(split, VAESplit):
        raise TypeError(f"split must be a VAESplit, got {type(split).__name__}")
    if split.size != group.size:
        raise ValueError(f"split {split.time} x {split.height} = {split.size} ranks does not match the group's "
                         f"{group.size} ranks")
    if split.height > latent_rows:
        raise ValueError(f"split height {split.height}: a latent height of {latent_rows} rows cannot give every "
                         f"height rank a row")
    return split


@dataclass
class _Plan:
    """Who runs what: the chunk bounds, each time rank's chunks, the height bands, this rank's place."""

    bounds: list[tuple[int, int]]
    split: VAESplit
    rank: int
    latent_bands: list[int]
    out_frames: list[int]  # output frames of every chunk
    owners: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.owners = [list(range(t, len(self.bounds), self.split.time)) for t in range(self.split.time)]


def _run(
    vae: CausalVideoVAE, x: torch.Tensor, group: SPGroup, plan: _Plan, step: Callable, *, in_scale: int,
    out_scale: int, out_channels: int, out_width: int, gather: bool, stats: WaveStats | None,
) -> torch.Tensor:
    split = plan.split
    t_rank, h_rank = split.coords(group.rank)
    height_group = group.subgroup(range(t_rank * split.height, (t_rank + 1) * split.height))
    bands = RowBands(height_group, plan.latent_bands) if split.height > 1 else None
    band = take_band(x, _ROWS, [s * in_scale for s in plan.latent_bands], h_rank).to(vae.dtype)
    prev = ((t_rank - 1) % split.time) * split.height + h_rank
    nxt = ((t_rank + 1) % split.time) * split.height + h_rank
    last = len(plan.bounds) - 1
    outputs = []
    if split.time == 1:  # no wavefront: the chunks run here one after another, the cache stays local
        cache = CausalCache() if len(plan.bounds) > 1 else None
        for c, (start, stop) in enumerate(plan.bounds):
            if cache is not None:
                cache.first = c == 0
            outputs.append(step(band[:, :, start:stop], RunContext(cache=cache, bands=bands)))
    else:
        # A chunk's sends are waited for only after this rank's next chunk: a send completes when the next rank
        # has taken it, which that rank does layer by layer while this one goes on. The messages travel on the
        # group's point-to-point twin (every rank, idle ones too, reaches this line), not among its collectives.
        relay = group.point_to_point()
        carried = carried_frames(step, band, plan.bounds, in_scale)
        previous = None
        for c in plan.owners[t_rank]:
            start, stop = plan.bounds[c]
            cache = RelayCache(relay, first=c == 0, last=c == last, prev=prev, next=nxt, stats=stats,
                               carried=carried[c - 1] if c > 0 else None)
            outputs.append(step(band[:, :, start:stop], RunContext(cache=cache, bands=bands)))
            if previous is not None:
                previous.finish()
            previous = cache
        if previous is not None:
            previous.finish()
    rows = [s * out_scale for s in plan.latent_bands]
    b = x.shape[0]
    for c, out in zip(plan.owners[t_rank], outputs, strict=True):
        if out.shape[2] != plan.out_frames[c]:
            raise AssertionError(f"chunk {c} gave {out.shape[2]} frames, expected {plan.out_frames[c]}")
    local = torch.cat(outputs, dim=2) if outputs else band.new_zeros((b, out_channels, 0, rows[h_rank], out_width))
    if not gather:
        return local
    # One all-gather of every rank's (chunks x band) block, flattened, then each block to its place.
    frames_of = [sum(plan.out_frames[c] for c in plan.owners[t]) for t in range(split.time)]
    block = [b * out_channels * frames_of[t] * rows[h] * out_width
             for t, h in (split.coords(r) for r in range(group.size))]
    flat = group.all_gather_rows(local.reshape(-1), block) if not group.is_single else local.reshape(-1)
    full = local.new_empty((b, out_channels, sum(plan.out_frames), sum(rows), out_width))
    frame_starts = band_offsets(plan.out_frames)
    row_starts = band_offsets(rows)
    offset = 0
    for r in range(group.size):
        t, h = split.coords(r)
        piece = flat[offset:offset + block[r]].view(b, out_channels, frames_of[t], rows[h], out_width)
        offset += block[r]
        f = 0
        for c in plan.owners[t]:
            n = plan.out_frames[c]
            full[:, :, frame_starts[c]:frame_starts[c] + n, row_starts[h]:row_starts[h] + rows[h]] = \
                piece[:, :, f:f + n]
            f += n
    return full


class _CarryCounts(CausalCache):
    """A local chunk cache that records how many frames each chunk leaves at each causal convolution."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: list[dict[nn.Module, int]] = []

    def keep(self, conv: nn.Module, x: torch.Tensor, start: int) -> None:
        if getattr(conv, "time_lookback", 0):
            self.counts[-1][conv] = max(0, x.shape[2] - start)
        super().keep(conv, x, start)


@plans
def carried_frames(step: Callable, x: torch.Tensor, bounds: list[tuple[int, int]],
                   unit: int) -> list[dict[nn.Module, int]]:
    """For each chunk, the frames it leaves for the next at each causal convolution: shapes only, from the chunks run
    one after another on a one-latent-pixel sliver of ``x`` (``unit`` input pixels a latent pixel; the frame counts
    do not depend on the frame's size), so a rank knows on the host what its predecessor sends and never reads a count
    back from the device."""
    cache = _CarryCounts()
    side = min(x.shape[-2], x.shape[-1], unit)
    sliver = x[..., :side, :side]
    with torch.no_grad():
        for c, (start, stop) in enumerate(bounds):
            cache.first = c == 0
            cache.counts.append({})
            step(sliver[:, :, start:stop], RunContext(cache=cache))
    return cache.counts


def _plan(group: SPGroup, frames: int, chunk: int | None, latent_rows: int, split: VAESplit | None,
          out_frames: Callable[[int, int], int], video_side: str) -> _Plan:
    bounds = _chunk_bounds(frames, chunk)
    lengths = [stop - start for start, stop in bounds]
    outputs = [out_frames(c, n) for c, n in enumerate(lengths)]
    split = _check_split(split, group, lengths if video_side == "input" else outputs, latent_rows)
    return _Plan(bounds, split, group.rank, band_sizes(latent_rows, split.height), outputs)


def encode_wavefront(
    vae: CausalVideoVAE, video: torch.Tensor, group: SPGroup, *, split: VAESplit | None = None,
    sample: bool = False, generator: torch.Generator | None = None, gather: bool = True,
    stats: WaveStats | None = None,
) -> torch.Tensor:
    """``vae.encode(video)`` over ``group`` as a temporal wavefront (``split``: time x height, None: chosen by
    :func:`choose_split`); ``video`` is the full clip on every rank, the result the full latent on every rank
    (``gather=False``: this rank's chunks and band only). Equals the single-rank chunked encode; with
    ``sample=True`` seed ``generator`` identically on every rank."""
    vae.validate_video(video)
    factor, tf = vae.config.spatial_downsample_factor, vae.config.temporal_downsample_factor
    plan = _plan(group, video.shape[2], vae.temporal_chunk, video.shape[_ROWS] // factor, split,
                 lambda c, n: 1 + (n - 1) // tf if c == 0 else n // tf, "input")
    with torch.no_grad():
        moments = _run(vae, video, group, plan, vae._encode_step, in_scale=factor, out_scale=1,
                       out_channels=2 * vae.config.latent_channels, out_width=video.shape[4] // factor,
                       gather=gather, stats=stats)
    return moments_to_latent(moments, sample=sample, generator=generator)


def decode_wavefront(
    vae: CausalVideoVAE, latent: torch.Tensor, group: SPGroup, *, split: VAESplit | None = None,
    gather: bool = True, stats: WaveStats | None = None,
) -> torch.Tensor:
    """``vae.decode(latent)`` over ``group`` as a temporal wavefront (see :func:`encode_wavefront`)."""
    vae.validate_latent(latent)
    factor, tf = vae.config.spatial_downsample_factor, vae.config.temporal_downsample_factor
    chunk = None if vae.temporal_chunk is None else vae.temporal_chunk // tf
    plan = _plan(group, latent.shape[2], chunk, latent.shape[_ROWS], split,
                 lambda c, n: 1 + tf * (n - 1) if c == 0 else tf * n, "output")
    with torch.no_grad():
        return _run(vae, latent, group, plan, vae._decode_step, in_scale=1, out_scale=factor,
                    out_channels=vae.config.out_channels, out_width=latent.shape[4] * factor,
                    gather=gather, stats=stats)


def clip_chunk_frames(frames: int, *, temporal_chunk: int | None = 4,
                      temporal_factor: int = 4) -> tuple[list[int], list[int]]:
    """The video frames of each causal chunk of a clip of ``frames`` frames (1 + 4k): those encode reads, and those
    decode writes (its latent chunks' outputs, the first one shorter)."""
    video = [b - a for a, b in _chunk_bounds(frames, temporal_chunk)]
    latent_frames = 1 + (frames - 1) // temporal_factor
    latent_chunk = None if temporal_chunk is None else temporal_chunk // temporal_factor
    decoded = [1 + temporal_factor * (b - a - 1) if a == 0 else temporal_factor * (b - a)
               for a, b in _chunk_bounds(latent_frames, latent_chunk)]
    return video, decoded


def clip_splits(world: int, frames: int, latent_rows: int, *, temporal_chunk: int | None = 4,
                temporal_factor: int = 4) -> tuple[VAESplit, VAESplit]:
    """The (encode, decode) splits the wavefront mode uses for a clip of ``frames`` video frames (1 + 4k)."""
    video, decoded = clip_chunk_frames(frames, temporal_chunk=temporal_chunk, temporal_factor=temporal_factor)
    return choose_split(world, video, latent_rows), choose_split(world, decoded, latent_rows)


def split_for_clip(world: int, frames: int, latent_rows: int, *, temporal_chunk: int | None = 4,
                   temporal_factor: int = 4) -> VAESplit:
    """Of the two splits of :func:`clip_splits`, the one with fewer height ranks (the larger band, for a memory
    estimate)."""
    splits = clip_splits(world, frames, latent_rows, temporal_chunk=temporal_chunk, temporal_factor=temporal_factor)
    return min(splits, key=lambda s: s.height)


def splits_in_words(encode: VAESplit, decode: VAESplit) -> str:
    """What the splits mean, for a user: ``2 ranks pass chunks of frames along in time``, ``each frame's rows split
    over 2 ranks``, ``encode: ..., decode: ...``."""
    def words(split: VAESplit) -> str:
        if split.time == 1:
            return f"each frame's rows split over {split.height} ranks"
        chained = f"{split.time} ranks pass chunks of frames along in time"
        return chained if split.height == 1 else f"{chained}, each chunk's rows split over {split.height}"

    if encode == decode:
        return words(encode)
    return f"encode: {words(encode)}; decode: {words(decode)}"


def describe_splits(encode: VAESplit, decode: VAESplit) -> str:
    """``height bands x2`` / ``time x2`` / ``encode 1x2 (height), decode 2x1 (time)``, for a summary line."""
    def name(split: VAESplit) -> str:
        if split.time == 1:
            return f"height bands x{split.height}"
        return f"time x{split.time}" if split.height == 1 else f"time x height {split.time}x{split.height}"

    if encode == decode:
        return name(encode)
    return f"encode {name(encode)}, decode {name(decode)}"
