"""``examples.swin3d.import_torchvision``: a working torchvision imports untouched (no duplicate op registration, which
aborts the process), a CPU torch beside the CUDA torchvision wheel gets the shim, and afterwards user code's own
``import torchvision`` and ``from transformers import Swinv2Model`` work. Each case runs in a fresh interpreter: an
abort would kill pytest itself, and the import state is per process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, code: str, extra_path: Path | None = None) -> subprocess.CompletedProcess:
    script = tmp_path / "user_code.py"
    script.write_text(textwrap.dedent(code))
    path = [str(p) for p in (extra_path, ROOT) if p is not None]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=ROOT,
                          env=env)


def _fake_torchvision(tmp_path: Path, body: str) -> Path:
    package = tmp_path / "site" / "torchvision"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(body))
    return package.parent


def test_a_torchvision_whose_extension_registers_nms_imports_without_the_shim(tmp_path):
    # Stands in for a torchvision matching its torch: the import itself defines torchvision::nms / qnms, as the C
    # extension does. Declaring them first (the old behaviour) makes this definition a duplicate.
    site = _fake_torchvision(tmp_path, """
        import torch
        _lib = torch.library.Library("torchvision", "FRAGMENT")
        _lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        MATCHING = True
        """)
    run = _run(tmp_path, """
        import examples.swin3d.load_torchvision as loader
        tv = loader.import_torchvision()
        import torchvision
        assert tv is torchvision and torchvision.MATCHING
        assert loader._LIBRARY is None, "a working import must not declare any schema"
        print("ok")
        """, extra_path=site)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "ok"


def test_an_unrelated_import_error_is_not_shimmed(tmp_path):
    site = _fake_torchvision(tmp_path, """
        raise RuntimeError("torchvision is broken in some other way")
        """)
    run = _run(tmp_path, """
        import examples.swin3d.load_torchvision as loader
        try:
            loader.import_torchvision()
        except RuntimeError as error:
            assert "some other way" in str(error)
            assert loader._LIBRARY is None
            print("raised")
        """, extra_path=site)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "raised"


def test_user_code_imports_torchvision_and_transformers_after_the_one_liner(tmp_path):
    """The documented one-liner, then the user's own imports, on whatever torchvision this environment has: the shim
    is used exactly when torchvision's C ops did not load."""
    pytest.importorskip("transformers")
    run = _run(tmp_path, """
        from examples.swin3d import import_torchvision; import_torchvision()
        import torchvision
        from torchvision.models.video import swin3d_t
        from transformers import Swinv2Config, Swinv2Model
        import examples.swin3d.load_torchvision as loader
        has_ops = torchvision.extension._has_ops()
        assert (loader._LIBRARY is None) == has_ops, (has_ops, loader._LIBRARY)
        swin3d_t(), Swinv2Model(Swinv2Config(image_size=32, patch_size=4, embed_dim=8, depths=[1], num_heads=[1]))
        print("shimmed" if not has_ops else "as is")
        """)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() in ("shimmed", "as is")


@pytest.mark.slow  # the default run's budget
def test_swinv2_import_goes_through_the_same_loader(tmp_path):
    pytest.importorskip("transformers")
    run = _run(tmp_path, """
        from examples.swinv2.hf_import import import_swinv2
        Swinv2Config, Swinv2Model = import_swinv2()
        import sys
        assert "torchvision" in sys.modules
        print(Swinv2Model.__name__)
        """)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "Swinv2Model"
