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
