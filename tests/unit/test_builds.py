"""Choosing between the compiled and the pure-Python build (``kvcache/_builds.py``).

Each case imports kvcache in a fresh interpreter, since one process holds one
build. Cases that need the compiled modules skip where none is built (a
machine without a C compiler); ``make verify`` builds them first, so there
they run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvcache import _builds

PACKAGE = Path(_builds.__file__).resolve().parent
needs_compiled = pytest.mark.skipif(
    not (_builds.has_compiled_modules() and _builds.compiled_is_current()),
    reason="no current compiled build here (`make compiled` builds it)",
)

REPORT = (
    "import kvcache, sys; from kvcache import _builds;"
    "print(kvcache.COMPILED, all(_builds.is_compiled(sys.modules['kvcache.' + n]) "
    "== kvcache.COMPILED for n in _builds.CORE_MODULES))"
)


def run_python(code: str, root: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHE_")}
    environment.update(env, PYTHONPATH=str(root))
    return subprocess.run(
        [sys.executable, "-c", code], env=environment, cwd=root, capture_output=True, text=True,
        timeout=120, check=True,
    )  # fmt: skip


@needs_compiled
def test_compiled_build_is_the_default_and_kvcache_pure_selects_the_sources() -> None:
    root = PACKAGE.parent
    assert run_python(REPORT, root).stdout.split() == ["True", "True"]
    for env in ({"KVCACHE_PURE": "1"}, {"KVCACHE_SELF_CHECK": "1"}):
        assert run_python(REPORT, root, **env).stdout.split() == ["False", "True"], env
    assert run_python(REPORT, root, KVCACHE_PURE="0").stdout.split() == ["True", "True"]


@needs_compiled
def test_a_stale_compiled_build_is_not_loaded(tmp_path: Path) -> None:
    """An edited source no longer matches the recorded digest: the sources load,
    with a warning, so no test runs stale compiled code."""
    shutil.copytree(PACKAGE, tmp_path / "kvcache", ignore=shutil.ignore_patterns("__pycache__"))
    source = tmp_path / "kvcache" / "kv_cache_math.py"
    source.write_text(source.read_text() + "\n# edited\n")
    result = run_python(REPORT, tmp_path)
    assert result.stdout.split() == ["False", "True"]
    assert "compiled build is stale" in result.stderr


def test_pure_copy_is_separate_and_leaves_the_loaded_build_in_place() -> None:
    import kvcache

    before = {n: sys.modules[f"kvcache.{n}"] for n in _builds.CORE_MODULES}
    copy = _builds.import_pure_copy()
    after = {n: sys.modules[f"kvcache.{n}"] for n in _builds.CORE_MODULES}
    assert after == before
    assert all(getattr(kvcache, n) is before[n] for n in _builds.CORE_MODULES)
    assert not any(_builds.is_compiled(m) for m in copy.values())
    assert all(copy[n] is not before[n] for n in _builds.CORE_MODULES)
    # The copy's modules refer to each other, not to the loaded build.
    assert copy["kv_cache_manager"].KVCacheBlock is copy["kv_cache_utils"].KVCacheBlock
    assert copy["kv_cache_utils"].KVCacheBlock is not kvcache.KVCacheBlock


def test_both_builds_give_identical_bench_results() -> None:
    from kvcache.kit.bench import bench_workload

    result = bench_workload("chat", ["kvcache", "kvcache-pure", "spec"], 1, num_requests=40)
    assert result.identical, result.digests


def test_a_kvcache_patch_that_never_runs_is_reported() -> None:
    """The ``monkeypatch`` fixture's check (``tests/conftest.py``): a planted bug
    the code never reached is named, one that ran is not."""
    import importlib.util

    import kvcache

    # By path: in a whole-suite run the module name ``conftest`` may be another
    # directory's conftest (tests/kernels/conftest.py).
    spec = importlib.util.spec_from_file_location(
        "tests_root_conftest", Path(__file__).resolve().parents[1] / "conftest.py"
    )
    assert spec is not None and spec.loader is not None
    root_conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(root_conftest)
    CheckedMonkeyPatch = root_conftest.CheckedMonkeyPatch

    patch = CheckedMonkeyPatch()
    try:
        original = kvcache.BlockPool.get_num_free_blocks
        patch.setattr(kvcache.BlockPool, "get_usage", lambda self: 0.5)
        patch.setattr(kvcache.BlockPool, "get_num_free_blocks", original)
        pool = kvcache.BlockPool(4, enable_caching=True, hash_block_size=2)
        assert pool.get_num_free_blocks() == 3
        assert patch.unreached() == ["BlockPool.get_usage"]
    finally:
        patch.undo()
