"""The C extension ``kvcache._blockhash`` (keyless sha256 block-hash chains, issue 28):
its hashes are ``hashlib.sha256(pickle.dumps((parent, tuple(block), None), 5))``
byte for byte, it answers None (the caller then pickles) for every input it does
not encode, and a request hasher gives the same hashes with it and without it.

The extension loads only with the compiled build, so this file (which ``make
verify`` runs on the pure build) loads it from its file beside the sources: it
must be there wherever a current compiled build is, as in CI.
"""

from __future__ import annotations

import enum
import hashlib
import importlib.machinery
import importlib.util
import os
import pickle
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

import kvcache
from kvcache import _builds
from kvcache import kv_cache_utils as utils
from kvcache.request import Request

Chain = Callable[[object, Sequence[int], int, int, int], "list[bytes] | None"]
PACKAGE = Path(_builds.__file__).resolve().parent
COMPILED_ON_DISK = _builds.has_compiled_modules() and _builds.compiled_is_current()

EDGES = (0, 1, 255, 256, 65535, 65536, 2**31 - 1, -1, -(2**31), 7919, 32000, 70000)
"""Tokens at each width pickle gives an int: BININT1, BININT2, BININT (negatives too)."""


def _load_chain() -> Chain | None:
    """``sha256_chain`` from the built extension beside the sources, or None."""
    module = sys.modules.get("kvcache._blockhash")
    if module is None:
        paths = [
            PACKAGE / f"_blockhash{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES
        ]
        path = next((p for p in paths if p.is_file()), None)
        if path is None:
            return None
        spec = importlib.util.spec_from_file_location("kvcache._blockhash", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)  # not in sys.modules: the pure build
        spec.loader.exec_module(module)
    chain: Chain = module.sha256_chain
    return chain


@pytest.fixture(scope="module")
def chain() -> Chain:
    found = _load_chain()
    if found is None:
        # CI builds the compiled variant before the tests: there this is a failure.
        if COMPILED_ON_DISK or os.environ.get("CI"):
            pytest.fail("the compiled build has no kvcache/_blockhash*.so (OpenSSL's headers?)")
        pytest.skip("no compiled build here (`make compiled` builds it)")
    return found


def pickled_chain(parent: bytes, tokens: Sequence[Any], block_size: int) -> list[bytes]:
    """The reference: each block's ``sha256(pickle.dumps((parent, block, None), 5))``."""
    hashes: list[bytes] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tuple(tokens[start : start + block_size])
        parent = hashlib.sha256(pickle.dumps((parent, block, None), protocol=5)).digest()
        hashes.append(parent)
    return hashes


def edge_tokens(count: int, salt: int = 0) -> list[int]:
    """``count`` tokens cycling through ``EDGES`` (shifted by ``salt``)."""
    return [EDGES[(i * 5 + salt) % len(EDGES)] for i in range(count)]


def test_the_extension_loads_with_the_compiled_build_only() -> None:
    assert (utils._sha256_chain is not None) == kvcache.COMPILED
    if not COMPILED_ON_DISK:
        return
    report = (
        "import kvcache, importlib; from kvcache import kv_cache_utils as u\n"
        "try:\n    importlib.import_module('kvcache._blockhash'); ext = True\n"
        "except ImportError:\n    ext = False\n"
        "print(kvcache.COMPILED, u._sha256_chain is not None, ext)"
    )
    environment = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHE_")}
    environment["PYTHONPATH"] = str(PACKAGE.parent)
    for env, expected in (({}, "True True True"), ({"KVCACHE_PURE": "1"}, "False False False")):
        result = subprocess.run(
            [sys.executable, "-c", report], env={**environment, **env}, cwd=PACKAGE.parent,
            capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
        assert result.stdout.split() == expected.split(), (env, result.stderr)


@pytest.mark.parametrize("block_size", [1, 2, 3, 4, 5, 16, 17, 256, 2048])
def test_chain_is_pickle_and_hashlib_byte_for_byte(chain: Chain, block_size: int) -> None:
    tokens = edge_tokens(3 * block_size + block_size // 2, salt=block_size)
    for parent in (b"\x01" * 32, utils.sha256("seed"), b"", b"\x02", b"\x03" * 255, b"\x04" * 256):
        expected = pickled_chain(parent, tokens, block_size)
        assert len(expected) == 3
        assert chain(parent, tokens, 0, len(tokens), block_size) == expected
        assert chain(parent, tuple(tokens), 0, len(tokens), block_size) == expected
    # From an offset, up to a stop that is not a block boundary.
    parent = b"\x05" * 32
    offset = block_size // 2 + 1
    assert chain(parent, tokens, offset, len(tokens), block_size) == pickled_chain(
        parent, tokens[offset:], block_size
    )


def test_every_token_width_and_tuple_length() -> None:
    """The reference itself against ``kv_cache_utils.sha256`` (kvcache's hash function),
    and the chain on every single edge token and every short tuple."""
    chain = _load_chain()
    for size in range(1, 9):
        for salt in range(len(EDGES)):
            tokens = edge_tokens(size, salt)
            expected = pickled_chain(b"\x06" * 32, tokens, size)
            assert expected == [utils.sha256((b"\x06" * 32, tuple(tokens), None))]
            if chain is not None:
                assert chain(b"\x06" * 32, tokens, 0, size, size) == expected


class Color(enum.IntEnum):
    RED = 1


@pytest.mark.parametrize(
    "bad",
    [2**31, -(2**31) - 1, 2**70, True, False, 1.0, "a", None, Color.RED],
    ids=repr,
)
def test_a_token_not_encoded_gives_none(chain: Chain, bad: object) -> None:
    tokens: list[Any] = [1, 2, 3, 4, 5, 6, 7, 8]
    tokens[5] = bad
    assert chain(b"\x01" * 32, tokens, 0, 8, 4) is None
    assert chain(b"\x01" * 32, tokens, 0, 4, 4) is not None  # the bad token not reached


class BytesSubclass(bytes):
    pass


@pytest.mark.parametrize(
    "parent", [bytearray(32), memoryview(b"\x01" * 32), BytesSubclass(b"\x01" * 32), None, 7]
)
def test_a_parent_not_exactly_bytes_gives_none(chain: Chain, parent: object) -> None:
    assert chain(parent, [1, 2, 3, 4], 0, 4, 2) is None


def test_bounds_and_arguments(chain: Chain) -> None:
    parent = b"\x01" * 32
    assert chain(parent, [1, 2, 3], 0, 4, 1) is None  # stop past the tokens: the caller's slicing
    assert chain(parent, [1, 2, 3], 0, 3, 4) == []
    assert chain(parent, [1, 2, 3], 2, 1, 1) == []
    assert chain(parent, range(6), 0, 6, 3) == pickled_chain(parent, list(range(6)), 3)
    with pytest.raises(ValueError, match="block_size"):
        chain(parent, [1], 0, 1, 0)
    with pytest.raises(ValueError, match="start"):
        chain(parent, [1], -1, 1, 1)
    with pytest.raises(TypeError):
        chain(parent, 5, 0, 1, 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        chain(parent, [1], 0, 1)  # type: ignore[call-arg]


@pytest.mark.parametrize(("token", "width"), [(5, 2), (500, 3), (70000, 5)])
def test_blocks_near_a_64_kib_frame(chain: Chain, token: int, width: int) -> None:
    """pickle starts a new frame once one reaches 64 KiB: such blocks (over ~13,000
    tokens) are left to pickle; the chain answers the same hashes or None."""
    parent = b"\x01" * 32
    last_answered = 0
    for size in range(65536 // width - 200, 65536 // width + 10):
        tokens = [token] * size
        got = chain(parent, tokens, 0, size, size)
        if got is not None:
            assert got == pickled_chain(parent, tokens, size), size
            last_answered = size
    assert last_answered > 0  # up to the margin below 64 KiB
    for length in (65000, 65535, 65536, 70000):  # a long parent, as BINBYTES, or left to pickle
        parent = b"\x07" * length
        got = chain(parent, [1, 2], 0, 2, 2)
        assert got is None or got == pickled_chain(parent, [1, 2], 2), length


def _hashes(
    hasher: Callable[[Request], list[Any]], prompt: list[Any], grow: Sequence[Sequence[Any]]
) -> list[list[Any]]:
    """A request's hashes when built, then after each chunk of appended tokens."""
    request = Request("r", prompt, block_hasher=hasher)
    seen = [list(request.block_hashes)]
    for chunk in grow:
        request.append_output_token_ids(list(chunk))
        seen.append(list(request.block_hashes))
    return seen


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_request_hasher_same_with_and_without_the_extension(
    chain: Chain, monkeypatch: pytest.MonkeyPatch, block_size: int
) -> None:
    prompt = edge_tokens(101)
    grow = [[3], [70000, 1], edge_tokens(5, 2), edge_tokens(16, 3), [2**31 - 1], edge_tokens(33)]
    # A token pickle writes otherwise (LONG1, NEWTRUE) mid-way: that call pickles.
    odd: list[list[Any]] = [[3], [2**31, 5], [True] * 20, [4] * 40]
    cases: list[tuple[list[Any], list[list[Any]]]] = [
        (prompt, grow),
        (prompt, odd),
        ([*prompt[:50], 2**40, *prompt[50:]], grow),
    ]

    monkeypatch.setattr(utils, "_sha256_chain", None)
    without = [_hashes(utils.get_request_block_hasher(block_size, utils.sha256), *c) for c in cases]
    calls = []

    def counted(*args: Any) -> list[bytes] | None:
        calls.append(args)
        return chain(*args)

    monkeypatch.setattr(utils, "_sha256_chain", counted)
    hasher = utils.get_request_block_hasher(block_size, utils.sha256)
    assert [_hashes(hasher, *c) for c in cases] == without
    assert calls  # the extension hashed them

    # The fast path is kvcache's sha256 (or vLLM's) only: a wrapper gets every block.
    blocks = []

    def wrapper(value: Any) -> bytes:
        blocks.append(value)
        return utils.sha256(value)

    calls.clear()
    assert _hashes(utils.get_request_block_hasher(block_size, wrapper), *cases[0]) == without[0]
    assert len(blocks) == len(without[0][-1]) and not calls
    # Nor with lookahead (vLLM 0.33.0's extra keys: the next tokens).
    assert utils.get_request_block_hasher(block_size, utils.sha256, num_hash_lookahead_tokens=1)(
        Request("r", prompt)
    )
    assert not calls


def test_request_hasher_with_vllms_sha256_and_request(
    chain: Chain, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's sha256 takes the fast path too, over vLLM's Request (its tokens a
    ``ConstantList``): the hashes of the pickle reference, as vLLM's hasher makes."""
    from kvcache.kit.adapters import vllm_available

    if not vllm_available():
        pytest.skip("vLLM 0.25.1 is not installed")
    from vllm.utils.hashing import sha256 as vllm_sha256
    from vllm.v1.core import kv_cache_utils as vllm_utils

    from kvcache.kit.sides import chain_seed, set_chain_seed
    from kvcache.kit.vllm_side import build_request

    calls = []

    def counted(*args: Any) -> list[bytes] | None:
        calls.append(args)
        return chain(*args)

    monkeypatch.setattr(utils, "_sha256_chain", counted)
    assert utils._is_pickle_sha256(vllm_sha256)
    tokens = edge_tokens(64)
    saved = chain_seed(vllm_utils)  # vLLM's NONE_HASH, for the tests after this one
    try:
        vllm_utils.init_none_hash(vllm_sha256)
        request = build_request({"request_id": "v", "prompt_token_ids": tokens}, 16, vllm_sha256)
        vllms = list(request.block_hashes)
        vllm_none_hash = vllm_utils.NONE_HASH
    finally:
        set_chain_seed(vllm_utils, saved)
    assert vllms == pickled_chain(vllm_none_hash, tokens, 16)
    request.block_hashes.clear()
    ours = utils.get_request_block_hasher(16, vllm_sha256)(request)
    assert isinstance(utils.NONE_HASH, bytes)
    assert calls and ours == pickled_chain(utils.NONE_HASH, tokens, 16)
