"""``rollout(..., speculative=False)`` through a real daemon (simulated engines): it crosses
the wire and runs where it can be kept (speculative.method "off"), and a daemon whose
engines use vLLM's own drafters ("ngram") refuses it up front, leaving nothing behind."""

from __future__ import annotations

import pytest

from seer.client import SeerClient, SeerServiceError
from seer.protocol import SamplingParams
from tests.daemon_helpers import Daemon, wait_for, write_sim_config


@pytest.fixture(scope="module")
def ngram_daemon(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("ngram")
    config = write_sim_config(root / "sim.toml")
    config.write_text(config.read_text() + '\n[speculative]\nmethod = "ngram"\n')
    daemon = Daemon(root / "run", config)
    daemon.start()
    yield daemon
    daemon.stop()


def test_a_rollout_without_drafts_runs_on_a_daemon_without_sd(sim_daemon):
    """speculative=False is a no-op without SD: every sample comes back, the same as with the default."""
    sampling = SamplingParams(max_tokens=12, seed=5)
    with SeerClient(sim_daemon.address, timeout_s=60) as client:
        off = client.rollout(["a", "b"], 2, sampling, policy="divided", speculative=False)
        default = client.rollout(["a", "b"], 2, sampling, policy="divided")
    tokens = lambda r: [[s.token_ids for s in g.samples] for g in r.groups]  # noqa: E731
    assert [len(g.samples) for g in off.groups] == [2, 2]
    assert tokens(off) == tokens(default)


def test_a_rollout_without_drafts_is_refused_by_an_ngram_daemon(ngram_daemon):
    """speculative_unsupported names the method and the fix; no rollout is left; the default still runs."""
    with SeerClient(ngram_daemon.address, timeout_s=60) as client:
        with pytest.raises(SeerServiceError) as info:
            client.rollout(["q"], 2, SamplingParams(max_tokens=8), speculative=False)
        assert info.value.code == "speculative_unsupported"
        assert "'ngram'" in info.value.message and "'grouped' or 'off'" in info.value.message
        wait_for(lambda: client.status().rollouts == [], 10, "no rollout to be left")
        assert len(client.rollout(["q"], 2, SamplingParams(max_tokens=8)).groups) == 1
