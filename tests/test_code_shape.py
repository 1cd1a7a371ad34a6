"""The shape the code keeps so a newcomer can read it: no module of the product over
400 lines, no class over 300 (issue 17). A file that grows past them is split by job."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = sorted(p for d in ("appliance", "tui") for p in (ROOT / d).rglob("*.py"))
MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 300


def test_the_product_has_modules_to_check() -> None:
    assert len(PRODUCT) > 50
    assert ROOT / "appliance" / "supervisor.py" in PRODUCT


@pytest.mark.parametrize("path", PRODUCT, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_and_classes_fit_their_limits(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    assert len(text.splitlines()) < MAX_MODULE_LINES, f"{path.name}: split it by job"
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.ClassDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES
    ]
    assert not long, f"{path.name}: {', '.join(long)}"
