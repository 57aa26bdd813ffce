"""The README's kit commands run as printed, with the results the README promises.

Each line of the README's "The kit in ten lines" block runs in a subprocess from a
scratch directory that holds the repository's ``tests`` and ``examples`` (so the
files the commands write land there, not in the checkout). The example manager's
planted bug must be found (exit 1, a counterexample that replays as a
divergence), the recorded vLLM traces must show it too, and the other commands
must succeed. Lines naming vLLM need the reference layer (skipped locally without
it, a failure under CI: the ``vllm_reference`` fixture).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def readme_kit_commands() -> list[str]:
    """The ``python -m kvcache ...`` lines of the README's kit block (comments cut)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## The kit in ten lines", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block is not None, "README's kit section has no sh block"
    lines = [line.split("#", 1)[0].strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line]


# What each command must do: the exit status, and text its output must hold.
EXPECTED = {
    "fuzz --impl examples.mymanager:MyManager": (1, "DIVERGENCE: a counterexample"),
    "replay cex.jsonl": (1, "free_queue"),
    "replay tests/data/": (1, "free_queue"),
    "simulate": (0, "plot written to sim.png"),
    "effectiveness": (0, "of them expected"),
    "fuzz --impl kvcache --reference vllm": (0, "no divergence"),
    "record --impl vllm": (0, "t.jsonl.gz"),
    "bench": (0, "chat"),
}


def expected_for(command: str) -> tuple[int, str]:
    """The expectation whose key the command contains (exactly one must match)."""
    found = [value for key, value in EXPECTED.items() if f"kvcache {key}" in command]
    assert len(found) == 1, f"no single expectation for README line: {command}"
    return found[0]


def test_every_readme_kit_line_has_an_expectation() -> None:
    """A new README line needs its expected outcome here (so none goes unchecked)."""
    commands = readme_kit_commands()
    assert len(commands) == len(EXPECTED)
    for command in commands:
        assert command.startswith("python -m kvcache "), command
        expected_for(command)


def run_readme_lines(tmp_path: Path, needs_vllm: bool) -> list[str]:
    """Run the README lines that do (or do not) name vLLM, in order; their outputs."""
    (tmp_path / "tests").symlink_to(ROOT / "tests")
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = {**os.environ, "PYTHONHASHSEED": "0", "VLLM_LOGGING_LEVEL": "ERROR"}
    env.pop("KVCACHE_PURE", None)
    outputs = []
    for command in readme_kit_commands():
        if ("vllm" in command.split("#")[0]) != needs_vllm:
            continue
        argv = [sys.executable, *shlex.split(command)[1:]]
        argv = [str(p) for arg in argv for p in _glob(arg, tmp_path)]
        result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=600, check=False)
        status, text = expected_for(command)
        output = result.stdout + result.stderr
        assert result.returncode == status, f"{command}: exit {result.returncode}\n{output[-3000:]}"
        assert text in output, f"{command}: no {text!r} in its output\n{output[-3000:]}"
        outputs.append(output)
    return outputs


def _glob(arg: str, cwd: Path) -> list[str]:
    """A shell's expansion of one argument (globs only), relative to ``cwd``."""
    if "*" not in arg:
        return [arg]
    matches = sorted(str(p.relative_to(cwd)) for p in cwd.glob(arg))
    assert matches, f"{arg} matches nothing"
    return matches


def test_readme_kit_lines_without_vllm(tmp_path: Path) -> None:
    """The oracle-only lines: the planted bug is found, shrunk, replayed; simulate plots;
    the effectiveness suite's flags are the release's known ones."""
    outputs = run_readme_lines(tmp_path, needs_vllm=False)
    assert len(outputs) == 5
    assert (tmp_path / "cex.jsonl").exists() and (tmp_path / "sim.png").exists()


@pytest.mark.usefixtures("vllm_reference")
def test_readme_kit_lines_with_vllm(tmp_path: Path) -> None:
    """The lines that need the reference layer: vLLM as the judge, record, bench."""
    outputs = run_readme_lines(tmp_path, needs_vllm=True)
    assert len(outputs) == 3
    assert (tmp_path / "t.jsonl.gz").exists()
