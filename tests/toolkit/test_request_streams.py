"""Request streams from files (``--requests-from``, ``kvcache.kit.streams``) and sizing
sweeps (``simulate --pool-sizes``), on small streams the kit generates itself
(``make-trace``): no Mooncake data is shipped."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from kvcache.kit import streams, sweeps
from kvcache.kit.cli import main
from kvcache.kit.streams import StreamError, read_stream, stream_workload

PLANTED = "conformance.mutants:FreeInAllocationOrder"


def write(path: Path, rows: list[object]) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def mooncake_row(ts: int, length: int, ids: list[int], out: int = 10) -> dict[str, object]:
    return {"timestamp": ts, "input_length": length, "output_length": out, "hash_ids": ids}


def generated(tmp_path: Path, fmt: str, *argv: str) -> Path:
    out = tmp_path / f"gen-{fmt}.jsonl"
    assert main(["make-trace", "--format", fmt, "--out", str(out), *argv]) == 0
    return out


# ---------------------------------------------------------------- parsing


def test_mooncake_lines_become_requests(tmp_path: Path) -> None:
    path = write(
        tmp_path / "t.jsonl",
        [
            mooncake_row(900, 1030, [7, 8, 9], out=100),  # last block: 6 of 512 tokens
            "",
            {**mooncake_row(120, 512, [7]), "extra": "ignored"},
        ],
    )
    entries = read_stream(path, "mooncake", step_ms=100)
    assert [e.arrival_step for e in entries] == [1, 9]  # sorted by arrival
    late, early = entries[1], entries[0]
    assert (late.prompt_length, late.output_length, late.segments) == (1030, 100, (7, 8, 9))
    assert early.request_id == "mc-3" and early.prompt_length == 512
    scaled = read_stream(path, "mooncake", block_tokens=32, step_ms=100)
    # 2 whole blocks of 32, then ceil(6 * 32 / 512) = 1 token; output ceil(100 / 16)
    assert (scaled[1].prompt_length, scaled[1].output_length) == (65, 7)
    assert len(read_stream(path, "mooncake", limit=1)) == 1


def test_jsonl_lines_become_requests(tmp_path: Path) -> None:
    path = write(
        tmp_path / "own.jsonl",
        [
            {"prompt_token_ids": [5, 6, 7], "arrival": 3, "output_length": 2},
            {
                "request_id": "x",
                "prompt_length": 40,
                "prefix_ids": ["sys", 4],
                "timestamp": 250,
                "output_length": 1,
                "cache_salt": "s",
                "lora": ["a", 2],
            },
        ],
    )
    first, second = read_stream(path, "jsonl", block_tokens=16, step_ms=50)
    assert first.request_id == "req-1" and first.explicit == (5, 6, 7)
    assert (second.arrival_step, second.segments, second.lora, second.cache_salt) == (
        5,
        ("sys", 4),
        ("a", 2),
        "s",
    )
    spec = streams.entry_spec(second)
    assert spec.prompt_token_ids[:32] == streams.segment_tokens("sys", 16) + streams.segment_tokens(
        4, 16
    )
    assert len(spec.prompt_token_ids) == 40 and spec.lora == ("a", 2)


BAD_MOONCAKE = [
    ("{not json", "not JSON"),
    ("[1, 2]", "expected a JSON object"),
    ({"input_length": 5, "output_length": 1, "hash_ids": [1]}, "field 'timestamp'"),
    (mooncake_row(0, 0, [1]), "field 'input_length'"),
    ({**mooncake_row(0, 5, [1]), "output_length": True}, "field 'output_length'"),
    (mooncake_row(0, 5, []), "field 'hash_ids'"),
    (mooncake_row(0, 5, [1, -2]), "field 'hash_ids'"),
    (mooncake_row(0, 600, [1]), "field 'hash_ids': 1 ids, but input_length 600 makes 2"),
    ({**mooncake_row(0, 5, [1]), "timestamp": "soon"}, "field 'timestamp'"),
]

BAD_JSONL = [
    ({"prompt_length": 4, "output_length": 1, "lengh": 3}, "unknown field 'lengh'"),
    ({"output_length": 1}, "exactly one of 'prompt_token_ids' and 'prompt_length'"),
    ({"prompt_token_ids": [1, "a"], "output_length": 1}, "field 'prompt_token_ids'"),
    ({"prompt_token_ids": [1], "prefix_ids": [1], "output_length": 1}, "field 'prefix_ids'"),
    ({"prompt_length": 4, "prefix_ids": [[1]], "output_length": 1}, "field 'prefix_ids'"),
    ({"prompt_length": 4, "output_length": 0}, "field 'output_length'"),
    ({"prompt_length": 4, "output_length": 1, "arrival": -1}, "field 'arrival'"),
    ({"prompt_length": 4, "output_length": 1, "arrival": 1, "timestamp": 2}, "at most one"),
    ({"prompt_length": 4, "output_length": 1, "lora": ["a", 0]}, "field 'lora'"),
    ({"prompt_length": 4, "output_length": 1, "cache_salt": 3}, "field 'cache_salt'"),
    ({"request_id": "", "prompt_length": 4, "output_length": 1}, "field 'request_id'"),
    ({"request_id": "r", "prompt_length": 4, "output_length": 1}, "'r' repeated"),
]


@pytest.mark.parametrize(
    ("fmt", "line", "message"),
    [("mooncake", *case) for case in BAD_MOONCAKE] + [("jsonl", *case) for case in BAD_JSONL],
)
def test_bad_lines_name_the_line_and_field(
    tmp_path: Path, fmt: str, line: object, message: str
) -> None:
    good = (
        mooncake_row(0, 5, [1])
        if fmt == "mooncake"
        else {"request_id": "r", "prompt_length": 4, "output_length": 1}
    )
    path = write(tmp_path / "bad.jsonl", [good, line])
    with pytest.raises(StreamError) as info:
        read_stream(path, fmt)
    assert str(info.value).startswith(f"{path}:2: ") and message in str(info.value)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------- derived content


def test_derived_content_is_deterministic_and_shares_prefixes(tmp_path: Path) -> None:
    path = write(
        tmp_path / "t.jsonl",
        [
            mooncake_row(0, 1500, [1, 2, 3]),
            mooncake_row(0, 1500, [1, 2, 3]),
            mooncake_row(0, 1100, [1, 2, 4]),
            mooncake_row(0, 600, [1, 9]),
            mooncake_row(0, 300, [2]),
        ],
    )
    a, b, c, d, e = (streams.entry_spec(x) for x in read_stream(path, "mooncake"))
    assert a.prompt_token_ids == b.prompt_token_ids and len(a.prompt_token_ids) == 1500
    assert a.prompt_token_ids[:1024] == c.prompt_token_ids[:1024]
    assert a.prompt_token_ids[1024:1100] != c.prompt_token_ids[1024:]
    assert a.prompt_token_ids[:512] == d.prompt_token_ids[:512] != a.prompt_token_ids[512:1024]
    # a block cut short is a prefix of the whole block; a block's content is its own
    assert e.prompt_token_ids == a.prompt_token_ids[512:812]
    again = streams.entry_spec(read_stream(path, "mooncake")[0])
    assert again.prompt_token_ids == a.prompt_token_ids
    assert max(a.prompt_token_ids) < 65536 and len(set(a.prompt_token_ids)) > 1000


def test_ideal_hits_counts_seen_block_prefixes(tmp_path: Path) -> None:
    rows = [
        {"prompt_length": 64, "prefix_ids": ["p"], "output_length": 1},
        {"prompt_length": 64, "prefix_ids": ["p"], "output_length": 1, "arrival": 1},
        {"prompt_length": 48, "prefix_ids": ["p"], "output_length": 1, "arrival": 2},
        {"prompt_length": 48, "prefix_ids": ["p"], "output_length": 1, "cache_salt": "z"},
    ]
    entries = read_stream(write(tmp_path / "i.jsonl", rows), "jsonl", block_tokens=32)
    workload = stream_workload(entries, name="i", block_size=16)
    # request 2: own tail blocks differ, 2 blocks of "p" hit; request 3 likewise;
    # the salted one hits nothing
    assert streams.ideal_hits(workload) == (64, 224)


# ---------------------------------------------------------------- running streams


def test_a_generated_mooncake_stream_runs_identically_on_kvcache_and_vllm(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], vllm_reference: ModuleType
) -> None:
    trace = generated(tmp_path, "mooncake", "--requests", "30", "--mean-gap-ms", "80")
    jsonl = generated(tmp_path, "jsonl", "--requests", "30", "--block-tokens", "32")
    plot = tmp_path / "sweep.png"
    argv = ["simulate", "--block-tokens", "32", "--impl", "kvcache,vllm"]
    code = main(
        [*argv, "--requests-from", str(trace), "--pool-sizes", "26,60", "--plot", str(plot)]
    )
    out = capsys.readouterr().out
    assert code == 0 and "outputs identical on kvcache, vllm at every pool size" in out
    assert plot.stat().st_size > 0 or "no plot" in out
    code = main([*argv, "--requests-from", str(jsonl), "--format", "jsonl"])
    out = capsys.readouterr().out
    assert code == 0 and "outputs identical on kvcache, vllm" in out


def test_pool_size_sweep_reaches_the_ideal(tmp_path: Path) -> None:
    # Requests 10 s apart: each is done before the next arrives, so a pool that
    # never evicts hits exactly what the infinite cache would.
    trace = generated(tmp_path, "mooncake", "--requests", "40", "--mean-gap-ms", "10000")
    entries = read_stream(trace, "mooncake", block_tokens=32)
    workload = stream_workload(entries, name="spaced", block_size=16)
    need = streams.min_pool_blocks(workload)
    result = sweeps.sweep(workload, [need, 2 * need, 10_000], ["kvcache", "spec"], progress=False)
    assert not result.differences
    rates = [r.hit_rate_first for r in result.rows if r.impl == "kvcache"]
    assert result.ideal > 0.3
    assert rates[-1] == result.ideal
    assert rates[0] < rates[-1] and rates[0] <= rates[1] + 0.02
    assert all(r.result.preemptions == 0 for r in result.rows)


def test_crowded_small_pool_preempts_and_readmits(tmp_path: Path) -> None:
    trace = generated(tmp_path, "mooncake", "--requests", "40", "--mean-gap-ms", "0")
    entries = read_stream(trace, "mooncake", block_tokens=32)
    workload = stream_workload(entries, name="crowded", block_size=16, token_budget=256)
    need = streams.min_pool_blocks(workload)
    result = sweeps.sweep(workload, [need, 100_000], ["kvcache"], progress=False)
    small, huge = result.rows
    assert small.result.preemptions > 0 and huge.result.preemptions == 0
    assert small.result.prompt_tokens > small.result.first_prompt_tokens  # re-admissions
    assert small.queue_mean_steps > huge.queue_mean_steps > 0
    assert small.usage_peak == 1.0 and huge.usage_peak < 0.1
    assert len(small.result.queue_steps) == len(entries) == small.result.finished
    assert result.calls > 0 and "crowded" in sweeps.format_sweep(result)


def test_a_planted_bug_is_named_at_its_first_differing_call(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = generated(tmp_path, "mooncake", "--requests", "40", "--mean-gap-ms", "500")
    argv = ["simulate", "--requests-from", str(trace), "--block-tokens", "32"]
    code = main([*argv, "--impl", f"kvcache,{PLANTED}", "--pool-sizes", "26"])
    out = capsys.readouterr().out
    assert code == 1
    assert f"DIFFER: pool 26: {PLANTED} differs from kvcache: first differing call #" in out
    assert "returned" in out


def test_progress_lines_go_to_stderr_every_5_s(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    clock = iter([100.0, 101.0, 106.0, 107.0])
    monkeypatch.setattr(sweeps.time, "monotonic", lambda: next(clock))
    report = sweeps._progress_printer("kvcache pool 9", 10)
    for step in (0, 256, 512, 768):
        report(step, step // 100, 2, 3)
    out, err = capsys.readouterr()
    assert (
        out == ""
        and err == "  kvcache pool 9: step 512, 5/10 arrived, 2 running, 3 waiting (6 s)\n"
    )


def test_record_and_bench_take_a_stream(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = generated(
        tmp_path, "jsonl", "--requests", "8", "--block-tokens", "32", "--mean-gap-ms", "0"
    )
    stream = ["--requests-from", str(trace), "--format", "jsonl", "--block-tokens", "32"]
    out = tmp_path / "rec.jsonl"
    record = ["record", "--impl", "kvcache", *stream, "--state-every", "25", "--out", str(out)]
    assert main(record) == 0
    assert "8 requests" in capsys.readouterr().out
    assert main(["replay", str(out), "--impl", "spec"]) == 0
    assert "replay identically" in capsys.readouterr().out
    assert main(["bench", "--impls", "kvcache,spec", "--repetitions", "1", *stream]) == 0
    text = capsys.readouterr().out
    assert "== gen-jsonl.jsonl (32 tokens a block): 8 requests" in text and "identical" in text
    assert "== chat" not in text
    sized = ["bench", "--impls", "kvcache,spec", "--repetitions", "1", *stream]
    assert main([*sized, "--pool-sizes", "40,400"]) == 0  # one table per pool size
    text = capsys.readouterr().out
    assert "32 tokens a block), pool 40: 8 requests" in text
    assert "32 tokens a block), pool 400: 8 requests" in text


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--pool-sizes", "40,x"], "--pool-sizes '40,x': 'x' is not a pool size"),
        (["--pool-sizes", "3"], "--pool-sizes: 3 blocks cannot hold the longest request"),
        (["--num-blocks", "3"], "pool size 3: request mc-"),
        (["--impl", "kvcache,,spec"], "--impl 'kvcache,,spec'"),
        (["--block-tokens", "0"], "--block-tokens 0: must be >= 1"),
        (["--limit", "-1"], "--limit -1"),
        (["--step-ms", "0"], "--step-ms 0.0"),
        (["--token-budget", "0"], "--token-budget 0"),
        (["--format", "jsonl"], ":1: unknown field"),
    ],
)
def test_cli_errors_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    trace = write(tmp_path / "t.jsonl", [mooncake_row(0, 600, [1, 2])])
    code = main(["simulate", "--requests-from", str(trace), "--block-tokens", "32", *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1


def test_missing_file_and_bad_make_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["simulate", "--requests-from", str(tmp_path / "none.jsonl")])
    assert code == 2 and "cannot read it" in capsys.readouterr().err
    code = main(["make-trace", "--requests", "0", "--out", str(tmp_path / "x")])
    assert code == 2 and "--requests 0" in capsys.readouterr().err
