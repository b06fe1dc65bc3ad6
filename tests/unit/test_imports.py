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
    "seer.integrations.verl",
    "seer.integrations.batching",  # the trainer-side grouping logic (integrations/trl.py imports TRL)
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


# ---------------------------------------------------------------------------
# The layers (docs/architecture.md, "Dependency direction"): which folder may import which.
# Every import counts, including the lazy ones inside functions.

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {  # import namespace -> folder in the repository
    "seer.controlplane": "controlplane",
    "seer.dataplane": "dataplane",
    "seer.engines": "engines",
    "seer.cli": "cli",
    "seer.sim": "sim",
    "seer.integrations": "integrations",
}
ALLOWED = {  # layer -> layers it may import (a layer may always import itself)
    "seer": set(),
    "seer.dataplane": {"seer"},
    "seer.controlplane": {"seer", "seer.dataplane"},
    "seer.engines": {"seer", "seer.dataplane"},
    "seer.sim": {"seer", "seer.controlplane"},
    "seer.integrations": {"seer"},
    "seer.cli": {"seer", "seer.dataplane", "seer.controlplane", "seer.engines", "seer.sim"},
}


def layer_of(module: str) -> str | None:
    """The layer a ``seer.*`` module belongs to, or None for a module outside Seer."""
    if module != "seer" and not module.startswith("seer."):
        return None
    for namespace in FOLDERS:
        if module == namespace or module.startswith(namespace + "."):
            return namespace
    return "seer"


def source_files() -> list[tuple[str, Path]]:
    files = [("seer", path) for path in (ROOT / "seer").glob("*.py")]
    for namespace, folder in FOLDERS.items():
        files += [(namespace, path) for path in (ROOT / folder).rglob("*.py")]
    return files


def imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            if node.module == "seer":  # ``from seer import protocol``
                found += [(node.lineno, f"seer.{alias.name}") for alias in node.names]
    return found


def test_every_import_follows_the_documented_layers():
    """No module imports a layer above its own (seer/ is the base; only cli/ may import everything)."""
    files = source_files()
    assert len(files) > 50, "the layer check found too few source files"
    violations = []
    for layer, path in files:
        for lineno, module in imported_modules(path):
            target = layer_of(module)
            if target is None or target == layer or target in ALLOWED[layer]:
                continue
            violations.append(f"{path.relative_to(ROOT)}:{lineno} ({layer}) imports {module} ({target})")
    assert violations == [], "imports against the layers:\n" + "\n".join(violations)


def test_the_layer_check_sees_an_upward_import(tmp_path):
    """The check itself: an upward import in a base module is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from seer.controlplane.scheduler import Scheduler\n")
    assert [(2, "seer.controlplane.scheduler")] == imported_modules(bad)
    assert layer_of("seer.controlplane.scheduler") not in ALLOWED["seer"]
    assert layer_of("seer.protocol") == "seer" and layer_of("numpy") is None


@pytest.mark.parametrize("module", ["seer.dataplane", "seer.controlplane", "seer.sim"])
def test_only_engines_import_vllm(module):
    """torch and vLLM are imported only under engines/, never by the data plane, control plane or simulator."""
    folder = ROOT / FOLDERS[module]
    offenders = [f"{path.relative_to(ROOT)}:{lineno} imports {name}"
                 for path in folder.rglob("*.py") for lineno, name in imported_modules(path)
                 if name.split(".")[0] in ("vllm", "torch")]
    assert offenders == []


# The Ray launcher (docs/operations.md), and the veRL adapter, whose reward workers are
# Ray actors in the trainer's own process (docs/integrations.md).
RAY_MODULES = {"cli/ray_launcher.py", "cli/ray_actor.py", "integrations/verl/manager.py"}


def test_only_the_ray_launcher_imports_ray_and_only_lazily():
    """Ray (an optional extra) is imported only by the Ray launcher's two modules (and the veRL adapter), inside functions,
    so the local launcher and every other module work without it."""
    offenders = []
    for _, path in source_files():
        rel = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text(), filename=rel)
        top_level = {id(node) for node in tree.body}
        for lineno, name in imported_modules(path):
            if name.split(".")[0] != "ray":
                continue
            node = next(n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and n.lineno == lineno)
            if rel not in RAY_MODULES or id(node) in top_level:
                offenders.append(f"{rel}:{lineno} imports {name}")
    assert offenders == []


def test_integrations_never_import_vllm():
    """Trainer adapters (integrations/) reach Seer through its client only: no vLLM import, even a lazy one."""
    offenders = [f"{path.relative_to(ROOT)}:{lineno} imports {name}"
                 for path in (ROOT / "integrations").rglob("*.py") for lineno, name in imported_modules(path)
                 if name.split(".")[0] == "vllm"]
    assert offenders == []
