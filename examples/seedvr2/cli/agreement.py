"""Where a rank runs, and the ranks' agreement: they meet to start (or all stop) and after loading, and a peer's
failure is told apart from this rank's own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch

from winsp.comm.group import abort_world, init_world_from_env, shutdown_world

from .memory_plan import MemoryPlan, _per_rank_figures
from .parser import InputError

if TYPE_CHECKING:  # the load stage's models, held for the next file of a batch
    from .stages import LoadedModels

#: how long a rank waits for the others when leaving the process group normally. Every rank arrives within
#: moments (they have just met: the summary's figures, or the agreement to start), so this bounds only how long a
#: rank can be kept by a peer that died meanwhile; a failed rank does not meet at all (it aborts).
EXIT_MEETING_S = 5.0


#: how long a collective waits for a peer before it fails (the WINSP_COLLECTIVE_TIMEOUT environment variable
#: overrides it): far below torch's 30 minutes, far above any step of a run, so a stuck rank is named in minutes
COLLECTIVE_TIMEOUT_S = 600.0


@dataclass
class Launch:
    """Where this process runs: its rank among ``world_size`` (torchrun's environment) and its device."""

    rank: int
    world_size: int
    device: torch.device
    initialised_here: bool = False

    @classmethod
    def from_env(cls) -> "Launch":
        """Read torchrun's WORLD_SIZE / RANK / LOCAL_RANK; initialise the default process group when WORLD_SIZE > 1."""
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if torch.cuda.is_available():
            device = torch.device("cuda", local % torch.cuda.device_count())
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        rank, world, started = init_world_from_env(device.type, timeout_s=COLLECTIVE_TIMEOUT_S)
        return cls(rank, world, device, initialised_here=started)

    def close(self, failed: bool = False) -> None:
        """Leave the process group: after meeting the other ranks, or at once when this rank ``failed`` mid-run (its
        peers may be blocked in a collective with it; closing its connections makes their operations fail)."""
        if self.initialised_here:
            abort_world() if failed else shutdown_world(timeout_s=EXIT_MEETING_S)


class PeerFailed(InputError):
    """Another rank failed before the run started (it reports why); this rank stops quietly."""


@dataclass
class RunState:
    """What a failing run's error handling needs: the memory plan; whether the ranks are still in lockstep (every
    failure so far happens on every rank at the same point, reported once by ``reporter``) or running (a failure is
    this rank's own: it reports it and leaves at once)."""

    memory: Optional[MemoryPlan] = None
    lockstep: bool = True
    reporter: int = 0
    models: Optional[LoadedModels] = None  # loaded by an earlier file of a batch: reused
    # for `serve` (see .serve.worker): called on every rank before each temporal batch (may raise to stop the run
    # there, on every rank alike), and on the writer with (frames written, frames) as batches are written
    before_batch: Optional[Callable[[int], None]] = None
    on_frames: Optional[Callable[[int, int], None]] = None
    # the command's start (time.time()) for the closing line's wall time: a single file's run from main() only
    command_started: Optional[float] = None
    # resume hook (issue 48): keep finished batches beside the output (set by the restore command and `serve`'s jobs)
    keep_batches: bool = False
    # `serve`'s jobs: a kept store that cannot be resumed (other settings or version, a disk too small) is removed
    # and the job starts over, in one line, instead of a refusal (nobody is there to pass --restart)
    start_over: bool = False
    # `serve`'s jobs: called on the writer with (frames reused, frames) once the ranks agreed where the run starts
    on_resume: Optional[Callable[[int, int], None]] = None


def agree_to_start(limit, error: Optional[Exception], launch: Launch, state: RunState):
    """The one meeting of all ranks before the run: each tells whether its checks failed and what memory it may use.

    Returns the tightest limit of all ranks (so every rank chooses the same settings). If any rank failed, every rank
    raises: the failed ones their own error (the lowest of them reports it, see ``state.reporter``), the others
    :class:`PeerFailed`; all of them are then at the same point and leave the group together.
    """
    from winsp.comm.group import SPGroup

    from ..memory.limits import MemoryLimit

    if launch.world_size == 1:
        if error is not None:
            raise error
        return limit
    mine = float(limit.usable) if limit.usable is not None else float("inf")
    rows = _per_rank_figures([mine, 1.0 if error is not None else 0.0], launch.device)
    failed = [rank for rank, row in enumerate(rows) if row[1]]
    if failed:
        state.reporter = failed[0]
        raise error if error is not None else PeerFailed(f"rank {failed[0]} failed")
    values = [row[0] for row in rows]
    smallest = min(range(len(values)), key=values.__getitem__)
    if values[smallest] == float("inf"):
        return limit
    if values[smallest] >= mine:
        return MemoryLimit(limit.usable, f"rank {SPGroup.world().rank}: {limit.source}", limit.candidates)
    return MemoryLimit(int(values[smallest]), f"the limit of rank {smallest}", limit.candidates)


def agree_loaded(error: Optional[Exception], launch: Launch, state: RunState) -> None:
    """The ranks' meeting after loading the models: if any rank's load failed, every rank raises (the failed ones
    their own error, reported by the lowest of them; the others :class:`PeerFailed`), as in :func:`agree_to_start`."""
    if launch.world_size == 1:
        if error is not None:
            raise error
        return
    rows = _per_rank_figures([1.0 if error is not None else 0.0], launch.device)
    failed = [rank for rank, row in enumerate(rows) if row[0]]
    if failed:
        state.reporter = failed[0]
        raise error if error is not None else PeerFailed(f"rank {failed[0]} failed")


def _open_kept_batches(args, launch: Launch, progress, state: RunState, output: str, settings, plan, geometry,
                       info, dtype: torch.dtype, color_fix: str, sp_size: int, demo: bool):
    """Resume hook (issue 48): the finished batches kept beside the output (see
    :mod:`examples.seedvr2.restore.kept_batches`), read on rank 0 against this run's settings and agreed by every rank
    in one meeting. A refusal (a changed setting, another version, a disk too small) is an :class:`InputError`
    reported by rank 0; every rank stops."""
    from ..restore.kept_batches import PeerRefused, open_kept_batches
    from ..restore.resume import ResumeRefused, run_settings
    from .parser import PROG

    if demo:
        from ..models.demo import demo_vae_config

        weights = f"demo weights, VAE widths {demo_vae_config()['block_out_channels']}"
    else:
        from ..restore.resume import file_identity

        weights = (f"DiT {file_identity(args.dit_checkpoint)}; VAE {file_identity(args.vae_checkpoint)}; --weights "
                   f"{getattr(args, 'weights', 'stored')}")
    enabled = state.keep_batches and bool(getattr(args, "resume_store", True)) and not info.is_image
    run = run_settings(
        input_path=args.input, model=args.model or "3b", weights=weights, text_embeds=args.text_embeds,
        output_size=geometry.output, work_size=geometry.work, frames=info.num_frames, seed=args.seed,
        batch_frames=settings.batch_frames, overlap=settings.overlap, dtype=str(dtype).replace("torch.", ""),
        vae_parallel=settings.vae_parallel, vae_tile=settings.vae_tile, color_fix=color_fix, sp_size=sp_size)
    rows = None if launch.world_size == 1 else (lambda row: _per_rank_figures(row, launch.device))
    try:
        return open_kept_batches(
            output=output, settings=run, plan=plan,
            frame_hw=geometry.output, overlap=settings.overlap, writer=launch.rank == 0, enabled=enabled,
            restart=bool(getattr(args, "restart", False)), gather_rows=rows,
            say=(lambda line: progress.note(f"{PROG}: {line}")) if launch.rank == 0 else (lambda line: None),
            start_over=state.start_over)
    except (ResumeRefused, PeerRefused) as exc:
        state.reporter = 0
        raise InputError(str(exc)) from None


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that failed because another rank went away (gloo/NCCL connection errors)."""
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        marker in text for marker in ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                                      "ProcessGroupGloo", "gloo", "NCCL",
                                      "monitoredBarrier"))  # TORCH_DISTRIBUTED_DEBUG=DETAIL's checker names the rank


def _peer_failure(exc: BaseException) -> str:
    """What a rank whose collective failed says: the peers that no longer answer (a roll call through the group's
    store) when the collective timed out, else that another rank failed."""
    from winsp.comm.group import COLLECTIVE_TIMEOUT_ENV, unresponsive_ranks

    reason = " ".join(str(exc).split())[:200]
    if "timed out" in reason.lower() or "timeout" in reason.lower():
        missing = unresponsive_ranks()
        if missing:
            ranks = ", ".join(map(str, missing))
            return (f"rank{'s' if len(missing) > 1 else ''} {ranks} stopped answering (stuck, stopped or gone): a "
                    f"collective timed out ({COLLECTIVE_TIMEOUT_ENV} sets how long to wait)")
    return f"another rank failed ({type(exc).__name__}: {reason})"
