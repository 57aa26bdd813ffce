"""``python -m kvcache``: see ``kvcache.kit.cli``."""

import sys

from kvcache import _deps

try:
    from kvcache.kit.cli import main
except ModuleNotFoundError as exc:  # a dependency of the kit itself: one line, exit 2
    missing = _deps.third_party(exc)
    if missing is None:
        raise
    print(_deps.missing_line(missing), file=sys.stderr)
    raise SystemExit(_deps.CLI_EXIT) from None

raise SystemExit(main())
