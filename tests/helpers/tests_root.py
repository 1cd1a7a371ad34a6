"""Where the tests' files lie, for tests in any folder: the repository root, tests/data
and the chat templates of tests/fixtures."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
DATA = TESTS / "data"
CHAT_TEMPLATES = TESTS / "fixtures" / "chat_templates"
