"""The examples of docs/divergences.md's "vLLM <release>: matched although doubtful"
section, run on kvcache's profile of that release and on the release itself.

A release is a parameter (``release``, ``--release``; 0.33.0 is the one with such a
section today). Each entry of the section has one ``python`` block ending in a line
``result = ...  # vLLM 0.33.0: <repr>; kvcache: <repr>``. The section's first
block is a preamble that makes ``K = api("kvcache")``: the release's drop-in
(``kvcache.vllm_0_33`` for 0.33.0) with kvcache's specs and a few helpers. This
module reads the blocks out of the document and runs every one, in a fresh
namespace after the preamble, once per side (``api("vllm")`` gives the same names
from the installed vLLM, which must be that release), and compares
``repr(result)`` with what the comment claims for that side, so the document
cannot drift from either implementation.

``make conformance-0.33`` runs both sides first (``kvcache.kit.conformance``);
``tests/toolkit/test_doubts.py`` runs the kvcache side under any venv and both
where vLLM 0.33.0 is installed. By hand::

    .venv-0.33/bin/python -m kvcache.kit.doubts --release 0.33.0
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import textwrap
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The document.
DOC = Path(__file__).resolve().parents[2] / "docs" / "divergences.md"
#: The release whose section is read when none is named.
DEFAULT_RELEASE = "0.33.0"
#: The releases kvcache has a drop-in module for (``kvcache.vllm_<major>_<minor>``).
RELEASES = ("0.33.0",)


def check_release(release: str) -> str:
    """``release`` when kvcache has a drop-in module for it.

    Raises:
        ValueError: another release, named with the ones there are.
    """
    if release not in RELEASES:
        raise ValueError(
            f"release={release!r}: kvcache has no drop-in module for it; "
            f"choose from {', '.join(RELEASES)}"
        )
    return release


def section_heading(release: str = DEFAULT_RELEASE) -> str:
    """The heading of ``release``'s section of docs/divergences.md."""
    return f"## vLLM {release}: matched although doubtful"


def side_labels(release: str = DEFAULT_RELEASE) -> dict[str, str]:
    """The sides an example runs on, and the label its claim comment gives each."""
    return {"vllm": f"vLLM {release}", "kvcache": "kvcache"}


#: The default release's heading and side labels.
SECTION = section_heading()
SIDES = side_labels()
#: The version ``api("vllm")`` needs by default.
VLLM_VERSION = DEFAULT_RELEASE

_BLOCK = re.compile(r"^(?P<indent> *)```python\n(?P<code>.*?)^(?P=indent)```", re.M | re.S)
_TITLE = re.compile(r"^\d+\.\s+\*\*([^*]+?)\*\*", re.M)


def _claim(release: str) -> re.Pattern[str]:
    return re.compile(
        rf"#\s*vLLM {re.escape(release)}:\s*(?P<vllm>.+?);\s*kvcache:\s*(?P<kvcache>.+?)\s*$"
    )


def drop_in_module(release: str) -> str:
    """The name of kvcache's drop-in module for ``release`` (``kvcache.vllm_0_33``)."""
    major, minor = check_release(release).split(".")[:2]
    return f"kvcache.vllm_{major}_{minor}"


def outcome(call: Callable[[], Any]) -> Any:
    """``call()``'s value, or the name of the exception it raised (what an example
    compares: both sides' failures are part of the record)."""
    try:
        return call()
    except Exception as exc:  # the exception's name is the outcome
        return type(exc).__name__


def api(side: str, release: str = DEFAULT_RELEASE) -> types.SimpleNamespace:
    """The names the examples use, from kvcache's drop-in for ``release``
    (``"kvcache"``) or from the installed vLLM, which must be ``release``
    (``"vllm"``): the manager, the specs and config classes, the hasher and its seed,
    and two helpers, ``request(request_id, tokens, hash_block, report=None,
    lookahead=0)`` (a request hashed at ``hash_block`` tokens, with the release's
    ``kv_cache_report_mode`` when ``report`` is set) and
    ``config(num_blocks, *specs)`` (one group per spec).

    Raises:
        ValueError: ``side`` is not "kvcache" or "vllm", or ``release`` has no drop-in.
        RuntimeError: ``side`` is "vllm" and the installed vLLM is not ``release``.
    """
    check_release(release)
    if side == "kvcache":
        from kvcache import kv_cache_interface as iface
        from kvcache import kv_cache_utils, request
        drop_in: Any = importlib.import_module(drop_in_module(release))

        def kvcache_request(
            request_id: str, tokens: list[int], hash_block: int, report: str | None = None,
            lookahead: int = 0,
        ) -> Any:  # fmt: skip
            hasher = drop_in.get_request_block_hasher(hash_block, kv_cache_utils.sha256, lookahead)
            made: Any = request.Request(request_id, tokens, block_hasher=hasher)
            if report is not None:
                # kvcache's Request (0.25.1's vocabulary) has no such parameter; the
                # 0.33 profile reads the field off the request, as vLLM does.
                made.kv_cache_report_mode = report
            return made

        names = dict(
            KVCacheManager=drop_in.KVCacheManager,
            init_none_hash=drop_in.init_none_hash,
            sha256=kv_cache_utils.sha256,
            request=kvcache_request,
        )
    elif side == "vllm":
        import vllm

        if vllm.__version__ != release:
            raise RuntimeError(f"api('vllm') needs vLLM {release}, found {vllm.__version__}")
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1 import kv_cache_interface as iface  # type: ignore[no-redef]
        from vllm.v1.core import kv_cache_manager, kv_cache_utils  # type: ignore[no-redef]
        from vllm.v1.request import Request

        def vllm_request(
            request_id: str, tokens: list[int], hash_block: int, report: str | None = None,
            lookahead: int = 0,
        ) -> Any:  # fmt: skip
            # Any: type-checked against the installed vLLM, which may be 0.25.1's.
            make_hasher: Any = kv_cache_utils.get_request_block_hasher
            hasher = make_hasher(hash_block, sha256, lookahead)
            extra = None if report is None else {"kv_cache_report_mode": report}
            params = SamplingParams(max_tokens=16, extra_args=extra)
            return Request(request_id, tokens, params, None, arrival_time=0.0,
                           block_hasher=hasher)  # fmt: skip

        names = dict(
            KVCacheManager=kv_cache_manager.KVCacheManager,
            init_none_hash=kv_cache_utils.init_none_hash,
            sha256=sha256,
            request=vllm_request,
        )
    else:
        raise ValueError(f"side={side!r}; expected 'kvcache' or 'vllm'")

    def config(num_blocks: int, *specs: Any) -> Any:
        groups = [iface.KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(specs)]
        return iface.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                   kv_cache_groups=groups)  # fmt: skip

    return types.SimpleNamespace(
        **names,
        config=config,
        FullAttentionSpec=iface.FullAttentionSpec,
        SlidingWindowSpec=iface.SlidingWindowSpec,
        MambaSpec=iface.MambaSpec,
    )


@dataclass(frozen=True)
class Example:
    """One entry's code and what it claims ``repr(result)`` is on each side."""

    title: str
    code: str
    claims: dict[str, str]


def section_text(text: str, release: str = DEFAULT_RELEASE) -> str:
    """The section of ``text`` under ``release``'s heading (``section_heading``), up to
    the next ``## `` heading.

    Raises:
        ValueError: the document has no such section.
    """
    heading = section_heading(release)
    start = text.find(heading + "\n")
    if start < 0:
        raise ValueError(f"docs/divergences.md has no section {heading!r}")
    end = text.find("\n## ", start + len(heading))
    return text[start : None if end < 0 else end]


def examples(
    text: str | None = None, release: str = DEFAULT_RELEASE
) -> tuple[str, list[Example]]:
    """``release``'s section's preamble and its examples (``text``: the document,
    read from ``DOC`` by default).

    Raises:
        ValueError: no section, no preamble, an example without its claim line,
            or a numbered entry without an example.
    """
    heading = section_heading(release)
    section = section_text(DOC.read_text() if text is None else text, release)
    blocks = list(_BLOCK.finditer(section))
    if not blocks:
        raise ValueError(f"{heading!r} has no python block (the preamble comes first)")
    claims = _claim(release)
    codes = [textwrap.dedent(b.group("code")) for b in blocks]
    preamble = codes[0]
    found = []
    titles = list(_TITLE.finditer(section))
    for block, code in zip(blocks[1:], codes[1:], strict=True):
        before = [t for t in titles if t.start() < block.start()]
        title = " ".join(before[-1].group(1).split()) if before else "?"
        claim = next((m for m in map(claims.search, code.splitlines()) if m), None)
        if claim is None or "result =" not in code:
            raise ValueError(f"the example of {title!r} has no line "
                             f"'result = ...  # vLLM {release}: ...; kvcache: ...'")  # fmt: skip
        found.append(Example(title, code, claim.groupdict()))
    if len(found) != len(titles):
        raise ValueError(f"{len(titles)} entries but {len(found)} examples in {heading!r}")
    return preamble, found


def run_example(
    preamble: str, example: Example, side: str, release: str = DEFAULT_RELEASE
) -> str:
    """``repr(result)`` after the preamble (with ``api(side, release)``) and
    ``example``, in a fresh namespace."""
    if side not in SIDES:
        raise ValueError(f"side={side!r}; expected one of {', '.join(SIDES)}")
    namespace: dict[str, Any] = {"__name__": "doubts_example"}
    code = preamble.replace('api("kvcache")', f"api({side!r}, {release!r})")
    # The document's own code, run as a reader pasting it would.
    exec(compile(code, "<preamble>", "exec"), namespace)
    exec(compile(example.code, f"<{example.title}>", "exec"), namespace)
    return repr(namespace["result"])


def check(
    sides: Sequence[str] = ("vllm", "kvcache"),
    text: str | None = None,
    release: str = DEFAULT_RELEASE,
) -> list[str]:
    """Every example of ``release``'s section on every side in ``sides``: the lines
    of the claims that do not hold (empty when the document is right)."""
    preamble, found = examples(text, release)
    labels = side_labels(release)
    failures = []
    for example in found:
        for side in sides:
            observed = run_example(preamble, example, side, release)
            if observed != example.claims[side]:
                failures.append(f"{example.title!r} on {labels[side]}: claimed "
                                f"{example.claims[side]}, observed {observed}")  # fmt: skip
    return failures


def summary_label(release: str) -> str:
    """The label of the summary line for ``release`` (``doubts-0.33``)."""
    return "doubts-" + ".".join(release.split(".")[:2])


def main(argv: Sequence[str] | None = None) -> int:
    """Check every example on the sides named (default both); 0 when every claim
    holds, 2 on a bad argument."""
    parser = argparse.ArgumentParser(prog="python -m kvcache.kit.doubts")
    parser.add_argument("sides", nargs="*", default=[],
                        help="the sides to run: vllm, kvcache (default: both)")  # fmt: skip
    parser.add_argument("--release", default=DEFAULT_RELEASE,
                        help=f"whose section to check (default {DEFAULT_RELEASE})")  # fmt: skip
    args = parser.parse_args(argv)
    if args.release not in RELEASES:
        print(f"doubts: --release={args.release!r}: kvcache has no drop-in module for it; "
              f"choose from {', '.join(RELEASES)}", file=sys.stderr)  # fmt: skip
        return 2
    bad = [side for side in args.sides if side not in SIDES]
    if bad:
        print(f"doubts: side={bad[0]!r}: expected one of {', '.join(SIDES)}", file=sys.stderr)
        return 2
    sides = list(args.sides) or ["vllm", "kvcache"]
    failures = check(sides, release=args.release)
    count = len(examples(release=args.release)[1])
    print(f"{summary_label(args.release)}: {count} examples of docs/divergences.md on "
          f"{', '.join(sides)}: {len(failures)} claims wrong", flush=True)  # fmt: skip
    for line in failures:
        print(f"  {line}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
