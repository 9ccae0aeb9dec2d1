"""The frontier report without a sweep: axis labels true to the device, the settings as a
table, dominated points in their setting's colour (faded); the servers' port range."""

from __future__ import annotations

import socket

import matplotlib.axes
import pytest

from skyline.bench.frontier import free_port
from skyline.bench.report import DOMINATED_ALPHA, write_report
from skyline.cli import build_parser


def _point(setting: str, c: int, tok_s: float, tpot: float) -> dict:
    s = {"output_throughput": tok_s, "tpot_ms": {"median": tpot}, "ttft_ms": {"median": 50.0}}
    return {"setting": setting, "concurrency": c, "command": f"skyline serve {setting}",
            "quality_key": "q", "summary": s}


def _state(device: str) -> dict:
    sweep = {"grid": ["max_num_seqs=1,8"], "base_flags": "--kv-cache-memory 128MiB",
             "levels": [1, 8], "workload": {"name": "random", "input_len": "128"},
             "load": {"endpoint": "completions", "num_requests": 20, "duration": None},
             "slos_ms": {}, "num_gpus": 2, "percentile": "median",
             "reference_flags": "--quantization none", "calib_tokens": 64,
             "quality": "off", "device": device}
    # --max-num-seqs 1 at c=8 is dominated by --max-num-seqs 8 at c=8
    points = [_point("--max-num-seqs 1", 1, 40.0, 25.0), _point("--max-num-seqs 1", 8, 45.0, 30.0),
              _point("--max-num-seqs 8", 8, 200.0, 28.0)]
    return {"sweep": sweep, "points": points, "quality": {}, "startup_s": []}


def test_cpu_report_says_total_and_tables_the_settings(tmp_path, monkeypatch, capsys):
    drawn = []
    real = matplotlib.axes.Axes.scatter

    def scatter(self, x, y, **kw):
        drawn.append((x, kw))
        return real(self, x, y, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "scatter", scatter)
    write_report(_state("cpu"), str(tmp_path))
    html = (tmp_path / "report.html").read_text()
    assert "out tok/s total" in html and "per GPU" not in html
    assert '<table class="settings"><tr><th>grid</th><td>max_num_seqs=1,8</td></tr>' in html
    assert "<th>workload: input_len</th><td>128</td>" in html
    assert '{"name"' not in html  # no raw JSON
    assert "45.0" in html  # a CPU's throughput is not divided by --num-gpus
    assert "tok/s total" in capsys.readouterr().out
    # The dominated point (45 tok/s) is drawn in its setting's colour, faded, like the others
    # of that setting; the legend keeps one entry per setting.
    first = [kw for x, kw in drawn if x == 40.0][0]
    faded = [kw for x, kw in drawn if x == 45.0][0]
    assert faded["color"] == first["color"] and faded["alpha"] == DOMINATED_ALPHA


def test_gpu_report_is_per_gpu(tmp_path):
    write_report(_state("cuda"), str(tmp_path))
    html = (tmp_path / "report.html").read_text()
    assert "out tok/s per GPU" in html and "<td>100.0</td>" in html  # 200 over 2 GPUs


def test_port_range():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        assert port < free_port((port, port + 50)) <= port + 50
        with pytest.raises(RuntimeError, match=f"no port in {port}..{port} is free"):
            free_port((port, port))
    assert free_port() > 0
    parse = build_parser().parse_args
    assert parse(["frontier", "--port", "8100-8199"]).port == (8100, 8199)
    assert parse(["frontier", "--port", "8100"]).port == (8100, 8100)
    with pytest.raises(SystemExit):
        parse(["frontier", "--port", "8199-8100"])
