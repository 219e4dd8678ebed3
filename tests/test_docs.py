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


def _project_files() -> list[str]:
    """The repository's files, relative to it: ``git ls-files`` in a git checkout; outside one (an unpacked
    sdist, a copy of the tree) every file under the project's own folders and top-level files (no virtual
    environment, build output, cache or hidden folder)."""
    import subprocess
    try:
        listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        listed = ""
    if listed.strip() and (REPO / ".git").exists():
        return listed.split()
    names = [p.name for p in REPO.iterdir() if p.is_file()]
    for folder in ("revtrain", "tests", "docs", "configs", "scripts", "examples", ".ci"):
        names += [str(p.relative_to(REPO)) for p in (REPO / folder).rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts]
    return names


def test_project_files_are_found():
    """`_project_files` finds the sources, docs and this file, with or without a git checkout."""
    names = set(_project_files())
    assert {"README.md", "pyproject.toml", "tests/test_docs.py", "docs/recipe.md", "revtrain/cli.py"} <= names


def test_no_merge_conflict_markers():
    """A merge's unresolved conflict (``<<<<<<<`` / ``=======`` / ``>>>>>>>`` lines) is in no project text file
    (the tracked files in a git checkout; the project's folders outside one)."""
    marked = []
    for name in _project_files():
        path = REPO / name
        if path.suffix in (".md", ".py", ".gin", ".sh", ".toml", ".txt", "") and path.is_file():
            for k, line in enumerate(path.read_text(errors="ignore").splitlines(), 1):
                if re.match(r"(<{7}|>{7})( |$)|={7}$", line):
                    marked.append(f"{name}:{k}")
    assert not marked, marked
