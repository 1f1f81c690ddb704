"""The shape the code keeps (DEVELOPERS.md, "Rules of the craft"), checked on every run: short functions,
no history in package comments, benchmarks that stand on the package alone."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FUNCTION_LINES_MAX = 80  # TigerBeetle's TIGER_STYLE keeps functions short enough to read whole; 80 is ours


def _python_files(*roots: str) -> list[Path]:
    return sorted(path for root in roots for path in (REPO / root).rglob("*.py"))


def test_no_function_in_the_package_is_longer_than_80_lines():
    long = []
    for path in _python_files("fairgate"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > FUNCTION_LINES_MAX:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "functions over 80 lines:\n" + "\n".join(long)


# A SQL function from its CREATE line to the line that closes its body ($$ followed by ;).
_SQL_FUNCTION = re.compile(r"^CREATE (?:OR REPLACE )?FUNCTION\s+(\w+).*?\$\$;", re.M | re.S)


def test_no_sql_function_in_the_package_is_longer_than_80_lines():
    """The PostgreSQL server-side functions (PL/pgSQL and SQL) keep the same rule as the Python."""
    long, found = [], 0
    for path in sorted((REPO / "fairgate").rglob("*.sql")):
        text = path.read_text(encoding="utf-8")
        matches = list(_SQL_FUNCTION.finditer(text))
        # one match a CREATE: a body closed otherwise would run on into the next function uncounted
        assert len(matches) == len(re.findall(r"^CREATE (?:OR REPLACE )?FUNCTION", text, re.M)), path
        found += len(matches)
        for match in matches:
            lines = match.group(0).count("\n") + 1
            if lines > FUNCTION_LINES_MAX:
                line = text.count("\n", 0, match.start()) + 1
                long.append(f"{path.relative_to(REPO)}:{line} {match.group(1)} ({lines} lines)")
    assert found, "no SQL functions found: the pattern does not match the files"
    assert not long, "SQL functions over 80 lines:\n" + "\n".join(long)


def test_package_comments_say_why_not_history():
    """History is git's: no issue numbers or bug stories in the package's comments and docstrings."""
    pattern = re.compile(r"\bissue \d+|\(issue|\bfound by (a|the) (helper|drill|tester)|\bused to be\b", re.I)
    found = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in _python_files("fairgate")
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, "history in package code:\n" + "\n".join(found)


def test_benchmarks_never_import_the_tests():
    imports = re.compile(r"^\s*(from|import)\s+tests\b", re.M)
    offenders = [str(p.relative_to(REPO)) for p in _python_files("bench") if imports.search(p.read_text("utf-8"))]
    assert not offenders, f"bench/ imports tests/: {offenders}"
