"""The checkout's ``kernels/`` never shadows Hugging Face's ``kernels`` package.

transformers 5.25 and later depend on Hugging Face's ``kernels`` and import it at
start-up; from a checkout's root the directory ``kernels/`` comes first on
``sys.path``. Imported as plain ``kernels`` while another ``kernels`` is installed,
the checkout's package hands the name over; ``kvcache_kernels`` is always ours.
Each case runs in a fresh interpreter from the repository root, as a user's would.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, *flags: str, extra_path: Path | None = None) -> str:
    prelude = f"import sys; sys.path.insert(1, {str(extra_path)!r}); " if extra_path else ""
    result = subprocess.run(
        [sys.executable, *flags, "-c", prelude + code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip()


def test_another_kernels_package_gets_the_name(tmp_path: Path) -> None:
    fake = tmp_path / "site" / "kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("WHO = 'installed'\nfrom kernels.part import PART\n")
    (fake / "part.py").write_text("PART = 'its own submodule'\n")
    out = _python(
        "import kernels, kvcache_kernels; "
        "print(kernels.WHO, '|', kernels.PART, '|', kvcache_kernels.__name__, "
        "kvcache_kernels.PAD_SLOT_ID if hasattr(kvcache_kernels, 'PAD_SLOT_ID') else 'lazy')",
        extra_path=tmp_path / "site",
    )
    who, part, ours = (s.strip() for s in out.split("|"))
    assert (who, part) == ("installed", "its own submodule")
    assert ours.startswith("kvcache_kernels")


def test_without_another_kernels_the_checkout_keeps_the_name() -> None:
    # -S: no site-packages, so neither Hugging Face's kernels nor triton is found.
    out = _python("import kernels; print(kernels.__file__)", "-S")
    assert Path(out) == ROOT / "kernels" / "__init__.py"
    out = _python(
        "import kernels\ntry:\n    kernels.paged_attention\nexcept ModuleNotFoundError as e:\n"
        "    print(e)",
        "-S",
    )
    assert "needs triton" in out


def test_transformers_imports_from_the_checkout_root() -> None:
    """The reference layer's transformers (5.25+ imports Hugging Face's kernels at
    start-up; older ones probe it) imports beside the checkout's ``kernels/``."""
    transformers = pytest.importorskip("transformers")  # the reference layer has it
    out = _python("import transformers.activations, kernels; print(kernels.__file__)")
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        assert Path(out) == ROOT / "kernels" / "__init__.py"
    else:
        assert Path(out) != ROOT / "kernels" / "__init__.py", transformers.__version__
