"""A world that torchrun starts again (``--max-restarts``) joins its process group afresh through
:func:`winsp.comm.group.init_world_from_env`: torchrun keeps one store for all its attempts, and without a namespace of
the attempt's own, the second world's gloo connected to the first world's dead ranks ("Connection refused")."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: every rank: join, all-reduce; rank 1 of the first attempt then dies, so that torchrun starts the world again. In the
#: second attempt rank 0 joins late (as serve's rank 0 does, it binds its HTTP socket first): rank 1 reads rank 0's
#: address before rank 0 has written it again
RANK_SCRIPT = """
import os, sys, time
import torch
import torch.distributed as dist
from winsp.comm.group import init_world_from_env, shutdown_world

attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
if attempt != "0" and os.environ["RANK"] == "0":
    time.sleep(3)
rank, size, started = init_world_from_env("cpu", timeout_s=60)
total = torch.ones(1)
dist.all_reduce(total)
print(f"attempt {attempt} rank {rank}: {total.item():.0f} of {size}", flush=True)
if attempt == "0":  # rank 1 dies; rank 0 waits until torchrun stops it
    os._exit(3) if rank == 1 else time.sleep(120)
shutdown_world()
"""


def test_a_world_torchrun_starts_again_joins_its_own_process_group(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    for name in ("RANK", "WORLD_SIZE", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           "--max-restarts=1", str(script)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=240)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    for rank in (0, 1):
        assert f"attempt 1 rank {rank}: 2 of 2" in out, out
    assert "Connection refused" not in out, out
