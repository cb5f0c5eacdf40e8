"""The house a newcomer reads: links that resolve, no file over the size guideline, every benchmark listed,
no numbered work periods in the project's files."""
import re
import subprocess
from pathlib import Path

import doc_links

ROOT = Path(__file__).resolve().parent.parent


def tracked(*patterns):
    out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / f for f in out.stdout.split()]


def test_every_relative_link_in_the_docs_resolves():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "docs" / "measurements").glob("*/README.md")), ROOT / "benchmarks" / "README.md"]
    assert [p for f in files for p in doc_links.broken_links(f)] == []


def test_no_library_file_is_over_400_lines():
    long = {str(f.relative_to(ROOT)): n for f in tracked("gdn_layer/*.py", "parallel/*.py", "kernels/*.py")
            if (n := len(f.read_text().splitlines())) > 400}
    assert long == {}


def test_benchmarks_readme_lists_each_benchmark():
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    missing = [f.name for f in tracked("benchmarks/*.py") if f.name not in readme and f.name != "timing.py"]
    assert missing == []


def test_no_numbered_work_periods_in_the_project():
    pattern = re.compile("sess" + r"ion [0-9]", re.IGNORECASE)       # (split: this file must not match itself)
    hits = [str(f.relative_to(ROOT)) for f in tracked() if f.is_file() and f.suffix not in (".png", ".json")
            and pattern.search(f.read_text(errors="replace"))]
    assert hits == []


def _imports(path: Path) -> set[str]:
    import ast
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(("." * node.level) + node.module)
    return names


def test_each_package_keeps_to_its_imports():
    """DESIGN.md's layout: gdn_layer/ imports no Triton (its kernels come through gdn_layer.kernels' API),
    kernels/ no torch.distributed, parallel/ no model code. (parallel/packing.py's use of the kernels' cu_seqlens
    checks and cache is the one exception the table does not allow yet.)"""
    rules = {"gdn_layer/*.py": ("triton", "gdn_layer.kernels.triton", ".kernels.triton"),
             "kernels/*.py": ("torch.distributed",), "kernels/triton/*.py": ("torch.distributed",),
             "parallel/*.py": ("gdn_layer.layer", "..layer", "gdn_layer.hf", "gdn_layer.pool")}
    bad = sorted(f"{f.relative_to(ROOT)}: {name}" for pattern, banned in rules.items() for f in tracked(pattern)
                 for name in _imports(f) if any(name == b or name.startswith(b + ".") for b in banned))
    assert bad == []
