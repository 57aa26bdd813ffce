"""kvcache's pure arithmetic against the spec's, input by input (docs/mutation.md).

``proofs/`` proves these with CrossHair, but ``make verify``'s pytest run reached
some of them only through the stateful machines, whose short mutation-testing
budget rarely hits the corner that tells a mutant apart (Mamba "align" with
speculative blocks, chunked-local admission caps). Here every twin pair of
``proofs.manifest.PAIRS`` (``spec.pure`` vs ``kvcache.kv_cache_math``) is compared
on small generated arguments within the pair's own domain, and the functions
kvcache alone has are checked against their PEP 316 ``post:`` lines.

The functions called are those ``import kvcache`` loaded, compiled (mypyc) or
not; their parameters (names, annotations) and contract lines are read from the
source module (``SOURCE``), since compiled functions carry neither.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import itertools
import re
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import kvcache
import spec.pure
from kvcache import kv_cache_math
from proofs.manifest import CONTRACTS, PAIRS

SMALL = st.integers(-2, 12)


def _load_source() -> Any:
    """``kvcache/kv_cache_math.py`` itself, under a private name (a leaf module)."""
    path = inspect.getfile(kvcache).replace("__init__.py", "kv_cache_math.py")
    loaded = importlib.util.spec_from_file_location("_kv_cache_math_source", path)
    assert loaded is not None and loaded.loader is not None
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return module


SOURCE = _load_source()


def resolve(dotted: str) -> Callable[..., Any]:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def source_of(dotted: str) -> Callable[..., Any]:
    """The pure-Python definition of a ``kvcache.kv_cache_math`` function: its
    signature and docstring (a compiled function has neither)."""
    return getattr(SOURCE, dotted.rpartition(".")[2])  # type: ignore[no-any-return]


def test_the_twins_are_the_loaded_build() -> None:
    """The subjects compared are the build ``import kvcache`` loaded (compiled under
    ``make setup``), and their parameters come from the source beside it."""
    for pair in MATH_PAIRS:
        subject = resolve(pair.subject)
        assert subject is getattr(kv_cache_math, subject.__name__)
        assert inspect.isfunction(subject) != kvcache.COMPILED, pair.subject
        assert list(inspect.signature(source_of(pair.subject)).parameters)


def argument(name: str, annotation: str) -> st.SearchStrategy[Any]:
    """A small-domain strategy for one parameter, chosen by its name and annotation."""
    if annotation == "bool":
        return st.booleans()
    if annotation == "int | None":
        return st.none() | SMALL
    if name == "block_hashes":
        return st.lists(st.integers(0, 4), max_size=10)
    if name == "cached":
        return st.sets(st.integers(0, 4))
    if name == "blocks":
        return st.lists(st.integers(0, 3), max_size=8)
    if name == "boundaries":  # token positions a replay resumes at
        return st.lists(SMALL, max_size=3)
    if name == "null":
        return st.integers(0, 1)
    assert annotation == "int", (name, annotation)
    return SMALL


MATH_PAIRS = [p for p in PAIRS if p.subject.startswith("kvcache.kv_cache_math.")]


@pytest.mark.parametrize("pair", MATH_PAIRS, ids=[p.name for p in MATH_PAIRS])
# Each pair's domain filters the drawn arguments (assume): a run that draws many
# outside it is slow, not wrong.
@settings(max_examples=200, suppress_health_check=[HealthCheck.filter_too_much])
@given(data=st.data())
def test_math_twin_agrees_with_spec(pair: Any, data: st.DataObject) -> None:
    oracle, subject = resolve(pair.oracle), resolve(pair.subject)
    params = inspect.signature(source_of(pair.subject)).parameters
    args = [data.draw(argument(n, str(p.annotation)), label=n) for n, p in params.items()]
    assume(pair.domain(*args))
    try:
        expected: Any = ("ok", oracle(*args))
    except Exception as exc:  # the spec's asserts: both must refuse
        expected = ("raise", type(exc))
    try:
        actual: Any = ("ok", subject(*args))
    except Exception as exc:
        actual = ("raise", type(exc))
    if expected[0] == "raise":
        assert actual[0] == "raise", (args, actual)
    else:
        assert actual == expected, args


KVCACHE_ONLY = [c.target for c in CONTRACTS if c.target.startswith("kvcache.kv_cache_math.")]


def conditions(fn: Callable[..., Any], kind: str) -> list[str]:
    return [m.strip() for m in re.findall(rf"^\s*{kind}:(.*)$", fn.__doc__ or "", re.M)]


@pytest.mark.parametrize("target", KVCACHE_ONLY)
@settings(max_examples=200)
@given(data=st.data())
def test_contract_of_kvcache_only_function(target: str, data: st.DataObject) -> None:
    fn, source = resolve(target), source_of(target)
    params = inspect.signature(source).parameters
    args = {n: data.draw(st.integers(-1, 40), label=n) for n in params}
    scope = {**vars(kv_cache_math), **args}
    assume(all(eval(pre, scope) for pre in conditions(source, "pre")))
    scope["__return__"] = fn(**args)
    for post in conditions(source, "post"):
        assert eval(post, scope), (post, args, scope["__return__"])


def test_chunked_local_hit_range_on_every_tiny_input() -> None:
    """Exhaustive over three hashes: the one-token, one-block chunk corners that
    random draws rarely combine."""
    hashes = [0, 1, 2]
    for r in range(4):
        for cached in map(set, itertools.combinations(hashes, r)):
            for length, chunk, bs in itertools.product(range(4), range(1, 4), range(1, 4)):
                if length // bs <= len(hashes):
                    args = (hashes, cached, length, chunk, bs)
                    expected = spec.pure.chunked_local_hit_range(*args)
                    assert kv_cache_math.chunked_local_hit_range(*args) == expected, args
