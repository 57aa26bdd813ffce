"""Cache effectiveness over recorded lookups: what each lookup could have reused
(``spec.effectiveness``: content-level, from the pool's state) against what it did.

Its names live in modules by job, and are all importable from here:

* ``effectiveness_judge``  -- ``judge_records``: every ``get_computed_blocks`` of a
  lockstep run's records judged (any implementation, any release the kit drives);
* ``effectiveness_suite``  -- the scenario suite (``SCENARIOS`` on ``SUITE_FAMILIES``,
  ``suite_config``), the subject's release (``subject_release``, ``switch_on``), and
  ``run_suite`` with its ``SuiteRow``;
* ``effectiveness_report`` -- the rows held to the known flags (``KNOWN_FLAGS``,
  ``check_flags``) and drawn as a table (``format_suite``) or a plot (``plot_suite``).
"""

from __future__ import annotations

from kvcache.kit.effectiveness_judge import WRITE_OPS as WRITE_OPS
from kvcache.kit.effectiveness_judge import eagle_groups, judge_records, layout
from kvcache.kit.effectiveness_report import (
    KNOWN_FLAGS,
    check_flags,
    format_suite,
    known_flags,
    lookup_cell,
    matches,
    parse_expectation,
    plot_suite,
)
from kvcache.kit.effectiveness_suite import HASH_LOOKAHEAD as HASH_LOOKAHEAD
from kvcache.kit.effectiveness_suite import LOOKAHEAD_SLOTS as LOOKAHEAD_SLOTS
from kvcache.kit.effectiveness_suite import (
    LOOKAHEADS,
    SCENARIOS,
    SUITE_FAMILIES,
    SuiteRow,
    master_switch_for,
    run_scenario,
    run_suite,
    subject_release,
    suite_config,
    switch_on,
    variants,
)
from kvcache.kit.effectiveness_suite import PREFILL_LOOKAHEAD as PREFILL_LOOKAHEAD
from kvcache.kit.effectiveness_suite import SCALE as SCALE

__all__ = [
    "KNOWN_FLAGS",
    "LOOKAHEADS",
    "SCENARIOS",
    "SUITE_FAMILIES",
    "SuiteRow",
    "check_flags",
    "eagle_groups",
    "format_suite",
    "judge_records",
    "known_flags",
    "layout",
    "lookup_cell",
    "master_switch_for",
    "matches",
    "parse_expectation",
    "plot_suite",
    "run_scenario",
    "run_suite",
    "subject_release",
    "suite_config",
    "switch_on",
    "variants",
]
