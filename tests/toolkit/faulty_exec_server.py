"""examples/exec_kvcache.py's server, broken on purpose at the first ``allocate_slots``:
``bad-json`` answers a line that is not JSON, ``crash`` exits with status 3, ``hang``
never answers. For the tests of the kit's handling of a broken ``exec:`` subject."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from examples.exec_kvcache import Server
from kvcache.kit.config import HASH_FNS


def main() -> int:
    """Serve stdin like examples/exec_kvcache.py until the fault."""
    fault = sys.argv[1]
    server = Server("none")
    # Warm up (imports, hashing) before the first request, so that a short
    # KVCACHE_EXEC_TIMEOUT times only the planted hang.
    for hash_fn in HASH_FNS:
        config = {"num_blocks": 4, "groups": [{"kind": "full", "block_size": 2}],
                  "max_model_len": 8, "hash_fn": hash_fn}
        server.answer({"op": "new", "manager": 0, "args": {"config": config}})
        server.answer({"op": "add_request", "manager": 0,
                       "args": {"request_id": "w", "prompt_token_ids": [1, 2, 3]}})
    for line in sys.stdin:
        message: dict[str, Any] = json.loads(line)
        if message.get("op") == "allocate_slots":
            if fault == "bad-json":
                sys.stdout.write("{oops\n")
                sys.stdout.flush()
                continue
            if fault == "crash":
                print("planted crash", file=sys.stderr)
                return 3
            time.sleep(3600)
        sys.stdout.write(json.dumps(server.answer(message)) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
