"""vLLM's own KV-cache core tests, run unchanged on kvcache (``make upstream``).

vLLM's tests are not ours to copy, so nothing of them lives in this repository:
:func:`fetch_tests` downloads vLLM's source distribution from the package index
(pip's own network code, the index pip is configured with), and extracts only
``tests/v1/core/`` and the one helper module it imports into ``build/upstream/``.

Then the same test files run three times, each in its own pytest process
(``python -m kvcache.kit.upstream``):

``vllm``
    stock vLLM: which tests pass on the reference itself (the baseline ``M``);
``objects``
    vLLM's core modules (``vllm.v1.core.{kv_cache_manager, block_pool,
    kv_cache_coordinator, single_type_kv_cache_manager, kv_cache_utils}``) are
    kvcache's; everything else (configs, specs, ``Request``, events, stats) is
    vLLM's own objects, so kvcache must accept them;
``vocabulary``
    kvcache's vocabulary is swapped in too (``vllm.v1.kv_cache_interface``,
    ``vllm.v1.request``, ``vllm.distributed.kv_events``,
    ``vllm.v1.metrics.stats``).

The swap is a sys.modules alias installed by the pytest plugin
:mod:`kvcache.kit.upstream_plugin` before any test imports vLLM's core. A name
kvcache lacks falls back to vLLM's module only when :data:`FALLBACKS` lists it
(data types and worker-side sizing helpers, never manager, coordinator, pool or
hashing logic); each fallback used is reported, and a call audit records every
function of vLLM's core files that ran, which must be none of the swapped logic.

Tests that cannot run here are listed in :data:`EXCLUDED` with a reason. Every
other test that passes on vLLM must pass in both swapped modes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build" / "upstream"
DATA = Path(__file__).resolve().parent / "upstream_data"
MODES = ("vllm", "objects", "vocabulary")

# vLLM module -> kvcache module serving it, per mode.
CORE_SWAPS: dict[str, str] = {
    "vllm.v1.core.kv_cache_utils": "kvcache.kv_cache_utils",
    "vllm.v1.core.block_pool": "kvcache.block_pool",
    "vllm.v1.core.single_type_kv_cache_manager": "kvcache.single_type_kv_cache_manager",
    "vllm.v1.core.kv_cache_coordinator": "kvcache.kv_cache_coordinator",
    "vllm.v1.core.kv_cache_manager": "kvcache.kv_cache_manager",
    "vllm.v1.core.kv_cache_metrics": "kvcache.kv_cache_metrics",
}
VOCABULARY_SWAPS: dict[str, str] = {
    "vllm.v1.kv_cache_interface": "kvcache.kv_cache_interface",
    "vllm.v1.request": "kvcache.request",
    "vllm.distributed.kv_events": "kvcache.kv_events",
    "vllm.v1.metrics.stats": "kvcache.metrics",
}

# The logic under test: no function of these vLLM files may run in a swapped mode.
AUDITED_FILES = (
    "vllm/v1/core/kv_cache_manager.py",
    "vllm/v1/core/block_pool.py",
    "vllm/v1/core/kv_cache_coordinator.py",
    "vllm/v1/core/single_type_kv_cache_manager.py",
    "vllm/v1/core/kv_cache_utils.py",
    "vllm/v1/core/kv_cache_metrics.py",
)

# Names kvcache lacks that may be served by vLLM's own module, with the reason.
# Worker-side sizing (how many blocks fit in GPU memory, how groups are formed from
# a model's layers) and plain data types kvcache does not model; none of them
# allocates, frees, hashes or looks up blocks. Everything else missing is an
# AttributeError, so the test that needs it fails.
FALLBACKS: dict[str, dict[str, str]] = {
    "vllm.v1.core.kv_cache_utils": {
        name: "worker-side sizing: KV-cache config from a model's layers and GPU memory"
        for name in (
            "get_kv_cache_configs",
            "get_kv_cache_config_from_groups",
            "get_kv_cache_groups",
            "generate_scheduler_kv_cache_config",
            "estimate_max_model_len",
            "check_enough_kv_cache_memory",
            "get_max_concurrency_for_kv_cache_config",
            "get_num_blocks",
            "unify_hybrid_kv_cache_specs",
            "unify_kv_cache_spec_page_size",
            "may_override_num_blocks",
            "create_kv_cache_group_specs",
            "_get_kv_cache_groups_uniform_spec",
            "_get_kv_cache_groups_uniform_type",
            "_get_kv_cache_groups_uniform_page_size",
            "_get_kv_cache_config_uniform_type",
            "_get_kv_cache_config_uniform_page_size",
            "_max_memory_usage_bytes_from_groups",
            "_estimate_max_model_len_from_groups",
            "_auto_fit_max_model_len",
            "_project_kv_cache_groups_to_worker",
            "_report_kv_cache_config",
            "max_memory_usage_bytes",
            "get_max_model_len_for_memory",
            "get_kv_cache_capacity",
            "_get_kv_cache_config_packed",
        )
    },
    "vllm.v1.kv_cache_interface": {
        name: "data type kvcache does not model (worker-side or issue 14)"
        for name in (
            "KVCacheTensor",
            "KVQuantMode",
            "KVCacheSpecKind",
            "get_kv_quant_mode",
            "kv_cache_uses_per_token_head_scales",
        )
    },
    "vllm.v1.request": {
        name: "request-lifecycle type of the scheduler, not of the KV-cache core"
        for name in ("StreamingUpdate", "RequestStatus", "FinishReason")
    },
    "vllm.distributed.kv_events": {
        name: "event transport (publisher, config), not the events kvcache emits"
        for name in (
            "EventPublisherFactory",
            "EventPublisher",
            "NullEventPublisher",
            "ZmqEventPublisher",
            "KVEventsConfig",
            "KVEventBatch",
            "EventBatch",
            "KVConnectorKVEvents",
            "KVEventAggregator",
            "BlockRemoved",
            "BlockStored",
            "AllBlocksCleared",
            "KVCacheEvent",
        )
    },
    "vllm.v1.metrics.stats": {
        name: "engine-level statistics type, not the KV-cache core's"
        for name in (
            "SchedulerStats",
            "IterationStats",
            "RequestStateStats",
            "FinishedRequestStats",
            "LoRAStats",
            "LoRARequestStates",
            "MultiModalCacheStats",
            "CachingMetrics",
            "SpecDecodingStats",
            "PromptTokenStats",
            "KVCacheEvictionEvent",
            "CCLStats",
            "BaseCacheStats",
            "PrefillStats",
        )
    },
}


# vLLM 0.33.0: the drop-in module kvcache.vllm_0_33 (the manager built with Profile("0.33.0"),
# 0.33.0's hasher, NONE_HASH seed rule, block pool and single-type manager signatures) serves
# the manager's, the hashing module's, the pool's and the managers' names first; the rest is
# kvcache's shared modules, as for 0.25.1.
CORE_SWAPS_0_33: dict[str, tuple[str, ...]] = {
    name: (("kvcache.vllm_0_33", module) if name.endswith(
               ("kv_cache_manager", "kv_cache_utils", "block_pool", "single_type_kv_cache_manager"))
           else (module,))
    for name, module in CORE_SWAPS.items()
}  # fmt: skip


_SIZING_0_33 = (
    "worker-side sizing / config resolution of vLLM 0.33.0 "
    "(no block is allocated, freed, hashed or looked up)"
)
FALLBACKS_0_33: dict[str, dict[str, str]] = {
    **FALLBACKS,
    "vllm.v1.core.kv_cache_utils": {
        **FALLBACKS["vllm.v1.core.kv_cache_utils"],
        "KVCacheBlockCopy": "data type: a (src, dst) block-id pair of a copy-on-write copy",
        **{
            name: _SIZING_0_33
            for name in (
                "_kv_cache_device_name",
                "update_kv_cache_capacity",
                "resolve_dcp_kv_block_size",
                "resolve_dcp_kv_cache_spec",
                "resolve_kv_cache_block_sizes",
            )
        },
    },
}
_NOT_MODELLED_0_33 = "not modelled by kvcache's 0.33.0 profile: "
NOT_MODELLED_0_33: dict[str, dict[str, str]] = {
    "vllm.v1.core.kv_cache_utils": {
        "eagle_proof_margin": _NOT_MODELLED_0_33 + "the EAGLE margin rules beside Mamba",
    },
    "vllm.v1.core.kv_cache_coordinator": {
        "replay_boundaries": _NOT_MODELLED_0_33 + "sparse retention's replay boundaries with EAGLE",
    },
}


@dataclass(frozen=True)
class Excluded:
    """A vLLM test that this stage does not demand, and why."""

    pattern: str  # a node id, or its prefix ending in "[" / "::"
    reason: str

    def matches(self, nodeid: str) -> bool:
        """Whether ``nodeid`` is this exclusion's test (or one of its parametrizations)."""
        return nodeid == self.pattern or (
            self.pattern.endswith(("[", "::")) and nodeid.startswith(self.pattern)
        )


def known_failing_from(path: Path) -> tuple[Excluded, ...]:
    """The ratchet of a release kept in a TOML file (``upstream_data/known_failing-*.toml``):
    ``[reasons]`` names each feature a test needs, ``[tests]`` maps a node id (or its
    prefix ending in ``[``) to ``+``-joined reason names.

    Raises:
        ValueError: naming the test whose reason name is not in ``[reasons]``.
    """
    import tomllib

    table = tomllib.loads(path.read_text())
    reasons: dict[str, str] = table["reasons"]
    rules = []
    for pattern, keys in table["tests"].items():
        unknown = [k for k in keys.split("+") if k not in reasons]
        if unknown:
            raise ValueError(f"{path.name}: {pattern}: unknown reason {unknown[0]!r}")
        rules.append(Excluded(pattern, "; ".join(reasons[k] for k in keys.split("+"))))
    return tuple(rules)


@dataclass(frozen=True)
class Release:
    """One vLLM release's test selection, and how kvcache is swapped in for it.

    ``core_swaps`` maps each vLLM core module to the kvcache modules serving it, searched
    in order (a release's drop-in module first, kvcache's shared module after it);
    ``modes`` are the runs demanded (the baseline ``vllm`` first).
    """

    version: str
    files: tuple[str, ...]
    core_swaps: dict[str, tuple[str, ...]] = field(
        default_factory=lambda: {name: (module,) for name, module in CORE_SWAPS.items()}
    )
    vocabulary_swaps: dict[str, str] = field(default_factory=lambda: dict(VOCABULARY_SWAPS))
    fallbacks: dict[str, dict[str, str]] = field(default_factory=lambda: FALLBACKS)
    # Names of the release's core modules for logic kvcache does not model (managers,
    # hashing helpers): served as placeholders that raise NotImplementedError naming the
    # feature when called, so a test file importing one still collects and only the
    # tests that use it fail (each listed in known_failing); vLLM's code never runs.
    not_modelled: dict[str, dict[str, str]] = field(default_factory=dict)
    modes: tuple[str, ...] = MODES
    excluded: tuple[Excluded, ...] = ()
    # Tests that pass on vLLM and still fail on kvcache, each with the issue that fixes it:
    # a ratchet (a new failure fails the stage, and so does a listed test that passes).
    known_failing: tuple[Excluded, ...] = ()
    # ... on the compiled build only (it checks annotated types at run time).
    known_failing_compiled: tuple[Excluded, ...] = ()


RELEASES: dict[str, Release] = {
    "0.25.1": Release(
        "0.25.1",
        files=(
            "tests/v1/core/test_kv_cache_utils.py",
            "tests/v1/core/test_prefix_caching.py",
            "tests/v1/core/test_single_type_kv_cache_manager.py",
            "tests/v1/core/prefix_cache/test_partial_prefix_cache_primitives.py",
            "tests/v1/core/test_kv_cache_metrics.py",
            "tests/v1/core/test_deferred_block_free.py",
            "tests/v1/core/test_kv_sharing.py",
        ),
    ),
    "0.33.0": Release(
        "0.33.0",
        files=(
            "tests/v1/core/test_kv_cache_utils.py",
            "tests/v1/core/test_prefix_caching.py",
            "tests/v1/core/test_single_type_kv_cache_manager.py",
            "tests/v1/core/prefix_cache/test_partial_prefix_cache_primitives.py",
            "tests/v1/core/prefix_cache/test_partial_prefix_cache_hits.py",
            "tests/v1/core/prefix_cache/test_mamba_eagle_resume_checkpoint.py",
            "tests/v1/core/test_kv_cache_metrics.py",
            "tests/v1/core/test_deferred_block_free.py",
            "tests/v1/core/test_kv_sharing.py",
            "tests/v1/core/test_swa_inflight_window_free.py",
            "tests/v1/core/test_prefix_replay.py",
            "tests/v1/core/test_mamba_align_chunk_split.py",
            "tests/v1/core/prefix_cache/test_hybrid_prefix_cache_hit_rate.py",
            "tests/v1/core/test_scheduler.py",
            "tests/v1/core/test_async_scheduler.py",
            "tests/v1/core/test_contiguous_kv_packing.py",
            "tests/v1/core/test_kv_cache_planning.py",
            "tests/v1/core/test_kv_cache_config_builder.py",
            "tests/v1/core/test_priority_preemption_bug.py",
            "tests/v1/core/test_priority_scheduler_random.py",
            "tests/v1/core/test_worker_slot_overflow.py",
            "tests/v1/core/test_output.py",
            "tests/v1/core/test_encoder_cache_manager.py",
            "tests/v1/core/test_repetition_detection.py",
        ),
        core_swaps=CORE_SWAPS_0_33,
        fallbacks=FALLBACKS_0_33,
        not_modelled=NOT_MODELLED_0_33,
        known_failing=known_failing_from(DATA / "known_failing-0.33.0.toml"),
        known_failing_compiled=known_failing_from(DATA / "known_failing_compiled-0.33.0.toml"),
        # Objects mode only: vLLM 0.33.0's tests build 0.33.0's vocabulary (its specs,
        # Request fields, events), which kvcache's shared vocabulary modules are not;
        # the drop-in serves the manager and hashing names.
        modes=("vllm", "objects"),
    ),
}

# Members of the source distribution extracted, relative to its top directory.
EXTRACT_PREFIXES = ("tests/v1/core/",)
EXTRACT_FILES = ("tests/v1/kv_connector/unit/utils.py",)
PACKAGE_INITS = (
    "tests/__init__.py",
    "tests/v1/__init__.py",
    "tests/v1/kv_connector/__init__.py",
    "tests/v1/kv_connector/unit/__init__.py",
)


def fetch_sdist(version: str, dest: Path) -> Path:
    """Download vLLM ``version``'s source distribution into ``dest`` (once) and return it.

    ``pip download --no-binary`` would build vLLM's metadata (it cannot, here), so the
    file is fetched directly from the package index pip is configured with, through
    pip's own session (proxies, certificates and retries as pip has them), and checked
    against the index's sha256.

    Raises:
        RuntimeError: if the index has no such file or the digest does not match.
    """
    from pip._internal.models.index import PyPI
    from pip._internal.network.session import PipSession

    names = (f"vllm-{version}.tar.gz",)
    for name in names:
        if (dest / name).exists():
            return dest / name
    index = os.environ.get("PIP_INDEX_URL", PyPI.simple_url).rstrip("/")
    session = PipSession()
    page = session.get(f"{index}/vllm/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    page.raise_for_status()
    for entry in page.json()["files"]:
        if entry["filename"] in names:
            body = session.get(entry["url"])
            body.raise_for_status()
            digest = entry.get("hashes", {}).get("sha256")
            if digest and hashlib.sha256(body.content).hexdigest() != digest:
                raise RuntimeError(f"sha256 mismatch for {entry['filename']}")
            dest.mkdir(parents=True, exist_ok=True)
            part = dest / (entry["filename"] + ".part")
            part.write_bytes(body.content)
            target: Path = dest / entry["filename"]
            part.replace(target)
            return target
    raise RuntimeError(f"vLLM {version} has no source distribution on {index}")


def fetch_tests(version: str) -> Path:
    """vLLM ``version``'s core tests extracted under ``build/upstream/vllm-<version>/``.

    Only ``tests/v1/core/`` and the helper module it imports are extracted; vLLM's
    top-level ``tests/conftest.py`` (which needs vLLM's whole test environment) is
    not, and the package ``__init__`` files are written empty.
    """
    tree = BUILD / f"vllm-{version}"
    stamp = tree / ".extracted"
    if stamp.exists():
        return tree
    sdist = fetch_sdist(version, BUILD / "sdist")
    with tarfile.open(sdist) as archive:
        top = f"vllm-{version}/"
        for member in archive.getmembers():
            if not member.isfile() or not member.name.startswith(top):
                continue
            relative = member.name[len(top) :]
            if relative.startswith(EXTRACT_PREFIXES) or relative in EXTRACT_FILES:
                target = tree / relative
                target.parent.mkdir(parents=True, exist_ok=True)
                source = archive.extractfile(member)
                assert source is not None
                target.write_bytes(source.read())
    for init in PACKAGE_INITS:
        (tree / init).parent.mkdir(parents=True, exist_ok=True)
        (tree / init).write_text("")
    (tree / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    cpu_test: vLLM's marker for tests that need no GPU\n"
    )
    stamp.write_text(version)
    return tree


def offline_model_cache() -> Path:
    """A Hugging Face cache under ``build/`` holding this repo's own model configs.

    A few of vLLM's tests build a ``ModelConfig`` for a hub model id
    (``facebook/opt-125m``, ``Qwen/Qwen3-0.6B``, ``Qwen/Qwen1.5-7B``). Nothing can be
    downloaded here, so ``upstream_data/models/`` carries hand-written config.json
    files with the public architecture figures of those models, laid out the way the
    hub client finds them offline (``HF_HUB_OFFLINE=1``).
    """
    home = BUILD / "hf-home"
    for config in sorted((DATA / "models").glob("*/config.json")):
        repo = config.parent.name  # "org--name"
        snapshot = home / "hub" / f"models--{repo}" / "snapshots" / "kvcache"
        snapshot.mkdir(parents=True, exist_ok=True)
        _write_atomically(snapshot / "config.json", config.read_bytes())
        refs = home / "hub" / f"models--{repo}" / "refs"
        refs.mkdir(parents=True, exist_ok=True)
        _write_atomically(refs / "main", b"kvcache")
    return home


def _write_atomically(path: Path, data: bytes) -> None:
    """Write ``path`` by renaming a finished file onto it: two releases' upstream
    runs (verify's two lanes) may build the same cache at once, and a reader never
    sees a half-written file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def run_mode(release: Release, tree: Path, mode: str) -> dict[str, Any]:
    """Run the release's test files in one pytest process in ``mode``; its JSON report."""
    report = BUILD / f"report-{release.version}-{mode}.json"
    report.unlink(missing_ok=True)
    env = dict(os.environ)
    env.update(
        KVCACHE_UPSTREAM_MODE=mode,
        KVCACHE_UPSTREAM_VERSION=release.version,
        KVCACHE_UPSTREAM_REPORT=str(report),
        PYTHONPATH=os.pathsep.join([str(tree), str(ROOT), *filter(None, [env.get("PYTHONPATH")])]),
        HF_HOME=str(offline_model_cache()),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "ERROR"),
        PYTHONHASHSEED=env.get("PYTHONHASHSEED", "0"),
    )
    command = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
        "-p", "kvcache.kit.upstream_plugin", "-W", "ignore",
        "--continue-on-collection-errors", "--rootdir", str(tree),
        *release.files,
    ]  # fmt: skip
    log = BUILD / f"pytest-{release.version}-{mode}.log"
    with log.open("w") as out:
        subprocess.run(command, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT)
    if not report.exists():
        raise RuntimeError(f"mode {mode}: pytest wrote no report (see {log})")
    result: dict[str, Any] = json.loads(report.read_text())
    result["log"] = str(log.relative_to(ROOT))
    return result


@dataclass
class Verdict:
    """What the three runs of one release say."""

    version: str
    baseline: list[str]  # passed on vLLM and not excluded
    passed: dict[str, list[str]]
    failed: dict[str, list[str]] = field(default_factory=dict)
    excluded: dict[str, str] = field(default_factory=dict)
    fallbacks: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    known_failing: dict[str, str] = field(default_factory=dict)
    compiled: bool = False
    audit: dict[str, dict[str, int]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """The stage's one line."""
        m = len(self.baseline)
        vocabulary = (
            f"{len(self.passed['vocabulary'])} passed of {m} (kvcache vocabulary)"
            if "vocabulary" in self.passed
            else "kvcache vocabulary not run"
        )
        return (
            f"upstream: {len(self.passed['objects'])} passed of {m} (vLLM objects), "
            f"{vocabulary}; vLLM itself {m}"
            + f" [vLLM {self.version}, {'compiled' if self.compiled else 'pure'} build; "
            f"{len(self.excluded)} excluded, "
            f"{len(self.known_failing)} known failing]"
        )


def judge(release: Release, reports: dict[str, dict[str, Any]]) -> Verdict:
    """Compare the three runs: every baseline test must pass in both swapped modes."""
    excluded = {
        nodeid: rule.reason
        for nodeid in reports["vllm"]["outcomes"]
        for rule in release.excluded
        if rule.matches(nodeid)
    }
    baseline = sorted(
        nodeid
        for nodeid, outcome in reports["vllm"]["outcomes"].items()
        if outcome == "passed" and nodeid not in excluded
    )
    swapped = release.modes[1:]
    compiled = any(reports[m].get("compiled") for m in swapped)
    rules = release.known_failing + (release.known_failing_compiled if compiled else ())
    known = {nodeid: rule.reason for nodeid in baseline for rule in rules if rule.matches(nodeid)}
    verdict = Verdict(
        release.version, baseline, passed={}, excluded=excluded, known_failing=known,
        compiled=compiled,
    )  # fmt: skip
    for mode in swapped:
        outcomes = reports[mode]["outcomes"]
        verdict.passed[mode] = [n for n in baseline if outcomes.get(n) == "passed"]
        verdict.failed[mode] = [
            n for n in baseline if outcomes.get(n) != "passed" and n not in known
        ]
        verdict.fallbacks[mode] = reports[mode]["fallbacks"]
        verdict.audit[mode] = reports[mode]["audit"]
        if reports[mode]["audit"]:
            verdict.problems.append(
                f"{mode}: vLLM's own core logic ran: {sorted(reports[mode]['audit'])[:10]}"
            )
        if not reports[mode]["kvcache_calls"] and not reports[mode].get("compiled"):
            verdict.problems.append(f"{mode}: no kvcache function ran (the swap did not take)")
        if verdict.failed[mode]:
            verdict.problems.append(
                f"{mode}: {len(verdict.failed[mode])} tests pass on vLLM but not on kvcache"
            )
    stale = [n for n in known if all(reports[m]["outcomes"].get(n) == "passed" for m in swapped)]
    if stale:
        verdict.problems.append(
            f"{len(stale)} known-failing tests pass now: drop them from known_failing: {stale[:5]}"
        )
    # The audit's teeth: on stock vLLM it must see vLLM's core logic run.
    if not reports["vllm"]["audit"]:
        verdict.problems.append("vllm: the call audit saw no vLLM core function run")
    if not baseline:
        verdict.problems.append("vllm: no test passed on vLLM itself")
    return verdict


def main(argv: list[str] | None = None) -> int:
    """Fetch, run the three modes, print the failures and the summary line."""
    parser = argparse.ArgumentParser(prog="python -m kvcache.kit.upstream", description=__doc__)
    parser.add_argument("--version", default="0.25.1", choices=sorted(RELEASES))
    parser.add_argument("--json", type=Path, help="write the verdict here")
    parser.add_argument("--verbose", "-v", action="store_true", help="list failing tests")
    parser.add_argument(
        "--reuse-baseline",
        action="store_true",
        help="take stock vLLM's outcomes from the last run's report (when debugging kvcache)",
    )
    args = parser.parse_args(argv)
    release = RELEASES[args.version]
    started = time.monotonic()
    tree = fetch_tests(release.version)
    reports = {}
    for mode in release.modes:
        saved = BUILD / f"report-{release.version}-{mode}.json"
        if mode == "vllm" and args.reuse_baseline and saved.exists():
            reports[mode] = json.loads(saved.read_text()) | {"log": "(reused)"}
        else:
            reports[mode] = run_mode(release, tree, mode)
    verdict = judge(release, reports)
    if args.json:
        args.json.write_text(json.dumps(verdict.__dict__, indent=1, sort_keys=True))
    for mode in release.modes[1:]:
        failed = verdict.failed[mode]
        shown = failed if args.verbose else failed[:15]
        for nodeid in shown:
            print(f"{mode}: FAILED {nodeid}")
        if len(shown) < len(failed):
            print(f"{mode}: ... and {len(failed) - len(shown)} more (see {reports[mode]['log']})")
        for module, names in sorted(verdict.fallbacks[mode].items()):
            print(f"{mode}: fallback to vLLM {module}: {', '.join(sorted(names))}")
    for nodeid, reason in sorted(verdict.excluded.items()):
        print(f"excluded: {nodeid}: {reason}")
    for nodeid, reason in sorted(verdict.known_failing.items()):
        print(f"known failing: {nodeid}: {reason}")
    for problem in verdict.problems:
        print(f"PROBLEM: {problem}")
    print(f"{verdict.summary()} in {time.monotonic() - started:.0f}s")
    return 1 if verdict.problems else 0


if __name__ == "__main__":
    sys.exit(main())
