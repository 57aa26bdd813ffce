"""``--impl exec:CMD``: a subject in another process, speaking JSON lines.

The kit starts CMD (split as a shell would, no shell run) once per command and
writes one JSON object per line to its stdin; CMD answers each with one JSON
object on one line of its stdout (its stderr is kept for error messages). The
messages (docs/protocol.md):

* ``{"op": "hello", "args": {"protocol": "kvcache-kit/1"}}`` →
  ``{"ok": {"protocol": "kvcache-kit/1", "name": ..., "version": ..., "features": [...]}}``
  (``features`` optional: absent means every feature);
* ``{"op": "new", "manager": M, "args": {"config": CONFIG, "hash_seed": "0", "state":
  bool}}`` → ``{"ok": null}``, or ``{"raises": TYPE, "message": ...}`` when the
  subject cannot build that config; ``M`` is an int naming the manager in later calls;
* ``{"op": OP, "manager": M, "args": ARGS}`` for the trace's calls → ``{"ok": RESULT}``
  or ``{"raises": TYPE, "message": ...}`` (the call failed, as a manager raises);
* ``{"op": "close", "manager": M}`` → ``{"ok": null}``: the kit is done with ``M``.

Any answer may add ``"free"``: the free block count after the call (saves a
``get_num_free_blocks`` call), and, when ``new`` asked for it, ``"state"``: the
canonical abstract state after the call (compared at level ``exact``). An answer
``{"error": TEXT}`` says the request itself was wrong: the kit stops.

Every read is bounded: a subject that does not answer within ``KVCACHE_EXEC_TIMEOUT``
seconds (default 30; ``hello``, while the process starts, at least 30) is killed.
A bad line, a crash or a hang is an ``ExecError`` (a ``ValueError``: the CLI prints
one line naming ``--impl`` and exits 2).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import select
import shlex
import subprocess
import tempfile
import time
import weakref
from collections.abc import Mapping
from typing import IO, Any

from kvcache.kit.config import ManagerConfig
from kvcache.kit.features import ALL_FEATURES, check_features
from kvcache.kit.protocol import PROTOCOL, ProtocolAdapter, ProtocolSide
from kvcache.kit.sides import CannotBuild, HarnessError

TIMEOUT_ENV = "KVCACHE_EXEC_TIMEOUT"
DEFAULT_TIMEOUT_S = 30.0


class ExecError(HarnessError, ValueError):
    """An ``exec:`` subject broke the protocol: a bad line, a crash, a hang."""


def timeout_s() -> float:
    """Seconds to wait for one answer (``KVCACHE_EXEC_TIMEOUT``).

    Raises:
        ValueError: the variable is set to something other than a positive number.
    """
    text = os.environ.get(TIMEOUT_ENV, "")
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV}={text!r}: expected a positive number of seconds")
    return value


_EXCEPTIONS: dict[str, type[Exception]] = {}


def exception_type(name: str) -> type[Exception]:
    """An exception class called ``name``: the kit compares exceptions by type name."""
    if name not in _EXCEPTIONS:
        _EXCEPTIONS[name] = type(name, (Exception,), {})
    return _EXCEPTIONS[name]


class ExecProcess:
    """One running subject process and its line-by-line conversation."""

    def __init__(self, command: str) -> None:
        self.label = f"--impl exec:{command}"
        self.timeout_s = timeout_s()
        argv = shlex.split(command)
        if not argv:
            raise ValueError(f"{self.label}: no command given after exec:")
        self.stderr: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 (closed in close())
        try:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr
            )
        except OSError as exc:
            raise ValueError(f"{self.label}: cannot start {argv[0]!r} ({exc.strerror})") from None
        self.buffer = b""
        self.hello: dict[str, Any] = {}
        self.pending_close: list[int] = []
        self.calls = 0

    def alive(self) -> bool:
        """Whether the process still runs."""
        return self.proc.poll() is None

    def stderr_tail(self) -> str:
        """The last line the process wrote on stderr (for error messages)."""
        self.stderr.seek(0)
        lines = self.stderr.read().decode("utf-8", "replace").strip().splitlines()
        return f"; its stderr ends: {lines[-1][:200]!r}" if lines else ""

    def fail(self, what: str) -> ExecError:
        """An ``ExecError`` saying ``what``, the process killed."""
        if self.alive():
            self.proc.kill()
            self.proc.wait()
        return ExecError(f"{self.label}: {what}{self.stderr_tail()}")

    def request(self, message: Mapping[str, Any]) -> dict[str, Any]:
        """Send one request and read its answer.

        Raises:
            ExecError: the process exited, hung past the timeout, or answered with a
                line that is not a JSON object with ``ok``, ``raises`` or ``error``.
        """
        for manager in self.pending_close:
            self._exchange({"op": "close", "manager": manager})
        self.pending_close.clear()
        return self._exchange(message)

    def _exchange(self, message: Mapping[str, Any]) -> dict[str, Any]:
        op = message.get("op")
        self.calls += 1
        where = f"request #{self.calls} ({op})"
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            raise self.fail(
                f"the subject exited (status {self.proc.poll()}) before {where}"
            ) from None
        line = self._read_line(where, max(self.timeout_s, DEFAULT_TIMEOUT_S) if op == "hello"
                               else self.timeout_s)
        try:
            answer = json.loads(line)
        except json.JSONDecodeError:
            raise self.fail(
                f"answered {where} with a line that is not JSON: {line[:120]!r}"
            ) from None
        if not isinstance(answer, dict) or not {"ok", "raises", "error"} & set(answer):
            raise self.fail(
                f"answered {where} with {line[:120]!r}; expected an object with ok, raises "
                "or error (docs/protocol.md)"
            )
        if "error" in answer:
            raise self.fail(f"refused {where}: {str(answer['error'])[:200]}")
        if "raises" in answer and not (
            isinstance(answer["raises"], str) and answer["raises"].isidentifier()
        ):
            raise self.fail(f"answered {where} with raises={answer['raises']!r}: not a type name")
        return answer

    def _read_line(self, where: str, timeout: float) -> str:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self.fail(f"no answer to {where} within {timeout:g} s ({TIMEOUT_ENV})")
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self.proc.wait()
                raise self.fail(
                    f"the subject exited (status {self.proc.returncode}) instead of answering "
                    f"{where}"
                )
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode("utf-8", "replace")

    def close(self) -> None:
        """End the process: stdin closed, then killed if it lingers."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.stderr.close()


_PROCESSES: dict[str, ExecProcess] = {}
_MANAGER_IDS = itertools.count(1)


def process_for(command: str) -> tuple[ExecProcess, dict[str, Any]]:
    """The running process of ``command`` (started and greeted once) and its hello."""
    process = _PROCESSES.get(command)
    if process is not None and process.alive():
        return process, process.hello
    process = ExecProcess(command)
    answer = process.request({"op": "hello", "args": {"protocol": PROTOCOL}})
    hello = answer.get("ok")
    if not isinstance(hello, dict) or hello.get("protocol") != PROTOCOL:
        raise process.fail(f"answered hello with {json.dumps(answer)[:160]}; expected "
                           f'{{"ok": {{"protocol": "{PROTOCOL}", ...}}}}')
    process.hello = hello
    _PROCESSES[command] = process
    return process, hello


@atexit.register
def _close_all() -> None:
    for process in _PROCESSES.values():
        process.close()
    _PROCESSES.clear()


class ExecManager:
    """One manager inside an ``exec:`` process: the last answer's free count and state."""

    def __init__(self, process: ExecProcess, manager: int) -> None:
        self.process = process
        self.manager = manager
        self.free: int | None = None
        self.state: dict[str, Any] | None = None
        weakref.finalize(self, process.pending_close.append, manager)

    def call(self, op: str, args: Mapping[str, Any]) -> Any:
        """One call; a ``raises`` answer is raised as an exception of that type name."""
        answer = self.process.request({"op": op, "manager": self.manager, "args": dict(args)})
        self.keep(answer)
        if "raises" in answer:
            raise exception_type(answer["raises"])(str(answer.get("message", ""))[:300])
        return answer["ok"]

    def keep(self, answer: Mapping[str, Any]) -> None:
        """Keep an answer's ``free`` and ``state`` (None when it has none)."""
        free = answer.get("free")
        self.free = free if isinstance(free, int) and not isinstance(free, bool) else None
        state = answer.get("state")
        self.state = state if isinstance(state, dict) else None


class ExecAdapter(ProtocolAdapter):
    """The adapter of ``exec:CMD``: managers are made by ``new`` requests."""

    def __init__(self, name: str) -> None:
        self.command = name.removeprefix("exec:")
        _, hello = process_for(self.command)
        declared = hello.get("features")
        self.FEATURES = (
            ALL_FEATURES if declared is None else check_features(declared, f"--impl {name}")
        )
        self.name = name
        self.version = hello.get("version")
        self.factory = self.new

    def side(self, config: ManagerConfig, hash_seed: str = "0", states: bool = True) -> ExecSide:
        """A side driving a new manager in the process (sending states if ``states``)."""
        return ExecSide(self, config, hash_seed, states)

    def new(self, config: ManagerConfig, hash_seed: str, states: bool = True) -> ExecManager:
        """A new manager in the process (``CannotBuild`` when the subject refuses); its
        answers carry the abstract state only if ``states`` (level ``exact``)."""
        process, _ = process_for(self.command)
        manager = ExecManager(process, next(_MANAGER_IDS))
        args = {"config": config.to_record(), "hash_seed": hash_seed, "state": states}
        answer = process.request({"op": "new", "manager": manager.manager, "args": args})
        if "raises" in answer:
            raise CannotBuild(self.name, f"{self.name}: {answer.get('message', '')}"[:300])
        manager.keep(answer)
        return manager


class ExecSide(ProtocolSide):
    """A side whose calls travel as JSON lines; free counts and states come with the
    answers when the subject sends them."""

    manager: ExecManager

    def send(self, op: str, args: Mapping[str, Any]) -> Any:
        """One call through the process."""
        return self.manager.call(op, args)

    def raw_state(self) -> dict[str, Any] | None:
        """The state the last answer carried (None: the subject sends none)."""
        return self.manager.state

    def num_free_blocks(self) -> int:
        """The free count the last answer carried, else asked for."""
        if self.manager.free is not None:
            return self.manager.free
        return int(self.manager.call("get_num_free_blocks", {}))

    def check_invariants(self) -> str | None:
        """None: a process has no invariant check the kit can call."""
        return None


def exec_adapter(name: str) -> ExecAdapter:
    """The adapter for ``exec:CMD`` (the process started and greeted now, so that a
    command that cannot run is a usage error before any sequence)."""
    return ExecAdapter(name)
