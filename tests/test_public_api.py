"""The names the README uses are reachable from ``import fxrec`` alone."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_subpackages_and_exports_are_attributes_of_a_fresh_import() -> None:
    """In a fresh interpreter (nothing imported a subpackage yet): ``fxrec.distributed.shard``
    and the like, as the README writes them."""
    code = (
        "import fxrec\n"
        "fxrec.distributed.clip_grad_norm_, fxrec.distributed.shard\n"
        "fxrec.nn.EmbeddingBagCollection, fxrec.train.TrainPipelineSparseDist\n"
        "fxrec.sparse.KeyedJaggedTensor, fxrec.combine_inputs\n"
        "assert 'distributed' in dir(fxrec)\n"
        "try:\n"
        "    fxrec.nothing\n"
        "except AttributeError as e:\n"
        "    assert \"no attribute 'nothing'\" in str(e)\n"
        "else:\n"
        "    raise SystemExit('fxrec.nothing did not raise')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_import_fxrec_stays_cheap() -> None:
    """``import fxrec`` loads no subpackage (nor torch.distributed's collection) by itself."""
    code = "import sys, fxrec; print(sorted(m for m in sys.modules if m.startswith('fxrec.')))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("name", ["combine_inputs", "optimize", "count_kernels"])
def test_exports_are_documented(name: str) -> None:
    import fxrec

    assert name in fxrec.__all__
    assert getattr(fxrec, name).__doc__
