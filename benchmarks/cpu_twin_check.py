"""The planner's CPU twin (examples/seedvr2/memory/cpu_twin.py) against measured peak RSS, on two configurations.

    python benchmarks/cpu_twin_check.py            # both configurations, each in fresh processes (real, then twin)

``dit``: the SeedVR2 3B architecture at real width (2560, 20 heads x 128) with 4 layers, float32, one forward over a
latent of 3 x 48 x 64 (SP = 1). ``vae``: the released VAE widths, float32, decode of a 2 x 32 x 32 latent (5 frames of
256 x 256) in temporal chunks of 4. Prints the measured peak RSS (``ru_maxrss`` of a process that builds the model with
random weights and runs the stage), the twin's prediction (its process's RSS before the stage plus the traced peak of
live fake bytes) and their ratio.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _stage(name: str):
    import torch

    if name == "dit":
        from examples.seedvr2.models.dit import NaDiTConfig, SeedVR2NaDiT

        cfg = NaDiTConfig.seedvr2_at_size(vid_dim=2560, txt_in_dim=5120, heads=20, head_dim=128, num_layers=4,
                                          mm_layers=2, rope_dim=128)
        model = SeedVR2NaDiT(cfg).eval()
        t, h, w = 3, 48, 64
        vid = torch.randn(t * h * w, cfg.vid_in_channels)
        txt = torch.randn(58, cfg.txt_in_dim)
        from winsp.utils.phases import planning_phase

        with planning_phase("request shapes"):  # host values (real tensors under the twin too)
            shapes = torch.tensor([[t, h, w]]), torch.tensor([[58]])
        with torch.no_grad():
            return tuple(model(vid, txt, *shapes, torch.full((1,), 1000.0)).shape)
    from examples.seedvr2.models.vae import CausalVideoVAE, VideoVAEConfig

    vae = CausalVideoVAE(VideoVAEConfig.seedvr2()).eval()
    vae.set_temporal_chunking(4)
    with torch.no_grad():
        return tuple(vae.decode(torch.randn(1, 16, 2, 32, 32)).shape)


def child(name: str, twin: bool) -> dict:
    import torch  # noqa: F401 - imported before the baseline, as in the real run

    import examples.seedvr2.models.dit  # noqa: F401
    import examples.seedvr2.models.vae  # noqa: F401

    if twin:
        from examples.seedvr2.memory.cpu_twin import trace_on_cpu

        trace = trace_on_cpu(lambda: _stage(name))
        return {"shape": trace.result, "baseline_rss": trace.baseline_rss, "traced_peak": trace.peak_bytes,
                "predicted_rss": trace.predicted_rss}
    shape = _stage(name)
    return {"shape": shape, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main() -> int:
    rows = []
    for name in ("dit", "vae"):
        out = {}
        for twin in (False, True):
            run = subprocess.run([sys.executable, __file__, "--child", name, "twin" if twin else "real"],
                                 capture_output=True, text=True, cwd=ROOT)
            if run.returncode:
                print(run.stderr[-2000:], file=sys.stderr)
                return 1
            out.update(json.loads(run.stdout.strip().splitlines()[-1]))
        ratio = out["predicted_rss"] / out["peak_rss"]
        rows.append(f"| {name} | {out['peak_rss'] / 2**30:.2f} GiB | {out['predicted_rss'] / 2**30:.2f} GiB "
                    f"(baseline {out['baseline_rss'] / 2**30:.2f} + traced {out['traced_peak'] / 2**30:.2f}) "
                    f"| {ratio:.2f} |")
    print("| configuration | measured peak RSS | twin's prediction | ratio |\n|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], sys.argv[3] == "twin")))
        sys.exit(0)
    sys.exit(main())
