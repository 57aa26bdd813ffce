"""Request streams from files (``--requests-from``), as workloads for the one scheduler loop.

Two formats (``docs/request-streams.md``):

* ``mooncake``: the FAST'25 Mooncake traces (kvcache-ai/Mooncake,
  FAST25-release/README.md): one JSON object a line with ``timestamp`` (ms),
  ``input_length``, ``output_length`` and ``hash_ids``, one id per 512-token block,
  equal ids meaning equal content. The traces carry no tokens, so each id is given
  ``block_tokens`` token ids by a fixed function of the id (``segment_tokens``), the
  last block cut to the request's length: equal ids give equal tokens, and a shared
  id prefix a shared prompt prefix, on every implementation and every run.
* ``jsonl``: kvcache's own, for hand-written or generated streams: prompt token ids
  or a length (optionally starting with shared segments named by ``prefix_ids``), an
  arrival, an output length, an optional LoRA and cache salt.

Either becomes a ``Workload`` whose requests are built on demand (a 12,000-request
trace of 12,000-token prompts would not fit in memory as tuples), run by the one
scheduler loop of ``kvcache.kit.workloads.simulate`` on every implementation, so
results can be, and are, compared call by call (``kvcache.kit.sweeps``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import random
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

from kvcache.kit.workloads import GroupLayout, RequestSpec, Workload

FORMATS = ("mooncake", "jsonl")
#: Tokens per hash id in the Mooncake traces.
MOONCAKE_BLOCK_TOKENS = 512

JSONL_FIELDS = frozenset(
    {
        "request_id",
        "prompt_token_ids",
        "prompt_length",
        "prefix_ids",
        "arrival",
        "timestamp",
        "output_length",
        "cache_salt",
        "lora",
    }
)


class StreamError(ValueError):
    """A request stream that cannot be read: names the file, the line and the field."""


@dataclass(frozen=True)
class StreamEntry:
    """One request of a stream, compact: its prompt is built when it arrives.

    ``segments`` name the prompt's leading blocks of ``block_tokens`` tokens each
    (Mooncake hash ids, or a jsonl line's ``prefix_ids``); ``explicit`` holds a jsonl
    line's own token ids instead. Tokens past the segments are the request's own.
    """

    request_id: str
    segments: tuple[int | str, ...]
    explicit: tuple[int, ...] | None
    prompt_length: int
    output_length: int
    arrival_step: int
    cache_salt: str | None = None
    lora: tuple[str, int] | None = None
    line: int = 0
    block_tokens: int = MOONCAKE_BLOCK_TOKENS


@functools.lru_cache(maxsize=4096)
def segment_tokens(key: int | str, block_tokens: int) -> tuple[int, ...]:
    """The ``block_tokens`` token ids (each in [0, 65536)) of the block named ``key``.

    A fixed function of the key's text (SHAKE-128 of it), so equal keys give equal
    content on every run and machine; the first tokens of a block do not depend on
    ``block_tokens``, so a block cut short is a prefix of the whole block.
    """
    data = hashlib.shake_128(f"kvcache-stream-block:{key}".encode()).digest(2 * block_tokens)
    return tuple(array("H", data))


def own_tokens(request_id: str, count: int) -> tuple[int, ...]:
    """``count`` token ids that only this request has (a function of its id)."""
    if count <= 0:
        return ()
    data = hashlib.shake_128(f"kvcache-stream-own:{request_id}".encode()).digest(2 * count)
    return tuple(array("H", data))


def entry_tokens(entry: StreamEntry) -> tuple[int, ...]:
    """The prompt token ids of ``entry``: its segments' blocks, then its own tokens,
    cut to its prompt length."""
    if entry.explicit is not None:
        return entry.explicit
    tokens: list[int] = []
    for key in entry.segments:
        if len(tokens) >= entry.prompt_length:
            break
        tokens.extend(segment_tokens(key, entry.block_tokens))
    if len(tokens) >= entry.prompt_length:
        return tuple(tokens[: entry.prompt_length])
    return tuple(tokens) + own_tokens(entry.request_id, entry.prompt_length - len(tokens))


def entry_spec(entry: StreamEntry) -> RequestSpec:
    """The workload request of ``entry``."""
    return RequestSpec(
        entry.request_id,
        entry_tokens(entry),
        entry.output_length,
        entry.arrival_step,
        cache_salt=entry.cache_salt,
        lora=entry.lora,
    )


class StreamRequests(Sequence[RequestSpec]):
    """A stream's requests as a sequence whose items are built on access."""

    def __init__(self, entries: Sequence[StreamEntry]) -> None:
        self.entries = tuple(entries)

    def __len__(self) -> int:
        return len(self.entries)

    @overload
    def __getitem__(self, index: int) -> RequestSpec: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[RequestSpec]: ...

    def __getitem__(self, index: int | slice) -> RequestSpec | Sequence[RequestSpec]:
        if isinstance(index, slice):
            return StreamRequests(self.entries[index])
        return entry_spec(self.entries[index])

    def __iter__(self) -> Iterator[RequestSpec]:
        for entry in self.entries:
            yield entry_spec(entry)


# ---------------------------------------------------------------- reading


def _where(path: Path, line: int) -> str:
    return f"{path}:{line}"


def _int_field(obj: dict[str, Any], name: str, where: str, minimum: int) -> int:
    value = obj.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise StreamError(
            f"{where}: field {name!r}: expected an integer >= {minimum}, got {value!r}"
        )
    return value


def _number_field(obj: dict[str, Any], name: str, where: str) -> float:
    value = obj.get(name)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise StreamError(f"{where}: field {name!r}: expected a number >= 0, got {value!r}")
    return float(value)


def _id_list_field(obj: dict[str, Any], name: str, where: str) -> list[int]:
    """Field ``name``: a non-empty list of integers >= 0 (block ids, token ids)."""
    ids = obj.get(name)
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
    ):
        raise StreamError(
            f"{where}: field {name!r}: expected a non-empty list of integers >= 0, "
            f"got {str(ids)[:80]}"
        )
    return ids


def _scaled(length: int, block_tokens: int) -> int:
    return max(1, -(-length * block_tokens // MOONCAKE_BLOCK_TOKENS))


def parse_mooncake_line(
    obj: Any, where: str, index: int, block_tokens: int, step_ms: float
) -> StreamEntry:
    """One Mooncake trace line (a decoded JSON object) as a stream entry.

    The prompt is ``len(hash_ids) - 1`` whole blocks of ``block_tokens`` tokens and a
    last block holding the rest of ``input_length`` (scaled by block_tokens / 512, as
    is ``output_length``, rounded up); the arrival step is ``timestamp // step_ms``.
    Fields other than the four are ignored.

    Raises:
        StreamError: a missing or malformed field, or ``input_length`` that does not
            fit ``hash_ids`` (``ceil(input_length / 512)`` ids).
    """
    if not isinstance(obj, dict):
        raise StreamError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    timestamp = _number_field(obj, "timestamp", where)
    input_length = _int_field(obj, "input_length", where, 1)
    output_length = _int_field(obj, "output_length", where, 1)
    ids = _id_list_field(obj, "hash_ids", where)
    blocks = -(-input_length // MOONCAKE_BLOCK_TOKENS)
    if len(ids) != blocks:
        raise StreamError(
            f"{where}: field 'hash_ids': {len(ids)} ids, but input_length {input_length} "
            f"makes {blocks} blocks of {MOONCAKE_BLOCK_TOKENS} tokens"
        )
    last = input_length - (blocks - 1) * MOONCAKE_BLOCK_TOKENS
    prompt_length = (blocks - 1) * block_tokens + _scaled(last, block_tokens)
    return StreamEntry(
        request_id=f"mc-{index}",
        segments=tuple(ids),
        explicit=None,
        prompt_length=prompt_length,
        output_length=_scaled(output_length, block_tokens),
        arrival_step=int(timestamp // step_ms),
        line=index,
        block_tokens=block_tokens,
    )


def parse_jsonl_line(
    obj: Any, where: str, index: int, block_tokens: int, step_ms: float
) -> StreamEntry:
    """One line of kvcache's own stream format (``docs/request-streams.md``).

    Raises:
        StreamError: an unknown, missing or malformed field.
    """
    if not isinstance(obj, dict):
        raise StreamError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - JSONL_FIELDS)
    if unknown:
        raise StreamError(
            f"{where}: unknown field {unknown[0]!r}; fields: {', '.join(sorted(JSONL_FIELDS))}"
        )
    request_id = obj.get("request_id", f"req-{index}")
    if not isinstance(request_id, str) or not request_id:
        raise StreamError(
            f"{where}: field 'request_id': expected a non-empty string, got {request_id!r}"
        )
    explicit: tuple[int, ...] | None = None
    segments: tuple[int | str, ...] = ()
    if ("prompt_token_ids" in obj) == ("prompt_length" in obj):
        raise StreamError(f"{where}: give exactly one of 'prompt_token_ids' and 'prompt_length'")
    if "prompt_token_ids" in obj:
        ids = _id_list_field(obj, "prompt_token_ids", where)
        if "prefix_ids" in obj:
            raise StreamError(f"{where}: field 'prefix_ids' goes with 'prompt_length' only")
        explicit = tuple(ids)
        prompt_length = len(explicit)
    else:
        prompt_length = _int_field(obj, "prompt_length", where, 1)
        prefix = obj.get("prefix_ids", [])
        if not isinstance(prefix, list) or not all(
            isinstance(p, (int, str)) and not isinstance(p, bool) for p in prefix
        ):
            raise StreamError(
                f"{where}: field 'prefix_ids': expected a list of integers or strings, "
                f"got {str(prefix)[:80]}"
            )
        segments = tuple(prefix)
    if "arrival" in obj and "timestamp" in obj:
        raise StreamError(f"{where}: give at most one of 'arrival' and 'timestamp'")
    if "timestamp" in obj:
        arrival = int(_number_field(obj, "timestamp", where) // step_ms)
    elif "arrival" in obj:
        arrival = _int_field(obj, "arrival", where, 0)
    else:
        arrival = 0
    output_length = _int_field(obj, "output_length", where, 1)
    salt = obj.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise StreamError(f"{where}: field 'cache_salt': expected a string, got {salt!r}")
    lora_value = obj.get("lora")
    lora: tuple[str, int] | None = None
    if lora_value is not None:
        if (
            not isinstance(lora_value, list)
            or len(lora_value) != 2
            or not isinstance(lora_value[0], str)
            or isinstance(lora_value[1], bool)
            or not isinstance(lora_value[1], int)
            or lora_value[1] < 1
        ):
            raise StreamError(
                f"{where}: field 'lora': expected [name, id >= 1], got {lora_value!r}"
            )
        lora = (lora_value[0], lora_value[1])
    return StreamEntry(
        request_id,
        segments,
        explicit,
        prompt_length,
        output_length,
        arrival,
        salt,
        lora,
        index,
        block_tokens,
    )


def read_stream(
    path: str | Path,
    fmt: str,
    *,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    limit: int = 0,
    step_ms: float = 50.0,
) -> list[StreamEntry]:
    """The requests of a stream file, in arrival order (ties in file order).

    Args:
        path: The file (JSON lines; blank lines are skipped).
        fmt: ``mooncake`` or ``jsonl``.
        block_tokens: Tokens per Mooncake hash id / per jsonl ``prefix_ids`` segment;
            below 512 it scales a Mooncake trace down (lengths scaled alike).
        limit: Read only the first ``limit`` requests (0: all).
        step_ms: Milliseconds of trace time per scheduler step (timestamps -> steps).

    Raises:
        StreamError: bad arguments, an unreadable file, or a bad line (named with
            its number and field).
    """
    path = Path(path)
    if fmt not in FORMATS:
        raise StreamError(f"--format {fmt!r}: choose {' or '.join(FORMATS)}")
    if block_tokens < 1:
        raise StreamError(f"--block-tokens {block_tokens}: must be >= 1")
    if limit < 0:
        raise StreamError(f"--limit {limit}: must be >= 0")
    if not (step_ms > 0 and math.isfinite(step_ms)):
        raise StreamError(f"--step-ms {step_ms}: must be > 0")
    try:
        handle = path.open(encoding="utf-8")
    except OSError as exc:
        raise StreamError(f"--requests-from {path}: cannot read it ({exc.strerror})") from None
    entries: list[StreamEntry] = []
    seen: set[str] = set()
    with handle:
        for number, text in enumerate(handle, 1):
            if limit and len(entries) >= limit:
                break
            if not text.strip():
                continue
            where = _where(path, number)
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raise StreamError(f"{where}: not JSON ({exc.msg})") from None
            if fmt == "mooncake":
                entry = parse_mooncake_line(obj, where, number, block_tokens, step_ms)
            else:
                entry = parse_jsonl_line(obj, where, number, block_tokens, step_ms)
            if entry.request_id in seen:
                raise StreamError(f"{where}: field 'request_id': {entry.request_id!r} repeated")
            seen.add(entry.request_id)
            entries.append(entry)
    if not entries:
        raise StreamError(f"--requests-from {path}: no requests in it")
    entries.sort(key=lambda e: e.arrival_step)
    return entries


def stream_workload(
    entries: Sequence[StreamEntry],
    *,
    name: str,
    num_blocks: int = 0,
    block_size: int = 16,
    token_budget: int = 8192,
    max_num_seqs: int = 256,
) -> Workload:
    """A one-group (full attention) workload running ``entries``.

    ``max_model_len`` is the longest request (prompt + output), rounded up to whole
    blocks; ``num_blocks`` 0 means 4 x ``min_pool_blocks``.

    Raises:
        StreamError: a parameter out of range, or a pool that cannot hold the longest
            request (the scheduler loop would never finish it).
    """
    for label, value in (
        ("--block-size", block_size),
        ("--token-budget", token_budget),
        ("--max-num-seqs", max_num_seqs),
    ):
        if value < 1:
            raise StreamError(f"{label} {value}: must be >= 1")
    longest = max(entries, key=lambda e: e.prompt_length + e.output_length)
    length = longest.prompt_length + longest.output_length
    needed = -(-length // block_size) + 1  # the pool's null block is never handed out
    if num_blocks == 0:
        num_blocks = 4 * needed
    if num_blocks < needed:
        raise StreamError(
            f"pool size {num_blocks}: request {longest.request_id} (line {longest.line}) "
            f"needs {needed - 1} blocks of {block_size} tokens; the pool must have at "
            f"least {needed} blocks"
        )
    return Workload(
        name=name,
        num_blocks=num_blocks,
        groups=(GroupLayout("full", block_size),),
        max_model_len=-(-length // block_size) * block_size,
        token_budget=token_budget,
        max_num_seqs=max_num_seqs,
        requests=StreamRequests(entries),
    )


def min_pool_blocks(workload: Workload) -> int:
    """The smallest pool that holds the workload's longest request, null block included."""
    bs = workload.scheduler_block_size
    longest = max(len(r.prompt_token_ids) + r.max_output_tokens for r in workload.requests)
    return -(-longest // bs) + 1


def ideal_hits(workload: Workload) -> tuple[int, int]:
    """``(hit tokens, prompt tokens)`` of an infinite cache, content level.

    Requests in arrival order; a prompt's leading full blocks (the workload's block
    size) count as hits when the same block prefix (same tokens, same LoRA and cache
    salt) was in an earlier prompt, up to the block before its last token (a manager
    must compute a prompt's last token; vLLM's lookup stops there). A manager that
    never evicts and admits requests one after another attains exactly this.
    """
    bs = workload.scheduler_block_size
    seen: set[bytes] = set()
    hit = total = 0
    for spec in workload.requests:
        tokens = spec.prompt_token_ids
        total += len(tokens)
        cap = (len(tokens) - 1) // bs
        prev = hashlib.blake2b(repr((spec.lora, spec.cache_salt)).encode(), digest_size=16).digest()
        hitting = True
        for i in range(len(tokens) // bs):
            chunk = array("q", tokens[i * bs : (i + 1) * bs]).tobytes()
            prev = hashlib.blake2b(prev + chunk, digest_size=16).digest()
            if hitting and i < cap and prev in seen:
                hit += bs
            else:
                hitting = False
            seen.add(prev)
    return hit, total


# ---------------------------------------------------------------- generating streams


def make_trace(
    fmt: str,
    num_requests: int,
    seed: int = 0,
    mean_gap_ms: float = 1000.0,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    max_output: int = 200,
) -> list[str]:
    """Lines of a synthetic stream in ``fmt`` (mooncake or jsonl), for tests and demos.

    Conversations: a few shared system prompts (1-2 blocks), turns that extend an
    earlier turn's full blocks by 1-3 new blocks (a partial last block each), a new
    conversation with probability 0.4 (or when one grows past 12 blocks), Poisson
    arrivals of mean ``mean_gap_ms``. Mooncake lines count 512 tokens a hash id (scale
    them down when reading, ``--block-tokens``); in jsonl the same structure is told
    with ``prefix_ids`` (segments of ``block_tokens``), and every 7th request has a cache
    salt, every 5th a LoRA.

    Raises:
        StreamError: for an unknown format or a count below 1.
    """
    if fmt not in FORMATS:
        raise StreamError(f"--format {fmt!r}: choose {' or '.join(FORMATS)}")
    if num_requests < 1:
        raise StreamError(f"--requests {num_requests}: must be >= 1")
    if not mean_gap_ms >= 0:
        raise StreamError(f"--mean-gap-ms {mean_gap_ms}: must be >= 0")
    rng = random.Random(seed)
    counter = iter(range(10**9))
    systems = [[next(counter) for _ in range(rng.randint(1, 2))] for _ in range(3)]
    conversations: list[list[int]] = []
    clock = 0.0
    lines = []
    for i in range(num_requests):
        if conversations and rng.random() > 0.4:
            k = rng.randrange(len(conversations))
            ids = conversations[k][:-1]
        else:
            k = -1
            ids = list(rng.choice(systems))
        ids += [next(counter) for _ in range(rng.randint(1, 3))]
        if len(ids) > 12:
            ids = [*systems[0], next(counter)]
        if k >= 0:
            conversations[k] = ids
        else:
            conversations.append(ids)
        last = rng.randint(1, MOONCAKE_BLOCK_TOKENS if fmt == "mooncake" else block_tokens)
        output = rng.randint(1, max_output)
        clock += rng.expovariate(1 / mean_gap_ms) if mean_gap_ms > 0 else 0.0
        if fmt == "mooncake":
            row: dict[str, Any] = {
                "timestamp": int(clock),
                "input_length": (len(ids) - 1) * MOONCAKE_BLOCK_TOKENS + last,
                "output_length": output,
                "hash_ids": ids,
            }
        else:
            row = {
                "request_id": f"gen-{i}",
                "prefix_ids": [f"b{x}" for x in ids[:-1]],
                "prompt_length": (len(ids) - 1) * block_tokens + last,
                "timestamp": round(clock, 1),
                "output_length": output,
            }
            if i % 7 == 3:
                row["cache_salt"] = f"salt-{i % 2}"
            if i % 5 == 2:
                row["lora"] = ["adapter-a", 1]
        lines.append(json.dumps(row))
    return lines


# ---------------------------------------------------------------- command line


def add_stream_options(parser: Any, sweep_options: bool = False) -> None:
    """The options that read a request stream from a file (simulate, bench, record)."""
    g = parser.add_argument_group("request streams from files (docs/request-streams.md)")
    g.add_argument(
        "--requests-from",
        default="",
        metavar="FILE",
        help="run the requests of this file instead of a built-in workload",
    )
    g.add_argument(
        "--format",
        default="mooncake",
        choices=FORMATS,
        help="mooncake (FAST'25 traces: timestamp, input_length, output_length, "
        "hash_ids) or jsonl (kvcache's own); default mooncake",
    )
    g.add_argument(
        "--block-tokens",
        type=int,
        default=MOONCAKE_BLOCK_TOKENS,
        metavar="N",
        help="tokens per Mooncake hash id (default 512; less scales a trace "
        "down, lengths alike) / per jsonl prefix_ids segment",
    )
    g.add_argument(
        "--limit",
        type=int,
        default=0,
        metavar="N",
        help="only the first N requests of the file (default 0: all)",
    )
    g.add_argument(
        "--step-ms",
        type=float,
        default=50.0,
        metavar="MS",
        help="trace milliseconds per scheduler step (default 50)",
    )
    g.add_argument(
        "--block-size",
        type=int,
        default=16,
        metavar="N",
        help="the manager's block size in tokens (default 16)",
    )
    g.add_argument(
        "--num-blocks",
        type=int,
        default=0,
        metavar="N",
        help="pool size in blocks (default: 4 x the smallest pool that holds the longest request)",
    )
    g.add_argument(
        "--token-budget",
        type=int,
        default=8192,
        metavar="N",
        help="tokens scheduled per step (chunked prefill; default 8192)",
    )
    g.add_argument(
        "--max-num-seqs",
        type=int,
        default=256,
        metavar="N",
        help="running requests at most (default 256)",
    )
    if sweep_options:
        g.add_argument(
            "--pool-sizes",
            default="",
            metavar="A,B,...",
            help="run at each of these pool sizes (blocks): simulate reports hit rates "
            "(first admission, all admissions) against the infinite-cache ideal, "
            "preemptions, queueing delay and usage per size (--plot: hit rate vs pool "
            "size); bench times every size (one table each)",
        )


def workload_from_args(args: Any) -> Workload:
    """The workload of ``--requests-from`` and the options beside it.

    Raises:
        StreamError: a bad option or file.
    """
    entries = read_stream(
        args.requests_from,
        args.format,
        block_tokens=args.block_tokens,
        limit=args.limit,
        step_ms=args.step_ms,
    )
    name = Path(args.requests_from).name
    if args.limit:
        name += f" (first {len(entries)})"
    if args.block_tokens != MOONCAKE_BLOCK_TOKENS:
        name += f" ({args.block_tokens} tokens a block)"
    if args.num_blocks < 0:
        raise StreamError(f"--num-blocks {args.num_blocks}: must be >= 0")
    return stream_workload(
        entries,
        name=name,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        token_budget=args.token_budget,
        max_num_seqs=args.max_num_seqs,
    )


def make_trace_command(args: Any) -> int:
    """``make-trace``: write a synthetic stream file."""
    lines = make_trace(
        args.format, args.requests, args.seed, args.mean_gap_ms, args.block_tokens, args.max_output
    )
    Path(args.out).write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} {args.format} requests to {args.out}")
    return 0
