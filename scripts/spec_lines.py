"""Lines of spec/ per concept (issue 25's bar: spec/ at most 2,000 lines in all).

Every line of every ``spec/*.py`` file counts once: a top-level function, class or
assignment (and each method of a class) goes to the concept its name says, by the
first rule of ``CONCEPTS`` that matches; module docstrings, imports and blank lines
between definitions go to "module". ``--ref`` reads the files at a git revision
instead of the working tree, so a change can be measured before and after:

    python scripts/spec_lines.py --ref b65e882 && python scripts/spec_lines.py
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FILES = {"profile.py": "profiles", "releases.py": "profiles", "effectiveness.py": "effectiveness"}
"""Files that are one concept each."""

CONCEPTS = (  # (concept, pattern on "Class.name" or "name"), first match wins
    ("stats", r"stats|Stats"),
    ("events", r"event|Stored|Removed|Cleared|emit|external_hash|MEDIUM|stored"),
    ("hashing", r"hash(?!_num)|extra_keys|mm_|embeds|_end_of|coarsen|pool_key|sha256|xxh"),
    ("hit search", r"hit|search|find_|Cached|lookup|_sub_block|_eagle_step|SpecGroup|_reads|"
                   r"get_computed|common_prefix|_groups$|_all_cached|_aligned$|_fills"),
    ("caching", r"cache_|mask|retention|replay|prompt_tail|_add_key|checkpoint|boundary|"
                r"offer|tail|publish|key_full|cached_this_step|refuse_caching|to_cache|"
                r"_align_down"),
    ("free", r"free|skipped|gap|pop|evict|null_out|unpin|reset|remove|forget|before_|"
             r"nothing_skipped|watcher|release|less_drafts|drop_null"),
    ("allocation", r"allocat|num_blocks|num_new|num_required|admi|append_new|claim|copy|"
                   r"get_new_blocks|touch|adopt|add_local|reserve|pages|hot|resident|"
                   r"zeroing|new_block_ids|sink|host|import|cap|_num_|grow|extend|load|drain|"
                   r"reports_new|ends_inside|waits_for|cow"),
    ("rows", r"KindRules|KINDS|ROWS|row_named|ROLE_KINDS|^(FULL|RSWA|SINK|RING|SLIDING_WINDOW|"
             r"CHUNKED_LOCAL|CROSS|MAMBA\w*|HISPARSE_\w+)$"),
    ("rows", r"^row_for$"),
    ("state", r"__init__|abstract_state|invariants|_blocks_of|get_block|MambaAlign|"
              r"KVCacheBlocks|usage|NULL_BLOCK|check_|set_up|step_starts|residency|_table_len|"
              r"pools|group_role|_nothing|cdiv|^(KVCacheManager|SingleTypeKVCacheManager|"
              r"BlockPool)$"),
)


def sources(ref: str | None) -> dict[str, str]:
    """Every spec/*.py file's text, by file name: the working tree's, or at ``ref``."""
    if ref is None:
        return {p.name: p.read_text(encoding="utf-8") for p in sorted(ROOT.glob("spec/*.py"))}
    names = subprocess.run(["git", "ls-tree", "--name-only", ref, "spec/"], cwd=ROOT,
                           check=True, capture_output=True, text=True).stdout.split()
    return {Path(n).name: subprocess.run(["git", "show", f"{ref}:{n}"], cwd=ROOT, check=True,
                                         capture_output=True, text=True).stdout
            for n in names if n.endswith(".py")}


def concept_of(file_name: str, label: str) -> str:
    """The file's concept, else the first concept whose pattern matches ``label``;
    "API" when none does."""
    if file_name in FILES:
        return FILES[file_name]
    return next((c for c, pattern in CONCEPTS if re.search(pattern, label)), "API")


def span(node: ast.stmt, start: int) -> int:
    """Lines from ``start`` to the end of ``node``."""
    return (node.end_lineno or node.lineno) - start + 1


def count(files: dict[str, str]) -> Counter[str]:
    """Lines per concept over ``files``."""
    lines: Counter[str] = Counter()
    for name, text in files.items():
        total = len(text.splitlines())
        owned = 0
        for node in ast.parse(text).body:
            start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
            items: list[tuple[str, int]] = []
            if isinstance(node, ast.ClassDef):
                body = [n for n in node.body if isinstance(n, ast.FunctionDef)]
                rest = span(node, start) - sum(
                    span(n, n.lineno) + len(n.decorator_list) for n in body)
                items.append((node.name, rest))
                items += [(f"{node.name}.{n.name}", span(n, n.lineno) + len(n.decorator_list))
                          for n in body]
            elif isinstance(node, ast.FunctionDef | ast.ClassDef):
                items.append((node.name, span(node, start)))
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                target = node.targets[0] if isinstance(node, ast.Assign) else node.target
                items.append((getattr(target, "id", "?"), span(node, start)))
            else:
                continue
            for label, num_lines in items:
                lines[concept_of(name, label)] += num_lines
                owned += num_lines
        lines["module"] += total - owned
    return lines


def main() -> None:
    """Print lines per concept (and the total) for the tree or ``--ref``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", help="a git revision (default: the working tree)")
    args = parser.parse_args()
    lines = count(sources(args.ref))
    for concept, num_lines in lines.most_common():
        print(f"{concept:14s} {num_lines:5d}")
    print(f"{'total':14s} {sum(lines.values()):5d}")


if __name__ == "__main__":
    main()
