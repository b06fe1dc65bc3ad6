"""The client, the schema, the control plane and the CLI import without torch or vLLM.

Each check runs in a fresh interpreter (``sys.executable``) so modules already imported
by the test session cannot hide or fake an import.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

MODULES = [
    "seer.client",
    "seer.protocol",
    "seer.controlplane.server",
    "seer.controlplane.scheduler",
    "seer.cli.main",
]
HEAVY = ("torch", "vllm")

CHECK = textwrap.dedent(
    """
    import importlib, json, sys

    BLOCK = {block}
    HEAVY = {heavy!r}

    def heavy_loaded():
        return sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)

    if BLOCK:
        import importlib.abc

        class Blocker(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in HEAVY:
                    raise ImportError(f"{{name}} is blocked for this test")
                return None

        sys.meta_path.insert(0, Blocker())
        for name in HEAVY:  # the blocker works: neither can be imported now
            try:
                importlib.import_module(name)
            except ImportError:
                pass
            else:
                raise SystemExit(f"blocker failed: {{name}} imported")

    assert heavy_loaded() == [], heavy_loaded()
    report = []
    for module in {modules!r}:
        importlib.import_module(module)
        report.append([module, module in sys.modules, heavy_loaded()])
    print(json.dumps(report))
    """
)


def run_check(block: bool, tmp_path) -> list:
    code = CHECK.format(block=block, heavy=HEAVY, modules=MODULES)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("block", [False, True], ids=["installed", "blocked"])
def test_light_modules_do_not_import_torch_or_vllm(block, tmp_path):
    """Importing client, protocol, server, scheduler and CLI loads neither torch nor vllm (also when both are absent)."""
    report = run_check(block, tmp_path)
    assert [row[0] for row in report] == MODULES
    for module, imported, heavy in report:
        assert imported, f"{module} was not imported"
        assert heavy == [], f"importing {module} pulled in {heavy[:5]} ({len(heavy)} heavy modules)"
