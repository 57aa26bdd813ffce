"""The kit judges an implementation against the oracle without torch or vLLM.

``make setup`` (and ``pip install kvcache``) installs neither: a user fuzzing
their own manager against ``spec`` must not need them. Here torch and vLLM are
made unimportable in a subprocess (``sys.modules[name] = None``) and ``fuzz``
must still run every family the default profile builds, drawing no prompt
embeddings (the one request field that needs torch), and find a planted bug.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

BLOCKED = """
import sys
for name in ("torch", "vllm", "triton"):
    sys.modules[name] = None  # import fails, find_spec says it is not there
from kvcache.kit import driver
assert not driver.PROMPT_EMBEDS_DRAWN
from kvcache.kit.cli import main
sys.exit(main(sys.argv[1:]))
"""


def fuzz_without_torch(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m kvcache fuzz ARGS`` with torch, vLLM and triton unimportable."""
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    return subprocess.run(
        [sys.executable, "-c", BLOCKED, "fuzz", *args], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=300, check=False,
    )


def test_fuzz_against_the_oracle_without_torch() -> None:
    """Every family, no embeddings drawn, kvcache equals spec: exit 0."""
    result = fuzz_without_torch("--impl", "kvcache", "--sequences", "30")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "no divergence" in output
    assert "torch" not in output.lower().replace("without torch", "")


def test_planted_bug_found_without_torch(tmp_path: Path) -> None:
    """The README's example manager is caught and shrunk without torch too."""
    out = tmp_path / "cex.jsonl"
    result = fuzz_without_torch(
        "--impl", "examples.mymanager:MyManager", "--sequences", "200", "--out", str(out)
    )
    assert result.returncode == 1, (result.stdout + result.stderr)[-3000:]
    assert out.exists()
