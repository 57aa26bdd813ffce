"""The installed distribution, as a user gets it: build a wheel, install it, use it.

``make wheel-check`` (a stage of ``make verify``) does what the README tells a
new user, outside this repository's ``.venv`` and its editable install:

1. ``pip wheel .`` (pip's build isolation: the build needs only what
   ``[build-system] requires`` names) into ``build/wheel/dist``;
2. a fresh venv, ``build/wheel/venv``, and ``pip install`` of that wheel (not
   editable), plus CPU torch and transformers (``--with-transformers``, the
   default) but not triton;
3. in that venv, from a directory outside the repository: the import names the
   distribution claims are kvcache's own (``import kernels`` and ``import spec``
   do not resolve to kvcache's code; ``kvcache_spec`` and ``kvcache_kernels``
   do), kvcache and kvcache_spec both read the one release table
   (``kvcache_spec/releases.toml``), ``import transformers.activations`` works
   (transformers probes a top-level ``kernels`` package at import),
   ``kvcache.COMPILED`` is true where a C compiler exists (and the compiled
   build has the C extension ``kvcache._blockhash``), the README's first
   example runs as printed, and the ``kvcache`` command answers ``--help`` and
   fuzzes against the installed oracle.

Each check prints one line; the first failure exits 1 naming it. The venv is
reused when it already holds this wheel's digest (``--fresh`` rebuilds it).

``make verify`` runs it beside the single-process ``tests`` stage, on the
machine's other core: ``--start`` launches the check in the background (its
output to ``build/wheel/check.log``, its exit status to
``build/wheel/check.rc``) and returns at once; ``--await`` later waits for that
run, prints its output and exits with its status (or runs the check itself when
none was started).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "build" / "wheel"
TORCH = "torch==2.13.0"  # the CPU build on this machine's disk (README, set-up)


class CheckFailed(Exception):
    """One check of the installed wheel failed (its message says which and why)."""


def run(cmd: list[str], cwd: Path | None = None, env: dict[str, str] | None = None,
        timeout: int = 900) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` capturing its output; CheckFailed with the output's tail on failure."""
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout, check=False)
    if result.returncode != 0:
        tail = (result.stdout + result.stderr)[-3000:]
        raise CheckFailed(f"{' '.join(cmd[:6])} ... exited {result.returncode}:\n{tail}")
    return result


def source_copy() -> Path:
    """The working tree's files (tracked, and untracked ones git does not ignore) copied
    to ``build/wheel/src``: what a clean clone has, without this checkout's in-place
    compiled modules and build directories, which must not leak into the wheel."""
    src = WORK / "src"
    shutil.rmtree(src, ignore_errors=True)
    names = run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT).stdout
    for name in filter(None, names.split("\0")):
        source = ROOT / name
        if source.is_file():
            target = src / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return src


def build_wheel() -> Path:
    """``pip wheel .`` of ``source_copy()`` into ``build/wheel/dist``; the wheel's path."""
    dist = WORK / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check",
         "-q", "-w", str(dist), str(source_copy())])
    wheels = sorted(dist.glob("kvcache-*.whl"))
    if len(wheels) != 1:
        raise CheckFailed(f"pip wheel left {len(wheels)} kvcache wheels in {dist}")
    return wheels[0]


def install(wheel: Path, fresh: bool, with_transformers: bool) -> Path:
    """A venv with ``wheel`` installed (not editable); its python."""
    venv = WORK / "venv"
    python = venv / "bin" / "python"
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    stamp = venv / ".stamp-wheel"
    extras = with_transformers and not (venv / ".stamp-transformers").exists()
    if fresh or not python.exists():
        shutil.rmtree(venv, ignore_errors=True)
        run([sys.executable, "-m", "venv", str(venv)])
        extras = with_transformers
    pip = [str(python), "-m", "pip", "install", "-q", "--no-compile",
           "--disable-pip-version-check"]
    if extras:
        run([*pip, TORCH, "transformers"])
        (venv / ".stamp-transformers").touch()
    if not stamp.exists() or stamp.read_text() != digest:
        run([*pip, "--force-reinstall", "--no-deps", str(wheel)])
        run([*pip, str(wheel)])  # its dependencies
        stamp.write_text(digest)
    return python


def readme_example() -> str:
    """The README's first ``python`` code block: the example a new user runs first."""
    text = (ROOT / "README.md").read_text()
    match = re.search(r"```python\n(.*?)```", text, re.S)
    if match is None:
        raise CheckFailed("README.md has no ```python example")
    return match.group(1)


PROBE = """
import importlib.util, json, sys
import kvcache
import kvcache.profile
import kvcache_spec.profile
found = {name: importlib.util.find_spec(name) for name in ("spec", "kernels")}
ours = {name: str(s.origin) for name, s in found.items()
        if s is not None and "kvcache" in str(s.origin) + str(s.submodule_search_locations)}
print(json.dumps({
    "kvcache": kvcache.__file__,
    "compiled": kvcache.COMPILED,
    "blockhash": kvcache.kv_cache_utils._sha256_chain is not None,
    "shadowed": ours,
    "kvcache_spec": importlib.util.find_spec("kvcache_spec") is not None,
    "kvcache_kernels": importlib.util.find_spec("kvcache_kernels") is not None,
    "triton": importlib.util.find_spec("triton") is not None,
    "release_table": [str(kvcache.profile.TABLE_PATH), str(kvcache_spec.profile.TABLE_PATH),
                       kvcache.profile.Profile("0.29.0").switches()
                       == kvcache_spec.profile.Profile("0.29.0").switches()],
}))
"""


def check(python: Path, with_transformers: bool) -> list[str]:
    """The checks of the module docstring, in the installed venv; one line each."""
    import json

    lines = []
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVCACHE_PURE")}
    env["PYTHONHASHSEED"] = "0"
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        probe = json.loads(run([str(python), "-c", PROBE], cwd=cwd, env=env).stdout)
        if not probe["kvcache"].startswith(str(python.parents[1])):
            raise CheckFailed(f"kvcache imported from {probe['kvcache']}, not the venv")
        if probe["shadowed"]:
            raise CheckFailed(f"the wheel claims generic import names: {probe['shadowed']}")
        if not (probe["kvcache_spec"] and probe["kvcache_kernels"]):
            raise CheckFailed("kvcache_spec / kvcache_kernels are not installed")
        lines.append("import names: kvcache, kvcache_spec, kvcache_kernels; "
                     "no top-level spec or kernels")
        kvcache_table, spec_table, agree = probe["release_table"]
        if not (kvcache_table == spec_table and "kvcache_spec" in kvcache_table and agree):
            raise CheckFailed(f"the release table: kvcache read {kvcache_table}, the spec "
                              f"{spec_table}, 0.29.0's switches agree: {agree}")
        lines.append(f"release table: {kvcache_table}, read by kvcache and kvcache_spec")
        compiler = sysconfig.get_config_var("CC") or "cc"
        has_cc = shutil.which(compiler.split()[0]) is not None
        if has_cc and not probe["compiled"]:
            raise CheckFailed(f"a C compiler ({compiler}) exists but kvcache.COMPILED is False")
        if probe["compiled"] and not probe["blockhash"]:
            raise CheckFailed("the compiled build has no kvcache._blockhash (OpenSSL's headers?)")
        lines.append(f"kvcache.COMPILED: {probe['compiled']} (C compiler: {has_cc}); "
                     f"keyless sha256 chains in C: {probe['blockhash']}")
        if with_transformers:
            if probe["triton"]:
                raise CheckFailed("triton is in the wheel venv: the check needs it absent")
            run([str(python), "-c", "import transformers.activations"], cwd=cwd, env=env)
            lines.append("transformers.activations imports (triton absent)")
        example = cwd / "readme_example.py"
        example.write_text(readme_example())
        run([str(python), str(example)], cwd=cwd, env=env)
        lines.append("README example runs")
        cli = python.parent / "kvcache"
        out = run([str(cli), "--help"], cwd=cwd, env=env).stdout
        if "fuzz" not in out:
            raise CheckFailed(f"kvcache --help does not list fuzz:\n{out[:500]}")
        out = run([str(cli), "fuzz", "--impl", "kvcache", "--reference", "spec",
                   "--sequences", "20", "--layouts", "full"], cwd=cwd, env=env).stdout
        lines.append(f"kvcache --help; kvcache fuzz vs the installed oracle: "
                     f"{out.strip().splitlines()[-1][:100] if out.strip() else 'ok'}")
    return lines


LOG = WORK / "check.log"
RC = WORK / "check.rc"
AWAIT_POLLS = 3600
"""Half-second polls ``--await`` makes for the background run before it gives up."""


def start_background(argv: list[str]) -> int:
    """Launch this check detached (``--start``); its results go to ``LOG`` and ``RC``."""
    WORK.mkdir(parents=True, exist_ok=True)
    RC.unlink(missing_ok=True)
    with LOG.open("w") as log:
        subprocess.Popen(
            [sys.executable, __file__, "--record", *argv], stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, cwd=ROOT,
        )
    print(f"wheel-check: started in the background (log: {LOG.relative_to(ROOT)})")
    return 0


def await_background(argv: list[str]) -> int:
    """Wait for the ``--start`` run, print its output, return its status; without one,
    run the check here."""
    import time

    if not LOG.exists():
        return run_check(argv)
    for _ in range(AWAIT_POLLS):
        if RC.exists():
            break
        time.sleep(0.5)
    else:
        print(f"wheel-check: FAILED: the background run did not finish ({LOG})")
        return 1
    print(LOG.read_text(), end="")
    LOG.unlink()
    return int(RC.read_text().strip() or 1)


def main(argv: list[str] | None = None) -> int:
    """Build, install and check the wheel; 0 when every check holds."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--start"]:
        return start_background(args[1:])
    if args[:1] == ["--await"]:
        return await_background(args[1:])
    if args[:1] == ["--record"]:
        rc = run_check(args[1:])
        RC.write_text(f"{rc}\n")
        return rc
    return run_check(args)


def run_check(argv: list[str]) -> int:
    """The check itself (the module docstring's steps); 0 when every check holds."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fresh", action="store_true", help="rebuild the venv from scratch")
    parser.add_argument("--no-transformers", dest="with_transformers", action="store_false",
                        help="skip the transformers check (no torch download)")
    args = parser.parse_args(argv)
    try:
        wheel = build_wheel()
        python = install(wheel, args.fresh, args.with_transformers)
        lines = check(python, args.with_transformers)
    except (CheckFailed, subprocess.TimeoutExpired) as exc:
        print(f"wheel-check: FAILED: {exc}")
        return 1
    for line in lines:
        print(line, flush=True)
    print(f"wheel-check: ok ({wheel.name}; {len(lines)} checks)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
