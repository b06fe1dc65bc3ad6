"""`seerctl rollout` checks every file and flag before starting anything, and answers bad
input with exit code 2 and one line, never a traceback (issue 14, defects 6 and 7)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from seer.cli.main import main
from seer.cli.rollout import PromptFileError, read_prompts
from tests.daemon_helpers import write_sim_config


def _rollout(tmp_path: Path, capsys, prompts: Path | str, *flags: str) -> tuple[int, str]:
    config = write_sim_config(tmp_path / "sim.toml")
    code = main(["rollout", "--prompts", str(prompts), "--config", str(config), "--run-dir",
                 str(tmp_path / "run"), *flags])
    return code, capsys.readouterr().err


def _assert_refused_before_start(tmp_path: Path, code: int, err: str, needle: str) -> None:
    assert code == 2
    assert needle in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "run").exists(), "a daemon was started for input that was bad from the start"


def _file(tmp_path: Path, content: bytes | str) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def test_a_missing_prompt_file_is_refused_before_any_daemon_starts(tmp_path, capsys):
    """--prompts /nonexistent.jsonl: exit 2, one line, and no embedded daemon (no run dir)."""
    code, err = _rollout(tmp_path, capsys, tmp_path / "nonexistent.jsonl")
    _assert_refused_before_start(tmp_path, code, err, "no such prompt file")


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b'{"id": 1, "prompt": "caf\xe9"}\n', "not UTF-8 (byte 0xe9"),
        ('{"id": null, "prompt": "hi"}\n', '"id" is null'),
        ('{"id": [1], "prompt": "hi"}\n', '"id" is [1]'),
        ('{"id": true, "prompt": "hi"}\n', '"id" is true'),
        ('{"id": "a", "prompt": "\\ud800"}\n', "not valid Unicode"),
        ('{"id": "a", "prompt_token_ids": [1, 18446744073709551616]}\n', "64 bits"),
        ('{"id": "a", "prompt": 5}\n', ":1:"),
        ("[1, 2]\n", "JSON object"),
    ],
)
def test_bad_prompt_files_exit_2_with_one_line(tmp_path, capsys, content, needle):
    """Non-UTF-8 files, null or non-scalar ids, lone surrogates, integers beyond 64 bits and
    wrong types are refused with the file, the line and the problem, before anything starts."""
    code, err = _rollout(tmp_path, capsys, _file(tmp_path, content))
    _assert_refused_before_start(tmp_path, code, err, needle)


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--temperature", "inf"], "--temperature"),
        (["--temperature", "nan"], "--temperature"),
        (["--top-p", "0"], "--top-p"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--group-size", "0"], "--group-size"),
        (["--seed", str(2**64)], "64 bits"),
        (["--policy", "nope"], "--policy 'nope'"),
        (["--timeout", "0"], "--timeout"),
    ],
)
def test_bad_flags_exit_2_with_one_line_before_any_daemon_starts(tmp_path, capsys, flags, needle):
    """Out-of-range sampling flags, a bad group size, seed, policy or timeout are refused before start."""
    code, err = _rollout(tmp_path, capsys, _file(tmp_path, '{"id": "a", "prompt": "hi"}\n'), *flags)
    _assert_refused_before_start(tmp_path, code, err, needle)


def test_prompts_larger_than_the_embedded_daemons_request_limit_are_refused_before_start(tmp_path, capsys):
    """A file whose prompts exceed the config's server.max_request_bytes is refused up front."""
    big = "x" * 300_000  # write_sim_config sets max_request_bytes = 200000
    code, err = _rollout(tmp_path, capsys, _file(tmp_path, json.dumps({"id": "a", "prompt": big}) + "\n"))
    _assert_refused_before_start(tmp_path, code, err, "server.max_request_bytes")


def test_integer_ids_become_their_decimal_string_and_missing_ids_stay_unset(tmp_path):
    """"id": 7 reads as "7"; a row without id keeps None (the daemon names it by position)."""
    prompts, metas = read_prompts(_file(tmp_path, '{"id": 7, "prompt": "a", "answer": 1}\n{"prompt": "b"}\n'))
    assert [p.id for p in prompts] == ["7", None]
    assert metas == [{"answer": 1}, {}]


def test_read_prompts_names_the_line_of_a_null_id(tmp_path):
    """The refusal of a null id names file and line."""
    path = _file(tmp_path, '{"id": "a", "prompt": "x"}\n\n{"id": null, "prompt": "y"}\n')
    with pytest.raises(PromptFileError, match=r"prompts.jsonl:3: \"id\" is null"):
        read_prompts(path)
