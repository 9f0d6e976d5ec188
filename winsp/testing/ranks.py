"""Testing a window-parallel model: run a function on several CPU ranks, and compare with the original model.

:func:`run_ranks` runs a function on several gloo ranks (one process a rank) with a deadline: a deadlock becomes a
``TimeoutError`` naming the ranks that did not finish, instead of a hung test session. :func:`check_parallel`
compares a parallelised model with the original one (outputs, and every parameter and input gradient after one
backward and ``winsp.sync_gradients``) at several world sizes. Both serve winsp's own tests and users testing their
models.
"""

from __future__ import annotations

import math
import os
import pickle
import queue as queue_mod
import shutil
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_ranks", "RankError", "check_parallel", "ParallelCheckError", "ParallelReport", "Discrepancy",
           "DEFAULT_TOLERANCES"]


class RankError(RuntimeError):
    """A rank raised; the message carries that rank's traceback."""


class ParallelCheckError(AssertionError):
    """:func:`check_parallel` found a difference; ``report`` is the full :class:`ParallelReport`."""

    def __init__(self, message: str, report: "ParallelReport") -> None:
        super().__init__(message)
        self.report = report


# Modules the fork server imports once; every rank process is forked from it with them already loaded.
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "winsp")


def _rank_main(rank: int, world_size: int, init_method: str, env: dict[str, str], fn: Callable, args: tuple,
               kwargs: dict, out) -> None:
    # A forked rank inherits the fork server's environment (the parent's when the server started); the parent's
    # environment now is what a spawned rank would have seen.
    os.environ.clear()
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
        try:
            # Every rank has connected to every other before any runs ``fn``: a rank whose ``fn`` raises at once
            # (a refusal) and exits would otherwise break a peer still inside gloo's connectFullMesh.
            dist.barrier()
            result = fn(rank, world_size, *args, **kwargs)
            # No rank leaves before every rank is done: a rank that closes its connections while a peer's last
            # operation with it is still under way makes that operation fail ("connection closed by peer").
            dist.barrier()
        finally:
            dist.destroy_process_group()
        out.put((rank, True, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - reported to the parent verbatim
        out.put((rank, False, traceback.format_exc()))


def _check_importable(fn: Callable[..., Any]) -> None:
    """``TypeError`` in one line, before any process starts, when the ranks could not receive ``fn``: a new process
    gets it by its module and name, so a lambda or a function defined inside another cannot go."""
    try:
        pickle.dumps(fn)
    except Exception:  # noqa: BLE001 - PicklingError, AttributeError ("local object"), TypeError
        name = getattr(fn, "__qualname__", None) or repr(fn)
        raise TypeError(f"run_ranks: the function must be importable by the new rank processes, i.e. defined at the "
                        f"top level of a module (not a lambda, nor a function defined inside another); {name} is "
                        f"not") from None


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    start_method: str = "forkserver",
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args, **kwargs)`` in ``world_size`` new gloo processes, one a rank.

    ``fn`` must be importable (a module-level function) and its result picklable. Returns the
    results in rank order. Raises :class:`RankError` with the first failing rank's traceback, or
    ``TimeoutError`` naming the ranks still running after ``timeout`` seconds (all are killed).

    Every call gets fresh processes. With ``start_method="forkserver"`` (the default) they are forked from a server
    that imported torch and winsp once, which makes a call about five times cheaper than ``"spawn"`` (each rank
    importing torch anew); ranks see the caller's environment as it is at the call either way.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")
    _check_importable(fn)
    if start_method == "forkserver":
        server = mp.get_context("forkserver")
        server.set_forkserver_preload(list(FORKSERVER_PRELOAD))  # no effect once the server runs
        ctx: Any = server
    else:
        ctx = mp.get_context("spawn")
    out = ctx.Queue()
    # Rendezvous through a file of our own, not a TCP port: a "free" port can be taken by another process between
    # choosing it and binding it, which failed tests when several suites ran at once.
    store_dir = tempfile.mkdtemp(prefix="winsp-ranks-")
    init_method = "file://" + os.path.join(store_dir, "store")
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, init_method, dict(os.environ), fn, args, kwargs, out),
                    daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if failures:
                    break
                pending = sorted(set(range(world_size)) - set(results) - set(failures))
                detail = "".join(f"\n--- rank {r} failed ---\n{tb}" for r, tb in sorted(failures.items()))
                raise TimeoutError(
                    f"ranks {pending} of {world_size} did not finish within {timeout:.0f}s "
                    f"(deadlock or a rank stuck in a collective){detail}"
                )
            try:
                rank, ok, payload = out.get(timeout=min(remaining, 0.5))
            except queue_mod.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)
                        and i not in results and i not in failures]
                for i in dead:
                    failures[i] = f"process exited with code {procs[i].exitcode} without reporting"
                continue
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                failures[rank] = payload
                # Peers of a failed rank usually block in a collective; give them a moment, then stop.
                deadline = min(deadline, time.monotonic() + 10.0)
        if failures:
            first = min(failures)
            raise RankError(f"rank {first} of {world_size} failed:\n{failures[first]}")
        return [results[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        shutil.rmtree(store_dir, ignore_errors=True)


# ---- comparing a parallelised model with the original ------------------------------------------------------------

# (rtol, atol) by dtype: error <= atol + rtol * max |original value| over the tensor
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-9, 1e-12),
    torch.float32: (1e-4, 1e-6),
    torch.bfloat16: (3e-2, 1e-3),
    torch.float16: (1e-2, 1e-4),
}


@dataclass
class Discrepancy:
    """One compared tensor: the largest |parallel - original| over ranks and world sizes, and where it was seen."""

    kind: str  # "output", "param" or "input"
    name: str
    error: float
    scale: float  # max |original value|
    tolerance: float
    world_size: int
    rank: int

    @property
    def ratio(self) -> float:
        """error / tolerance (> 1 fails)."""
        return self.error / self.tolerance if self.tolerance > 0 else (math.inf if self.error > 0 else 0.0)


@dataclass
class ParallelReport:
    """What :func:`check_parallel` compared, one :class:`Discrepancy` per output, parameter gradient and input
    gradient (the worst over all ranks and world sizes), and any structural problem (a gradient missing on one side)."""

    world_sizes: tuple[int, ...]
    items: dict[tuple[str, str], Discrepancy] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def record(self, item: Discrepancy) -> None:
        key = (item.kind, item.name)
        if key not in self.items or item.ratio > self.items[key].ratio:
            self.items[key] = item

    def max_error(self, kind: str) -> float:
        """Largest error among the outputs ("output"), parameter gradients ("param") or input gradients ("input")."""
        return max((d.error for d in self.items.values() if d.kind == kind), default=0.0)

    @property
    def failures(self) -> list[Discrepancy]:
        """Items over their tolerance, worst (error / tolerance) first."""
        return sorted((d for d in self.items.values() if d.ratio > 1), key=lambda d: -d.ratio)

    @property
    def ok(self) -> bool:
        return not self.failures and not self.problems

    def worst(self, kind: str | None = None) -> Discrepancy | None:
        """The item closest to (or furthest over) its tolerance, of ``kind`` if given."""
        found = [d for d in self.items.values() if kind is None or d.kind == kind]
        return max(found, key=lambda d: d.ratio, default=None)

    def __str__(self) -> str:
        lines = [f"check_parallel over world sizes {list(self.world_sizes)}: {len(self.items)} tensors compared"]
        for kind in ("output", "param", "input"):
            worst = self.worst(kind)
            if worst is not None:
                count = sum(d.kind == kind for d in self.items.values())
                lines.append(f"  {kind}s ({count}): max error {self.max_error(kind):.3g}; closest to its tolerance: "
                             f"{worst.name} {worst.error:.3g} (tolerance {worst.tolerance:.3g}, world size "
                             f"{worst.world_size}, rank {worst.rank})")
        lines += [f"  problem: {p}" for p in self.problems]
        return "\n".join(lines)


def _flatten_outputs(out, prefix: str = "output") -> list[tuple[str, torch.Tensor]]:
    """Named tensors of a forward's result (a tensor, or tuples / lists / dicts of them; other values are skipped)."""
    if isinstance(out, torch.Tensor):
        return [(prefix, out)]
    if isinstance(out, (tuple, list)):
        return [item for i, v in enumerate(out) for item in _flatten_outputs(v, f"{prefix}[{i}]")]
    if isinstance(out, dict):
        return [item for k, v in out.items() for item in _flatten_outputs(v, f"{prefix}[{k!r}]")]
    return []


def _default_loss(out) -> torch.Tensor:
    """A fixed random weighting of every floating-point output (the same draw on every rank and in the original)."""
    total = None
    g = torch.Generator().manual_seed(1234)
    for _, t in _flatten_outputs(out):
        if t.is_floating_point():
            w = torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.dtype)
            term = (t * w).sum()
            total = term if total is None else total + term
    if total is None:
        raise ValueError("check_parallel: the model returned no floating-point tensor to take a loss of")
    return total


def _leaf(value):
    """A tensor that requires grad becomes a fresh leaf (its gradient is compared); anything else is kept."""
    if isinstance(value, torch.Tensor) and value.requires_grad:
        return value.detach().clone().requires_grad_(True)
    return value


def _run_model(make_model, make_inputs, loss, seed: int, train: bool) -> dict:
    """Build, forward, backward; everything the comparison needs, on the CPU in float64-safe form."""
    torch.manual_seed(seed)
    model = make_model()
    torch.manual_seed(seed)
    inputs = make_inputs()
    args, kwargs = (inputs, {}) if isinstance(inputs, (tuple, list)) else ((), inputs) if isinstance(inputs, dict) \
        else ((inputs,), {})
    args = [_leaf(a) for a in args]
    kwargs = {k: _leaf(v) for k, v in kwargs.items()}
    model.train(train)
    torch.manual_seed(seed)  # random per-sample ops draw the same numbers in the original and the parallel model
    out = model(*args, **kwargs)
    (loss or _default_loss)(out).backward()
    return dict(model=model, out=out, args=args, kwargs=kwargs)


def _collect(run: dict) -> dict:
    inputs = [(f"args[{i}]", a) for i, a in enumerate(run["args"])] + [(k, v) for k, v in run["kwargs"].items()]
    return dict(
        outputs={n: t.detach().cpu() for n, t in _flatten_outputs(run["out"])},
        params={n: (p.grad.detach().cpu() if p.grad is not None else None) for n, p in run["model"].named_parameters()},
        inputs={n: (t.grad.detach().cpu() if t.grad is not None else None) for n, t in inputs
                if isinstance(t, torch.Tensor) and t.requires_grad},
    )


def _parallel_rank(rank: int, world_size: int, make_original, make_parallel, make_inputs, loss, seed: int,
                   train: bool) -> dict:
    from winsp.runtime.gradients import sync_gradients

    torch.manual_seed(seed)
    weights = sum(float(p.detach().double().abs().sum()) for p in make_original().parameters())

    def make_model():
        original = make_original()
        made = make_parallel(original, world_size)
        return original if made is None else made

    run = _run_model(make_model, make_inputs, loss, seed, train)
    sync_gradients(run["model"])  # the runtime the model carries gives the SP group
    tensors = [t for t in list(run["args"]) + list(run["kwargs"].values())
               if isinstance(t, torch.Tensor) and t.requires_grad]
    sync_gradients(tensors, run["model"])
    return dict(_collect(run), weights=weights)


def _match_name(name: str, reference: dict) -> str | None:
    """The original's parameter name for a parallel model's ``name`` (equal, or a wrapper's prefix dropped)."""
    if name in reference:
        return name
    tails = [r for r in reference if name.endswith("." + r)]
    longest = [r for r in tails if len(r) == max(map(len, tails))]  # 'w.mapping.norm.scale' is 'mapping.norm.scale'
    return longest[0] if len(longest) == 1 else None


def check_parallel(
    make_original: Callable[[], torch.nn.Module],
    make_parallel: Callable[[torch.nn.Module, int], torch.nn.Module | None],
    make_inputs: Callable[[], Any],
    world_sizes: Sequence[int] = (2, 3),
    *,
    loss: Callable[[Any], torch.Tensor] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    seed: int = 0,
    train: bool = False,
    timeout: float = 300.0,
) -> ParallelReport:
    """Compare a parallelised model with the **original** model: outputs, and every gradient after one backward.

    The original runs once, here (one process, no process group); the parallel model runs under :func:`run_ranks`
    (gloo, CPU) at every world size. On every rank the same loss is taken of the output and ``winsp.sync_gradients``
    averages the gradients over the group of the runtime the parallel model carries; then every output, every
    parameter gradient (matched by parameter name) and every input gradient must equal the original's, on every rank.

    Args:
        make_original: builds the original model (plain PyTorch, written without winsp). It must build the same
            weights on every call: ``torch.manual_seed(seed)`` runs before each call.
        make_parallel: ``make_parallel(original, world_size)`` turns a freshly built original into the parallel
            model: return a new module (e.g. your winsp model with ``load_state_dict(original.state_dict())`` and
            ``build_runtime(DiffusionParallelConfig(sp_degree=world_size))``), or change ``original`` in place and
            return None or it (``winsp.parallelize``). Its parameter names must be the original's (a wrapper's prefix
            such as ``module.`` is dropped when matching).
        make_inputs: the forward's inputs, a tuple of positional arguments (or a dict of keyword arguments, or one
            tensor); the same on every call (it runs after ``torch.manual_seed(seed)``). The gradients of the tensors
            that require grad (``vid.requires_grad_()`` in ``make_inputs``) are compared too.
        world_sizes: the SP degrees to run (1 runs the parallel model alone in a one-rank world).
        loss: ``loss(output) -> scalar``; by default a fixed random weighting of every floating-point output (video
            and text alike: no output is divided by anything).
        rtol, atol: error <= atol + rtol * max |original| per tensor; by default from the tensor's dtype
            (:data:`DEFAULT_TOLERANCES`: 1e-9 relative in float64, 1e-4 in float32). Use float64 for exactness.
        seed: the seed set before building, before making inputs and before the forward (so random ops that draw per
            sample, through ``request.row_sample``, draw the same numbers in both models).
        train: run both models in ``train()`` mode (dropout, stochastic depth); by default both run in ``eval()``.
        timeout: seconds each world may take (:func:`run_ranks`).

    The three functions (and ``loss``) go to spawned processes: they must be importable, module-level functions (or
    ``functools.partial`` of them), not lambdas or closures.

    Returns the :class:`ParallelReport`; raises AssertionError naming the worst tensor (and the report) when anything
    is over its tolerance, a gradient exists on one side only (and is not all zeros there), or the ranks built different
    weights.
    """
    sizes = tuple(world_sizes)
    if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
        raise ValueError(f"check_parallel: world_sizes must be positive integers, got {world_sizes!r}")
    for name, value in (("rtol", rtol), ("atol", atol)):
        if value is not None and not value >= 0:
            raise ValueError(f"check_parallel: {name} must be >= 0, got {value!r}")
    torch.manual_seed(seed)
    weights = sum(float(p.detach().double().abs().sum()) for p in make_original().parameters())
    reference = _collect(_run_model(make_original, make_inputs, loss, seed, train))
    report = ParallelReport(world_sizes=sizes)

    def tolerance(t: torch.Tensor) -> tuple[float, float]:
        r, a = DEFAULT_TOLERANCES.get(t.dtype, DEFAULT_TOLERANCES[torch.float32])
        return (r if rtol is None else rtol), (a if atol is None else atol)

    def compare(kind, name, got, want, world_size, rank):
        if (want is None) != (got is None) and not bool((got if want is None else want).count_nonzero()):
            got = want = torch.zeros(())  # no gradient is a zero one: a model that computes unused outputs apart
        if want is None or got is None:
            if (want is None) != (got is None):
                side = "the parallel model" if got is None else "the original"
                report.problems.append(f"{kind} {name}: no gradient in {side} (world size {world_size}, rank {rank})")
            return
        if got.shape != want.shape:
            report.problems.append(f"{kind} {name}: shape {tuple(got.shape)} in the parallel model, "
                                   f"{tuple(want.shape)} in the original (world size {world_size}, rank {rank})")
            return
        r, a = tolerance(want)
        scale = want.double().abs().max().item() if want.numel() else 0.0
        error = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
        report.record(Discrepancy(kind, name, error, scale, a + r * scale, world_size, rank))

    for world_size in sizes:
        results = run_ranks(_parallel_rank, world_size, make_original, make_parallel, make_inputs, loss, seed, train,
                            timeout=timeout)
        for rank, result in enumerate(results):
            if not math.isclose(result["weights"], weights, rel_tol=1e-12):
                report.problems.append(f"make_original built different weights on rank {rank} of {world_size} "
                                       f"(seed the model inside make_original)")
            for name in sorted(set(reference["outputs"]) | set(result["outputs"])):
                got, want = result["outputs"].get(name), reference["outputs"].get(name)
                if got is None or want is None:
                    report.problems.append(f"output {name} exists in one model only")
                    continue
                compare("output", name, got, want, world_size, rank)
            matched = set()
            for name, got in result["params"].items():
                ref_name = _match_name(name, reference["params"])
                if ref_name is None:
                    report.problems.append(f"parameter {name} of the parallel model has no counterpart in the original")
                    continue
                matched.add(ref_name)
                compare("param", ref_name, got, reference["params"][ref_name], world_size, rank)
            for name in sorted(set(reference["params"]) - matched):
                report.problems.append(f"parameter {name} of the original is missing from the parallel model")
            for name, want in reference["inputs"].items():
                compare("input", name, result["inputs"].get(name), want, world_size, rank)
    report.problems = list(dict.fromkeys(report.problems))
    if not report.ok:
        worst = report.failures[0] if report.failures else None
        head = (f"{worst.kind} {worst.name} differs from the original by {worst.error:.3g} (tolerance "
                f"{worst.tolerance:.3g}, max |original| {worst.scale:.3g}) at world size {worst.world_size}, rank "
                f"{worst.rank}" if worst else report.problems[0])
        raise ParallelCheckError(f"check_parallel: {head}\n{report}", report)
    return report
