"""Fuzzing campaigns share one example database: the wiring ``make fuzz`` relies on.

Several HypoFuzz workers (on one machine or several) find and replay failures
through the Hypothesis example database named by ``$KVCACHE_FUZZ_DB`` (the
``fuzz`` profile of tests/conftest.py). This test plays two workers on
loopback with plain Hypothesis (HypoFuzz itself is an optional extra): worker
A fuzzes ``tests/fuzz/targets.py`` against a planted bug and saves the failing
example to a shared ``DirectoryBasedExampleDatabase``; worker B, generating
nothing, replays that example from the database and fails the same way; a
worker with an empty database has nothing to replay, and once the bug is
"fixed" (the subject is kvcache) the saved example passes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLANTED = "conformance.mutants:FreeInAllocationOrder"


def worker(database: Path, subject: str, phases: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "HYPOTHESIS_PROFILE": "fuzz",
        "KVCACHE_FUZZ_DB": str(database),
        "KVCACHE_FUZZ_IMPL": subject,
        "KVCACHE_FUZZ_PHASES": phases,
        "PYTHONHASHSEED": "0",
        "PYTHONPATH": str(ROOT / "tests"),
    }
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-rs",
        "tests/fuzz/targets.py",
        "-k",
        "random_scheduler",
    ]
    return subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=300
    )


def test_two_workers_share_failures_through_the_database(tmp_path: Path) -> None:
    shared = tmp_path / "shared-db"
    found = worker(shared, PLANTED, "generate")
    assert found.returncode == 1, found.stdout[-3000:]
    assert "diverges from spec" in found.stdout
    assert any(shared.rglob("*")), "worker A saved nothing to the shared database"

    replayed = worker(shared, PLANTED, "reuse")
    assert replayed.returncode == 1, replayed.stdout[-3000:]
    assert "diverges from spec" in replayed.stdout

    empty = worker(tmp_path / "empty-db", PLANTED, "reuse")
    assert empty.returncode == 0, empty.stdout[-3000:]
    assert "run no test cases" in empty.stdout

    fixed = worker(shared, "kvcache", "reuse")
    assert fixed.returncode == 0, fixed.stdout[-3000:]
    assert "1 passed" in fixed.stdout
