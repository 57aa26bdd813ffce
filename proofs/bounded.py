"""Deterministically bounded checks of the contracts and twin pairs of ``proofs/manifest.py``.

Every bound here is a count, never a duration, so a property gets the same verdict
on an idle or a loaded machine:

* CrossHair runs through its Python API with ``max_iterations`` (paths per condition
  or per pair) as its only limit: no per-condition or per-path timeout, and z3's
  wall-clock timeout replaced by ``CROSSHAIR_SMT_RLIMIT`` (a count of solver work,
  set by ``proofs/run.py`` before CrossHair is imported). CrossHair's search is
  seeded, so the same code explores the same paths in the same order;
* where CrossHair does not exhaust the paths within its cap, ``enumerate_inputs``
  checks the same property on every input of a small domain (``Domain``): ints
  ``-1..B``, both bools, ``None``, every list of up to ``max_len`` ints below
  ``alphabet``, every subset of them. ``B`` is the largest (up to ``max_int``) that
  keeps the cases within ``max_cases``; the verdict names the domain.

``python -m proofs.bounded`` runs the checks named in its JSON argument (a list of
``["contract", target, iterations, cases]`` or ``["pair", name, iterations, cases]``)
in that order, in one process, and prints one JSON line per check (``Verdict``).
``proofs/run.py`` runs each check in a fresh process, so no check's exploration
depends on what ran before it (z3's shared context, CrossHair's caches).
"""

from __future__ import annotations

import copy
import importlib
import itertools
import json
import math
import os
import sys
import time
import typing
from collections import Counter
from collections.abc import Callable, Container, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from types import UnionType
from typing import Any

PROVED, EXHAUSTED, COUNTEREXAMPLE, ERROR = "proved", "exhausted", "counterexample", "error"


@dataclass(frozen=True)
class Verdict:
    """The outcome of one check, as one JSON line."""

    kind: str
    name: str
    status: str
    """``proved`` (CrossHair exhausted every path), ``exhausted`` (the enumeration
    covered its domain), ``counterexample`` or ``error``."""
    detail: str
    evidence: str = ""


@dataclass(frozen=True)
class Domain:
    """The inputs ``enumerate_inputs`` tries, per parameter type."""

    max_int: int
    max_len: int = 4
    alphabet: int = 2
    """Two letters suffice for hashes: with ``cached`` any subset, every pattern of
    cached and uncached blocks of up to ``max_len`` blocks occurs."""

    def ints(self) -> range:
        """Every int from -1 to ``max_int``."""
        return range(-1, self.max_int + 1)

    def describe(self, types: list[Any], num_cases: int) -> str:
        """The bound, as the verdict line states it (the parts ``types`` use)."""
        names = {_kind(t) for t in types}
        parts = [f"ints -1..{self.max_int}"] if "int" in names else []
        if names & {"list", "set", "tables"}:
            parts.append(f"lists of <= {self.max_len} of 0..{self.alphabet - 1} and their sets")
        return ", ".join([*parts, f"{num_cases} inputs"])


# ---------------------------------------------------------------- CrossHair, bounded by counts


def _options(max_iterations: int) -> Any:
    from crosshair.options import DEFAULT_OPTIONS, AnalysisOptionSet

    return DEFAULT_OPTIONS.overlay(AnalysisOptionSet(
        max_iterations=max_iterations,
        per_condition_timeout=math.inf,
        per_path_timeout=math.inf,  # also no z3 timeout: CROSSHAIR_SMT_RLIMIT bounds it
        max_uninteresting_iterations=0,  # 0: no such stop (max_iterations is the bound)
        report_all=True,
        report_verbose=False,
    ))


def crosshair_contract(target: str, max_iterations: int) -> tuple[str, str, str]:
    """``(status, detail, evidence)`` of CrossHair on each ``post:`` of ``target``, at most
    ``max_iterations`` paths per condition."""
    from crosshair.core_and_libs import analyze_function
    from crosshair.statespace import MessageType

    fn = resolve(target)
    concrete_type_variables(fn)
    options = _options(max_iterations)
    checkables = analyze_function(fn, options)
    confirmed, unconfirmed, failures, paths = 0, 0, [], 0
    for checkable in checkables:
        stats: Counter[str] = Counter()
        checkable.options = replace(checkable.options, stats=stats)  # type: ignore[attr-defined]
        for message in checkable.analyze():
            if message.state == MessageType.CONFIRMED:
                confirmed += 1
            elif message.state in (MessageType.CANNOT_CONFIRM, MessageType.PRE_UNSAT):
                unconfirmed += 1
            else:
                failures.append(f"{message.filename}:{message.line}: {message.message}")
        paths += stats["num_paths"]
    total = confirmed + unconfirmed
    if failures:
        return COUNTEREXAMPLE, "", "\n".join(failures)
    if total == 0:
        return ERROR, "", f"{target}: no post: condition was checked"
    return (PROVED if confirmed == total else ""), (
        f"{confirmed}/{total} conditions on all paths, {paths} paths"), ""


def concrete_type_variables(fn: Callable[..., Any]) -> None:
    """Read ``fn``'s type variables as ints (``Sequence[T]`` as ``list[int]``,
    ``Container[H]`` as ``set[int]``), in this process only, as the pairs do
    (``manifest.Pair.types``). For a bare type variable CrossHair would pick a
    class among all those loaded, in an order that differs from run to run (and
    some, third-party, break on symbolic values)."""
    hints = typing.get_type_hints(fn)
    concrete: dict[str, Any] = {}
    for name, hint in hints.items():
        args = typing.get_args(hint)
        if isinstance(hint, typing.TypeVar):
            concrete[name] = int
        elif args and isinstance(args[0], typing.TypeVar):
            origin = typing.get_origin(hint)
            concrete[name] = set[int] if origin is Container else list[int]
        else:
            concrete[name] = hint
    fn.__annotations__ = concrete


def crosshair_pair(name: str, max_iterations: int) -> tuple[str, str, str]:
    """``(status, detail, evidence)`` of CrossHair's diffbehavior on the pair's wrappers,
    at most ``max_iterations`` paths in all (half per argument order)."""
    from crosshair.diff_behavior import diff_behavior
    from crosshair.fnutil import FunctionInfo

    pairs = importlib.import_module("proofs.pairs")
    options = replace(_options(max_iterations), stats=Counter())
    fns = [FunctionInfo.from_fn(getattr(pairs, f"{name}__{role}"))
           for role in ("oracle", "subject")]
    nondeterministic: list[bool] = []
    diffs = diff_behavior(fns[0], fns[1], options,
                          on_nondeterminism=lambda: nondeterministic.append(True))
    if isinstance(diffs, str):
        return ERROR, "", diffs
    if nondeterministic:
        return ERROR, "", "CrossHair saw a nondeterministic path"
    if diffs:
        return COUNTEREXAMPLE, "", "\n".join(
            f"Given {diff.args}: oracle {diff.result1.describe(set())}, "
            f"subject {diff.result2.describe(set())}" for diff in diffs)
    paths = options.stats["num_paths"]
    if options.stats["exhaustion"] > 0:
        return PROVED, f"all paths exhausted, {paths} paths", ""
    return "", f"no difference in {paths} paths", ""


# ---------------------------------------------------------------- enumeration of a small domain


def resolve(dotted: str) -> Callable[..., Any]:
    """The function at ``package.module.function``."""
    module_name, _, attr = dotted.rpartition(".")
    fn: Callable[..., Any] = getattr(importlib.import_module(module_name), attr)
    return fn


def parameter_types(fn: Callable[..., Any],
                    overrides: typing.Mapping[str, Any] | None = None) -> list[Any]:
    """The annotation of each parameter (type variables read as ``int``)."""
    hints = typing.get_type_hints(getattr(fn, "__wrapped__", fn))
    names = list(hints)
    if "return" in names:
        names.remove("return")
    return [(overrides or {}).get(name, hints[name]) for name in names]


def _kind(annotation: Any) -> str:
    """``int``, ``bool``, ``list``, ``set`` or ``tables`` (a list of lists)."""
    if isinstance(annotation, typing.TypeVar) or annotation is int:
        return "int"
    if annotation is bool:
        return "bool"
    origin = typing.get_origin(annotation)
    if origin in (UnionType, typing.Union):
        kinds = {_kind(a) for a in typing.get_args(annotation) if a is not type(None)}
        return "int" if "int" in kinds else kinds.pop()
    if origin in (set, Container) or annotation in (set, Container):
        return "set"
    args = typing.get_args(annotation)
    return "tables" if args and typing.get_origin(args[0]) is list else "list"


def values_of(annotation: Any, domain: Domain) -> list[Any]:
    """Every value of ``annotation`` in ``domain``."""
    if isinstance(annotation, typing.TypeVar) or annotation is int:
        return list(domain.ints())
    if annotation is bool:
        return [False, True]
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (UnionType, typing.Union):
        return [v for arg in args for v in ([None] if arg is type(None)
                                             else values_of(arg, domain))]
    letters = range(domain.alphabet)
    if origin in (set, Container) or annotation in (set, Container):
        return [set(c) for n in range(domain.alphabet + 1) for c in itertools.combinations(
            letters, n)]
    if origin in (list, Sequence) or annotation in (list, Sequence):
        if args and typing.get_origin(args[0]) is list:  # a batch of block tables
            rows = [list(p) for n in range(3) for p in itertools.product(letters, repeat=n)]
            return [list(p) for n in range(3) for p in itertools.product(rows, repeat=n)]
        return [list(p) for n in range(domain.max_len + 1)
                for p in itertools.product(letters, repeat=n)]
    raise TypeError(f"no enumeration for parameter type {annotation!r}")


def pick_domain(types: list[Any], max_cases: int, max_int: int = 24) -> tuple[Domain, int]:
    """The widest ``Domain`` (largest ``max_int``) whose cases fit ``max_cases``."""
    for bound in range(max_int, 0, -1):
        domain = Domain(bound)
        num_cases = math.prod(len(values_of(t, domain)) for t in types)
        if num_cases <= max_cases:
            return domain, num_cases
    domain = Domain(1)
    return domain, math.prod(len(values_of(t, domain)) for t in types)


def inputs(types: list[Any], domain: Domain) -> Iterator[tuple[Any, ...]]:
    """Every argument tuple of ``domain`` (fresh copies of mutable values)."""
    for args in itertools.product(*(values_of(t, domain) for t in types)):
        yield copy.deepcopy(args)


def conditions(fn: Callable[..., Any], prefix: str) -> list[tuple[str, Any]]:
    """The compiled ``pre:`` or ``post:`` lines of ``fn``'s docstring."""
    lines = [line.strip()[len(prefix):].strip() for line in (fn.__doc__ or "").splitlines()
             if line.strip().startswith(prefix)]
    return [(line, compile(line, f"<{prefix} {fn.__name__}>", "eval")) for line in lines]


def _call(fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[str, Any]:
    try:
        return "ok", fn(*args)
    except Exception as exc:  # compared by type and message, as diffbehavior does
        return "raise", f"{type(exc).__name__}: {exc}"


def enumerate_contract(target: str, max_cases: int) -> tuple[str, str, str]:
    """Every input of the domain that meets the ``pre:`` lines meets every ``post:``."""
    fn = resolve(target)
    types = parameter_types(fn)
    names = list(typing.get_type_hints(fn))[:len(types)]
    pre, post = conditions(fn, "pre:"), conditions(fn, "post:")
    domain, num_cases = pick_domain(types, max_cases)
    num_met = 0
    for args in inputs(types, domain):
        scope = {**fn.__globals__, **dict(zip(names, args, strict=True))}
        try:
            if not all(eval(code, scope) for _, code in pre):
                continue
        except Exception:  # a precondition that raises is not met (as CrossHair)
            continue
        num_met += 1
        outcome, result = _call(fn, copy.deepcopy(args))
        if outcome == "raise":
            return COUNTEREXAMPLE, "", f"{target}{args} raised {result}"
        scope["__return__"] = result
        for line, code in post:
            try:
                holds = eval(code, scope)
            except Exception as exc:
                holds, line = False, f"{line} (raised {type(exc).__name__}: {exc})"
            if not holds:
                return COUNTEREXAMPLE, "", f"{target}{args} -> {result!r}: false: {line}"
    if num_met == 0:
        return ERROR, "", f"{target}: no input of {domain.describe(types, num_cases)} meets pre:"
    return EXHAUSTED, f"{domain.describe(types, num_cases)}, {num_met} meet pre:", ""


def enumerate_pair(name: str, max_cases: int) -> tuple[str, str, str]:
    """Oracle and subject agree (result, exception, argument mutations) on the domain."""
    from proofs.manifest import PAIRS

    (pair,) = [p for p in PAIRS if p.name == name]
    pairs = importlib.import_module("proofs.pairs")
    oracle, subject = (getattr(pairs, f"{name}__{role}") for role in ("oracle", "subject"))
    types = parameter_types(resolve(pair.oracle), pair.types)
    domain, num_cases = pick_domain(types, max_cases)
    num_in_domain = 0
    for args in inputs(types, domain):
        if not pair.domain(*args):
            continue
        num_in_domain += 1
        args_oracle, args_subject = copy.deepcopy(args), copy.deepcopy(args)
        out_oracle, out_subject = _call(oracle, args_oracle), _call(subject, args_subject)
        if out_oracle != out_subject or args_oracle != args_subject:
            return COUNTEREXAMPLE, "", (f"Given {args}: {pair.oracle} -> {out_oracle}, "
                                        f"{pair.subject} -> {out_subject}")
    return EXHAUSTED, f"{domain.describe(types, num_cases)}, {num_in_domain} in the domain", ""


# ---------------------------------------------------------------- one check, a worker


ENUMERATE_ONLY_ENV = "PROOFS_ENUMERATE_ONLY"
"""Set to 1 by ``proofs.run`` after a check's CrossHair run passed the safety limit:
the check is then decided by its enumeration alone."""


def check(kind: str, name: str, max_iterations: int, max_cases: int) -> Verdict:
    """CrossHair within ``max_iterations``; the enumeration when it did not exhaust."""
    label = name if kind == "contract" else f"pair {name}"
    try:
        if os.environ.get(ENUMERATE_ONLY_ENV) == "1":
            status, detail, evidence = "", "stopped at the safety limit", ""
        else:
            symbolic = crosshair_contract if kind == "contract" else crosshair_pair
            status, detail, evidence = symbolic(name, max_iterations)
        if status:
            return Verdict(kind, label, status, detail, evidence)
        enumerate_ = enumerate_contract if kind == "contract" else enumerate_pair
        status, enum_detail, evidence = enumerate_(name, max_cases)
        if status == EXHAUSTED:
            detail = f"{enum_detail}; CrossHair: {detail} (cap {max_iterations})"
        return Verdict(kind, label, status, detail, evidence)
    except Exception as exc:  # the check could not run: say why
        return Verdict(kind, label, ERROR, "", f"{type(exc).__name__}: {exc}")


def main(argv: list[str]) -> int:
    """Run the checks of ``argv[0]`` (JSON) in order; one JSON ``Verdict`` per line."""
    import crosshair.core_and_libs  # noqa: F401  (loads the opcode patches every check needs)
    from crosshair.util import CROSSHAIR_SMT_RLIMIT

    if CROSSHAIR_SMT_RLIMIT <= 0:
        print("CROSSHAIR_SMT_RLIMIT is not set: z3 would stop on wall-clock time",
              file=sys.stderr)
        return 2
    for kind, name, max_iterations, max_cases in json.loads(argv[0]):
        cpu = time.process_time()
        print(json.dumps(asdict(check(kind, name, int(max_iterations), int(max_cases)))),
              flush=True)
        print(f"{name}: {time.process_time() - cpu:.1f}s of CPU", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
