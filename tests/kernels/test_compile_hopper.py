"""The kernels compile for Hopper (sm_90) with Triton's real compiler.

The interpreter runs code the GPU compiler rejects (``tl.dot`` with a dim
below 16, mismatched types across branches, ...). ``compile_for_hopper.py``
lowers every kernel to a cubin without a GPU; it runs in a subprocess because
this process runs Triton in interpreter mode.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("compile_for_hopper.py")
REPO_ROOT = Path(__file__).resolve().parents[2]


def test_kernels_compile_for_sm90() -> None:
    env = dict(os.environ, TRITON_INTERPRET="0")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, str(SCRIPT)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all kernels compile for sm_90" in result.stdout
