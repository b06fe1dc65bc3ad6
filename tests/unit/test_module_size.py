"""The 500-line rule (docs/architecture.md, "Dependency direction"): a module outside tests/ over 500 lines says why
it must be one piece in its docstring ("One piece on purpose (over 500 lines): ...").

Reads the files git tracks, so a module added to the repository is checked the day it lands.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 500
REASON = "over 500 lines"


def tracked_modules() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / p for p in out.split() if not p.startswith("tests/")]


def test_long_modules_say_why() -> None:
    modules = tracked_modules()
    assert len(modules) > 50, "git ls-files found too few modules: is the test running in the repository?"
    unexplained = []
    for path in modules:
        text = path.read_text()
        lines = text.count("\n")
        if lines > LIMIT and REASON not in (ast.get_docstring(ast.parse(text)) or ""):
            unexplained.append(f"{path.relative_to(ROOT)} ({lines} lines)")
    assert not unexplained, (f"modules over {LIMIT} lines without a reason in their docstring: {unexplained}; "
                             f"split them by job, or say in the docstring why each is one piece "
                             f"('One piece on purpose ({REASON}): ...')")
