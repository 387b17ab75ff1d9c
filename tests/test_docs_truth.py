"""The documentation says only what is true of the repository (fast: files and ``ast``, nothing imported).

- **Names**: every repository path (``alpa_torch/core/remat.py``, ``bench/*.py``, ``docs/...``) and
  every dotted name of a package (``runtime.checkpoint``, ``alpa_torch.tune.Candidate.to_dict``)
  in README.md, docs/*.md and the docstrings of the packages' modules exists: the path as a file
  or folder (a ``*`` as a glob; a path with an upper-case placeholder such as ``NAME`` or
  ``DATE`` that does not exist is an example, not a name), the dotted name as a module, then an
  attribute defined at its top level, then one defined in that class. Relative links of the
  Markdown pages lead to files, and every ``docs/benchmarks.md §N`` to a section of that number.
- **Environment variables**: every variable of the project's own (``ALPA_TORCH_*``, as a string
  in the code) and every one the library sets in the user's process (``environ["X"] = ...``)
  has a row in the README's table, and every variable of the table is in the code.
- **Package docstrings** (``alpa_torch``, ``alpa_torch.core``, ``intra_ilp``, ``stage_dp``,
  ``runtime``): each names every module of its package (or the page of docs/ it points to for
  the reading order does), and its ``Imports:`` line names exactly the other packages of the
  project and the third-party packages its modules import, function-level imports included;
  a "no X" / "nothing here imports X" of the docstring holds. Which layer may import which is
  ``tests/test_layers.py``'s.
- **Linter comments**: no ``# noqa: X`` names a rule the configured ruff does not run
  (``[tool.ruff.lint] select`` of pyproject.toml, less ``ignore``).
- **The results pages**: docs/results.md fits one screen (80 lines), docs/benchmarks.md 400
  lines, and docs/results/archive/README.md has one line for every file of the archive.
"""

from __future__ import annotations

import ast
import re
import sys
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("alpa_torch", "intra_ilp", "stage_dp", "runtime")
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SKIP_DIRS = {".git", ".hypothesis", "__pycache__", "alpa_torch.egg-info", "venv", ".venv", "build", "dist"}

PATH = re.compile(r"(?<![\w/.~$-])((?:alpa_torch|stage_dp|intra_ilp|runtime|tests|bench|docs|examples)"
                  r"/[\w./*\[\]-]*[\w*])")
DOTTED = re.compile(r"(?<![\w./-])((?:alpa_torch|stage_dp|intra_ilp|runtime)(?:\.\w+)+)")
PLACEHOLDER = re.compile(r"[A-Z]{2,}")


# ------------------------------------------------------------------ what the repository holds
def python_files(*tops: str) -> list[Path]:
    roots = [REPO / t for t in tops] if tops else [REPO]
    return sorted(p for root in roots for p in root.rglob("*.py")
                  if not SKIP_DIRS & set(p.relative_to(REPO).parts))


@cache
def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def module_path(name: str) -> Path | None:
    """The file of module ``name`` (a package's ``__init__.py``), or None."""
    base = REPO.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def top_level_names(body: list[ast.stmt]) -> set[str]:
    """Names a module (or class) body defines, inside ``if`` / ``try`` blocks too, ``__all__`` included."""
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            if any(isinstance(t, ast.Name) and t.id in ("__all__", "_EXPORTS") for t in targets) and node.value:
                names |= {c.value for c in ast.walk(node.value)
                          if isinstance(c, ast.Constant) and isinstance(c.value, str)}
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            blocks = [node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])]
            blocks += [h.body for h in getattr(node, "handlers", [])]
            names |= {n for block in blocks for n in top_level_names(block)}
    return names


def dotted_name_exists(name: str) -> bool:
    """``name`` is a module, or a module then names defined at its top level, then in that class."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        path = module_path(".".join(parts[:cut]))
        if path is None:
            continue
        rest = parts[cut:]
        if not rest:
            return True
        if (path.parent / rest[0]).is_dir() and path.name == "__init__.py":
            return False  # a subpackage that module_path did not find
        body = tree(path).body
        if rest[0] not in top_level_names(body):
            return False
        cls = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == rest[0]), None)
        return len(rest) == 1 or cls is None or rest[1] in top_level_names(cls.body)
    return False


def path_exists(text: str) -> bool:
    """A file or folder (``*`` and ``[...]`` as a glob); ``pkg/module`` without ``.py``; or
    ``pkg/module.name``, a module's file then a dotted name in it (``stage_dp/search._fitting``)."""
    if any(c in text for c in "*[]"):
        return any(REPO.glob(text))
    if (REPO / text).exists() or (REPO / f"{text}.py").is_file():
        return True
    folder, _, leaf = text.rpartition("/")
    module, dot, attributes = leaf.partition(".")
    return bool(dot) and attributes != "py" and (REPO / folder / f"{module}.py").is_file() and \
        dotted_name_exists(f"{folder.replace('/', '.')}.{leaf}")


def docstrings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of the module's, its classes' and functions' docstrings, and of the string that
    documents an assignment (a field's docstring)."""
    out = []
    for node in ast.walk(tree(path)):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for i, stmt in enumerate(body):
            is_doc = i == 0 and isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            after_assign = i > 0 and isinstance(body[i - 1], (ast.Assign, ast.AnnAssign))
            if (is_doc or after_assign) and isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) \
                    and isinstance(stmt.value.value, str):
                out.append((stmt.lineno, stmt.value.value))
    return out


def texts() -> list[tuple[str, int, str]]:
    """(file, first line, text) of every page and every docstring of the packages."""
    out = [(str(p.relative_to(REPO)), 1, p.read_text()) for p in PAGES]
    for path in python_files(*PACKAGES):
        out += [(str(path.relative_to(REPO)), line, text) for line, text in docstrings(path)]
    return out


# ------------------------------------------------------------------ (a) names
def wrong_names() -> list[str]:
    wrong = []
    for file, first, text in texts():
        for found in PATH.finditer(text):
            path = found.group(1).rstrip(".")
            if not path_exists(path) and not PLACEHOLDER.search(path):
                wrong.append(f"{file}:{first + text.count(chr(10), 0, found.start())}: {path} does not exist")
        for found in DOTTED.finditer(text):
            if not dotted_name_exists(found.group(1)):
                wrong.append(f"{file}:{first + text.count(chr(10), 0, found.start())}: {found.group(1)} is not a "
                             "module or a name defined in one")
    return wrong


def test_every_path_and_module_named_in_docs_and_docstrings_exists():
    wrong = wrong_names()
    assert not wrong, "stale names (fix the text, or the name if the text is right):\n" + "\n".join(wrong)


def test_the_pages_links_lead_to_files():
    wrong = []
    for page in PAGES + [REPO / "docs" / "results" / "archive" / "README.md"]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:|#", target):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                wrong.append(f"{page.relative_to(REPO)}: ({target})")
    assert not wrong, "links to nothing:\n" + "\n".join(wrong)


def test_benchmarks_sections_cited_by_number_exist():
    numbers = set(re.findall(r"^## (\d+)\. ", (REPO / "docs" / "benchmarks.md").read_text(), flags=re.M))
    sources = [(file, text) for file, _, text in texts()] + [(str(p.relative_to(REPO)), p.read_text())
                                                             for p in python_files()]
    cited = [(where, n) for where, text in sources for n in re.findall(r"docs/benchmarks\.md §(\d+)", text)]
    wrong = [f"{where}: docs/benchmarks.md §{n}" for where, n in cited if n not in numbers]
    assert cited and not wrong, "sections cited that docs/benchmarks.md does not have:\n" + "\n".join(wrong)


# ------------------------------------------------------------------ (b) environment variables
def environment_variables() -> tuple[set[str], set[str]]:
    """(the project's own variables, the variables the library sets in the user's process)."""
    own, sets = set(), set()
    documented = {id(s.value) for p in python_files(*PACKAGES) for _, s in _docstring_nodes(p)}
    for path in python_files(*PACKAGES):
        for node in ast.walk(tree(path)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in documented \
                    and re.fullmatch(r"ALPA_TORCH_[A-Z0-9_]+", node.value):
                own.add(node.value)
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and _is_environ(node.value) \
                    and isinstance(node.slice, ast.Constant):
                sets.add(node.slice.value)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "setdefault" \
                    and _is_environ(node.func.value) and node.args and isinstance(node.args[0], ast.Constant):
                sets.add(node.args[0].value)
    return own, sets


def _docstring_nodes(path: Path) -> list[tuple[int, ast.Constant]]:
    out = []
    for node in ast.walk(tree(path)):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            out += [(s.lineno, s.value) for s in body
                    if isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) and isinstance(s.value.value, str)]
    return out


def _is_environ(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id.endswith("environ")) or (
        isinstance(node, ast.Attribute) and node.attr == "environ")


def readme_table_variables() -> set[str]:
    section = (REPO / "README.md").read_text().split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return {v for cell in rows for v in re.findall(r"`([A-Z][A-Z0-9_]{2,})(?:=[^`]*)?`", cell)}


def test_every_environment_variable_is_in_the_readme_table():
    own, sets = environment_variables()
    assert "ALPA_TORCH_EARLY_ANSWER" in own and {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"} <= sets  # the scan finds them
    missing = sorted((own | sets) - readme_table_variables())
    assert not missing, f"environment variables the code reads or sets that the README's table lacks: {missing}"


def test_every_variable_of_the_readme_table_is_in_the_code():
    code = "\n".join(p.read_text() for p in python_files())
    stale = sorted(v for v in readme_table_variables() if v not in code)
    assert not stale, f"the README's table names variables no code reads or sets: {stale}"


# ------------------------------------------------------------------ (c) package docstrings
PACKAGE_DIRS = {"alpa_torch": "alpa_torch", "alpa_torch.core": "alpa_torch/core", "intra_ilp": "intra_ilp",
                "stage_dp": "stage_dp", "runtime": "runtime"}
PROJECT = tuple(PACKAGE_DIRS)
NO_CLAIMS = {"torch": "torch", "ray": "ray", "pyomo": "pyomo", "highs": "highspy", "numba": "numba"}


def package_modules(package: str) -> list[str]:
    folder = REPO / PACKAGE_DIRS[package]
    files = [p.stem for p in folder.glob("*.py") if p.stem != "__init__"]
    subpackages = [p.name for p in folder.iterdir() if (p / "__init__.py").is_file()]
    return sorted(files + subpackages)


def package_imports(package: str) -> set[str]:
    """What the package's modules import (anywhere in a file): other packages of the project, as
    the names of ``PACKAGE_DIRS``, and third-party top-level packages."""
    out = set()
    folder = REPO / PACKAGE_DIRS[package]
    for path in folder.glob("*.py"):
        for node in ast.walk(tree(path)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                project = max((p for p in PROJECT if name == p or name.startswith(p + ".")), key=len, default=None)
                if project is not None:
                    out.add(project)
                elif name.split(".")[0] not in sys.stdlib_module_names and name.split(".")[0] != "__future__":
                    out.add(name.split(".")[0])
    return out - {package}


def declared_imports(doc: str) -> set[str] | None:
    found = re.search(r"^Imports:(.*?)(?:\n\s*\n|\Z)", doc, flags=re.S | re.M)
    if found is None:
        return None
    return {n.rstrip(".") for n in re.findall(r"[A-Za-z_][\w.]*", found.group(1).split(". ")[0])}


@pytest.mark.parametrize("package", PROJECT)
def test_package_docstring_names_every_module(package):
    doc = ast.get_docstring(tree(REPO / PACKAGE_DIRS[package] / "__init__.py")) or ""
    pages = [REPO / p for p in re.findall(r"docs/[\w-]+\.md", doc)]
    text = doc + "".join(p.read_text() for p in pages if p.is_file())
    missing = [m for m in package_modules(package) if not re.search(rf"\b{m}\b", text)]
    assert not missing, f"{package}'s docstring (or the page it points to) does not name the modules {missing}"


@pytest.mark.parametrize("package", PROJECT)
def test_package_docstring_says_what_it_imports(package):
    doc = ast.get_docstring(tree(REPO / PACKAGE_DIRS[package] / "__init__.py")) or ""
    real = package_imports(package)
    declared = declared_imports(doc)
    assert declared is not None, (
        f"{PACKAGE_DIRS[package]}/__init__.py's docstring has no line starting 'Imports:' whose first sentence lists, "
        f"comma-separated, what the package's modules import; it would read: Imports: {', '.join(sorted(real))}.")
    assert declared == real, (f"{package}'s docstring says it imports {sorted(declared)}; its modules import "
                              f"{sorted(real)}")
    claims = re.findall(r"\b(?:[Nn]o|[Nn]ever imports?|[Nn]othing here imports)\s+([\w, ]+?)(?:[.;:(]|$)", doc,
                        flags=re.M)
    denied = {NO_CLAIMS[w.lower()] for claim in claims for w in re.findall(r"\w+", claim) if w.lower() in NO_CLAIMS}
    assert not denied & real, f"{package}'s docstring says no {sorted(denied & real)}, but its modules import them"


# ------------------------------------------------------------------ (d) noqa comments
def ruff_rules() -> tuple[list[str], list[str]]:
    text = (REPO / "pyproject.toml").read_text().split("[tool.ruff.lint]", 1)[1].split("\n[", 1)[0]

    def listed(key: str) -> list[str]:
        found = re.search(rf"^{key}\s*=\s*\[(.*?)\]", text, flags=re.M | re.S)
        return re.findall(r'"([A-Z]+\d*)"', found.group(1)) if found else []

    return listed("select"), listed("ignore")


def rule_runs(code: str, select: list[str], ignore: list[str]) -> bool:
    def matches(prefix: str) -> bool:
        rest = code[len(prefix):]
        return code.startswith(prefix) and (rest == "" or rest[0].isdigit() or prefix[-1].isdigit())

    return any(matches(p) for p in select) and not any(code == i or matches(i) for i in ignore)


def test_noqa_comments_name_rules_that_ruff_runs():
    select, ignore = ruff_rules()
    wrong = []
    for path in python_files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            found = re.search(r"#\s*noqa:\s*([A-Z]+\d+(?:\s*,\s*[A-Z]+\d+)*)", line)
            if found:
                codes = re.findall(r"[A-Z]+\d+", found.group(1))
                wrong += [f"{path.relative_to(REPO)}:{number}: {c}" for c in codes if not rule_runs(c, select, ignore)]
    assert not wrong, (f"noqa for rules ruff does not run (select {select}, ignore {ignore}): drop them, or the "
                       "code they excuse if it is wrong:\n" + "\n".join(wrong))


# ------------------------------------------------------------------ the results pages
def test_results_pages_fit_and_the_archive_is_indexed():
    assert len((REPO / "docs" / "results.md").read_text().splitlines()) <= 80
    assert len((REPO / "docs" / "benchmarks.md").read_text().splitlines()) <= 400
    archive = REPO / "docs" / "results" / "archive"
    index = (archive / "README.md").read_text()
    listed = re.findall(r"^- `([^`]+)`", index, flags=re.M)
    files = sorted(p.name for p in archive.iterdir() if p.name != "README.md")
    assert sorted(listed) == files, (f"not indexed: {sorted(set(files) - set(listed))}; indexed but absent: "
                                     f"{sorted(set(listed) - set(files))}")
