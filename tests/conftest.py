"""Shared test setup: Hypothesis profiles, the vLLM reference fixture, the conformance summary.

Hypothesis profiles (pick one with ``HYPOTHESIS_PROFILE``; ``make`` uses ``ci``):

* ``dev``     — quick local runs (the default outside ``make``);
* ``ci``      — what ``make verify`` / CI run: derandomized, so a CI failure
  reproduces with the same command;
* ``nightly`` — long fuzzing runs;
* ``mutation`` — ``make mutation`` (mutmut, ``docs/mutation.md``): few examples,
  derandomized, no example database, so every mutant meets the same inputs;
* ``compiled`` — the second pass of ``make verify`` over the compiled build
  (``KVCACHE_EXPECT_COMPILED=1``): fewer examples, derandomized;
* ``fuzz``    — ``make fuzz`` (HypoFuzz): the example database is
  ``$KVCACHE_FUZZ_DB``, a directory (default ``.hypothesis/fuzz-db``; put it
  on a shared mount for several machines) or ``redis://HOST:PORT/DB`` (needs
  the ``redis`` package); ``KVCACHE_FUZZ_PHASES=reuse`` only replays what the
  database holds.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings

# vLLM's first-block seed (NONE_HASH) is random unless PYTHONHASHSEED is set; tests that
# compare two implementations' block hashes need one seed, as under `make` (which exports
# 0). Set before kvcache, spec or vLLM is imported, so a bare `pytest FILE` agrees.
os.environ.setdefault("PYTHONHASHSEED", "0")

settings.register_profile("dev", max_examples=50, deadline=None)
settings.register_profile(
    "ci",
    max_examples=200,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "mutation",
    max_examples=20,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "compiled",
    max_examples=50,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "nightly",
    max_examples=5000,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)


def fuzz_database(location: str) -> Any:
    """The example database at ``location``: a directory or a ``redis://`` URL."""
    if location.startswith("redis://"):
        import redis
        from hypothesis.extra.redis import RedisExampleDatabase

        class SharedRedisDatabase(RedisExampleDatabase):
            """Equal to any other on the same URL, as directory databases are by path
            (HypoFuzz skips a test whose database differs from the default one)."""

            def __eq__(self, other: object) -> bool:
                # not isinstance(other, SharedRedisDatabase): the class is made anew
                # each time pytest imports this conftest (HypoFuzz collects twice)
                url = getattr(other, "url", None)
                return isinstance(other, RedisExampleDatabase) and url == self.url

            def __hash__(self) -> int:
                return hash(self.url)

        database = SharedRedisDatabase(redis.Redis.from_url(location))
        database.url = location
        return database
    from hypothesis.database import DirectoryBasedExampleDatabase

    return DirectoryBasedExampleDatabase(location)


if os.environ.get("HYPOTHESIS_PROFILE") == "fuzz":
    from hypothesis import Phase

    _phases = os.environ.get("KVCACHE_FUZZ_PHASES", "")
    settings.register_profile(
        "fuzz",
        deadline=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        database=fuzz_database(os.environ.get("KVCACHE_FUZZ_DB", ".hypothesis/fuzz-db")),
        phases=[Phase[name] for name in _phases.split(",")] if _phases else tuple(Phase),
    )
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

EXPECTED_VLLM_VERSION = "0.25.1"


def in_ci() -> bool:
    """Whether we run under CI (``CI=true``), where a missing reference is a failure."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


@pytest.fixture(scope="session")
def vllm_reference() -> ModuleType:
    """The kit's adapter around the real vLLM 0.25.1 (``kvcache.kit.vllm_side``).

    Fails under CI when vLLM cannot be imported (the reference must be there);
    skips locally, where ``make conformance`` installs it.
    """
    reason = None
    try:
        from kvcache.kit import vllm_side
    except Exception as exc:  # ImportError, or vLLM failing at import time
        reason = f"vLLM {EXPECTED_VLLM_VERSION} is not importable: {type(exc).__name__}: {exc}"
    else:
        if vllm_side.VLLM_VERSION != EXPECTED_VLLM_VERSION:
            reason = (
                f"vLLM {vllm_side.VLLM_VERSION} is installed; the reference is "
                f"{EXPECTED_VLLM_VERSION}"
            )
    if reason is not None:
        hint = "run `make conformance` (installs the reference into .venv)"
        if in_ci():
            pytest.fail(f"{reason}; CI requires it: {hint}", pytrace=False)
        pytest.skip(f"{reason}; {hint}")
    return vllm_side


IMPL_ENV = "KVCACHE_CONFORMANCE_IMPL"


@pytest.fixture(scope="session")
def subject_impl() -> str:
    """The implementation under test: ``$KVCACHE_CONFORMANCE_IMPL`` (any ``--impl``
    name of ``python -m kvcache``: a package, ``module:factory``, ``spec``), default
    kvcache."""
    from kvcache.kit.sides import resolve_adapter

    name = os.environ.get(IMPL_ENV, "kvcache")
    try:
        resolve_adapter(name)
    except ValueError as exc:
        pytest.fail(f"{IMPL_ENV}={name!r}: {exc}", pytrace=False)
    return name


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Print the conformance counts (sequences per family, calls, mismatches) and the
    slowest catches of planted bugs (``tests/injected_harness.py``), when any ran."""
    import sys

    module = sys.modules.get("conformance.test_conformance")
    if module is not None and module.STATS.sequences:
        terminalreporter.write_line(module.STATS.summary())
    harness = sys.modules.get("injected_harness")
    if harness is not None and harness.CATCHES:
        terminalreporter.write_line(harness.catch_summary())


# ---------------------------------------------------------------- two builds

EXPECT_COMPILED_ENV = "KVCACHE_EXPECT_COMPILED"


def pytest_configure(config: Any) -> None:
    """Under ``KVCACHE_EXPECT_COMPILED=1`` (``make verify``'s compiled pass), stop at
    once unless the compiled build is the one imported (missing or stale build)."""
    if os.environ.get(EXPECT_COMPILED_ENV, "0") in ("", "0"):
        return
    import kvcache

    if not kvcache.COMPILED:
        pytest.exit(
            f"{EXPECT_COMPILED_ENV}=1 but kvcache imported its pure-Python sources "
            "(no compiled build, a stale one, or KVCACHE_PURE set): run `make setup`",
            returncode=3,
        )


# kvcache names that compiled code looks up at each call (module variables, not
# functions), so that a patch takes effect on both builds.
PATCHABLE_WHEN_COMPILED = frozenset(
    {("kvcache.kv_cache_utils", "tensor_data"), ("kvcache.kv_cache_utils", "_sha256_chain")}
)


class CheckedMonkeyPatch(pytest.MonkeyPatch):
    """``monkeypatch`` that knows when it patches a kvcache class.

    Compiled (mypyc) code calls its methods directly, so a patch of a kvcache
    class changes nothing there: such a test skips on the compiled build (it
    runs on the pure one, saying so), unless ``PATCHABLE_WHEN_COMPILED`` lists
    the name. On either build every patched kvcache method must run at least
    once before the test ends; a planted bug or fault injector the code never
    reached fails the test instead of passing.
    """

    def __init__(self) -> None:
        super().__init__()
        self.kvcache_patches: list[tuple[str, list[int]]] = []

    def setattr(self, target: Any, name: Any, value: Any = None, raising: bool = True) -> None:
        """As ``MonkeyPatch.setattr``; kvcache class methods are counted (see the class)."""
        if isinstance(target, ModuleType):
            owner_module = target.__name__
        elif isinstance(target, type):
            owner_module = target.__module__
        else:
            owner_module = ""
        if owner_module.split(".")[0] == "kvcache" and not owner_module.startswith("kvcache.kit"):
            import kvcache

            if kvcache.COMPILED and (owner_module, name) not in PATCHABLE_WHEN_COMPILED:
                pytest.skip(
                    f"patches {target.__name__}.{name}: compiled code ignores such "
                    "patches, so this test runs on the pure-Python build only"
                )
            value = self._counted(f"{target.__name__}.{name}", value)
        super().setattr(target, name, value, raising=raising)

    def _counted(self, label: str, value: Any) -> Any:
        calls = [0]
        self.kvcache_patches.append((label, calls))
        if isinstance(value, (classmethod, staticmethod)):
            return type(value)(self._counted_function(value.__func__, calls))
        if callable(value):
            return self._counted_function(value, calls)
        calls[0] = 1  # a plain value: nothing to reach
        return value

    @staticmethod
    def _counted_function(fn: Any, calls: list[int]) -> Any:
        import functools

        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            return fn(*args, **kwargs)

        return counted

    def unreached(self) -> list[str]:
        """Patched kvcache methods that never ran."""
        return [label for label, calls in self.kvcache_patches if calls[0] == 0]


@pytest.fixture
def monkeypatch() -> Any:
    """pytest's ``monkeypatch``, checked for patches that never took effect
    (``CheckedMonkeyPatch``)."""
    patch = CheckedMonkeyPatch()
    try:
        yield patch
        unreached = patch.unreached()
    finally:
        patch.undo()
    if unreached:
        pytest.fail(
            f"patched kvcache method(s) never ran: {', '.join(unreached)}: the test "
            "exercised nothing it planted",
            pytrace=False,
        )
