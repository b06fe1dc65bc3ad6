"""benchmarks/kv_pool.py reads the KV connector's copy-timing lines from the engines' .out
files: the line the connector prints (engines/kv_connector.py, SEER_KV_COPY_TIMING) and the
pattern the benchmark parses must agree, or the migrate table silently loses its rows."""

from __future__ import annotations

import pytest

from seer.engines import kv_connector
from tests.benchmark_modules import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("kv_pool")


@pytest.mark.parametrize("repeat", [False, True])
def test_the_connectors_copy_line_is_parsed_by_the_benchmark(bench, tmp_path, capsys, monkeypatch, repeat):
    monkeypatch.setattr(kv_connector, "_COPY_REPEAT", repeat)
    calls = []
    usage0 = kv_connector._thread_usage()
    kv_connector._log_copy("load", "t3-abc", 4, 1000, 2.5, usage0, lambda: calls.append(1))
    kv_connector._log_copy("save", "t4-abc", 2, 1000, 1.0, usage0, None)
    (tmp_path / "engine-0.out").write_text("vLLM noise\n" + capsys.readouterr().err + "more noise\n")

    copies = bench._copies_since(tmp_path, {})

    assert [(c["what"], c["bytes"], c["ms"]) for c in copies] == [("load", 4000, 2.5), ("save", 2000, 1.0)]
    assert all(c["cpu_ms"] >= 0 and c["minflt"] >= 0 and c["nivcsw"] >= 0 for c in copies)
    # the repeat runs only when asked for, and only where there is one to run
    assert calls == ([1] if repeat else [])
    assert (copies[0]["repeat_ms"] >= 0) is repeat
    assert copies[1]["repeat_ms"] < 0


def test_only_new_lines_are_read(bench, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(kv_connector, "_COPY_REPEAT", False)
    out = tmp_path / "engine-1.out"
    kv_connector._log_copy("save", "t1", 1, 8, 1.0, kv_connector._thread_usage(), None)
    out.write_text(capsys.readouterr().err)
    sizes = bench._engine_log_sizes(tmp_path)
    kv_connector._log_copy("load", "t2", 3, 8, 1.0, kv_connector._thread_usage(), None)
    with out.open("a") as f:
        f.write(capsys.readouterr().err)

    assert [c["what"] for c in bench._copies_since(tmp_path, sizes)] == ["load"]
