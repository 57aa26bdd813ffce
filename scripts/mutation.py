"""Mutation testing of kvcache/*.py with mutmut (`make mutation`; docs/mutation.md).

Usage:
    python scripts/mutation.py run [--workers N] [MUTANT ...]
    python scripts/mutation.py report [--list]

``run`` without mutant names starts afresh (removes ``mutants/``), runs
``mutmut run`` with the quick test selection of ``[tool.mutmut]`` in
pyproject.toml under ``HYPOTHESIS_PROFILE=mutation``, writes mutmut's own
output to ``build/mutation.log``, prints a progress line a minute and then the
report. With mutant names it re-runs only those, keeping the other results.

``report`` reads mutmut's results (``mutants/**/*.py.meta``) and the
equivalent mutants listed in docs/mutation.md (section "Equivalent mutants",
one backquoted mutant name a line) and prints the counts and the score:
(killed + timeout) / (total - equivalent). ``--list`` also lists the
survivors that are not marked equivalent. Exit status 1 when the score is
below 90 %.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTANTS = ROOT / "mutants"
DOC = ROOT / "docs" / "mutation.md"
LOG = ROOT / "build" / "mutation.log"
TARGET_SCORE = 90.0

# The quick selection's settings (docs/mutation.md, "Test selection").
ENV_DEFAULTS = {
    "HYPOTHESIS_PROFILE": "mutation",
    "PYTHONHASHSEED": "0",
    "STATEFUL_SEED": "0",
    "KVCACHE_SOAK_STEPS": "300",
    "VLLM_LOGGING_LEVEL": "ERROR",
}

# mutmut's exit codes (mutmut/stats.py), folded into the report's columns.
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests",
          34: "skipped", 36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout",
          255: "timeout", None: "not checked"}
COLUMNS = ("killed", "timeout", "survived", "no tests", "not checked", "other")


def load_results() -> dict[str, dict[str, str]]:
    """{source file: {mutant name: status}} from mutmut's meta files."""
    results: dict[str, dict[str, str]] = {}
    for meta in sorted(MUTANTS.glob("kvcache/**/*.py.meta")):
        data = json.loads(meta.read_text())
        source = str(meta.relative_to(MUTANTS)).removesuffix(".meta")
        results[source] = {
            name: STATUS.get(code, "other") for name, code in data["exit_code_by_key"].items()
        }
    return results


def load_equivalents() -> set[str]:
    """Mutant names listed under "## Equivalent mutants" in docs/mutation.md."""
    if not DOC.exists():
        return set()
    text = DOC.read_text()
    match = re.search(r"^## Equivalent mutants\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    if match is None:
        return set()
    return set(re.findall(r"`(kvcache\.[^`\s]+__mutmut_\d+)`", match.group(1)))


def report(show_list: bool) -> int:
    results = load_results()
    if not results:
        print("mutation: no results (run `make mutation` first)")
        return 1
    equivalents = load_equivalents()
    totals: Counter[str] = Counter()
    width = max(len(s) for s in results)
    print(f"{'file':<{width}}  total  " + "  ".join(f"{c:>11}" for c in COLUMNS) + "  equivalent")
    survivors: list[str] = []
    stale: list[str] = []
    for source, mutants in results.items():
        counts = Counter(mutants.values())
        equivalent = 0
        for name, status in mutants.items():
            if name in equivalents:
                if status in ("survived", "no tests"):
                    equivalent += 1
                else:
                    stale.append(f"{name} ({status})")
            elif status in ("survived", "no tests", "other"):
                survivors.append(f"{name} ({status})")
        counts["equivalent"] = equivalent
        counts["total"] = len(mutants)
        totals.update(counts)
        print(f"{source:<{width}}  {len(mutants):>5}  "
              + "  ".join(f"{counts[c]:>11}" for c in COLUMNS) + f"  {equivalent:>10}")
    print(f"{'all':<{width}}  {totals['total']:>5}  "
          + "  ".join(f"{totals[c]:>11}" for c in COLUMNS) + f"  {totals['equivalent']:>10}")
    caught = totals["killed"] + totals["timeout"]
    scored = totals["total"] - totals["equivalent"] - totals["not checked"]
    score = 100.0 * caught / scored if scored else 0.0
    print(f"mutation score: {score:.1f} % ({caught} killed or timed out of {scored} "
          f"non-equivalent mutants; {totals['equivalent']} equivalent, "
          f"{len(survivors)} not caught, {totals['not checked']} not checked)")
    if stale:
        print("listed as equivalent in docs/mutation.md but caught (remove them there):")
        print("\n".join(f"  {s}" for s in stale))
    if show_list and survivors:
        print("not caught, not marked equivalent:")
        print("\n".join(f"  {s}" for s in survivors))
    return 0 if score >= TARGET_SCORE else 1


def run(workers: int, names: list[str]) -> int:
    # The selection is sized for the mutation profile (make exports HYPOTHESIS_PROFILE=ci);
    # the other settings may be overridden from the environment.
    env = {**ENV_DEFAULTS, **os.environ, "HYPOTHESIS_PROFILE": "mutation"}
    if not names:
        shutil.rmtree(MUTANTS, ignore_errors=True)
    LOG.parent.mkdir(exist_ok=True)
    mutmut = Path(sys.executable).parent / "mutmut"
    command = [str(mutmut), "run", "--max-children", str(workers), *names]
    print(f"mutation: mutmut {' '.join(command[1:])} ({workers} workers; "
          f"HYPOTHESIS_PROFILE={env['HYPOTHESIS_PROFILE']}; mutmut's output: {LOG})", flush=True)
    started = time.monotonic()
    with LOG.open("w") as log:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        while True:
            try:
                code = process.wait(timeout=60)
                break
            except subprocess.TimeoutExpired:
                counts = Counter(s for m in load_results().values() for s in m.values())
                done = sum(counts.values()) - counts["not checked"]
                print(f"mutation: {time.monotonic() - started:5.0f} s, {done}/"
                      f"{sum(counts.values())} checked ({counts['killed']} killed, "
                      f"{counts['survived']} survived)", flush=True)
    minutes = (time.monotonic() - started) / 60
    if code != 0:
        print(LOG.read_text(errors="replace")[-3000:])
        print(f"mutation: mutmut failed (exit {code}) after {minutes:.1f} min; log: {LOG}")
        return code
    print(f"mutation: mutmut finished in {minutes:.1f} min")
    return report(show_list=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser("run", help="run mutmut, then report")
    run_parser.add_argument("--workers", type=int, default=2)
    run_parser.add_argument("mutants", nargs="*", help="re-run only these mutants")
    report_parser = sub.add_parser("report", help="counts and score of the last run")
    report_parser.add_argument("--list", action="store_true", help="list the survivors")
    args = parser.parse_args()
    if args.command == "run":
        return run(args.workers, args.mutants)
    return report(args.list)


if __name__ == "__main__":
    sys.exit(main())
