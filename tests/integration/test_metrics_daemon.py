"""The daemon's Prometheus endpoint with simulated engines: its counters move by exactly
what a rollout did, read by prometheus_client's parser and by a real Prometheus server;
a metrics or OpenAI port in use stops ``seerctl start`` with one line and leaves nothing behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from seer.client import SamplingParams, SeerClient
from seer.cli.daemon import lock_held
from tests.daemon_helpers import Daemon, free_tcp_port, seerctl, stop_process, wait_for, write_sim_config

PROMETHEUS = "/usr/bin/prometheus"  # Debian's package (scripts/setup.sh installs it)


def metrics_config(path: Path, port: int) -> Path:
    write_sim_config(path)
    with path.open("a") as f:
        f.write(f'\n[metrics]\nenabled = true\nhost = "127.0.0.1"\nport = {port}\n')
    return path


@pytest.fixture(scope="module")
def metrics_daemon(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("metrics")
    daemon = Daemon(root / "run", metrics_config(root / "sim.toml", free_tcp_port()))
    daemon.start()
    yield daemon
    daemon.stop()


def scrape(url: str) -> dict[str, float]:
    """name{labels} -> value, summed over label sets, from the daemon's own exposition."""
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def run_rollout(daemon: Daemon, num_prompts: int, seed: int, max_tokens: int = 48, ignore_eos: bool = False):
    with SeerClient(daemon.address) as client:
        return client.rollout([f"question {i}" for i in range(num_prompts)], group_size=4, policy="divided",
                              sampling=SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=ignore_eos))


COUNTED = ("seer:samples_total", "seer:generation_tokens_total", "seer:chunks_dispatched_total",
           "seer:chunks_finished_total", "seer:rollouts_completed_total")


def expected_moves(result) -> dict[str, float]:
    stats = result.stats
    return {"seer:samples_total": stats.num_samples, "seer:generation_tokens_total": stats.num_output_tokens,
            "seer:chunks_dispatched_total": stats.num_chunks, "seer:chunks_finished_total": stats.num_chunks,
            "seer:rollouts_completed_total": 1}


def test_counters_move_by_exactly_what_a_rollout_did(metrics_daemon):
    """Samples, output tokens, chunks dispatched and finished, and completed rollouts each
    move by the rollout's own numbers; no chunk failed and nothing is left running."""
    url = json.loads((metrics_daemon.run_dir / "daemon.json").read_text())["metrics_url"]
    before = scrape(url)
    result = run_rollout(metrics_daemon, num_prompts=5, seed=3)
    after = scrape(url)
    assert result.stats.num_chunks > result.stats.num_samples  # divided: samples really were chunked
    for name, moved in expected_moves(result).items():
        assert after.get(name, 0.0) - before.get(name, 0.0) == moved, name
    assert after.get("seer:chunks_failed_total", 0.0) == 0
    assert after["seer:num_requests_running"] == 0 and after["seer:num_rollouts_running"] == 0
    assert after["seer:engine_up"] == 2
    assert after["seer:chunk_duration_seconds_count"] - before.get("seer:chunk_duration_seconds_count", 0.0) \
        == result.stats.num_chunks
    assert after["seer:time_to_first_chunk_seconds_count"] - \
        before.get("seer:time_to_first_chunk_seconds_count", 0.0) == result.stats.num_samples


def prometheus_or_fail() -> str:
    """The Prometheus binary; in CI (CI=true) a missing one fails the test, elsewhere it skips."""
    if os.path.exists(PROMETHEUS):
        return PROMETHEUS
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{PROMETHEUS} is missing: scripts/setup.sh installs Debian's `prometheus` package (as root)")
    pytest.skip(f"{PROMETHEUS} is missing (run scripts/setup.sh as root, or apt-get install prometheus)")


def query(api: str, expr: str) -> float | None:
    """The value of a PromQL instant query with one result, or None (no result yet)."""
    reply = json.loads(urllib.request.urlopen(f"{api}/api/v1/query?{urllib.parse.urlencode({'query': expr})}",
                                              timeout=30).read())
    assert reply["status"] == "success", reply
    results = reply["data"]["result"]
    return float(results[0]["value"][1]) if results else None


def query_all(api: str, expr: str) -> list:
    """Every result of a PromQL instant query; a query Prometheus refuses fails naming it."""
    try:
        reply = json.loads(urllib.request.urlopen(f"{api}/api/v1/query?{urllib.parse.urlencode({'query': expr})}",
                                                  timeout=30).read())
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"Prometheus refused {expr!r}: {exc.read().decode(errors='replace')}") from None
    assert reply["status"] == "success", (expr, reply)
    return reply["data"]["result"]


def settle(api: str, expr: str, want: float, timeout_s: float = 120.0) -> float | None:
    """Poll Prometheus until ``expr`` equals ``want`` (it scrapes every second); the last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = query(api, expr)
        if value == want or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


def test_a_real_prometheus_scrapes_the_exact_counts(metrics_daemon, tmp_path):
    """A Prometheus server scraping the daemon every second sees the counters move by
    exactly what a rollout did (its HTTP API, queried after the rollout)."""
    binary = prometheus_or_fail()
    url = json.loads((metrics_daemon.run_dir / "daemon.json").read_text())["metrics_url"]
    target = urllib.parse.urlparse(url).netloc
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        f"scrape_configs:\n  - job_name: seer\n    static_configs:\n      - targets: ['{target}']\n")
    port = free_tcp_port()
    api = f"http://127.0.0.1:{port}"
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                             "--storage.tsdb.retention.time=1h"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        def ready() -> bool:
            try:
                return query(api, 'up{job="seer"}') == 1.0
            except OSError:
                return False
        wait_for(ready, 120.0, f"Prometheus to scrape the daemon (see {tmp_path / 'prometheus.log'})", 0.5)
        before = scrape(url)
        for name in COUNTED:  # Prometheus has caught up with the daemon before the rollout
            assert settle(api, f"sum({name}) or vector(0)", before.get(name, 0.0)) == before.get(name, 0.0), name
        result = run_rollout(metrics_daemon, num_prompts=4, seed=11)
        for name, moved in expected_moves(result).items():
            want = before.get(name, 0.0) + moved
            assert settle(api, f"sum({name})", want) == want, name
        # Per policy, as a dashboard asks: the tokens of the divided rollouts.
        assert query(api, 'sum(seer:generation_tokens_total{policy="divided"})') == \
            scrape(url)["seer:generation_tokens_total"]
        # Every query of the Grafana dashboard is PromQL this Prometheus accepts.
        dashboard = json.loads((Path(__file__).resolve().parents[2] / "docs/grafana/seer-rollout.json").read_text())
        for expr in [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]:
            query_all(api, expr)
    finally:
        stop_process(proc)
        log.close()


@pytest.mark.parametrize("section", ["metrics", "openai"])
def test_a_port_in_use_is_one_line_and_leaves_nothing(tmp_path, section):
    """``seerctl start`` on a taken ``[metrics]`` or ``[openai]`` port exits non-zero with
    one line naming the port and the fix; no daemon runs on the run dir and no engine was started."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        config = write_sim_config(tmp_path / "sim.toml")
        with config.open("a") as f:
            f.write(f'\n[{section}]\nenabled = true\nhost = "127.0.0.1"\nport = {port}\n')
        run_dir = tmp_path / "run"
        proc = seerctl("start", "--config", str(config), "--run-dir", str(run_dir), timeout=120.0)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode != 0
        assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and f"{section}.port" in lines[0], proc.stderr
        assert not lock_held(run_dir) and not (run_dir / "daemon.json").exists()
        assert not list(run_dir.glob("engine-*"))
        # The daemon itself, should the port be taken between the probe and its bind:
        proc = seerctl("start", "--foreground", "--config", str(config), "--run-dir", str(run_dir), timeout=120.0)
        assert proc.returncode != 0
        assert f"127.0.0.1:{port}" in proc.stderr and f"{section}.port" in proc.stderr
        assert not lock_held(run_dir) and not (run_dir / "daemon.json").exists()
        assert not list(run_dir.glob("engine-*.log"))


def test_a_weights_update_and_a_killed_engine_are_counted(tmp_path):
    """A weights update moves the version gauge and is timed once; an engine SIGKILLed
    mid-rollout is counted lost, the chunks it had in flight are counted as failed
    (``engine_lost``, as many as the log's ``num_requeued``), and every sample is still
    counted exactly once."""
    config = metrics_config(tmp_path / "sim.toml", free_tcp_port())
    daemon = Daemon(tmp_path / "run", config)
    info = daemon.start()
    url = info["metrics_url"]
    checkpoint = tmp_path / "step-1.safetensors"
    checkpoint.write_bytes(b"weights")
    try:
        with SeerClient(daemon.address, timeout_s=120) as client:
            assert client.update_weights(checkpoint) == 1
            m = scrape(url)
            assert m["seer:weights_version"] == 1 and m["seer:weight_updates_total"] == 1
            assert m["seer:weight_update_duration_seconds_count"] == 1
            victim = next(e for e in client.status().engines if e.engine_id == 1).pid
        result: list = []
        worker = threading.Thread(target=lambda: result.append(run_rollout(daemon, num_prompts=16, seed=5,
                                                                           max_tokens=256, ignore_eos=True)))
        worker.start()
        wait_for(lambda: scrape(url).get("seer:chunks_finished_total", 0) >= 10, 120, "the rollout to be under way")
        os.kill(victim, signal.SIGKILL)
        worker.join(300)
        assert result, "the rollout did not finish"
        m = scrape(url)
        lost = [json.loads(line) for line in (daemon.run_dir / "controlplane.log").read_text().splitlines()
                if '"engine_lost"' in line]
        assert [e["engine_id"] for e in lost] == [1]
        assert m["seer:engines_lost_total"] == 1 and m["seer:engine_up"] == 1
        assert lost[0]["num_requeued"] >= 1  # it had chunks in flight (1,024 chunks; killed after 10)
        assert m.get("seer:chunks_failed_total", 0) == lost[0]["num_requeued"]
        assert m["seer:samples_total"] == result[0].stats.num_samples == 64
        assert m["seer:generation_tokens_total"] == result[0].stats.num_output_tokens
    finally:
        daemon.stop()
