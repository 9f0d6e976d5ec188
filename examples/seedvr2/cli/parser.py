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
(examples/seedvr2/models/demo.py) so that the command works anywhere in seconds, and says so, since that restores
nothing.

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
import os

from ..checkpoints.dtypes import WEIGHT_MODES
from ..media.color_fix import COLOR_FIXES
from ..media.reading import DEFAULT_CRF
from ..restore.temporal import DEFAULT_BATCH_FRAMES, DEFAULT_OVERLAP
from .launcher import env_rank

PROG = "python -m examples.seedvr2"


DEFAULT_TEXT_EMBEDS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets",
                                   "text_embeds.safetensors")


DEFAULT_SEED = 666


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
    p.add_argument("--untrusted-input", action="store_true",
                   help="open each input as a file from someone else, as serve does: by its content only as mp4/mov, "
                        "mkv/webm, avi, png, jpg, webp or bmp, never following what it names (playlists, lists, "
                        "patterns), no FIFO or device")
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
    # ---- resume hook (issue 48): see examples.seedvr2.restore.kept_batches
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
