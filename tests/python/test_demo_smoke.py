"""The README's demo (python -m kvtier_dev.demo) runs end to end on a small trace, restores only
exact bytes, and reports hits once conversations repeat."""

import json

from kvtier_dev import demo


def test_demo_runs_and_verifies_every_restored_page(tmp_path, capsys):
    out = tmp_path / "demo.json"
    code = demo.main(
        [
            "--users",
            "3",
            "--turns",
            "3",
            "--systems",
            "1",
            "--quiet",
            "--policies",
            "lru",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    results = json.loads(out.read_text())
    assert results[0]["wrong_pages"] == 0
    assert results[0]["pages_hit"] > 0 and results[0]["bytes_loaded"] > 0
    assert "page hit rate" in capsys.readouterr().out
