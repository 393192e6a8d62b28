"""The README's measured tables are the committed metrics, rendered (scripts/readme.py)."""

from __future__ import annotations

import importlib.util
import re

from conftest import ROOT


def _readme_module():
    spec = importlib.util.spec_from_file_location("readme", ROOT / "scripts" / "readme.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_generated_table_is_the_committed_metrics():
    readme = _readme_module()
    text = (ROOT / "README.md").read_text()
    blocks = [m.group(2) for m in readme.BLOCK.finditer(text)]
    assert {"default", "families"} <= set(blocks), blocks
    assert readme.regenerate(text) == text, "run `python scripts/readme.py` and commit README.md"


def test_a_changed_metric_shows_in_the_table(tmp_path):
    """The check can fail: one speedup edited in a copy of metrics/ changes the rendering."""
    readme = _readme_module()
    (tmp_path / "metrics/bench").mkdir(parents=True)
    for rel in ("metrics/summary.json", "metrics/bench/static.json", "metrics/families.json"):
        (tmp_path / rel).write_text((ROOT / rel).read_text())
    text = (ROOT / "README.md").read_text()
    summary = (tmp_path / "metrics/summary.json").read_text()
    edited = re.sub(r'("speedup": \{\s*"bs1": )[0-9.]+', r"\g<1>9.87", summary, count=1)
    assert edited != summary
    (tmp_path / "metrics/summary.json").write_text(edited)
    assert "x9.87" in readme.regenerate(text, tmp_path) and "x9.87" not in text
