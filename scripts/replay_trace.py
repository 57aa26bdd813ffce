#!/usr/bin/env python3
"""Replay trace files (tests/data/*.jsonl, build/conformance-failures/*.jsonl) on one
implementation and report the first call whose result or state differs from vLLM's.

Usage: ``.venv/bin/python scripts/replay_trace.py TRACE... [--impl kvcache|spec|vllm]``
Exit status 1 when any trace diverges.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

from conformance.driver import describe_calls, replay_trace  # noqa: E402
from conformance.trace import read_trace  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--impl", default="kvcache", help="package name, or vllm")
    args = parser.parse_args()
    failed = 0
    for path in args.traces:
        config, records = read_trace(path)
        mismatch = replay_trace(config, records, args.impl)
        if mismatch is None:
            print(f"{path}: {len(records)} calls, all match on {args.impl}")
            continue
        failed += 1
        print(f"{path}: DIVERGES on {args.impl}\n{mismatch}")
        print("calls up to it (vLLM's results):")
        print(describe_calls(records[: mismatch.index + 1]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
