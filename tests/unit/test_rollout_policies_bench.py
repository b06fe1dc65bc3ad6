"""benchmarks/rollout_policies.py's speculative row: ``<policy>+sd`` entries, the grouped-SD
daemon config it writes, and the "samples" column that leaves SD out of the invariance check."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import msgspec
import pytest

from seer.config import SeerConfig, config_from_dict
from tests.benchmark_modules import load_benchmark

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "rollout_policies.py"


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("rollout_policies")


def test_a_plus_sd_entry_names_the_policy_with_drafting_on(bench):
    """context+sd -> (context, True); a plain name drafts not."""
    assert bench.split_policy("context+sd") == ("context", True)
    assert bench.split_policy("divided") == ("divided", False)


@pytest.mark.parametrize(("labels", "speculative", "says"), [
    (["group", "context+sd"], "off", "--speculative grouped"),
    (["group", "oracle+sd"], "grouped", "oracle without +sd"),
    (["context+sd", "oracle"], "grouped", "--true-lengths"),
])
def test_policy_lists_that_cannot_run_are_named(bench, labels, speculative, says):
    """+sd without grouped engines, an SD oracle, or oracles with only SD runs to learn from."""
    problem = bench.check_policies(labels, speculative, has_true_lengths=False)
    assert problem is not None and says in problem and "\n" not in problem


def test_the_issue_row_set_is_accepted(bench):
    """group, divided, context and context+sd on grouped engines (issue 13's benchmark)."""
    assert bench.check_policies(["group", "divided", "context", "context+sd"], "grouped", False) is None
    assert bench.check_policies(["group", "context+sd", "oracle"], "grouped", False) is None


def test_a_plus_sd_entry_without_grouped_engines_exits_2_before_starting_anything():
    """The parser refuses it (exit 2) with the one-line reason."""
    proc = subprocess.run([sys.executable, str(BENCH), "--policies", "group,context+sd"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert "context+sd runs with speculative decoding: add --speculative grouped" in proc.stderr.splitlines()[-1]


def test_the_grouped_config_round_trips_through_its_toml(bench):
    """--speculative grouped: method grouped, adaptive, the given gamma_max, the rest unchanged;
    the written TOML loads back to the same config."""
    from seer.cli.ray_actor import config_toml

    base = SeerConfig()
    config = bench.bench_config(base, "grouped", 3)
    assert (config.speculative.method, config.speculative.gamma_max, config.speculative.adaptive) == ("grouped", 3, True)
    assert msgspec.structs.replace(config, speculative=base.speculative) == base
    assert config_from_dict(tomllib.loads(config_toml(msgspec.to_builtins(config)))) == config
    assert bench.bench_config(base, "off", 3) is base


def test_the_samples_column_checks_invariance_without_the_sd_runs(bench):
    """Runs without drafts agreeing read "same" even when an SD run differs; the SD row says it differs."""
    runs = [{"policy": "group", "digest": "aaaaaa11"}, {"policy": "context", "digest": "aaaaaa11"},
            {"policy": "context+sd", "digest": "bbbbbb22"}]
    digests = {r["digest"] for r in runs if not bench.split_policy(r["policy"])[1]}
    assert bench.samples_cell(runs[:1], digests) == "same"
    assert bench.samples_cell(runs[2:], digests) == "SD: differs"
    broken = digests | {"cccccc33"}
    assert bench.samples_cell(runs[:1], broken) == "aaaaaa"
