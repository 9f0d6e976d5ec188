"""Finding SeedVR2 weights a user already downloaded, without the network.

Without ``--dit-checkpoint`` / ``--vae-checkpoint`` the CLI looks, in this order, in

1. ``./ckpts/`` (where the original repository's instructions put ``snapshot_download``'s files),
2. ``$SEEDVR2_HOME`` (a folder the user names once),
3. the Hugging Face hub cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``): the
   snapshots of ``ByteDance-Seed/SeedVR2-3B`` and ``-7B`` (the released ``.pth`` files) and of the community repacks
   ``numz/SeedVR2_comfyUI`` (fp16 / fp8 safetensors), ``AInVFX/SeedVR2_comfyUI`` (mixed fp8, GGUF) and
   ``cmeka/SeedVR2-GGUF`` (GGUF), the revision ``refs/main`` names first, then the others, newest first.

Within a folder the file names of :data:`DIT_FILES` / :data:`VAE_FILES` are tried in their order: the released
weights first (exact), then the fp16 repacks, then fp8, then GGUF from the most to the least precise. The first
folder that has a file wins. The model: ``--model`` when given; else the 3B when a 3B DiT is found anywhere (the
smaller and faster of the two, and the CLI's default), else the 7B. The sharp 7B is taken only when no plain 7B is
found anywhere: a preference between models holds across every location (each is searched for the preferred model
first), while between files of one model the first location wins (:data:`DIT_TIERS`).

A file that is found but cannot be what it claims (a dangling link, as an interrupted hub download leaves, an empty
file, a folder) is an error naming its path, never a reason to look further or to fall back to the demo weights; its
content is checked by the loaders, whose errors name the path too. So is a location that exists but cannot be read (a
folder without permission, a snapshot link that does not resolve, a ``refs/main`` that cannot be read or decoded):
what it holds is unknown, and skipping it could pick other weights than the user's, or the demo. A location that does
not exist is simply not there. Pure file-system code: no torch, no network.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import Mapping, Optional

__all__ = ["DIT_FILES", "DIT_TIERS", "VAE_FILES", "HUB_REPOS", "WeightsFound", "WeightsError", "search_folders",
           "find_weights", "how_to_get_weights"]

_GGUF_LEVELS = ("Q8_0", "Q8_K_M", "Q6_K_M", "Q6_K", "Q5_K_M", "Q5_K", "Q4_K_M", "Q4_K", "Q3_K_M")


def _dit_names(stem: str, fp8_suffixes: tuple[str, ...]) -> tuple[str, ...]:
    return ((f"{stem}.pth", f"{stem}.safetensors", f"{stem}_fp16.safetensors", f"{stem}_bf16.safetensors")
            + tuple(f"{stem}_{suffix}.safetensors" for suffix in fp8_suffixes)
            + tuple(f"{stem}-{level}.gguf" for level in _GGUF_LEVELS))


_FP8 = ("fp8_e4m3fn", "fp8_e4m3fn_mixed_block35_fp16")
#: DiT file names by model, preferred first: the released checkpoint, then the community repacks (numz, AInVFX, cmeka)
DIT_FILES: dict[str, tuple[str, ...]] = {
    "3b": _dit_names("seedvr2_ema_3b", _FP8),
    "7b": _dit_names("seedvr2_ema_7b", _FP8) + _dit_names("seedvr2_ema_7b_sharp", _FP8),
}
#: the DiT names by model in tiers of preference: every location is searched for a tier before the next (the sharp 7B
#: only when no plain 7B is found anywhere)
DIT_TIERS: dict[str, tuple[tuple[str, ...], ...]] = {
    "3b": (DIT_FILES["3b"],),
    "7b": (_dit_names("seedvr2_ema_7b", _FP8), _dit_names("seedvr2_ema_7b_sharp", _FP8)),
}
#: VAE file names, preferred first (the released one, then the fp16 repack)
VAE_FILES: tuple[str, ...] = ("ema_vae.pth", "ema_vae.safetensors", "ema_vae_fp16.safetensors",
                               "ema_vae_bf16.safetensors")
#: Hugging Face repositories whose snapshots are searched, in order
HUB_REPOS: tuple[str, ...] = ("ByteDance-Seed/SeedVR2-3B", "ByteDance-Seed/SeedVR2-7B", "numz/SeedVR2_comfyUI",
                              "AInVFX/SeedVR2_comfyUI", "cmeka/SeedVR2-GGUF")


class WeightsError(ValueError):
    """A weights file was found but is broken (the message names its path)."""


@dataclass(frozen=True)
class WeightsFound:
    """What discovery found: the model, the two paths (None: not found) and the folders searched."""

    model: str
    dit: Optional[str]
    vae: Optional[str]
    searched: tuple[str, ...]

    @property
    def complete(self) -> bool:
        return self.dit is not None and self.vae is not None

    @property
    def nothing(self) -> bool:
        return self.dit is None and self.vae is None

    def describe(self) -> str:
        """The one line saying which files are used."""
        return f"weights: SeedVR2 {self.model.upper()} DiT {self.dit}, VAE {self.vae} (found without flags)"


def hub_cache_dir(env: Mapping[str, str]) -> str:
    """The Hugging Face hub cache: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``."""
    if env.get("HF_HUB_CACHE"):
        return env["HF_HUB_CACHE"]
    if env.get("HF_HOME"):
        return os.path.join(env["HF_HOME"], "hub")
    home = env.get("HOME") or os.path.expanduser("~")
    return os.path.join(home, ".cache", "huggingface", "hub")


def _unreadable(path: str, exc: OSError, what: str = "folder") -> "WeightsError":
    return WeightsError(f"cannot read the weights {what} {path} ({exc.strerror or exc}): fix it or its permissions, "
                        f"or pass --dit-checkpoint and --vae-checkpoint")


def _snapshots(repo_dir: str) -> list[str]:
    """A hub repository's snapshot folders: the one ``refs/main`` names first, then the others, newest first.
    :class:`WeightsError` for a snapshot folder or ``refs/main`` that exists but cannot be read or decoded."""
    root = os.path.join(repo_dir, "snapshots")
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []  # the repository is not in the cache
    except OSError as exc:
        raise _unreadable(root, exc) from None
    folders, modified = [], {}
    for name in names:
        path = os.path.join(root, name)
        try:
            info = os.stat(path)
        except OSError as exc:  # a link that does not resolve (a loop, a removed target), or no permission
            raise _unreadable(path, exc, "snapshot") from None
        if stat.S_ISDIR(info.st_mode):
            folders.append(path)
            modified[path] = info.st_mtime
    folders.sort(key=modified.__getitem__, reverse=True)
    ref = os.path.join(repo_dir, "refs", "main")
    try:
        with open(ref, "rb") as f:
            data = f.read(4096)
    except FileNotFoundError:
        return folders
    except OSError as exc:
        raise _unreadable(ref, exc, "revision file") from None
    try:
        revision = data.decode("ascii").strip()
    except UnicodeDecodeError:
        raise WeightsError(f"the hub revision file {ref} does not hold a revision (bytes that are not text); delete "
                           f"it or download the repository again, or pass --dit-checkpoint and --vae-checkpoint"
                           ) from None
    main = os.path.join(root, revision)
    if main in folders:
        folders.remove(main)
        folders.insert(0, main)
    return folders


def search_folders(env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None) -> list[str]:
    """The folders searched, in order (existing or not): ``./ckpts``, ``$SEEDVR2_HOME``, the hub snapshots."""
    env = os.environ if env is None else env
    folders = [os.path.join(cwd if cwd is not None else os.getcwd(), "ckpts")]
    if env.get("SEEDVR2_HOME"):
        folders.append(env["SEEDVR2_HOME"])
    hub = hub_cache_dir(env)
    for repo in HUB_REPOS:
        folders += _snapshots(os.path.join(hub, "models--" + repo.replace("/", "--")))
    return folders


def _check_found(path: str) -> None:
    """A name that exists in a folder must be a readable, non-empty file (a hub link must point at its blob)."""
    try:
        _check_found_file(path)
    except OSError as exc:
        raise _unreadable(path, exc, "file") from None


def _check_found_file(path: str) -> None:
    if os.path.islink(path) and not os.path.exists(path):
        raise WeightsError(f"found {path} but it is a broken link (to {os.readlink(path)}): an interrupted download? "
                           f"download it again, or pass the checkpoint flags")
    if os.path.isdir(path):
        raise WeightsError(f"found {path} but it is a folder, not a weights file")
    if os.path.getsize(path) == 0:
        raise WeightsError(f"found {path} but it is empty: download it again, or pass the checkpoint flags")
    if not os.access(path, os.R_OK):
        raise WeightsError(f"found {path} but it cannot be read (permissions)")


def _names_in(folder: str, listed: dict) -> frozenset:
    """The names in ``folder`` (none when it does not exist); :class:`WeightsError` when it exists but cannot be
    listed. ``listed`` caches each folder's names for one search."""
    if folder not in listed:
        try:
            listed[folder] = frozenset(os.listdir(folder))
        except FileNotFoundError:
            listed[folder] = frozenset()
        except OSError as exc:
            raise _unreadable(folder, exc) from None
    return listed[folder]


def _first(folders: list[str], names: tuple[str, ...], listed: Optional[dict] = None) -> Optional[str]:
    listed = {} if listed is None else listed
    for folder in folders:
        present = _names_in(folder, listed)
        for name in names:
            if name in present:
                path = os.path.join(folder, name)
                _check_found(path)
                return path
    return None


def _first_dit(folders: list[str], model: str, listed: dict) -> Optional[str]:
    """The preferred DiT of ``model``: every location searched for one tier of :data:`DIT_TIERS` before the next."""
    for names in DIT_TIERS[model]:
        found = _first(folders, names, listed)
        if found is not None:
            return found
    return None


def find_weights(model: Optional[str] = None, *, dit: Optional[str] = None, vae: Optional[str] = None,
                 env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None) -> WeightsFound:
    """Find the DiT (unless ``dit`` is given) and the VAE (unless ``vae`` is given) of ``model`` (``"3b"``, ``"7b"``
    or None: the 3B if found, else the 7B). Raises :class:`WeightsError` for a found file that is broken."""
    folders = search_folders(env, cwd)
    listed: dict = {}
    if model is None:
        if dit is not None:
            model = "7b" if "7b" in os.path.basename(dit).lower() else "3b"
        else:
            for candidate in ("3b", "7b"):
                dit = _first_dit(folders, candidate, listed)
                if dit is not None:
                    model = candidate
                    break
            else:
                model = "3b"
    elif dit is None:
        dit = _first_dit(folders, model, listed)
    if vae is None:
        vae = _first(folders, VAE_FILES, listed)
    return WeightsFound(model, dit, vae, tuple(folders))


def how_to_get_weights(model: str = "3b") -> str:
    """Where the real weights come from, for the demo warning."""
    repo = "ByteDance-Seed/SeedVR2-7B" if model == "7b" else "ByteDance-Seed/SeedVR2-3B"
    return (f"download them once (huggingface-cli download {repo}, which fills the Hugging Face cache; or into "
            f"./ckpts/ or $SEEDVR2_HOME), or pass --dit-checkpoint and --vae-checkpoint")


def _where(folders: tuple[str, ...], env: Optional[Mapping[str, str]] = None) -> str:
    env = os.environ if env is None else env
    places = [folders[0]] + ([env["SEEDVR2_HOME"]] if env.get("SEEDVR2_HOME") else [])
    return f"{', '.join(places)} and the Hugging Face cache {hub_cache_dir(env)}"


def resolve_cli_weights(args, env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None) -> Optional[str]:
    """Fill ``args.dit_checkpoint`` / ``args.vae_checkpoint`` / ``args.model`` from discovery where the user left them
    out; returns the line to print (None: the flags were given, or the demo runs). ``args.demo`` skips discovery.

    Raises :class:`WeightsError` for a broken file found, for ``--demo`` with checkpoint flags, and when only part of
    a set is found (one flag given and the other file not found, or a DiT without a VAE): the demo weights are used
    only when nothing at all is found."""
    given = args.dit_checkpoint is not None or args.vae_checkpoint is not None
    args.found_weights = getattr(args, "found_weights", False)  # True once found (a batch resolves per file)
    if getattr(args, "demo", False):
        if given:
            raise WeightsError("--demo runs the embedded demo weights; it cannot go with --dit-checkpoint or "
                               "--vae-checkpoint")
        args.model = args.model or "3b"
        return None
    if args.dit_checkpoint is not None and args.vae_checkpoint is not None:
        if args.model is None:
            args.model = "7b" if "7b" in os.path.basename(args.dit_checkpoint).lower() else "3b"
        return None
    found = find_weights(args.model, dit=args.dit_checkpoint, vae=args.vae_checkpoint, env=env, cwd=cwd)
    args.model = found.model
    if not given and found.nothing:
        return None
    if not found.complete:
        missing, flag, names = (("DiT", "--dit-checkpoint", DIT_FILES[found.model]) if found.dit is None
                                else ("VAE", "--vae-checkpoint", VAE_FILES))
        have = found.vae if found.dit is None else found.dit
        raise WeightsError(
            f"no SeedVR2 {found.model.upper()} {missing} found (looked for {names[0]} and {len(names) - 1} repack "
            f"names in {_where(found.searched, env)}) to go with {have}; pass {flag}, or put the file there")
    args.dit_checkpoint, args.vae_checkpoint = found.dit, found.vae
    args.found_weights = True
    return found.describe()
