"""What a newcomer meets first: `make setup`'s environment has what the documented commands need."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvcache.kit.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_simulate_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`simulate --plot` is documented, so the dev environment must carry matplotlib."""
    plot = tmp_path / "usage.png"
    code = main(["simulate", "--workload", "chat", "--requests", "12", "--rows", "1",
                 "--plot", str(plot)])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "not installed" not in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_dev_extra_lists_matplotlib() -> None:
    """`make setup` installs the dev extra only: the plot's dependency must be in it."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    dev = re.search(r"^dev = \[(.*?)\]", pyproject, re.MULTILINE | re.DOTALL)
    assert dev is not None and '"matplotlib"' in dev.group(1)


def test_typecheck_target_installs_what_mypy_reads() -> None:
    """mypy reads torch, numpy and vLLM's types: `make typecheck` needs the reference layer."""
    makefile = (ROOT / "Makefile").read_text()
    rule = re.search(r"^typecheck: (.*)$", makefile, re.MULTILINE)
    assert rule is not None and "$(REF_STAMP)" in rule.group(1)
