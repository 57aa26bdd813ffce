"""A subject server speaking the kit's JSON-lines protocol (docs/protocol.md), on kvcache.

    python -m kvcache fuzz --impl "exec:python examples/exec_kvcache.py" --compare exact

It reads one request per line on stdin and answers each with one line on stdout,
as a manager written in Rust, C++ or Go would; here the manager is kvcache's,
driven through the kit's own ``Side`` (which turns a trace call into manager calls
and its result into the trace's canonical form), so every level up to ``exact``
can be checked, states included.

``--bug free-head-first`` (or ``KVCACHE_EXEC_BUG=free-head-first``) plants
examples/mymanager.py's bug: ``free`` hands a request's blocks back head first, so
a cached chain loses its head first and later requests stop hitting it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from kvcache.kit.config import ManagerConfig
from kvcache.kit.sides import CannotBuild, HarnessError, Side, resolve_adapter

PROTOCOL = "kvcache-kit/1"
BUGS = ("none", "free-head-first")


class Server:
    """The managers the kit created, by id, and how to answer each request."""

    def __init__(self, bug: str) -> None:
        self.bug = bug
        self.managers: dict[int, tuple[Side, bool]] = {}

    def answer(self, message: dict[str, Any]) -> dict[str, Any]:
        """The answer line to one request line."""
        op, args = message.get("op"), message.get("args") or {}
        if op == "hello":
            return {"ok": {"protocol": PROTOCOL, "name": "kvcache", "version": None}}
        manager = message.get("manager")
        if not isinstance(manager, int):
            return {"error": f"{op} needs an int manager, got {manager!r}"}
        if op == "new":
            try:
                side = Side(resolve_adapter("kvcache"), ManagerConfig.from_record(args["config"]),
                            str(args.get("hash_seed", "0")))
            except (CannotBuild, ValueError) as exc:
                return {"raises": "CannotBuild", "message": str(exc)[:300]}
            self.managers[manager] = (side, bool(args.get("state")))
            return self.after(side, bool(args.get("state")), {"ok": None})
        if op == "close":
            self.managers.pop(manager, None)
            return {"ok": None}
        if manager not in self.managers:
            return {"error": f"unknown manager {manager!r}"}
        side, with_state = self.managers[manager]
        try:
            if op == "free" and self.bug == "free-head-first":
                request = side.request(args)
                side.manager.block_pool.free_blocks(side.manager.pop_blocks_for_free(request))
                result: Any = None
            else:
                result = side.call(str(op), args)
        except HarnessError as exc:
            return {"error": str(exc)}
        except Exception as exc:  # the manager raised: an outcome, as in-process
            return self.after(side, with_state,
                              {"raises": type(exc).__name__, "message": str(exc)[:300]})
        return self.after(side, with_state, {"ok": result})

    @staticmethod
    def after(side: Side, with_state: bool, answer: dict[str, Any]) -> dict[str, Any]:
        """``answer`` with the free count and (when asked) the state after the call."""
        answer["free"] = side.num_free_blocks()
        if with_state:
            answer["state"] = side.state()
        return answer


def serve(stdin: TextIO, stdout: TextIO, bug: str) -> None:
    """Answer every line of ``stdin`` until it closes."""
    server = Server(bug)
    for line in stdin:
        if not line.strip():
            continue
        try:
            message = json.loads(line)
            answer = server.answer(message) if isinstance(message, dict) else {
                "error": "a request is a JSON object"}
        except json.JSONDecodeError as exc:
            answer = {"error": f"not JSON: {exc.msg}"}
        stdout.write(json.dumps(answer, separators=(",", ":")) + "\n")
        stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse the flags, then serve stdin."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bug", choices=BUGS, default=os.environ.get("KVCACHE_EXEC_BUG", "none"),
                        help="plant a bug (default none; env KVCACHE_EXEC_BUG)")
    args = parser.parse_args(argv)
    serve(sys.stdin, sys.stdout, args.bug)
    return 0


if __name__ == "__main__":
    sys.exit(main())
