"""The documentation: the front page stays short, and no file of the repository points to a document that
is not in it (markdown links and ``docs/<page>.md`` mentions in code, configs and tests)."""

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_readme_is_a_front_page():
    assert len((REPO / "README.md").read_text().splitlines()) <= 250


def test_every_link_and_cited_page_exists():
    missing = []
    for path in [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "examples").rglob("*.md")]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if not target.startswith(("http://", "https://")) and not (path.parent / target).exists():
                missing.append(f"{path.relative_to(REPO)} -> {target}")
    sources = [*REPO.glob("revtrain/**/*.py"), *REPO.glob("tests/*.py"), *REPO.glob("scripts/*"),
               *REPO.glob("configs/*.gin"), *REPO.glob("examples/**/*"), REPO / "Makefile"]
    for path in sources:
        if path.is_file():
            text = path.read_text(errors="ignore")
            for page in re.findall(r"\bdocs/([\w.-]+\.(?:md|png|json))", text):
                if not (REPO / "docs" / page).exists():
                    missing.append(f"{path.relative_to(REPO)} -> docs/{page}")
            if "DESIGN.md" in text and path.name != "test_docs.py":
                missing.append(f"{path.relative_to(REPO)} -> DESIGN.md")
    assert not missing, missing


def test_no_merge_conflict_markers():
    """A merge's unresolved conflict (``<<<<<<<`` / ``=======`` / ``>>>>>>>`` lines) is in no tracked text file."""
    import subprocess
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    marked = []
    for name in files:
        path = REPO / name
        if path.suffix in (".md", ".py", ".gin", ".sh", ".toml", ".txt", "") and path.is_file():
            for k, line in enumerate(path.read_text(errors="ignore").splitlines(), 1):
                if re.match(r"(<{7}|>{7})( |$)|={7}$", line):
                    marked.append(f"{name}:{k}")
    assert not marked, marked
