"""spec/ stands alone: it imports nothing of kvcache's (or vLLM's) and runs without them.

A slip in a vocabulary shared by the oracle and the implementation would be
invisible to every kvcache-vs-spec comparison, so spec owns its vocabulary
(``spec/vocab.py``) and reads its inputs as data (``spec/__init__.py``).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SPEC_DIR = Path(__file__).resolve().parents[2] / "spec"
#: Third-party modules spec may import, each only inside the one function needing it.
OPTIONAL = {"cbor2": "the *_cbor hash algorithms", "xxhash": "the xxhash algorithms"}


def imports_of(path: Path) -> list[tuple[str, int, bool]]:
    """(module, line, at top level) of every import in ``path``, TYPE_CHECKING blocks too."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            # Relative imports stay inside spec/ (installed, it is kvcache_spec: README).
            assert node.level <= 1, f"{path.name}:{node.lineno}: an import from above spec/"
            module = (node.module or "") if node.level == 0 else f"spec.{node.module or ''}"
            found.append((module, node.lineno, id(node) in top))
    return found


@pytest.mark.parametrize("path", sorted(SPEC_DIR.glob("*.py")), ids=lambda p: p.name)
def test_spec_imports_only_stdlib_and_itself(path: Path) -> None:
    for module, line, at_top in imports_of(path):
        root = module.split(".")[0]
        where = f"spec/{path.name}:{line} imports {module}"
        if root in OPTIONAL:
            assert not at_top, f"{where} at top level: import it where {OPTIONAL[root]} need it"
            continue
        assert root == "spec" or root in sys.stdlib_module_names, (
            f"{where}: spec may import only the standard library and itself")


@pytest.mark.parametrize("path", sorted(SPEC_DIR.glob("*.py")), ids=lambda p: p.name)
def test_spec_does_not_import_dynamically(path: Path) -> None:
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
        assert name not in ("__import__", "import_module"), (
            f"spec/{path.name}:{getattr(node, 'lineno', '?')} imports dynamically")


def test_spec_runs_with_kvcache_and_vllm_blocked() -> None:
    """A whole scenario (hit, events, stats) on plain-data config and requests, in a
    process where importing kvcache or vllm fails."""
    program = textwrap.dedent("""
        import sys
        from dataclasses import dataclass, field
        sys.modules["kvcache"] = sys.modules["vllm"] = None  # any import of them fails

        import spec

        @dataclass(frozen=True)
        class FullAttentionSpec:
            block_size: int

        @dataclass
        class Group:
            kv_cache_spec: FullAttentionSpec
            is_eagle_group: bool = False

        @dataclass
        class Config:
            num_blocks: int
            kv_cache_groups: list

        class Status:
            name = "WAITING"

        @dataclass
        class Request:
            request_id: str
            all_token_ids: list
            lora_request: object = None
            cache_salt: object = "salt"
            mm_features: list = field(default_factory=list)
            num_computed_tokens: int = 0
            num_preemptions: int = 0
            skip_reading_prefix_cache: bool = False
            status: object = Status()
            num_tokens = property(lambda self: len(self.all_token_ids))
            num_prompt_tokens = property(lambda self: len(self.all_token_ids))

        config = Config(8, [Group(FullAttentionSpec(2))])
        m = spec.KVCacheManager(config, 16, 2, 2, log_stats=True, enable_kv_cache_events=True,
                                hash_seed="0")
        a, b = Request("a", [1, 2, 3, 4, 5]), Request("b", [1, 2, 3, 4, 6])
        m.allocate_slots(a, 5)
        hits, num_hits = m.get_computed_blocks(b)
        assert num_hits == 4 and hits.get_block_ids() == ([1, 2],), (hits, num_hits)
        (stored,) = m.take_events()
        assert type(stored).__name__ == "BlockStored" and stored.extra_keys == [("salt",), None]
        assert m.make_prefix_cache_stats().hits == 4
        loaded = [n for n, mod in sys.modules.items() if mod is not None]
        assert not [n for n in loaded if n.startswith(("kvcache", "vllm"))], loaded
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                         cwd=SPEC_DIR.parent, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_spec_mirrors_no_kvcache_layer() -> None:
    """Beneath ``spec.KVCacheManager`` nothing mirrors a kvcache layer (issue 25): no
    coordinator class, and one group-manager class whose kinds are rows of ``KINDS``,
    not subclasses, so a new kind is a new row."""
    classes = {node.name: path.name for path in SPEC_DIR.glob("*.py")
               for node in ast.walk(ast.parse(path.read_text(), str(path)))
               if isinstance(node, ast.ClassDef)}
    assert not [name for name in classes if "Coordinator" in name], classes
    managers = sorted(name for name in classes if name.endswith("Manager"))
    assert managers == ["KVCacheManager", "SingleTypeKVCacheManager"], managers
    import spec

    kinds = {type(row).__name__ for row in spec.KINDS.values()}
    assert kinds == {"KindRules"}, kinds
    assert not spec.SingleTypeKVCacheManager.__subclasses__()
