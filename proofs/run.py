"""Check every property of ``proofs/manifest.py``; the verdicts depend on no clock.

    python -m proofs.run [--jobs 2] [--only SUBSTRING]

Every property is decided by counts (``proofs/bounded.py``, ``proofs/exhaustive.py``):
CrossHair's paths, the inputs of an enumeration, the search depth. So the same commit
prints the same verdict table on an idle or a loaded machine; only the seconds on
the summary line differ. About 3 minutes on 2 idle cores. Each property ends with one of

    proved          CrossHair covered every path (contracts, pairs);
    exhausted       a deterministic enumeration covered its stated input domain
                    where CrossHair did not exhaust within its path cap, or the
                    exhaustive search reached each layout's depth (stated, with the
                    states and calls it took) without a difference;
    counterexample  a contract fails, the twins differ, or kvcache and spec diverge;
    error           the check itself could not run (an import error, a crash, or
                    the safety limit below: the bounds then need resizing).

The exhaustive search is one process; the CrossHair checks are split over
``--jobs - 1`` workers (at least one), each running its checks one after another,
each check in a fresh process, so no check's exploration depends on another's. Each process
has a generous wall-clock safety limit that no run of a correctly sized manifest comes
near: for the exhaustive search (``SAFETY_S``) reaching it is an error, never a verdict;
a CrossHair check past ``CHECK_SAFETY_S`` (CrossHair's search is not always
reproducible: one pair was seen to run for minutes once, seconds otherwise) is decided
by its enumeration alone, so a stuck search costs time, never the verdict's soundness.

The exit status is 1 if any property has a counterexample or an error, else 0.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from proofs.manifest import CONTRACTS, EXHAUSTIVE, PAIRS

ROOT = Path(__file__).resolve().parent.parent
PROVED, EXHAUSTED, COUNTEREXAMPLE, ERROR = "proved", "exhausted", "counterexample", "error"
FAILING = (COUNTEREXAMPLE, ERROR)
SMT_RLIMIT = 1_000_000
"""z3 work per solver check (``CROSSHAIR_SMT_RLIMIT``): a count, where CrossHair's
default is a wall-clock timeout. Far above what these functions' queries take."""
EXHAUSTIVE_NAME = "kvcache == spec on every call sequence"
SAFETY_S = 1500.0
"""Wall seconds after which the exhaustive search is stopped (an error: resize the bounds)."""
CHECK_SAFETY_S = 180.0
"""Wall seconds after which one CrossHair check's process is stopped. A check takes
seconds; one that passes this (CrossHair's search is not always reproducible) is
decided by its enumeration alone, so it can end ``exhausted``, never ``error``."""


@dataclass(frozen=True)
class Line:
    """One row of the verdict table."""

    status: str
    kind: str
    name: str
    detail: str = ""
    evidence: str = ""

    def text(self) -> str:
        """The row, and the evidence of a failure indented below it."""
        detail = f" ({self.detail})" if self.detail else ""
        row = f"{self.status:<15} {self.kind:<13} {self.name}{detail}"
        if self.evidence:
            row += "\n" + "\n".join(f"    {line}" for line in self.evidence.splitlines())
        return row


def environment() -> dict[str, str]:
    """The checks' environment: the repo importable, hashing and z3 deterministic."""
    return {**os.environ, "PYTHONHASHSEED": "0", "CROSSHAIR_SMT_RLIMIT": str(SMT_RLIMIT),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                        os.environ.get("PYTHONPATH")]))}


def run_process(command: list[str], limit_s: float = SAFETY_S,
                extra_env: dict[str, str] | None = None) -> tuple[int | None, str]:
    """Run ``command`` to its end or ``limit_s``; ``(returncode or None, stdout)``."""
    # stderr passes through: each check's seconds, no part of the verdict table.
    process = subprocess.Popen(command, cwd=ROOT, env={**environment(), **(extra_env or {})},
                               stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the whole session: crosshair's workers too
        output, _ = process.communicate()
        return None, output
    return process.returncode, output


def exhaustive() -> list[Line]:
    """``python -m proofs.exhaustive``: one row for all layouts, each layout below."""
    name = EXHAUSTIVE_NAME
    rc, output = run_process([sys.executable, "-m", "proofs.exhaustive"])
    lines = output.strip().splitlines()
    total = re.search(r"TOTAL depth (\d+) states (\d+) calls (\d+)", output)
    if rc is None:
        return [Line(ERROR, "exhaustive", name, f"stopped after the {SAFETY_S:.0f}s safety limit",
                     output.strip())]
    if rc not in (0, 1) or not total:
        return [Line(ERROR, "exhaustive", name, evidence=output.strip()[-2000:])]
    depth, states, calls = (int(g) for g in total.groups())
    evidence = "\n".join(lines[:-1])
    if rc == 1:
        return [Line(COUNTEREXAMPLE, "exhaustive", name, evidence=evidence)]
    if depth < EXHAUSTIVE.min_depth:
        return [Line(ERROR, "exhaustive", name,
                     f"a layout's depth {depth} is below the least {EXHAUSTIVE.min_depth}",
                     evidence)]
    return [Line(EXHAUSTED, "exhaustive", name,
                 f"each layout to depth >= {depth}: {states} states, {calls} calls", evidence)]


def checks() -> list[tuple[str, str, int, int]]:
    """Every CrossHair check of the manifest, in its order."""
    return ([("contract", c.target, c.max_iterations, c.max_cases) for c in CONTRACTS]
            + [("pair", p.name, p.max_iterations, p.max_cases) for p in PAIRS])


def crosshair_worker(batch: list[tuple[str, str, int, int]]) -> list[Line]:
    """``python -m proofs.bounded``, a fresh process per check of ``batch`` (no check
    sees another's interpreter history); a row per check."""
    return [row for check in batch for row in crosshair_check([check])]


def crosshair_check(batch: list[tuple[str, str, int, int]]) -> list[Line]:
    """``python -m proofs.bounded`` over ``batch`` in one process; a row per check."""
    command = [sys.executable, "-m", "proofs.bounded", json.dumps(batch)]
    rc, output = run_process(command, CHECK_SAFETY_S)
    if rc is None:  # past the safety limit: the enumeration alone decides
        print(f"{batch}: CrossHair passed {CHECK_SAFETY_S:.0f}s; enumerating", file=sys.stderr)
        rc, output = run_process(command, SAFETY_S, {"PROOFS_ENUMERATE_ONLY": "1"})
    rows: dict[tuple[str, str], Line] = {}
    for text in output.splitlines():
        if text.startswith("{"):
            verdict = json.loads(text)
            kind = "contract" if verdict["kind"] == "contract" else "diffbehavior"
            rows[(verdict["kind"], verdict["name"])] = Line(
                verdict["status"], kind, verdict["name"], verdict["detail"],
                verdict["evidence"] if verdict["status"] in FAILING else "")
    why = (f"stopped after the {SAFETY_S:.0f}s safety limit" if rc is None
           else "not reached: the worker ended first")
    result = []
    for kind, name, _, _ in batch:
        label = name if kind == "contract" else f"pair {name}"
        result.append(rows.get((kind, label)) or Line(
            ERROR, "contract" if kind == "contract" else "diffbehavior", label, why,
            output.strip()[-2000:] if rc not in (0, None) else ""))
    return result


def main(argv: list[str] | None = None) -> int:
    """Run the properties; print the verdict table and a summary; 1 on any failure."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="processes at once: the exhaustive search and jobs - 1 "
                             "CrossHair workers (default 2)")
    parser.add_argument("--only", default="",
                        help="check only the properties whose name contains this")
    parser.add_argument("--no-exhaustive", action="store_true",
                        help="skip the exhaustive search")
    args = parser.parse_args(argv)

    start = time.monotonic()
    selected = [c for c in checks() if args.only in c[1]]
    num_workers = max(1, args.jobs - 1)
    batches = [selected[i::num_workers] for i in range(num_workers)]
    run_exhaustive = not args.no_exhaustive and args.only in EXHAUSTIVE_NAME
    with concurrent.futures.ThreadPoolExecutor(max_workers=num_workers + 1) as pool:
        search = pool.submit(exhaustive) if run_exhaustive else None
        workers = [pool.submit(crosshair_worker, batch) for batch in batches if batch]
        by_name = {row.name: row for future in workers for row in future.result()}
        rows = [by_name[name if kind == "contract" else f"pair {name}"]
                for kind, name, _, _ in selected]
        if search is not None:
            rows = search.result() + rows
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.status] = counts.get(row.status, 0) + 1
        print(row.text())
    summary = ", ".join(f"{counts.get(s, 0)} {s}" for s in (PROVED, EXHAUSTED, COUNTEREXAMPLE,
                                                            ERROR))
    print(f"{len(rows)} properties in {time.monotonic() - start:.0f}s: {summary}")
    return 1 if any(counts.get(s) for s in FAILING) else 0


if __name__ == "__main__":
    sys.exit(main())
