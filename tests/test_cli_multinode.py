"""``restore`` across machines: two torchrun agents (``--nnodes 2``, c10d rendezvous on 127.0.0.1) on this host stand
in for two nodes; with ``--sp-size 2`` the window-SP group spans both, and the output equals the single-node run."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest

av = pytest.importorskip("av")

from tests.test_cli import REPO, make_mp4, probe, run_cli  # noqa: E402

RUN_TIMEOUT = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _frames(path) -> np.ndarray:
    with av.open(str(path)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])


@pytest.mark.slow
@pytest.mark.multirank
def test_two_nodes_sp_2_equal_one_node(tmp_path):
    src = make_mp4(tmp_path / "in.mp4", t=5, h=48, w=64, fps=Fraction(12))
    one_node, two_nodes = tmp_path / "one_node.mp4", tmp_path / "two_nodes.mp4"
    args = ["restore", src, "--sp-size", "2", "--crf", "0", "--quiet"]
    single = run_cli(*args, "-o", one_node, nproc=2)
    assert single.returncode == 0, single.stderr

    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
             "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
             "--rdzv-id", "winsp-two-nodes", "-m", "examples.seedvr2", *map(str, args), "-o", str(two_nodes)],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for node in (0, 1)
    ]
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=RUN_TIMEOUT))
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    for agent, (_, err) in zip(agents, outputs):
        assert agent.returncode == 0, err
    summaries = [line for _, err in outputs for line in err.splitlines() if "SP 2" in line]
    assert len(summaries) == 1  # one writer (global rank 0), whichever agent it runs under
    assert probe(two_nodes) == (5, 48, 64, Fraction(12))
    # the same ranks doing the same work in the same order: the same bytes, whatever the machines
    assert np.array_equal(_frames(one_node), _frames(two_nodes))
