"""docs/results/sweep-regime.md and .png are what scripts/studies/sweep_regime.py makes of the committed rows."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROWS = ROOT / "docs" / "results" / "sweep-regime.jsonl"


def test_replot_rebuilds_the_committed_table(tmp_path):
    rows = tmp_path / "sweep-regime.jsonl"
    shutil.copy2(ROWS, rows)
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "studies" / "sweep_regime.py"), "--replot", str(rows)],
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out.splitlines()[-1])["rows"] == len(ROWS.read_text().splitlines())
    assert rows.with_suffix(".md").read_text() == ROWS.with_suffix(".md").read_text()
    assert rows.with_suffix(".png").stat().st_size > 10_000  # a plot, not an empty figure


def test_every_row_names_its_regime_and_recipe():
    for line in ROWS.read_text().splitlines():
        r = json.loads(line)
        assert r["trunk_tokens"] == r["tpp"] * r["non_embedding_params"]
        assert {"experts", "rounds", "moe_over_wallclock_dense_mixed", "moe_over_flop_dense_mixed"} <= set(r)
