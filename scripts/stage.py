#!/usr/bin/env python3
"""Run one ``make verify`` stage quietly and print ONE summary line.

Usage: ``scripts/stage.py STAGE -- COMMAND...``, STAGE one of lint, typecheck, tests,
tests-compiled, upstream, upstream-compiled, proofs, proofs-compiled, check-0.33,
conformance-0.33, upstream-0.33, upstream-0.33-compiled, conformance-0.33-compiled,
wheel-check, effectiveness.

The command's full output goes to ``build/<stage>.log``; on failure its tail is
printed above the summary line. The line and the stage's time are appended to
``build/verify-stages.jsonl``, which ``scripts/figures.py`` renders into
``docs/figures.md``. The exit status is the command's (pytest's
"no tests ran", 5, counts as a failure).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TAIL_LINES = 60


def summarise(stage: str, output: str, rc: int, seconds: float) -> str:
    if stage == "lint":
        if rc == 0:
            return "lint: ok"
        found = re.search(r"Found (\d+) errors?", output)
        return f"lint: FAILED ({found.group(1) if found else '?'} problems)"
    if stage == "typecheck":
        files = re.search(r"no issues found in (\d+) source files?", output)
        if rc == 0:
            return f"typecheck: ok ({files.group(1) if files else '?'} files)"
        errors = re.search(r"Found (\d+) errors? in (\d+) files?", output)
        detail = f"{errors.group(1)} errors in {errors.group(2)} files" if errors else f"rc={rc}"
        return f"typecheck: FAILED ({detail})"
    if stage in ("tests", "tests-compiled"):
        counts = dict.fromkeys(("passed", "failed", "errors", "skipped"), 0)
        closing = r"\d+ (passed|failed|errors?|skipped|deselected)\b.* in [\d.]+s"
        final = [line for line in output.splitlines() if re.search(closing, line)]
        if final:
            for number, word in re.findall(r"(\d+) (passed|failed|errors?|skipped)", final[-1]):
                counts["errors" if word.startswith("error") else word] = int(number)
        line = f"{stage}: {counts['passed']} passed, {counts['failed']} failed"
        if counts["errors"]:
            line += f", {counts['errors']} errors"
        if counts["skipped"]:
            line += f", {counts['skipped']} skipped"
        line += f" in {seconds:.0f}s"
        conformance = re.search(r"^conformance: .*$", output, re.MULTILINE)
        if conformance:
            line += f" ({conformance.group(0)})"
        if rc == 5:
            line += " (no tests ran)"
        return line
    if stage == "proofs":
        found = re.findall(r"^\d+ properties in .*$", output, re.MULTILINE)
        exhaustive = re.findall(r"^.*exhaustive.*depth.*$", output, re.MULTILINE)
        detail = found[-1] if found else f"rc={rc}"
        if exhaustive:
            detail += "; " + exhaustive[-1].strip()
        return f"proofs: {'ok' if rc == 0 else 'FAILED'} ({detail})"
    if stage == "proofs-compiled":
        total = re.findall(r"^TOTAL depth .*$", output, re.MULTILINE)
        detail = total[-1].removeprefix("TOTAL ") if total else f"rc={rc}"
        verdict = "ok" if rc == 0 else "FAILED"
        return f"{stage}: {verdict} (exhaustive search, {detail}; {seconds:.0f}s)"
    if stage.startswith("upstream"):
        found = re.findall(r"^upstream: .*$", output, re.MULTILINE)
        detail = found[-1].removeprefix("upstream: ") if found else f"rc={rc}"
        return f"{stage}: {'ok' if rc == 0 else 'FAILED'} ({detail})"
    if stage.startswith("conformance-"):
        label = stage.removesuffix("-compiled")  # the compiled pass prints the same total line
        found = re.findall(rf"^{re.escape(label)}: \d+ sequences.*$", output, re.MULTILINE)
        detail = found[-1].removeprefix(f"{label}: ") if found else f"rc={rc}"
        pending = re.findall(r"^not yet conformant \(not run\): (.*)$", output, re.MULTILINE)
        streams = re.findall(r"^vllm scheduler on kvcache \[.*identical$", output, re.MULTILINE)
        if streams:
            detail += f"; vLLM's Scheduler: {len(streams)} streams identical"
        events = re.findall(r"^kv events over zmq \[.*identically$", output, re.MULTILINE)
        if events:
            detail += f"; KV events over ZMQ: {len(events)} streams decoded identically"
        if pending:
            detail += f"; not yet conformant: {pending[-1].strip()}"
        return f"{stage}: {'ok' if rc == 0 else 'FAILED'} ({detail})"
    if stage == "wheel-check":
        found = re.findall(r"^wheel-check: .*$", output, re.MULTILINE)
        return found[-1] if found else f"wheel-check: FAILED (rc={rc})"
    if stage.startswith("check-"):
        found = re.findall(r"^release-check .*$", output, re.MULTILINE)
        detail = found[-1] if found else f"rc={rc}"
        profile = re.findall(r"^kvcache@\S+ vs vLLM .*$", output, re.MULTILINE)
        caught = len(re.findall(r"^  \w+ flipped: [1-9]", output, re.MULTILINE))
        if profile:  # kvcache.kit.profile_check, after the census (check-release-%)
            detail += f"; {profile[-1][:160]}, {caught} flipped switches caught"
        return f"{stage}: {'ok' if rc == 0 else 'FAILED'} ({detail}; {seconds:.0f}s in all)"
    if stage == "effectiveness":
        found = re.findall(r"^\S+ \(vLLM .*\): \d+ rows.*$", output, re.MULTILINE)
        detail = "; ".join(found) if found else f"rc={rc}"
        return f"effectiveness: {'ok' if rc == 0 else 'FAILED'} ({detail})"
    return f"{stage}: {'ok' if rc == 0 else f'FAILED (rc={rc})'}"


def main() -> int:
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    stage, command = sys.argv[1], sys.argv[3:]
    log = ROOT / "build" / f"{stage}.log"
    log.parent.mkdir(exist_ok=True)
    started = time.monotonic()
    proc = subprocess.run(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False
    )
    seconds = time.monotonic() - started
    log.write_text(proc.stdout, encoding="utf-8")
    if proc.returncode != 0:
        print("\n".join(proc.stdout.splitlines()[-TAIL_LINES:]))
        print(f"(full output: {log.relative_to(ROOT)})")
    line = summarise(stage, proc.stdout, proc.returncode, seconds)
    print(line, flush=True)
    record = {"stage": stage, "line": line, "seconds": round(seconds, 1), "rc": proc.returncode}
    with (ROOT / "build" / "verify-stages.jsonl").open("a", encoding="utf-8") as records:
        records.write(json.dumps(record) + "\n")  # scripts/figures.py renders them
    return proc.returncode if proc.returncode != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
