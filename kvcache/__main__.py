"""``python -m kvcache``: see ``kvcache.kit.cli``."""

from kvcache.kit.cli import main

raise SystemExit(main())
