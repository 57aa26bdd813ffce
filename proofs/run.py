"""Check every property of ``proofs/manifest.py`` within a fixed time budget.

    python -m proofs.run [--budget-s 330] [--jobs 2] [--only SUBSTRING]

Each property runs in its own subprocess (``crosshair check``, ``crosshair
diffbehavior``, ``python -m proofs.exhaustive``), ``--jobs`` at a time, and prints
one line as it finishes:

    proved          CrossHair covered every path, or the exhaustive search reached
                    its minimum depth (or every reachable state) without a difference;
    counterexample  a contract fails, the twins differ, or kvcache and spec diverge;
    timed out       the budget ran out first (no counterexample found so far);
    error           the check itself could not run (an import error, a crash).

The exit status is 1 if any property has a counterexample or an error, else 0:
a timeout never fails the run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from proofs.manifest import CONTRACTS, EXHAUSTIVE, PAIRS

ROOT = Path(__file__).resolve().parent.parent
PROVED, COUNTEREXAMPLE, TIMED_OUT, ERROR = "proved", "counterexample", "timed out", "error"
FAILING = (COUNTEREXAMPLE, ERROR)
PER_PATH_TIMEOUT_S = 2.0
MAX_UNINTERESTING_ITERATIONS = 50
STARTUP_S = 15.0
"""Wall-clock allowance per subprocess on top of its CPU budget (start-up, imports)."""


@dataclass(frozen=True)
class Outcome:
    """The verdict on one property."""

    status: str
    detail: str = ""
    """A short qualifier for the line (conditions proved, depth reached)."""
    evidence: str = ""
    """The counterexample or error output, printed indented below the line."""


@dataclass(frozen=True)
class Property:
    """One check: a command, its wall-clock limit and how to read its output."""

    kind: str
    name: str
    command: list[str]
    limit_s: float
    judge: Callable[[int, str], Outcome]


def num_conditions(target: str) -> int:
    """How many ``post:`` lines the target's docstring has (CrossHair checks each)."""
    module_name, _, attr = target.rpartition(".")
    doc: str = getattr(importlib.import_module(module_name), attr).__doc__ or ""
    return max(1, sum(line.strip().startswith("post:") for line in doc.splitlines()))


def judge_contract(rc: int, output: str) -> Outcome:
    """Read ``crosshair check --report_all``."""
    errors = [line for line in output.splitlines() if ": error: " in line]
    if errors:
        return Outcome(COUNTEREXAMPLE, evidence="\n".join(errors))
    if rc != 0:
        return Outcome(ERROR, evidence=output.strip()[-2000:])
    confirmed = output.count("Confirmed over all paths")
    unmet = output.count("Unable to meet precondition")
    total = confirmed + output.count("Not confirmed") + unmet
    if total == 0:
        return Outcome(ERROR, evidence=output.strip()[-2000:] or "no condition was checked")
    if confirmed == total:
        return Outcome(PROVED, f"{total}/{total} conditions on all paths")
    detail = f"{confirmed}/{total} conditions on all paths, no counterexample"
    if unmet:
        detail += f"; precondition never met for {unmet}"
    return Outcome(TIMED_OUT, detail)


def judge_pair(rc: int, output: str) -> Outcome:
    """Read ``crosshair diffbehavior``."""
    if rc == 1 and "Given:" in output:
        return Outcome(COUNTEREXAMPLE, evidence=output.strip())
    if rc != 0:
        return Outcome(ERROR, evidence=output.strip()[-2000:])
    match = re.search(r"attempted (\d+) iterations", output)
    iterations = f"{match.group(1)} iterations" if match else "no iteration count"
    if "All paths exhausted" in output:
        return Outcome(PROVED, f"all paths exhausted, {iterations}")
    return Outcome(TIMED_OUT, f"no difference in {iterations}")


def judge_exhaustive(rc: int, output: str) -> Outcome:
    """Read ``python -m proofs.exhaustive``."""
    lines = output.strip().splitlines()
    total = re.search(r"TOTAL depth (\d+) states (\d+) calls (\d+)", output)
    if rc == 1 and total:
        return Outcome(COUNTEREXAMPLE, evidence="\n".join(lines[:-1]))
    if rc != 0 or not total:
        return Outcome(ERROR, evidence=output.strip()[-2000:])
    depth, states, calls = (int(g) for g in total.groups())
    detail = f"depth {depth}, {states} distinct states, {calls} calls"
    evidence = "\n".join(lines[:-1])
    if depth >= EXHAUSTIVE.min_depth or all("exhausted" in line for line in lines[:-1]):
        return Outcome(PROVED, detail, evidence)
    return Outcome(TIMED_OUT, detail, evidence)


def properties(exhaustive_budget_s: float) -> list[Property]:
    """Every property of the manifest, the longest first (so they start first)."""
    crosshair = [sys.executable, "-m", "crosshair"]
    found: list[Property] = []
    if exhaustive_budget_s > 0:
        found.append(Property(
            "exhaustive", "kvcache == spec on every call sequence",
            [sys.executable, "-m", "proofs.exhaustive", str(exhaustive_budget_s)],
            exhaustive_budget_s + 60.0, judge_exhaustive))
    for contract in CONTRACTS:
        cpu_s = contract.budget_s * num_conditions(contract.target)
        found.append(Property(
            "contract", contract.target,
            [*crosshair, "check", "--report_all", f"--per_path_timeout={PER_PATH_TIMEOUT_S}",
             f"--per_condition_timeout={contract.budget_s}", contract.target],
            2 * cpu_s + STARTUP_S, judge_contract))
    for pair in PAIRS:
        found.append(Property(
            "diffbehavior", f"{pair.oracle} ~ {pair.subject}",
            [*crosshair, "diffbehavior", f"--per_path_timeout={PER_PATH_TIMEOUT_S}",
             f"--max_uninteresting_iterations={MAX_UNINTERESTING_ITERATIONS}",
             f"--per_condition_timeout={pair.budget_s}",
             f"proofs.pairs.{pair.name}__oracle", f"proofs.pairs.{pair.name}__subject"],
            2 * pair.budget_s + STARTUP_S, judge_pair))
    return sorted(found, key=lambda p: -p.limit_s)


def run_property(prop: Property, deadline: float) -> tuple[Outcome, float]:
    """Run one property's subprocess until it ends, its limit or the run's deadline."""
    start = time.monotonic()
    limit = min(prop.limit_s, deadline - start)
    if limit <= 1:
        return Outcome(TIMED_OUT, "not started: the run's budget was spent"), 0.0
    env = {**os.environ, "PYTHONHASHSEED": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen(prop.command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the whole session: crosshair's workers too
        process.communicate()
        return Outcome(TIMED_OUT, f"stopped after {limit:.0f}s"), time.monotonic() - start
    return prop.judge(process.returncode, output), time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    """Run the properties; print a line each and a summary; 1 on any failure."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-s", type=float, default=330.0,
                        help="wall seconds for the whole run (default 330)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="properties checked at once (default 2)")
    parser.add_argument("--exhaustive-s", type=float, default=EXHAUSTIVE.budget_s,
                        help=f"wall seconds of the exhaustive search, 0 to skip "
                             f"(default {EXHAUSTIVE.budget_s:.0f})")
    parser.add_argument("--only", default="",
                        help="check only the properties whose name contains this")
    args = parser.parse_args(argv)

    start = time.monotonic()
    deadline = start + args.budget_s
    selected = [p for p in properties(args.exhaustive_s) if args.only in p.name]
    counts: dict[str, int] = {}
    lock = threading.Lock()

    def check(prop: Property) -> None:
        outcome, seconds = run_property(prop, deadline)
        with lock:
            counts[outcome.status] = counts.get(outcome.status, 0) + 1
            detail = f" ({outcome.detail})" if outcome.detail else ""
            print(f"{outcome.status:<15} {prop.kind:<13} {prop.name}{detail} [{seconds:.0f}s]")
            if outcome.evidence and (outcome.status in FAILING or prop.kind == "exhaustive"):
                print("\n".join(f"    {line}" for line in outcome.evidence.splitlines()))
            sys.stdout.flush()

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for future in [pool.submit(check, prop) for prop in selected]:
            future.result()
    summary = ", ".join(f"{counts.get(s, 0)} {s}" for s in (PROVED, TIMED_OUT, COUNTEREXAMPLE,
                                                            ERROR))
    print(f"{len(selected)} properties in {time.monotonic() - start:.0f}s: {summary}")
    return 1 if any(counts.get(s) for s in FAILING) else 0


if __name__ == "__main__":
    sys.exit(main())
