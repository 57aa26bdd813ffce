"""The examples of docs/divergences.md's "vLLM 0.33.0: matched although doubtful"
section, run on kvcache's 0.33 profile and on vLLM 0.33.0 itself.

Each entry of that section has one ``python`` block ending in a line
``result = ...  # vLLM 0.33.0: <repr>; kvcache: <repr>``. The section's first
block is a preamble that makes ``K = api("kvcache")``: the drop-in
(``kvcache.vllm_0_33``) with kvcache's specs and a few helpers. This module
reads the blocks out of the document and runs every one, in a fresh namespace
after the preamble, once per side (``api("vllm")`` gives the same names from
vLLM 0.33.0), and compares ``repr(result)`` with what the comment claims for
that side, so the document cannot drift from either implementation.

``make conformance-0.33`` runs both sides first (``kvcache.kit.conformance33``);
``tests/toolkit/test_doubts33.py`` runs the kvcache side under any venv and both
where vLLM 0.33.0 is installed. By hand::

    .venv-0.33/bin/python -m kvcache.kit.doubts33
"""

from __future__ import annotations

import re
import sys
import textwrap
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The document and the heading of its section.
DOC = Path(__file__).resolve().parents[2] / "docs" / "divergences.md"
SECTION = "## vLLM 0.33.0: matched although doubtful"
#: The sides an example runs on, and the label its comment gives each.
SIDES = {"vllm": "vLLM 0.33.0", "kvcache": "kvcache"}
#: The version ``api("vllm")`` needs.
VLLM_VERSION = "0.33.0"

_BLOCK = re.compile(r"^(?P<indent> *)```python\n(?P<code>.*?)^(?P=indent)```", re.M | re.S)
_CLAIM = re.compile(r"#\s*vLLM 0\.33\.0:\s*(?P<vllm>.+?);\s*kvcache:\s*(?P<kvcache>.+?)\s*$")
_TITLE = re.compile(r"^\d+\.\s+\*\*([^*]+?)\*\*", re.M)


def outcome(call: Callable[[], Any]) -> Any:
    """``call()``'s value, or the name of the exception it raised (what an example
    compares: both sides' failures are part of the record)."""
    try:
        return call()
    except Exception as exc:  # the exception's name is the outcome
        return type(exc).__name__


def api(side: str) -> types.SimpleNamespace:
    """The names the examples use, from kvcache's 0.33 drop-in (``"kvcache"``) or
    from vLLM 0.33.0 (``"vllm"``): the manager, the specs and config classes, the
    hasher and its seed, and two helpers, ``request(request_id, tokens, hash_block,
    report=None, lookahead=0)`` (a request hashed at ``hash_block`` tokens, with
    vLLM 0.33.0's ``kv_cache_report_mode`` when ``report`` is set) and
    ``config(num_blocks, *specs)`` (one group per spec).

    Raises:
        ValueError: ``side`` is not "kvcache" or "vllm".
        RuntimeError: ``side`` is "vllm" and the installed vLLM is not 0.33.0.
    """
    if side == "kvcache":
        from kvcache import kv_cache_interface as iface
        from kvcache import kv_cache_utils, request
        from kvcache import vllm_0_33 as drop_in

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

        if vllm.__version__ != VLLM_VERSION:
            raise RuntimeError(f"api('vllm') needs vLLM {VLLM_VERSION}, found {vllm.__version__}")
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


def section_text(text: str) -> str:
    """The section of ``text`` under ``SECTION``, up to the next ``## `` heading.

    Raises:
        ValueError: the document has no such section.
    """
    start = text.find(SECTION + "\n")
    if start < 0:
        raise ValueError(f"docs/divergences.md has no section {SECTION!r}")
    end = text.find("\n## ", start + len(SECTION))
    return text[start : None if end < 0 else end]


def examples(text: str | None = None) -> tuple[str, list[Example]]:
    """The section's preamble and its examples (``text``: the document, read from
    ``DOC`` by default).

    Raises:
        ValueError: no section, no preamble, an example without its claim line,
            or a numbered entry without an example.
    """
    section = section_text(DOC.read_text() if text is None else text)
    blocks = list(_BLOCK.finditer(section))
    if not blocks:
        raise ValueError(f"{SECTION!r} has no python block (the preamble comes first)")
    codes = [textwrap.dedent(b.group("code")) for b in blocks]
    preamble = codes[0]
    found = []
    titles = list(_TITLE.finditer(section))
    for block, code in zip(blocks[1:], codes[1:], strict=True):
        before = [t for t in titles if t.start() < block.start()]
        title = " ".join(before[-1].group(1).split()) if before else "?"
        claim = next((m for m in map(_CLAIM.search, code.splitlines()) if m), None)
        if claim is None or "result =" not in code:
            raise ValueError(f"the example of {title!r} has no line "
                             "'result = ...  # vLLM 0.33.0: ...; kvcache: ...'")  # fmt: skip
        found.append(Example(title, code, claim.groupdict()))
    if len(found) != len(titles):
        raise ValueError(f"{len(titles)} entries but {len(found)} examples in {SECTION!r}")
    return preamble, found


def run_example(preamble: str, example: Example, side: str) -> str:
    """``repr(result)`` after the preamble (with ``api(side)``) and ``example``, in a
    fresh namespace."""
    if side not in SIDES:
        raise ValueError(f"side={side!r}; expected one of {', '.join(SIDES)}")
    namespace: dict[str, Any] = {"__name__": "doubts33_example"}
    code = preamble.replace('api("kvcache")', f"api({side!r})")
    # The document's own code, run as a reader pasting it would.
    exec(compile(code, "<preamble>", "exec"), namespace)
    exec(compile(example.code, f"<{example.title}>", "exec"), namespace)
    return repr(namespace["result"])


def check(sides: Sequence[str] = ("vllm", "kvcache"), text: str | None = None) -> list[str]:
    """Every example on every side in ``sides``: the lines of the claims that do not
    hold (empty when the document is right)."""
    preamble, found = examples(text)
    failures = []
    for example in found:
        for side in sides:
            observed = run_example(preamble, example, side)
            if observed != example.claims[side]:
                failures.append(f"{example.title!r} on {SIDES[side]}: claimed "
                                f"{example.claims[side]}, observed {observed}")  # fmt: skip
    return failures


def main(argv: Sequence[str] | None = None) -> int:
    """Check every example on both sides; 0 when every claim holds."""
    sides = list(argv if argv is not None else sys.argv[1:]) or ["vllm", "kvcache"]
    failures = check(sides)
    count = len(examples()[1])
    print(f"doubts33: {count} examples of docs/divergences.md on {', '.join(sides)}: "
          f"{len(failures)} claims wrong", flush=True)  # fmt: skip
    for line in failures:
        print(f"  {line}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
