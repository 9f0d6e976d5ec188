"""Command line: python -m examples.seedvr2 restore INPUT... -o OUTPUT [options]

INPUT is a video or image, or a folder of them, or several: a folder's videos and images are restored into the
output folder under their own names with the models loaded once (see docs/seedvr2.md). Single process; or W ranks
started by the command itself with --ranks W (one per GPU; gloo on the CPU), or under torchrun --nproc-per-node W.
The clip is restored in temporal batches of --batch-frames frames that share --overlap cross-faded frames, decoded
lazily from the input and encoded to the output as they finish, so memory does not grow with the clip. With
--sp-size N the W ranks form W / N groups of N: each group takes whole batches (round-robin), runs the DiT
window-parallel and the VAE in its --vae-parallel mode over its N ranks, and sends its finished batches to rank 0,
which writes them in order. Across machines, run one torchrun --nnodes M --rdzv-backend c10d --rdzv-endpoint
HOST:PORT agent per node; ranks are numbered node by node, every rank reads the input, global rank 0 writes the
output.

With --dit-checkpoint and --vae-checkpoint it is the SeedVR2 3B restorer (--model 7b: the 7B). Without them it
looks for downloaded weights in ./ckpts/, $SEEDVR2_HOME and the Hugging Face cache (no network) and says which files
it uses; only when nothing is found (or with --demo) it runs embedded tiny demo weights of that architecture
(examples/seedvr2/demo.py) so that the command works anywhere in seconds, and says so, since that restores nothing.

Exit codes: 0 success; 2 bad input, usage, not enough memory, or a failed write (one "error:" line on stderr, no
output file); 128 + N stopped by signal N (143 SIGTERM, 130 SIGINT, 129 SIGHUP; also SIGQUIT, SIGUSR1/2, SIGALRM):
the partial output is removed and one line says so; anything else is a bug (docs/failures.md has the details).
A rank that fails once the run has started reports it and leaves at once; the others then stop too, within seconds
(under torchrun with a line "rank N: stopped: another rank failed"; under --ranks silently); a rank that stops
answering is named after the collective timeout (600 s, WINSP_COLLECTIVE_TIMEOUT seconds when set).

The command never loses data: an output path that is the input (same path, a symlink or a hard link to it) is
refused, an existing output is only replaced with --overwrite (nor one that appears during the run: the output is
published without replacing anything), an output directory that cannot take a new file is refused before anything
is read, a video that decodes fewer frames than its container declares is refused unless
--allow-partial-input, and a request that fits the usable memory in no setting is refused before anything is
allocated (settings left out are chosen to fit; see the memory options below). Without -o the output goes beside
the input as <input>_restored.<ext>.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from winsp.comm.group import abort_world, init_world_from_env, shutdown_world

from .checkpoint_file import read_error_reason
from .color_fix import COLOR_FIXES
from .media import (
    DEFAULT_CRF,
    IMAGE_EXTENSIONS,
    Geometry,
    MediaError,
    check_output_directory,
    check_scale,
    default_output_path,
    frames_to_model,
    h264_frame_size,
    model_to_frames,
    output_kind,
    parse_resolution,
    plan_geometry,
    same_file,
)
from .terminal_text import printable

__all__ = ["main", "build_parser", "InputError", "StageProgress", "DEFAULT_TEXT_EMBEDS", "DEFAULT_SEED"]

from .checkpoint_dtypes import WEIGHT_MODES
from .launcher import PORT_TAKEN_EXIT, env_rank, leave_note, record_port_taken, speaks_for_stop
from .temporal import DEFAULT_BATCH_FRAMES, DEFAULT_OVERLAP, check_batching
from .weights_discovery import WeightsError, how_to_get_weights, resolve_cli_weights

PROG = "python -m examples.seedvr2"
DEFAULT_TEXT_EMBEDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "text_embeds.safetensors")
DEFAULT_SEED = 666
STAGES = ("read", "load", "restore")
#: how long a rank waits for the others when leaving the process group normally. Every rank arrives within
#: moments (they have just met: the summary's figures, or the agreement to start), so this bounds only how long a
#: rank can be kept by a peer that died meanwhile; a failed rank does not meet at all (it aborts).
EXIT_MEETING_S = 5.0
#: a run projected (at the first batch's measured speed) to take longer than this is announced in one line
LONG_RUN_S = 600.0
#: outputs larger than 8K UHD (7680 x 4320 pixels) are refused without --allow-large-output, with a time estimate
LARGE_OUTPUT_PIXELS = 7680 * 4320
#: restore seconds per megapixel-frame of the working size, fp32, one process on a 2-core CPU (benchmarks/README.md,
#: "The whole restore at P = 2", 2026-12-02): the demo weights' whole restore stage (1280x720 x 9: 62.2 s), and for
#: SeedVR2's weights the VAE alone at its released widths (160x120 x 17: 60.4 s), a floor since the DiT comes on top
CPU_SECONDS_PER_MEGAPIXEL_FRAME = {"demo": 7.5, "released": 185.0}
#: how long a collective waits for a peer before it fails (the WINSP_COLLECTIVE_TIMEOUT environment variable
#: overrides it): far below torch's 30 minutes, far above any step of a run, so a stuck rank is named in minutes
COLLECTIVE_TIMEOUT_S = 600.0


class InputError(ValueError):
    """A problem with what the user gave (a checkpoint, an embedding file, an option); reported as one line."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line like every other error (exit code 2, as argparse does)."""

    def error(self, message: str):  # type: ignore[override]
        # every rank parses the same command line: rank 0 alone reports its mistake
        quiet = env_rank() != 0
        self.exit(2, None if quiet else f"{PROG}: error: {message} (see {self.prog} --help)\n")


def _crf(text: str) -> int:
    """``--crf``'s value, checked when the command line is parsed (before any weights are looked for)."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value <= 51:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 (lossless) to 51, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="SeedVR2 one-step video/image restoration on winsp (window-parallel). "
                                                  "`serve` restores jobs over HTTP on warm ranks (see serve --help).")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("restore", help="restore a video or image", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", nargs="+",
                   help="video (mp4, mov, webm, mkv, ...) or image (png, jpg), or a folder of them, or several: every "
                        "file is restored into the output folder under its own name, the models loaded once; a file "
                        "that fails is reported and the others continue (exit code 2 if any failed)")
    p.add_argument("-o", "--output",
                   help="output file: .mp4/.mov/.mkv (H.264) or .png/.jpg (default: <input>_restored.<ext> beside the "
                        "input); for a folder or several inputs, the output folder (created if missing; default "
                        "<folder>_restored, or each file beside its input)")
    p.add_argument("--overwrite", action="store_true", help="replace an output file if it exists (per file)")
    p.add_argument("--allow-partial-input", action="store_true",
                   help="restore the frames that decode from a truncated or damaged video (with a warning) instead of "
                        "refusing it")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--resolution", metavar="WxH",
                      help="exact output size; the input is scaled to cover it and centre-cropped "
                           "(default: input size)")
    size.add_argument("--scale", type=float, help="output size = input size x S (rounded)")
    p.add_argument("--allow-large-output", action="store_true",
                   help="run an output larger than 8K UHD (7680x4320 pixels), which is refused without it (with an "
                        "estimate of its time): with SeedVR2's weights such a restore takes hours on a CPU")
    p.add_argument("--model", choices=("3b", "7b"),
                   help="which SeedVR2 DiT (default: the 3B if its weights are found, else the 7B; 3b for the demo)")
    p.add_argument("--dit-checkpoint", metavar="PATH",
                   help="DiT weights: .pth, .safetensors (fp32, fp16, bf16, fp8) or .gguf (F16, BF16, Q8_0, Q4_K, ...) "
                        "(default: found in ./ckpts/, $SEEDVR2_HOME or the Hugging Face cache, see docs/seedvr2.md)")
    p.add_argument("--vae-checkpoint", metavar="PATH", help="VAE weights (the same formats) (default: found likewise)")
    p.add_argument("--demo", action="store_true",
                   help="run the embedded tiny demo weights even when real ones are found (restores nothing)")
    p.add_argument("--text-embeds", metavar="PATH",
                   help=f"prompt embedding (safetensors key 'pos', or a single tensor) (default: {DEFAULT_TEXT_EMBEDS} "
                        f"with checkpoints, random tiny embeddings with the demo weights)")
    p.add_argument("--weights", choices=WEIGHT_MODES, default="stored",
                   help="how the DiT's Linear weights are held: stored (fp8 and GGUF-quantised weights stay as stored "
                        "and are expanded one layer at a time: about half the memory of bf16 for fp8, a quarter to a "
                        "third for Q4/Q5), fp8 (also convert fp16/bf16/fp32 weights to fp8 with a per-tensor scale), "
                        "compute (expand every weight to the compute dtype at load: most memory, no per-layer "
                        "expansion) (default: stored)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"latent noise seed (default {DEFAULT_SEED})")
    p.add_argument("--dtype", choices=("bf16", "fp32"),
                   help="compute dtype (default: bf16 on GPU with checkpoints, else fp32)")
    memory = p.add_argument_group(
        "memory",
        "Left out, these are chosen to fit the memory this process may use (the smallest of free RAM, ulimit -v / -d,\n"
        "the cgroup's limit and free GPU memory; RAM and cgroup shared by the ranks on a host): the fastest settings\n"
        "that fit, longer temporal batches first, then the VAE as a wavefront and height-sharded (several ranks) or\n"
        "replicated (one), tiled with the largest tile. The summary line says what was chosen and why. Pinned\n"
        "settings that do not fit are refused, naming settings that would.")
    memory.add_argument("--vae-parallel", choices=("replicated", "height", "tiled", "wavefront"),
                        help="how the ranks of an SP group share the VAE: replicated (every rank runs it), height (the "
                             "frame's rows split over the group; exact), tiled (overlapping tiles; approximate, least "
                             "memory), wavefront (the ranks run consecutive causal chunks at once, the rows split too "
                             "where faster; exact) (default: chosen to fit: wavefront with several ranks, replicated "
                             "with one, when it does)")
    memory.add_argument("--vae-tile", type=int, metavar="PIXELS",
                        help="tile size of --vae-parallel tiled (square, a multiple of 8; implies tiled) (default: the "
                             "largest that fits)")
    memory.add_argument("--shard-weights", action="store_true",
                        help="split the DiT's block weights over the ranks of the SP group: each rank reads and holds "
                             "1/N of them (the 7B in bf16: 8.2 of 16.5 GB at N = 2) and gathers one block at a time, "
                             "the next prefetched while one computes; the output is bitwise that of whole weights. For "
                             "bf16/fp16/fp32 .safetensors and .pth checkpoints (fp8 and GGUF ones are refused: they "
                             "are already packed small) (default: every rank holds every weight)")
    memory.add_argument("--batch-frames", type=int, metavar="N",
                        help=f"frames per temporal batch, 4n+1 (default {DEFAULT_BATCH_FRAMES}, or fewer to fit); "
                             f"memory depends on this, not on the clip's length")
    memory.add_argument("--overlap", type=int, metavar="K",
                        help=f"frames shared by consecutive batches, cross-faded so batches join without a jump "
                             f"(default {DEFAULT_OVERLAP}, less for batches under {DEFAULT_OVERLAP + 4} frames; 0 "
                             f"disables)")
    p.add_argument("--sp-size", type=int, metavar="N",
                   help="window-SP degree: the world's ranks form (world / N) groups of N that take whole temporal "
                        "batches; the world size must be a multiple of N (default: all ranks one group)")
    p.add_argument("--color-fix", choices=COLOR_FIXES,
                   help="colour correction towards the input, frame by frame: wavelet (the input's low frequencies, "
                        "SeedVR2's own), adain (each RGB channel's mean and spread), lab (lightness and chroma in CIE "
                        "L*a*b*, hues kept), none (default: wavelet with checkpoints, none with the demo)")
    p.add_argument("--crf", type=_crf, default=DEFAULT_CRF,
                   help=f"H.264 quality of a video output, 0 (lossless) to 51 (default {DEFAULT_CRF})")
    p.add_argument("--quiet", action="store_true", help="no progress bar (the summary line is still printed)")
    # ---- resume hook (issue 48): see .kept_batches
    p.add_argument("--restart", action="store_true",
                   help="start from the first frame, removing the finished batches a stopped run kept beside the "
                        "output (by default the same command resumes after the last of them)")
    p.add_argument("--no-resume-store", dest="resume_store", action="store_false",
                   help="keep no finished batches beside the output while it runs (saves the disk they take: about "
                        "the output's frames uncompressed; a fault then loses the whole clip)")
    p.add_argument("--ranks", type=int, metavar="N",
                   help="start N ranks on this machine (one per GPU on a GPU machine; gloo on the CPU): the same "
                        "results as torchrun --nproc-per-node N, a failure is one line (exit 2) and every rank stops "
                        "within seconds. For several machines use torchrun (default: 1, or torchrun's ranks)")
    return parser


# ---- progress -----------------------------------------------------------------------------------------------------


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


# ---- distributed launch -------------------------------------------------------------------------------------------


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


# ---- the restore command ------------------------------------------------------------------------------------------


def _fmt_size(hw: tuple[int, int], frames: int) -> str:
    return f"{hw[1]}x{hw[0]}, {frames} frame{'s' if frames != 1 else ''}"


def _resolve_dtype(name: Optional[str], device: torch.device, demo: bool) -> torch.dtype:
    if name is None:
        name = "bf16" if (device.type == "cuda" and not demo) else "fp32"
    return torch.bfloat16 if name == "bf16" else torch.float32


def resolve_output_path(args: argparse.Namespace) -> str:
    """``-o`` or the default ``<input>_restored.<ext>``; refuses the input itself and, without ``--overwrite``, any
    existing file. Checked before anything is read or run."""
    path = args.output if args.output is not None else default_output_path(args.input)
    if os.path.exists(args.input) and same_file(path, args.input):
        raise MediaError(f"the output {path} is the input {args.input} (same file, or a link to it); "
                         f"choose another -o so the input is not overwritten")
    if os.path.isdir(path):
        raise MediaError(f"output path is a directory: {path}")
    if os.path.lexists(path) and not args.overwrite:
        raise MediaError(f"the output {path} exists; pass --overwrite to replace it, or choose another -o")
    return path


def _default_image_output(args: argparse.Namespace, path: str, is_image: bool) -> str:
    """A default output for an image input whose extension cannot be written (bmp, webp, ...) is a .png."""
    if args.output is None and is_image and os.path.splitext(path)[1].lower() not in IMAGE_EXTENSIONS:
        path = os.path.splitext(path)[0] + ".png"
        if os.path.lexists(path) and not args.overwrite:
            raise MediaError(f"the output {path} exists; pass --overwrite to replace it, or choose another -o")
    return path


def _check_output_path(path: str, num_frames_hint: Optional[int] = None) -> None:
    kind = output_kind(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise MediaError(f"output directory does not exist: {directory}")
    if kind == "image" and num_frames_hint is not None and num_frames_hint > 1:
        raise MediaError(
            f"the input has {num_frames_hint} frames but {path} is an image file; use a video extension (.mp4)"
        )


def _check_shardable(args: argparse.Namespace) -> None:
    """Refuse, before anything is read, a ``--shard-weights`` run whose DiT checkpoint cannot be sharded."""
    from .sharded_weights import check_shardable_checkpoint
    from .weight_memory import checkpoint_layout

    if not os.path.isfile(args.dit_checkpoint):
        return  # the loader names the missing file
    try:
        layout = checkpoint_layout(args.dit_checkpoint)
    except Exception:  # noqa: BLE001 - an unreadable header is reported by the loader, with its reason
        return
    try:
        check_shardable_checkpoint(args.dit_checkpoint, layout, getattr(args, "weights", "stored"))
    except ValueError as exc:
        raise InputError(str(exc)) from None


@dataclass
class LoadedModels:
    dit: torch.nn.Module
    vae: torch.nn.Module
    txt: torch.Tensor
    demo: bool


def _read_text_embeds(path: str, txt_in_dim: int) -> torch.Tensor:
    """``[L, txt_in_dim]`` prompt embedding from a safetensors file (key ``pos``, or its only tensor) or a .pt/.pth:
    string keys, a finite real floating-point tensor (else one line naming the file and what is wrong)."""
    if os.path.isdir(path):
        raise InputError(f"text embeddings {path} is a directory, not a file")
    if not os.path.isfile(path):
        raise InputError(f"text embeddings file not found: {path}")
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            tensors = load_file(path)
        else:
            import pickle
            import warnings

            try:
                with warnings.catch_warnings():  # torch warns about a raw pickle's protocol: the error says it all
                    warnings.simplefilter("ignore")
                    loaded = torch.load(path, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError:
                raise InputError(f"refused to read text embeddings {path}: it is not a plain tensor file (reading it "
                                 f"would need to run pickled code, which is never done, or it is damaged)") from None
            tensors = loaded if isinstance(loaded, dict) else {"pos": loaded}
    except InputError:
        raise
    except Exception as exc:  # noqa: BLE001 - any read failure is the file's fault, reported in one line
        kind = "safetensors" if path.endswith(".safetensors") else "torch (.pt/.pth)"
        raise InputError(f"text embeddings {path} is not a readable {kind} file ({read_error_reason(exc)})") from None
    odd = [k for k in tensors if not isinstance(k, str)]
    if odd:
        raise InputError(f"text embeddings {path} has keys that are not strings ({', '.join(map(repr, odd[:3]))}); "
                         f"it must map names to tensors (key 'pos')")
    if "pos" in tensors:
        txt = tensors["pos"]
    elif len(tensors) == 1:
        txt = next(iter(tensors.values()))
    else:
        raise InputError(f"text embeddings {path} has no 'pos' tensor (keys: {sorted(tensors)})")
    if not isinstance(txt, torch.Tensor) or txt.dim() != 2 or txt.shape[1] != txt_in_dim or txt.shape[0] < 1:
        shape = list(txt.shape) if isinstance(txt, torch.Tensor) else type(txt).__name__
        raise InputError(f"text embeddings {path} must be [tokens, {txt_in_dim}] for this DiT, got {shape}")
    if not txt.is_floating_point():
        raise InputError(f"text embeddings {path} must be a real floating-point tensor, got {txt.dtype}")
    finite = torch.isfinite(txt)
    if not bool(finite.all()):
        raise InputError(f"text embeddings {path} has {int((~finite).sum())} non-finite values (NaN or inf) of "
                         f"{txt.numel()}")
    return txt.float()


def load_models(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, report=None,
                group=None) -> LoadedModels:
    """The released models from the two checkpoints, or the embedded demo models when neither is given.

    ``report`` receives the loaders' one-line notes (what a half-precision checkpoint was cast to). With
    ``--shard-weights`` each rank of the SP ``group`` reads only its chunk of the DiT's blocks."""
    if (args.dit_checkpoint is None) != (args.vae_checkpoint is None):
        given, missing = (("--dit-checkpoint", "--vae-checkpoint") if args.vae_checkpoint is None
                          else ("--vae-checkpoint", "--dit-checkpoint"))
        raise InputError(f"{given} was given without {missing}; give both checkpoints, or neither for the demo weights")
    if args.dit_checkpoint is None:
        from .demo import demo_models, demo_text_embeds

        dit, vae = demo_models(device, dtype, model=args.model or "3b")
        txt = _read_text_embeds(args.text_embeds, dit.config.txt_in_dim) if args.text_embeds else demo_text_embeds()
        return LoadedModels(dit, vae, txt, demo=True)

    from .dit import load_dit_checkpoint
    from .pipeline import released_models_on_meta
    from .vae import load_vae_checkpoint

    found = getattr(args, "found_weights", False)  # discovered, not given: name the files, not the flags
    dit_flag, vae_flag = ("the DiT weights", "the VAE weights") if found else ("--dit-checkpoint", "--vae-checkpoint")
    for flag, path in ((dit_flag, args.dit_checkpoint), (vae_flag, args.vae_checkpoint)):
        if os.path.isdir(path):
            raise InputError(f"{flag}: {path} is a directory, not a checkpoint file")
        if not os.path.isfile(path):
            raise InputError(f"{flag}: file not found: {path}")
    dit, vae = released_models_on_meta(args.model or "3b", dtype)
    weights = {"weights": getattr(args, "weights", "stored")}
    dit_loader = load_dit_checkpoint
    if getattr(args, "shard_weights", False):
        from .sharded_weights import load_sharded_dit

        weights["device"] = device
        dit_loader = lambda model, path, **options: load_sharded_dit(model, path, group, **options)  # noqa: E731
    for flag, loader, model, path, options in (
            (dit_flag, dit_loader, dit, args.dit_checkpoint, weights),
            (vae_flag, load_vae_checkpoint, vae, args.vae_checkpoint, {})):
        try:
            loader(model, path, report=report, **options)
        except (ValueError, OSError) as exc:  # the loaders report every checkpoint problem as one of these
            raise InputError(f"{flag} {path}: {exc}") from None
    txt = _read_text_embeds(args.text_embeds or DEFAULT_TEXT_EMBEDS, dit.config.txt_in_dim)
    return LoadedModels(dit.to(device=device, dtype=dtype).eval(), vae.to(device=device, dtype=dtype).eval(), txt,
                        demo=False)


def _gib(n: float) -> str:
    """A size for messages: GiB with one decimal, MiB under 1 GiB."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


class OutOfMemory(InputError):
    """The request does not fit the memory this rank may use (refused up front, or an allocation failed)."""


#: what helps when memory runs short, in the order a user should try them
_MEMORY_HELP = ("--vae-parallel tiled with a smaller --vae-tile", "a smaller --batch-frames",
                "more ranks (--ranks N: --vae-parallel height shares the VAE)", "a smaller --resolution")


def pinned_settings(args: argparse.Namespace):
    """The memory-relevant settings the user fixed (the others are chosen by :func:`plan_memory`), checked."""
    from .memory_fit import PinnedSettings

    if args.vae_tile is not None:
        if args.vae_parallel not in (None, "tiled"):
            raise InputError(f"--vae-tile is the tile size of --vae-parallel tiled; it cannot go with "
                             f"--vae-parallel {args.vae_parallel}")
        if args.vae_tile < 16 or args.vae_tile % 8:
            raise InputError(f"--vae-tile must be a multiple of 8 pixels, at least 16, got {args.vae_tile}")
    try:
        if args.batch_frames is not None:
            check_batching(args.batch_frames, 0)
        if args.overlap is not None:
            check_batching(args.batch_frames if args.batch_frames is not None else DEFAULT_BATCH_FRAMES, args.overlap)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    return PinnedSettings(batch_frames=args.batch_frames, overlap=args.overlap,
                          vae_parallel="tiled" if args.vae_tile is not None else args.vae_parallel,
                          vae_tile=args.vae_tile)


@dataclass
class MemoryPlan:
    """The settings a run uses, their estimated need per rank, the memory limit seen, and why they were chosen."""

    settings: object  # memory_fit.RunSettings
    need: Optional[int]
    limit: object  # memory_limits.MemoryLimit
    reason: str
    warning: Optional[str] = None  # set when memory forced a setting that changes the output

    def summary(self) -> str:
        return f"memory: {self.reason}"


def _model_sizes(args: argparse.Namespace, demo: bool, dtype: torch.dtype = torch.float32,
                 shard_parts: Optional[int] = None) -> tuple[int, int, int]:
    """(first VAE level channels, DiT width, resident weight bytes in ``dtype``) of the models a run will load; with
    ``shard_parts``, the DiT's blocks sharded over that many ranks."""
    if demo:
        from .demo import DEMO_DIT_CONFIGS, demo_vae_config

        try:
            vae_config = demo_vae_config()
        except ValueError as error:
            raise InputError(str(error)) from None
        return vae_config["block_out_channels"][0], DEMO_DIT_CONFIGS[args.model or "3b"].vid_dim, 0
    from .dit import NaDiTConfig
    from .vae import VideoVAEConfig
    from .weight_memory import run_weight_bytes

    weights = run_weight_bytes(args.model or "3b", args.dit_checkpoint, args.vae_checkpoint, compute_dtype=dtype,
                               weights=getattr(args, "weights", "stored"), shard_parts=shard_parts)
    return VideoVAEConfig.seedvr2().block_out_channels[0], NaDiTConfig.released(args.model or "3b").vid_dim, weights


class PeerFailed(InputError):
    """Another rank failed before the run started (it reports why); this rank stops quietly."""


def agree_to_start(limit, error: Optional[Exception], launch: Launch, state: "RunState"):
    """The one meeting of all ranks before the run: each tells whether its checks failed and what memory it may use.

    Returns the tightest limit of all ranks (so every rank chooses the same settings). If any rank failed, every rank
    raises: the failed ones their own error (the lowest of them reports it, see ``state.reporter``), the others
    :class:`PeerFailed`; all of them are then at the same point and leave the group together.
    """
    from winsp.comm.group import SPGroup

    from .memory_limits import MemoryLimit

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


def agree_loaded(error: Optional[Exception], launch: Launch, state: "RunState") -> None:
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


def _open_kept_batches(args: argparse.Namespace, launch: Launch, progress: StageProgress, state: "RunState",
                       output: str, settings, plan, geometry: Geometry, info, dtype: torch.dtype, color_fix: str,
                       sp_size: int, demo: bool):
    """Resume hook (issue 48): the finished batches kept beside the output (see :mod:`.kept_batches`), read on rank 0
    against this run's settings and agreed by every rank in one meeting. A refusal (a changed setting, another
    version, a disk too small) is an :class:`InputError` reported by rank 0; every rank stops."""
    from .kept_batches import PeerRefused, open_kept_batches
    from .resume import ResumeRefused, run_settings

    if demo:
        from .demo import demo_vae_config

        weights = f"demo weights, VAE widths {demo_vae_config()['block_out_channels']}"
    else:
        from .resume import file_identity

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
            say=(lambda line: progress.note(f"{PROG}: {line}")) if launch.rank == 0 else (lambda line: None))
    except (ResumeRefused, PeerRefused) as exc:
        state.reporter = 0
        raise InputError(str(exc)) from None


def plan_memory(args: argparse.Namespace, pinned, geometry: Geometry, num_frames: int, dtype: torch.dtype,
                sp_size: int, device: torch.device, demo: bool, limit=None, *,
                weights_loaded: bool = False) -> MemoryPlan:
    """Choose the fastest settings whose estimated peak fits the memory this rank may use (see :mod:`.memory_fit`).

    Raises :class:`OutOfMemory` (before anything is allocated) when pinned settings do not fit, naming settings that
    would, or when nothing fits; when fp32 was chosen by default (the CPU's) and bf16 would fit, it says so.
    """
    try:
        return _plan_memory(args, pinned, geometry, num_frames, dtype, sp_size, device, demo, limit,
                            weights_loaded=weights_loaded)
    except OutOfMemory as exc:
        if getattr(args, "dtype", None) is not None or dtype != torch.float32 or demo:
            raise
        try:
            half = _plan_memory(argparse.Namespace(**{**vars(args), "dtype": "bf16"}), pinned, geometry, num_frames,
                                torch.bfloat16, sp_size, device, demo, limit, weights_loaded=weights_loaded)
        except OutOfMemory:
            raise exc from None
        raise OutOfMemory(f"{exc}; or add --dtype bf16, which fits (about {_gib(half.need or 0)} per rank): without "
                          f"--dtype this {device.type} run computes in fp32, which doubles the memory of bf16 "
                          f"weights and activations") from None


def _plan_memory(args: argparse.Namespace, pinned, geometry: Geometry, num_frames: int, dtype: torch.dtype,
                 sp_size: int, device: torch.device, demo: bool, limit=None, *,
                 weights_loaded: bool = False) -> MemoryPlan:
    from .memory_fit import candidate_settings, fit_settings, tile_overlap
    from .memory_limits import usable_memory
    from .pipeline import estimate_restore_bytes

    sharded = getattr(args, "shard_weights", False)
    vae_channels, dit_width, weights = _model_sizes(args, demo, dtype, sp_size if sharded else None)
    if weights_loaded:  # already held (an earlier file of a batch): the usable memory left them out
        weights = 0
    height, width = geometry.work

    def need(settings) -> int:
        tile = settings.vae_tile
        estimate = estimate_restore_bytes(
            frames=min(settings.batch_frames, num_frames), height=height, width=width, vae_channels=vae_channels,
            dit_width=dit_width, element_bytes=torch.finfo(dtype).bits // 8, vae_parallel=settings.vae_parallel,
            sp_size=sp_size, tile=None if tile is None else (tile, tile),
            tile_overlap=None if tile is None else tile_overlap(tile))
        return estimate.total + weights

    def candidates(p):
        return candidate_settings(num_frames, height // 8, sp_size, p, default_batch=DEFAULT_BATCH_FRAMES,
                                  default_overlap=DEFAULT_OVERLAP, frame_size=(height, width))

    limit = usable_memory(device) if limit is None else limit
    fit = fit_settings(candidates, pinned, need, limit.usable)
    where = f"{num_frames} frame{'s' if num_frames != 1 else ''} at {width}x{height}"
    if fit.chosen is None and not sharded and not demo and limit.usable is not None:
        _suggest_sharding(args, dtype, sp_size, weights, fit, limit, where)
    if fit.chosen is None:
        if fit.suggestion is not None:
            raise OutOfMemory(
                f"{fit.first.describe()} needs about {_gib(fit.first_need)} per rank for {where} but "
                f"{limit.describe()} is usable; {fit.suggestion.flags()} would fit (about "
                f"{_gib(fit.suggestion_need)}), or leave those flags out to let it choose")
        raise OutOfMemory(
            f"nothing fits: {'no settings allowed by the flags given' if pinned.anything else 'no settings'} fit the "
            f"{limit.describe()} usable per rank for {where} (the fastest needs about {_gib(fit.first_need)}, the "
            f"most frugal about {_gib(fit.smallest_need)}); try {', '.join(_MEMORY_HELP[2:])}")
    if limit.usable is None:
        reason = f"estimate {_gib(fit.need)} per rank (no memory limit could be read)"
    else:
        reason = f"estimate {_gib(fit.need)} of {limit.describe()} usable per rank"
    warning = None
    if fit.changed:
        reason = (f"chose {fit.chosen.describe()} because {fit.first.describe()} needs about {_gib(fit.first_need)}; "
                  + reason)
        warning = _output_changes(fit.first, fit.chosen, fit.first_need, limit)
    return MemoryPlan(fit.chosen, fit.need, limit, reason, warning)


def _output_changes(first, chosen, first_need: int, limit) -> Optional[str]:
    """The loud line for settings chosen to fit that change the output (shorter batches, less overlap, tiles); None
    when the change keeps the output (one exact VAE mode for another)."""
    changes = []
    if chosen.batch_frames != first.batch_frames:
        changes.append(f"temporal batches of {chosen.batch_frames} frames instead of {first.batch_frames}")
    if chosen.overlap != first.overlap:
        changes.append(f"an overlap of {chosen.overlap} frames instead of {first.overlap}")
    if chosen.vae_parallel == "tiled" and first.vae_parallel != "tiled":
        changes.append(f"the VAE in {chosen.vae_tile}px tiles (approximate)")
    if not changes:
        return None
    return (f"WARNING: to fit the {limit.describe()} usable per rank this run uses {' and '.join(changes)}, which "
            f"CHANGES THE OUTPUT (the exact settings need about {_gib(first_need)} per rank); free memory, use more "
            f"ranks (--ranks N), or a smaller --resolution to avoid it")


def _suggest_sharding(args: argparse.Namespace, dtype: torch.dtype, sp_size: int, weights: int, fit, limit,
                      where: str) -> None:
    """Raise :class:`OutOfMemory` recommending ``--shard-weights`` when whole weights are what does not fit: the
    most frugal settings fit once the DiT's blocks are split over the SP group (over 2 ranks when it has one)."""
    parts = max(sp_size, 2)
    sharded = _model_sizes(args, False, dtype, parts)[2]
    if fit.smallest_need - weights + sharded > limit.usable:
        return
    how = (f"add --shard-weights (the DiT's blocks split over the {sp_size} ranks of the SP group)" if sp_size > 1
           else "run 2 or more ranks (torchrun --nproc-per-node 2) with --shard-weights")
    raise OutOfMemory(
        f"the weights do not fit: every rank holds all {_gib(weights)} of them and needs about "
        f"{_gib(fit.smallest_need)} for {where} in the most frugal settings, but {limit.describe()} is usable; "
        f"{how}: each rank then holds about {_gib(sharded)} of weights and needs about "
        f"{_gib(fit.smallest_need - weights + sharded)}")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation failure: torch's (CPU allocator, CUDA) or Python's/numpy's MemoryError."""
    if isinstance(exc, MemoryError) or isinstance(exc, getattr(torch, "OutOfMemoryError", ())):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("DefaultCPUAllocator" in text or "can't allocate memory" in text
                                              or "out of memory" in text.lower())


def out_of_memory_error(exc: BaseException, memory: Optional[MemoryPlan], device: torch.device) -> OutOfMemory:
    """The one-line error for an allocation that failed although the estimate fitted."""
    detail = " ".join(str(exc).split())
    detail = detail.split("DefaultCPUAllocator: ")[-1].split(" (Triggered internally")[0][:160]
    if memory is None:
        seen = "before the memory plan was made"
    else:
        seen = (f"the estimate was {_gib(memory.need or 0)} per rank ({memory.settings.describe()}) with "
                f"{memory.limit.describe()} usable")
    return OutOfMemory(f"out of memory on {device.type} ({detail}); {seen}; try {', '.join(_MEMORY_HELP)}")


def _peak_memory(device: torch.device) -> tuple[float, str]:
    """This process's peak memory so far: GPU memory allocated by torch on CUDA, else the peak resident set."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device)), "peak GPU memory"
    import resource

    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "peak RSS"


def _per_rank_figures(values: list[float], device: torch.device) -> list[list[float]]:
    """Every rank's ``values`` (one row per rank), through winsp's world group (one collective)."""
    from winsp.comm.group import SPGroup

    world = SPGroup.world()
    row = torch.tensor([values], dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
    return world.all_gather_rows(row, [1] * world.size).cpu().tolist()


#: key prefixes of which a SeedVR2 checkpoint of each kind has at least one
_CHECKPOINT_KEYS = {"DiT": ("blocks.", "vid_in."), "VAE": ("encoder.", "decoder.")}


def _check_checkpoint_files(args: argparse.Namespace) -> None:
    """One line for a checkpoint path that is missing or a folder, before the memory plan (whose notes would come
    first) and before any weight is read."""
    found = getattr(args, "found_weights", False)  # discovered, not given: name the files, not the flags
    for flag, path in ((("the DiT weights" if found else "--dit-checkpoint"), args.dit_checkpoint),
                       (("the VAE weights" if found else "--vae-checkpoint"), args.vae_checkpoint)):
        if os.path.isdir(path):
            raise InputError(f"{flag}: {path} is a directory, not a checkpoint file")
        if not os.path.isfile(path):
            raise InputError(f"{flag}: file not found: {path}")


def _check_given_checkpoints(args: argparse.Namespace) -> None:
    """Raise :class:`InputError` for a ``--dit-checkpoint`` / ``--vae-checkpoint`` the user gave that cannot be a
    SeedVR2 checkpoint of that kind: missing, unreadable, or without any of its keys (the file's header only)."""
    from .weight_memory import checkpoint_layout

    for flag, path, what in (("--dit-checkpoint", args.dit_checkpoint, "DiT"),
                             ("--vae-checkpoint", args.vae_checkpoint, "VAE")):
        if path is None:
            continue
        if os.path.isdir(path):
            raise InputError(f"{flag}: {path} is a directory, not a checkpoint file")
        if not os.path.isfile(path):
            raise InputError(f"{flag}: file not found: {path}")
        try:
            keys = list(checkpoint_layout(path))
        except ValueError as exc:
            if "mmap" in str(exc):  # torch's legacy .pth format: no header to read without loading it all
                continue
            raise InputError(f"{flag} {path}: {exc}") from None
        if not any(key.startswith(_CHECKPOINT_KEYS[what]) for key in keys):
            example = f", e.g. {keys[0]!r}," if keys else ""
            raise InputError(f"{flag} {path}: not a SeedVR2 {what} checkpoint (none of its {len(keys)} "
                             f"tensors{example} is under {' or '.join(k + '*' for k in _CHECKPOINT_KEYS[what])})")


def _txt_in_dim(model: Optional[str], demo: bool) -> int:
    """The width of the prompt embedding the DiT a run builds expects."""
    if demo:
        from .demo import DEMO_DIT_CONFIGS

        return DEMO_DIT_CONFIGS[model or "3b"].txt_in_dim
    from .dit import NaDiTConfig

    return NaDiTConfig.released(model or "3b").txt_in_dim


def estimate_restore_time(geometry: Geometry, frames: int, demo: bool, device: torch.device) -> str:
    """An up-front estimate of the restore stage's time for a message, from :data:`CPU_SECONDS_PER_MEGAPIXEL_FRAME`
    (one 2-core CPU process; more cores or ranks go faster); no figure for a GPU, where none was measured yet."""
    from .progress import format_seconds

    if device.type != "cpu":
        return f"no {device.type} speed has been measured yet to estimate its time; expect long and much memory"
    megapixel_frames = geometry.work[0] * geometry.work[1] * frames / 1e6
    seconds = megapixel_frames * CPU_SECONDS_PER_MEGAPIXEL_FRAME["demo" if demo else "released"]
    return (f"at the speed measured on a 2-core CPU its restore takes {'about' if demo else 'at least'} "
            f"{format_seconds(seconds)} ({megapixel_frames:.1f} megapixel-frames)")


def _prepare(args: argparse.Namespace, launch: Launch, progress: StageProgress) -> tuple:
    """The checks and reads before the run, identical on every rank (no collective): the settings the user pinned,
    the SP size, the output path (and, on the writing rank, that its directory takes a new file), demo or not, dtype,
    colour fix, the input's description, the geometry, and notes for the user (a --batch-frames clamped to the clip).
    Nothing is read before the options and the output are checked."""
    from .media import probe_media
    from .pipeline import causal_frame_count

    if isinstance(args.input, (list, tuple)):  # parse_args' list, for callers of run_restore (main splits a batch)
        if len(args.input) != 1:
            raise InputError(f"run_restore restores one file; got {len(args.input)} (main() runs a batch)")
        args.input = args.input[0]
    resolution = parse_resolution(args.resolution) if args.resolution is not None else None
    if args.scale is not None:
        check_scale(args.scale)  # the number itself; the size it gives is checked against the input below
    pinned = pinned_settings(args)
    if getattr(args, "shard_weights", False) and getattr(args, "weights", "stored") == "fp8":
        raise InputError("--shard-weights cannot go with --weights fp8 (the fp8 conversion scales each weight by its "
                         "whole tensor's maximum, which a rank holding a shard never reads); use --weights stored")
    sp_size = launch.world_size if args.sp_size is None else args.sp_size
    if sp_size < 1 or launch.world_size % sp_size:
        raise InputError(
            f"--sp-size {sp_size}: the world size {launch.world_size} must be a positive multiple of it (run "
            f"--ranks with a multiple of {max(sp_size, 1)}, or choose an --sp-size dividing "
            f"{launch.world_size})"
        )
    output = resolve_output_path(args)
    _check_output_path(output)
    if launch.rank == 0:  # the writer: the only rank whose file system must take the output
        check_output_directory(output)
    notes = []
    try:
        weights_line = resolve_cli_weights(args)
    except WeightsError as exc:
        _check_given_checkpoints(args)  # a given file that cannot be what it is given as is the real cause
        raise InputError(str(exc)) from None
    if weights_line is not None:
        notes.append(weights_line)
    demo = args.dit_checkpoint is None and args.vae_checkpoint is None
    if not demo:
        _check_checkpoint_files(args)
    if args.text_embeds:  # read again at load; checked now so that a bad file is said before any slow work
        _read_text_embeds(args.text_embeds, _txt_in_dim(args.model, demo))
    if getattr(args, "shard_weights", False) and args.dit_checkpoint is not None:
        _check_shardable(args)
    dtype = _resolve_dtype(args.dtype, launch.device, demo)
    color_fix = args.color_fix or ("none" if demo else "wavelet")

    progress.start("read")
    info = probe_media(args.input, allow_partial=args.allow_partial_input)
    output = _default_image_output(args, output, info.is_image)
    _check_output_path(output, info.num_frames)
    geometry: Geometry = plan_geometry((info.height, info.width), resolution=resolution, scale=args.scale)
    if geometry.output[0] * geometry.output[1] > LARGE_OUTPUT_PIXELS and not getattr(args, "allow_large_output", False):
        raise InputError(
            f"the output would be {geometry.output[1]}x{geometry.output[0]}, larger than 8K UHD (7680x4320): "
            f"{estimate_restore_time(geometry, info.num_frames, demo, launch.device)}; pass --allow-large-output to "
            f"run it, or choose a smaller --scale or --resolution")
    latent_rows = geometry.work[0] // 8
    if pinned.vae_parallel == "height" and sp_size > latent_rows:
        raise InputError(
            f"--vae-parallel height needs at least one latent row (8 pixels) per rank: the working height "
            f"{geometry.work[0]} has {latent_rows} rows for {sp_size} ranks; use --vae-parallel replicated"
        )
    whole = causal_frame_count(info.num_frames)
    if pinned.batch_frames is not None and pinned.batch_frames > whole:
        frames = f"{info.num_frames} frame{'s' if info.num_frames != 1 else ''}"
        notes.append(f"note: --batch-frames {pinned.batch_frames} is longer than the clip ({frames}): one batch of "
                     f"{frames}" + (f" (--batch-frames {whole})" if whole != info.num_frames else ""))
        pinned = dataclasses.replace(pinned, batch_frames=whole,
                                     overlap=None if pinned.overlap is None else min(pinned.overlap, whole - 1))
    return pinned, sp_size, output, demo, dtype, color_fix, info, geometry, tuple(notes)


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
    # resume hook (issue 48): keep finished batches beside the output (set by the restore command; `serve` does not)
    keep_batches: bool = False


def run_restore(args: argparse.Namespace, launch: Launch, progress: StageProgress,
                state: Optional[RunState] = None) -> str:
    """Run the ``restore`` command; returns the one-line summary. Raises MediaError / InputError for bad input,
    :class:`OutOfMemory` when the request cannot fit."""
    state = RunState() if state is None else state
    import numpy as np

    from winsp.comm.temporal import build_temporal_mesh, ordered_results

    from . import stage_clock
    from .media import MediaWriter, iter_frames
    from .memory_fit import tile_overlap
    from .memory_limits import usable_memory
    from .overlap import background_worker, prefetch
    from .pipeline import SeedVR2Pipeline
    from .progress import RestoreProgress, expected_calls, format_seconds, summary_line
    from .stage_clock import timed_iter
    from .temporal import plan_temporal_batches, temporal_batches

    # Everything cheap to check is checked before anything is read or any model built, identically on every rank;
    # then the ranks meet once (the only collective before the run) and agree to start, or all stop.
    try:
        prepared = _prepare(args, launch, progress)
        error = None
    except (MediaError, InputError) as exc:
        prepared, error = None, exc
    except Exception as exc:  # noqa: BLE001 - an allocation failure while reading is reported like any other
        if not is_out_of_memory(exc):
            raise
        prepared, error = None, out_of_memory_error(exc, None, launch.device)
    limit = agree_to_start(usable_memory(launch.device), error, launch, state)
    pinned, sp_size, output, demo, dtype, color_fix, info, geometry, notes = prepared
    is_rank0 = launch.rank == 0
    memory = plan_memory(args, pinned, geometry, info.num_frames, dtype, sp_size, launch.device, demo, limit,
                         weights_loaded=state.models is not None)
    state.memory = memory
    settings = memory.settings
    plan = plan_temporal_batches(info.num_frames, settings.batch_frames, settings.overlap)
    is_video_out = output_kind(output) == "video"
    if is_rank0:
        for note in info.notes + notes:
            progress.note(f"{PROG}: {note}")
        if memory.warning is not None:
            progress.note(f"{PROG}: {memory.warning}")
        elif memory.reason.startswith("chose"):  # an exact setting instead of a faster one: said, quietly
            progress.note(f"{PROG}: note: memory: {memory.reason}")
        if geometry.output[0] * geometry.output[1] > LARGE_OUTPUT_PIXELS:
            progress.note(f"{PROG}: note: the output is {geometry.output[1]}x{geometry.output[0]}, larger than 8K "
                          f"(7680x4320): {estimate_restore_time(geometry, info.num_frames, demo, launch.device)}")
        coded = h264_frame_size(*geometry.output)
        if is_video_out and coded != geometry.output:
            progress.note(
                f"{PROG}: note: {geometry.output[1]}x{geometry.output[0]} has an odd side; H.264 yuv420p (what "
                f"players accept) needs even sides, so it is written as {coded[1]}x{coded[0]} with the edge "
                f"repeated (use --resolution with even sides to avoid this)"
            )

    # ---- resume hook (issue 48): the kept batches decide where this run starts; every rank agrees before the load
    kept = _open_kept_batches(args, launch, progress, state, output, settings, plan, geometry, info, dtype, color_fix,
                              sp_size, demo)

    progress.start("load")
    fresh = state.models is None
    mesh = build_temporal_mesh(sp_size)
    if fresh:
        # a bad checkpoint fails the same way on every rank (else on the rank that read the bad bytes): the ranks meet
        # once more, so that it is one line, from the lowest rank that failed, and every rank stops
        try:
            models, error = load_models(args, launch.device, dtype, report=progress.note if is_rank0 else None,
                                        group=mesh.sp), None
        except InputError as exc:
            models, error = None, exc
        agree_loaded(error, launch, state)
    else:
        models = state.models
    state.lockstep = False
    state.models = models
    if models.demo and is_rank0 and fresh:
        progress.note(
            f"{PROG}: WARNING: running the embedded tiny DEMO weights (random, seeded): the output is NOT a "
            f"restoration. "
            + ("" if args.demo else f"No SeedVR2 weights were found; {how_to_get_weights(args.model)}.")
        )
    tile = settings.vae_tile if settings.vae_tile is not None else 256
    pipe = SeedVR2Pipeline(models.dit, models.vae, settings.vae_parallel, group=mesh.sp, vae_tile_size=tile,
                           vae_tile_overlap=tile_overlap(tile), shard_weights=getattr(args, "shard_weights", False))

    progress.start("restore")
    started = time.perf_counter()
    if stage_clock.active() is not None:
        stage_clock.active().mark("restore started")
    needed = np.zeros(info.num_frames, dtype=bool)  # frames of the batches this rank's group restores
    for batch in plan:
        if mesh.owns(batch.index) and batch.index >= kept.first:  # resume hook: kept batches are not read again
            needed[batch.start:batch.stop] = True
    model_frames = (
        None if frame is None else frames_to_model(frame[None], geometry)[:, 0]
        for _, frame, _ in iter_frames(info, keep=lambda i: bool(needed[i]))
    )
    # the next batch's frames are decoded on a thread while this one is restored (see .overlap)
    batches = iter(prefetch(temporal_batches(timed_iter(model_frames, "read"), settings.batch_frames,
                                             settings.overlap)))
    computed = []
    owned = [batch for batch in plan if mesh.owns(batch.index) and batch.index >= kept.first]
    progress.break_line()  # the stage bar keeps its line; the restore bar below it (on a terminal)
    # each frame counted once: a batch adds its frames less those it shares with the previous batch
    live = RestoreProgress.for_stream(sum(b.num_frames - b.blend for b in owned), len(owned),
                                      enabled=is_rank0 and not args.quiet).attach(models.vae, models.dit)
    tiles = 1
    if settings.vae_parallel == "tiled":
        step = tile - tile_overlap(tile)
        tiles = math.prod(max(1, math.ceil((side - tile_overlap(tile)) / step)) for side in geometry.work)

    def next_batch(index: int):
        for batch, clip in batches:  # skip the batches other groups restore (their frames were not converted)
            if batch.index == index:
                return batch, clip
        raise RuntimeError(f"the input ended before temporal batch {index} of {len(plan)}")

    def compute(index: int) -> torch.Tensor:
        with stage_clock.stage("input wait"):
            batch, clip = next_batch(index)
        live.begin_batch(batch.num_frames - batch.blend,
                         expected_calls(batch.num_frames, steps=len(pipe.timesteps), tiles=tiles))
        # the colour fix and the conversion to 8-bit frames are shared by the group's ranks (see the pipeline)
        frames = pipe.restore_batch_frames(clip.transpose(0, 1), models.txt, batch.start, args.seed, color_fix,
                                           lambda v: torch.from_numpy(model_to_frames(v.cpu(), geometry)))
        live.end_batch()
        computed.append(batch.num_frames)
        projected = live.projected_seconds()
        if is_rank0 and len(computed) == 1 and len(owned) > 1 and projected is not None and projected > LONG_RUN_S:
            live.write(f"{PROG}: note: at the speed of the first batch this restore takes about "
                       f"{format_seconds(projected)} ({len(owned)} batches); Ctrl-C stops it and removes the partial "
                       f"output")
        return frames

    results = ordered_results(mesh, len(plan), compute, before=state.before_batch, first=kept.first)
    if mesh.is_writer:
        use_pts = is_video_out and len(info.frame_pts) == info.num_frames
        with MediaWriter(output, *geometry.output, info.fps, time_base=info.time_base if use_pts else None,
                         audio_from=args.input if is_video_out and info.has_audio else None, crf=args.crf,
                         overwrite=args.overwrite) as writer:
            kept.note_partial(getattr(writer, "partial_path", None))  # resume hook: a resumed run removes it
            blender = kept.blender()  # resume hook: the kept blend state, and the kept frames encoded first
            with stage_clock.stage("write"):
                for frame in kept.replay():
                    writer.write(frame, info.frame_pts[writer.frames_written] if use_pts else None)

            def write_batch(item: tuple[int, torch.Tensor]) -> None:
                index, frames = item
                try:
                    with stage_clock.stage("write"):
                        final = list(blender.push(plan[index], frames.cpu(), settings.overlap))
                        kept.keep(plan[index], final, blender)  # resume hook: kept as soon as final
                finally:
                    kept.mark_handled(index)
                with stage_clock.stage("write"):
                    for frame in final:
                        writer.write(frame.numpy(), info.frame_pts[writer.frames_written] if use_pts else None)
                if state.on_frames is not None:
                    state.on_frames(writer.frames_written, info.num_frames)

            # finished batches are cross-faded and encoded on a thread while the next one is restored
            write = background_worker(write_batch)
            try:
                for item in results:
                    with stage_clock.stage("writer wait"):
                        write.submit(item)
                        kept.wait(item[0], lambda: write.failed)  # resume hook: kept before the next batch starts
            except BaseException:
                write.abandon()  # the thread must not write on while the partial output is removed
                raise
            with stage_clock.stage("writer wait"):
                write.close()
            for frame in blender.finish():
                writer.write(frame.numpy(), info.frame_pts[writer.frames_written] if use_pts else None)
            if writer.frames_written != info.num_frames:  # a bug, never a silently short file
                raise RuntimeError(f"wrote {writer.frames_written} frames, expected {info.num_frames}")
        kept.complete()  # resume hook: the output is published; its kept batches go
    else:
        for _ in results:
            pass
    live.close()
    seconds_restore = time.perf_counter() - started
    if stage_clock.active() is not None:
        stage_clock.active().mark("restore finished")
    peak, peak_kind = _peak_memory(launch.device)
    figures = _per_rank_figures([peak, float(sum(computed)), seconds_restore], launch.device)
    progress.done()

    seconds, stages = _command_time(progress, state)
    written = h264_frame_size(*geometry.output) if is_video_out else geometry.output
    vae = f"tiled {settings.vae_tile}px" if settings.vae_parallel == "tiled" else settings.vae_parallel
    if sp_size == 1 and settings.vae_parallel in ("height", "wavefront"):
        vae = "replicated"  # what one rank runs (see SeedVR2Pipeline)
    if settings.vae_parallel == "wavefront" and sp_size > 1 and pipe.vae_splits:  # what the cost model chose
        from .vae.wavefront import splits_in_words

        vae += f" ({'; '.join(sorted({splits_in_words(*splits) for splits in pipe.vae_splits}))})"
    if pipe.weight_shards is not None:
        vae += f"; DiT blocks sharded x{mesh.sp_size}"
    return summary_line(
        PROG, output, written, info.num_frames, None if info.is_image else f"{float(info.fps):.5g} fps",
        weights=f"{'DEMO' if models.demo else 'SeedVR2'} {(args.model or '3b').upper()}",
        dtype="bf16" if dtype == torch.bfloat16 else "fp32", device=launch.device.type, world=launch.world_size,
        sp=mesh.sp_size, vae=vae, batches=len(plan), batch_frames=settings.batch_frames, overlap=settings.overlap,
        seconds=seconds, stages=stages, peak_gib=max(row[0] for row in figures) / 2**30,
        color_fix=color_fix, work=geometry.work if geometry.work != geometry.output else None)


#: set by ``python -m examples.seedvr2`` as it starts (inherited by the ranks ``--ranks`` starts): the command's start
COMMAND_STARTED_ENV = "SEEDVR2_COMMAND_STARTED"


def _command_time(progress: StageProgress, state: RunState) -> tuple[float, dict]:
    """The closing line's time: the whole command's wall time and the stages in it (``start-up`` first: the
    interpreter, imports, ranks and process group before the input is read), or, for a file of several (or a caller
    that gives no start), the file's own stages."""
    stages = dict(progress.seconds)
    if state.command_started is None:
        return sum(stages.values()), stages
    wall = time.time() - state.command_started
    return wall, {"start-up": max(0.0, wall - sum(stages.values())), **stages}


def describe_batches(plan) -> str:
    """The temporal batches that ran, for the summary: ``1 batch of 1 frame``, ``10 batches of 21 frames (the last
    16), overlap 5``."""
    frames = lambda n: f"{n} frame{'s' if n != 1 else ''}"  # noqa: E731
    if len(plan) == 1:
        return f"1 batch of {frames(plan[0].num_frames)}"
    first, last = plan[0].num_frames, plan[-1].num_frames
    return (f"{len(plan)} batches of {frames(first)}{f' (the last {last})' if last != first else ''}, overlap "
            f"{plan[1].blend}")


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


def _print_error(progress: StageProgress, message: str, names: Sequence[Optional[str]] = ()) -> None:
    progress.break_line()
    # one line, whatever the exception carried; names from files escaped (no terminal control sequences), file
    # ``names`` first, so that a newline in one is shown as \x0a, naming the file exactly, not joined into a space
    for name in names:
        if name and not name.isprintable():
            message = message.replace(name, printable(name))
    print(printable(f"{PROG}: error: {' '.join(message.split())}"), file=sys.stderr)


def _stop_message(rank: int):
    """The one line printed when a signal stops the run (by rank 0 only: the others stop silently)."""
    def message(signum: int, removed: list) -> Optional[str]:
        if not speaks_for_stop(rank):  # rank 0 alone; under --ranks, not when another rank failed
            return None
        import signal

        what = (f"removed the partial output {', '.join(os.path.basename(p) for p in removed)}" if removed
                else "no partial output left")
        from .kept_batches import kept_folder  # resume hook (issue 48)

        kept = kept_folder()
        if kept is not None:
            what += f"; kept the finished batches in {os.path.basename(kept)} (the same command resumes after them)"
        return printable(f"{PROG}: stopped by {signal.Signals(signum).name}: {what}")
    return message


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the process exit code.

    Bad input is found identically on every rank before any collective, so rank 0 reports it for all. A failure once
    ranks talk (an allocation that fails on one rank, or a bug) is reported by the rank it happened on; that rank
    leaves the process group at once (no meeting), its peers' pending collectives fail, and they exit too (with a
    one-line note), so no rank waits on a failed one. SIGTERM, SIGINT, SIGHUP and the other stop signals end the
    process at once (see :mod:`.stop_signals`); a Ctrl-C before their handling is in place is one line too.
    """
    from . import stage_clock

    global _MAIN_ENTERED
    _MAIN_ENTERED = time.time()
    if os.environ.get(stage_clock.PROFILE_ENV):
        stage_clock.enable(comm=True).mark("main entered")
    try:
        from .stop_signals import StopOnSignals

        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:
        print(f"{PROG}: stopped by SIGINT during start-up: nothing was written", file=sys.stderr)
        return 130
    with StopOnSignals(_stop_message(env_rank())):
        try:
            return _main(args)
        except Exception:
            if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
                raise
            # A bug on one rank of several: its traceback, then out at once. The process group is already torn down
            # (mid-run, without meeting); finalising the interpreter beside gloo's threads ended the process with
            # SIGABRT instead of exit 1 once in a CI run.
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)


def _main(args: argparse.Namespace) -> int:
    from .inputs import plan_jobs

    try:
        launch = Launch.from_env()
    except ValueError as exc:  # a malformed WINSP_COLLECTIVE_TIMEOUT, say
        print(printable(f"{PROG}: error: {exc}"), file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - rank 0 could not listen on MASTER_PORT: the launcher tries another
        if "EADDRINUSE" not in str(exc) or env_rank() != 0:
            raise
        if record_port_taken():
            return PORT_TAKEN_EXIT
        print(printable(f"{PROG}: error: rank 0 cannot listen on MASTER_PORT {os.environ.get('MASTER_PORT')}: the "
                        f"port is taken by another program; choose another MASTER_PORT"), file=sys.stderr)
        return 2
    failed = False
    try:
        try:
            job = plan_jobs(args.input, args.output)
        except MediaError as exc:  # the same on every rank, before any collective: rank 0 reports it
            if launch.rank == 0:
                _print_error(StageProgress(STAGES, enabled=False), str(exc), names=(*args.input, args.output))
            return 2
        if not job.batch:
            args.input, args.output = job.pairs[0]
            code, failed, _ = _restore_file(args, launch, RunState(command_started=_command_started(),
                                                                   keep_batches=True))
            return code
        code, failed = _restore_batch(args, launch, job)
        return code
    except BaseException:  # a bug: this rank leaves without meeting the others (they may be mid-collective)
        failed = True
        raise
    finally:
        launch.close(failed=failed)


def _command_started() -> float:
    """When the command started: ``$SEEDVR2_COMMAND_STARTED`` (set by ``python -m examples.seedvr2``), else when
    :func:`main` was entered."""
    try:
        return float(os.environ[COMMAND_STARTED_ENV])
    except (KeyError, ValueError):
        return _MAIN_ENTERED


_MAIN_ENTERED = time.time()


def _restore_batch(args: argparse.Namespace, launch: Launch, job) -> tuple[int, bool]:
    """Restore every (input, output) pair of ``job`` with the models loaded once; one line per file, then one summary
    line. A file that fails is reported and the next one runs, unless the failure broke the ranks' lockstep (then the
    process group is gone and the batch stops). Returns (exit code: 2 if any file failed, whether the group broke)."""
    if job.output_dir is not None:
        try:  # refused before anything runs, like a single output's folder (every rank: it is the same folder)
            os.makedirs(job.output_dir, exist_ok=True)
        except OSError as exc:
            error: Optional[MediaError] = MediaError(f"cannot create the output folder {job.output_dir} "
                                                     f"({exc.strerror or exc}); choose another -o")
        else:
            try:
                check_output_directory(os.path.join(job.output_dir, "probe"))
                error = None
            except MediaError as exc:
                error = exc
        if error is not None:
            if launch.rank == 0:
                _print_error(StageProgress(STAGES, enabled=False), str(error))
            return 2, False
    started = time.perf_counter()
    models, failures, done, broken = None, [], 0, False
    for index, (path, output) in enumerate(job.pairs):
        args.input, args.output = path, output
        state = RunState(models=models, keep_batches=True)
        code, broken, _ = _restore_file(args, launch, state)
        models = state.models
        if code == 0:
            done += 1
        else:
            failures.append(os.path.basename(path))
        if broken and launch.world_size > 1:
            failures += [os.path.basename(p) + " (not run)" for p, _ in job.pairs[index + 1:]]
            break
    if launch.rank == 0:
        where = f" into {job.output_dir}" if job.output_dir is not None else ""
        failed = f"; FAILED {len(failures)}: {', '.join(failures)}" if failures else ""
        print(printable(f"{PROG}: restored {done} of {len(job.pairs)} files{where} in "
                        f"{time.perf_counter() - started:.1f}s{failed}"), file=sys.stderr)
    return (2 if failures else 0), broken


def _restore_file(args: argparse.Namespace, launch: Launch, state: RunState) -> tuple[int, bool, Optional[str]]:
    """Restore ``args.input`` into ``args.output``: (exit code, whether this rank failed out of lockstep, summary).
    Errors are printed as one line (by the rank that reports them), the summary by rank 0."""
    progress = StageProgress(STAGES, enabled=launch.rank == 0 and not args.quiet)
    prefix = f"rank {launch.rank}: " if launch.world_size > 1 else ""
    from .pipeline import NonFiniteOutput

    try:
        summary = run_restore(args, launch, progress, state)
    except (MediaError, InputError, NonFiniteOutput) as exc:
        failed = not state.lockstep
        if launch.rank == state.reporter or failed:
            _print_error(progress, (prefix if failed or state.reporter else "") + str(exc),
                         names=(args.input, args.output))
        return 2, failed, None
    except Exception as exc:  # noqa: BLE001 - only memory and lost-peer failures are handled; the rest re-raised
        # whatever it is, this rank leaves without meeting the others (they may be mid-collective)
        if is_out_of_memory(exc):
            message = str(out_of_memory_error(exc, state.memory, launch.device))
            del exc
            _print_error(progress, prefix + message)
            return 2, True, None
        if launch.world_size > 1 and is_peer_failure(exc):
            line = printable(f"{PROG}: {prefix}stopped: {_peer_failure(exc)}")
            if leave_note(launch.rank, line[len(PROG) + 2:]):  # under --ranks: the launcher's to say, or not
                return 2, True, None
            progress.break_line()
            print(line, file=sys.stderr)
            return 2, True, None
        raise
    _write_profile(launch.rank, progress.seconds)
    if launch.rank == 0:
        _write_stage_times(progress.seconds)
        print(printable(summary), file=sys.stderr)
    return 0, False, summary


STAGE_TIMES_ENV = "SEEDVR2_STAGE_TIMES"


def _write_stage_times(stages: dict) -> None:
    """With ``SEEDVR2_STAGE_TIMES=FILE``: the CLI's own stage seconds (read, load, restore) as JSON, from rank 0.

    What ``benchmarks/bench_whole_command.py`` reads; unlike ``SEEDVR2_PROFILE`` it times nothing more, so the
    command runs as a user's does."""
    path = os.environ.get(STAGE_TIMES_ENV)
    if path:
        import json

        with open(path, "w") as f:
            json.dump({name: round(seconds, 4) for name, seconds in stages.items()}, f)


def _write_profile(rank: int, cli_stages: dict) -> None:
    """With ``SEEDVR2_PROFILE=DIR``: this rank's stage figures (and the CLI's own ``cli_stages`` seconds) to
    ``DIR/rank<N>.json`` (see :mod:`.stage_clock`)."""
    from . import stage_clock

    directory = os.environ.get(stage_clock.PROFILE_ENV)
    if directory and stage_clock.active() is not None:
        stage_clock.active().mark("main left")
        stage_clock.write_profile(directory, rank, {"cli": dict(cli_stages)})
        stage_clock.disable()

