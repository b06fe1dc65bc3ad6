"""`seerctl rollout` refuses everything it can check without an engine before any process
starts (issue 38, point 1): counts and sizes against the config's limits, the group size,
the policy's needs (the oracles need --true-lengths), the output path and the config
itself; one line naming the problem and the fix, exit code 2, no daemon started. The
limits are the config's for an embedded daemon and daemon.json's for a running one."""

from __future__ import annotations

import fcntl
import json
import time
from pathlib import Path

import pytest

from seer.cli.main import build_parser, main
from seer.cli.preflight import DaemonLimits, check_out_path, read_true_lengths
from seer.cli.rollout import InputError
from tests.daemon_helpers import write_sim_config


def _prompts(tmp_path: Path, rows: list[dict]) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _rollout(tmp_path: Path, capsys, prompts: Path, *flags: str, config: Path | None = None) -> tuple[int, str, float]:
    config = config or write_sim_config(tmp_path / "sim.toml")
    t0 = time.monotonic()
    code = main(["rollout", "--prompts", str(prompts), "--config", str(config), "--run-dir", str(tmp_path / "run"),
                 "--cache-dir", str(tmp_path / "cache"), *flags])
    return code, capsys.readouterr().err, time.monotonic() - t0


def _refused_before_start(tmp_path: Path, code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    assert not (tmp_path / "run").exists(), "a daemon was started for input that was bad from the start"


ONE = [{"id": "a", "prompt": "hi"}]


def test_more_prompts_than_the_configs_limit_are_refused_before_start(tmp_path, capsys):
    """3 prompts against server.max_prompts_per_rollout = 2: too_many_prompts, naming the limit."""
    config = write_sim_config(tmp_path / "sim.toml", server={"max_prompts_per_rollout": 2})
    code, err, _ = _rollout(tmp_path, capsys, _prompts(tmp_path, ONE * 3), config=config)
    _refused_before_start(tmp_path, code, err, "3 prompts", "server.max_prompts_per_rollout")


def test_a_group_size_above_the_configs_limit_is_refused_before_start(tmp_path, capsys):
    """--group-size 17 against server.max_group_size = 16 (write_sim_config)."""
    code, err, _ = _rollout(tmp_path, capsys, _prompts(tmp_path, ONE), "--group-size", "17")
    _refused_before_start(tmp_path, code, err, "--group-size", "server.max_group_size", "got 17")


@pytest.mark.parametrize("policy", ["oracle", "oracle-full", "oracle-group", "oracle-order"])
def test_an_oracle_policy_without_true_lengths_is_refused_naming_the_flag(tmp_path, capsys, policy):
    """The oracles need true lengths: without --true-lengths, exit 2 naming the flag and
    the file formats, instead of starting engines to be refused with needs_true_lengths."""
    code, err, _ = _rollout(tmp_path, capsys, _prompts(tmp_path, ONE), "--policy", policy)
    _refused_before_start(tmp_path, code, err, f"--policy {policy}", "--true-lengths FILE", "--policy context")


def test_an_oracle_as_the_configs_policy_needs_true_lengths_too(tmp_path, capsys):
    """No --policy and scheduler.policy = "oracle" in the config: the same refusal."""
    config = write_sim_config(tmp_path / "sim.toml")
    config.write_text(config.read_text().replace("[scheduler]\n", "[scheduler]\npolicy = \"oracle\"\n"))
    code, err, _ = _rollout(tmp_path, capsys, _prompts(tmp_path, ONE), config=config)
    _refused_before_start(tmp_path, code, err, "--policy oracle", "--true-lengths")


def test_true_lengths_of_the_wrong_shape_or_without_a_seed_are_refused(tmp_path, capsys):
    """The daemon's own checks of true lengths run first: a seed is needed, and one row per
    prompt of group-size lengths within max_tokens."""
    lengths = tmp_path / "bench.json"
    lengths.write_text(json.dumps({"runs": [{"lengths": [[3, 4]]}]}))
    prompts = _prompts(tmp_path, ONE)
    code, err, _ = _rollout(tmp_path, capsys, prompts, "--policy", "oracle", "--true-lengths", str(lengths),
                            "--group-size", "2")
    _refused_before_start(tmp_path, code, err, "--true-lengths", "sampling.seed")
    code, err, _ = _rollout(tmp_path, capsys, prompts, "--policy", "oracle", "--true-lengths", str(lengths),
                            "--group-size", "3", "--seed", "1")
    _refused_before_start(tmp_path, code, err, "--true-lengths", "one row per prompt")
    code, err, _ = _rollout(tmp_path, capsys, prompts, "--policy", "group", "--true-lengths", str(lengths),
                            "--group-size", "2", "--seed", "1")
    _refused_before_start(tmp_path, code, err, "--true-lengths is the input of the oracle policies")


@pytest.mark.parametrize("out", ["/proc/nope/o.jsonl", "/proc/o.jsonl"])
def test_an_output_path_that_cannot_be_written_is_refused_before_start(tmp_path, capsys, out):
    """--out in a folder that cannot be created or written: refused before the rollout runs
    (it used to run to the end and lose its results to a FileNotFoundError traceback)."""
    code, err, _ = _rollout(tmp_path, capsys, _prompts(tmp_path, ONE), "--out", out)
    _refused_before_start(tmp_path, code, err, f"--out {out}", "writable folder")


def test_an_output_path_in_a_folder_still_to_create_is_fine(tmp_path):
    """A missing folder under a writable one is created when the results are written."""
    check_out_path(tmp_path / "new" / "deeper" / "out.jsonl")
    assert not (tmp_path / "new").exists(), "the check must not create anything"
    (tmp_path / "file").write_text("")
    with pytest.raises(InputError, match="is not a folder"):
        check_out_path(tmp_path / "file" / "out.jsonl")


def test_a_prompt_too_long_for_the_model_is_refused_before_start(tmp_path, capsys):
    """A 600-byte prompt against model.max_model_len = 512 (sim: one token per byte):
    prompt_too_long from the daemon's own check, naming the file and the prompt."""
    code, err, _ = _rollout(tmp_path, capsys, _prompts(tmp_path, [{"id": "long", "prompt": "x" * 600}]))
    _refused_before_start(tmp_path, code, err, "prompts.jsonl", "'long'", "model.max_model_len")
    code, err, _ = _rollout(tmp_path, capsys, _prompts(tmp_path, [{"id": "ids", "prompt_token_ids": [1, 999]}]))
    _refused_before_start(tmp_path, code, err, "token id 999")


def test_a_config_whose_model_folder_is_not_a_model_is_refused_before_start(tmp_path, capsys):
    """model.path without config.json (the vLLM backend): the config's own problem, exit 2."""
    config = tmp_path / "bad.toml"
    config.write_text(f'[model]\npath = "{tmp_path / "nomodel"}"\n')
    code, err, _ = _rollout(tmp_path, capsys, _prompts(tmp_path, ONE), config=config)
    _refused_before_start(tmp_path, code, err, "model.path", "config.json")


def test_the_default_config_refuses_a_group_size_of_65_in_seconds(tmp_path, capsys):
    """The issue's case: default config (two vLLM engines), --group-size 65 against the
    default server.max_group_size = 64: exit 2 long before an engine could have started."""
    path = _prompts(tmp_path, ONE)
    t0 = time.monotonic()
    code = main(["rollout", "--prompts", str(path), "--run-dir", str(tmp_path / "run"), "--group-size", "65"])
    err = capsys.readouterr().err
    _refused_before_start(tmp_path, code, err, "got 65", "server.max_group_size")
    assert time.monotonic() - t0 < 30


def test_a_running_daemons_limits_come_from_its_daemon_json(tmp_path, capsys):
    """With a daemon on the run dir (its lock held), the request is checked against the
    limits in its daemon.json before anything is sent (the address here leads nowhere)."""
    run_dir = tmp_path / "daemon"
    run_dir.mkdir()
    (run_dir / "daemon.json").write_text(json.dumps({
        "pid": 1, "client_address": f"ipc://{run_dir}/client.sock", "max_request_bytes": 1 << 20,
        "max_group_size": 4, "max_prompts_per_rollout": 100, "policy": "context"}))
    with open(run_dir / "daemon.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        code = main(["rollout", "--prompts", str(_prompts(tmp_path, ONE)), "--config",
                     str(write_sim_config(tmp_path / "sim.toml")), "--run-dir", str(run_dir), "--group-size", "5",
                     "--timeout", "5"])
    err = capsys.readouterr().err
    assert code == 2 and "server.max_group_size" in err and "between 1 and 4" in err, err


def test_daemon_limits_need_every_field_of_daemon_json():
    """An older daemon.json without the limits: nothing to check against (None), not a crash."""
    assert DaemonLimits.of_info({"max_request_bytes": 10}) is None
    assert DaemonLimits.of_info({"max_request_bytes": 10, "max_group_size": 2, "max_prompts_per_rollout": 3,
                                 "policy": "group"}) == DaemonLimits(10, 2, 3, "group")


def test_true_lengths_are_read_from_the_benchmark_file_or_earlier_results(tmp_path):
    """The --out file of benchmarks/rollout_policies.py (its first run) and a results JSONL
    of `seerctl rollout` (groups by group_index, samples by sample_index) give [prompt][sample]."""
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"runs": [{"lengths": [[1, 2], [3, 4]]}, {"lengths": [[9, 9], [9, 9]]}]}))
    assert read_true_lengths(bench) == [[1, 2], [3, 4]]
    results = tmp_path / "rollout.jsonl"
    rows = [{"id": "b", "group_index": 1, "samples": [{"sample_index": 1, "token_ids": [5]},
                                                       {"sample_index": 0, "token_ids": [5, 6, 7]}]},
            {"id": "a", "group_index": 0, "samples": [{"sample_index": 0, "token_ids": [5, 6]},
                                                       {"sample_index": 1, "token_ids": [5]}]}]
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_true_lengths(results) == [[2, 1], [3, 1]]
    for bad in ('{"runs": []}', '{"runs": [{"lengths": [["x"]]}]}', "[1, 2]", "", "not json"):
        bench.write_text(bad)
        with pytest.raises(InputError, match="--true-lengths"):
            read_true_lengths(bench)
    with pytest.raises(InputError, match="no such file"):
        read_true_lengths(tmp_path / "missing.json")


def test_the_help_says_the_oracles_need_true_lengths():
    """`seerctl rollout --help` names the oracles and the flag they need."""
    rollout = next(a for a in build_parser()._subparsers._group_actions[0].choices.items() if a[0] == "rollout")[1]
    text = rollout.format_help()
    assert "--true-lengths FILE" in text and "oracle" in text and "need" in text


def test_results_that_cannot_be_written_after_all_go_to_a_file_the_error_names(tmp_path):
    """If --out cannot be written once the rollout is done (its folder went away), the
    results are written to a temporary file and the error names it: nothing is lost."""
    from seer.cli.rollout import ResultsNotWritten, write_results
    from seer.client import RolloutResult
    from seer.protocol import GroupResult, RolloutStats, SampleResult

    sample = SampleResult(sample_index=0, token_ids=[5], logprobs=[-0.1], text="x", finish_reason="stop",
                          num_prompt_tokens=2, first_scheduled_s=0.0, finished_s=0.1, engine_ids=[0])
    stats = RolloutStats(policy="group", num_groups=1, num_samples=1, num_output_tokens=1, wall_time_s=0.1,
                         throughput_tokens_per_s=10.0, tail_time_s=0.0, num_preemptions=0, num_chunks=1,
                         per_engine_output_tokens={"0": 1})
    result = RolloutResult(rollout_id="abcdef0123", groups=[GroupResult(group_index=0, prompt_id="a",
                                                                        samples=[sample])],
                           stats=stats, weights_version=0)
    (tmp_path / "file").write_text("")
    with pytest.raises(ResultsNotWritten) as info:
        write_results(tmp_path / "file" / "out.jsonl", result, [{}])
    fallback = Path(str(info.value).rsplit(" ", 1)[1])
    try:
        assert json.loads(fallback.read_text())["samples"][0]["token_ids"] == [5]
    finally:
        fallback.unlink()
