"""A tiny `skyline frontier` end to end on CPU: 2 settings x 1 load level, quality scoring,
resume from the JSON, PNG and HTML output, and --dry-run."""

from __future__ import annotations

import json

from skyline.cli import main


def _frontier(out_dir: str, *extra: str) -> list[str]:
    return ["frontier", "--grid", "max_num_seqs=1,2", "--base-flags", "--kv-cache-memory 128MiB",
            "--concurrency", "2", "--input-len", "8", "--output-len", "3", "--num-requests", "2",
            "--calib-tokens", "48", "--output-dir", out_dir, *extra]


def test_frontier_end_to_end_and_resume(tmp_path, capsys) -> None:
    out = tmp_path / "fr"
    main(_frontier(str(out), "--dry-run"))
    assert "2 of 2 points to run" in capsys.readouterr().out
    main(_frontier(str(out)))
    text = capsys.readouterr().out
    assert "Pareto front" in text and "skyline serve --kv-cache-memory 128MiB" in text
    # One line when a level starts and one when it ends, so a stuck level shows in the log.
    assert text.count("concurrency 2: running (2 requests)") == 2
    assert text.count("2 requests in ") == 2
    state = json.loads((out / "frontier.json").read_text())
    points = state["points"]
    assert [p["concurrency"] for p in points] == [2, 2]
    assert all(p["summary"]["completed"] == 2 for p in points)
    # Both settings differ only in scheduling: one quality measurement, vs the reference.
    assert state["sweep"]["quality"] == "measured"
    (q,) = state["quality"].values()
    assert 0 <= q["kl_mean"] < 0.05 and q["top1_agreement"] > 0.9
    for name in ("frontier.png", "frontier-ttft.png", "frontier-quality.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    html = (out / "report.html").read_text()
    assert "data:image/png;base64," in html and "--max-num-seqs 2" in html
    assert "Quality:" not in html  # measured: no note

    # A sweep killed after its first point continues with the second only.
    state["points"] = points[:1]
    (out / "frontier.json").write_text(json.dumps(state))
    main(_frontier(str(out), "--dry-run"))
    assert "1 of 2 points to run" in capsys.readouterr().out
    main(_frontier(str(out)))
    text = capsys.readouterr().out
    assert text.count("starting:") == 1 and "--max-num-seqs 2" in text.split("starting:")[1]
    assert len(json.loads((out / "frontier.json").read_text())["points"]) == 2


def test_quality_status_dummy_weights_not_applicable() -> None:
    from skyline.bench.frontier import FrontierSpec, quality_status
    from skyline.engine.args import EngineArgs

    spec = FrontierSpec(grid=[])
    assert quality_status(spec, EngineArgs()) == "measured"
    for args in (EngineArgs(model="llama-3.1-8b"),
                 EngineArgs(model="/some/dir", load_format="dummy")):
        assert quality_status(spec, args).startswith("not applicable: dummy")
    assert quality_status(FrontierSpec(grid=[], quality=False), EngineArgs()) == "off"


def test_report_notes_unmeasured_quality() -> None:
    from skyline.bench.report import _quality_note

    assert _quality_note({"quality": "measured"}) == _quality_note({}) == ""
    note = _quality_note({"quality": "not applicable: dummy (random) weights; KL ..."})
    assert note.startswith("<p>Quality: not applicable: dummy") and note.count("\n") == 0
