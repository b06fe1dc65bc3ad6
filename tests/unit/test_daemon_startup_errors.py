"""Start-up errors the daemon reports before or after its engines start (cli/daemon.py):
a ``model.max_model_len`` longer than the model allows is refused before any engine is
spawned, and when no engine becomes ready the message shows the end of each engine's
output, without the nanobind leak report that buries the real error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from seer.cli import daemon
from seer.cli.daemon import DaemonError, check_context_length, resolve_model_path
from seer.config import config_from_dict


def _model(tmp_path: Path, **hf) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf))
    return folder


def test_a_max_model_len_above_the_models_positions_is_refused_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    folder = _model(tmp_path, max_position_embeddings=8192)
    config = config_from_dict({"model": {"path": str(folder), "max_model_len": 9000}})
    with pytest.raises(DaemonError) as err:
        resolve_model_path(config, tmp_path / "cache")
    text = str(err.value)
    assert "model.max_model_len = 9000" in text and "max_position_embeddings = 8192" in text
    assert "at most 8192" in text and str(folder / "config.json") in text


def test_the_limit_itself_and_below_are_accepted(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    folder = _model(tmp_path, max_position_embeddings=8192)
    for n in (8192, 2048):
        config = config_from_dict({"model": {"path": str(folder), "max_model_len": n}})
        assert resolve_model_path(config, tmp_path / "cache") == str(folder)


@pytest.mark.parametrize(("hf", "env"), [
    ({"max_position_embeddings": 8192, "rope_scaling": {"type": "yarn", "factor": 4.0}}, None),  # vLLM's rules
    ({"max_position_embeddings": 8192}, "1"),  # vLLM's own override
    ({"n_positions": 1024}, None),  # another key: left to vLLM
])
def test_cases_whose_limit_vllm_owns_are_not_checked_here(tmp_path, monkeypatch, hf, env):
    if env is None:
        monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    else:
        monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", env)
    check_context_length(20000, _model(tmp_path, **hf) / "config.json")


def test_an_unreadable_model_config_names_the_file(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(DaemonError, match="config.json"):
        check_context_length(2048, bad)


def test_the_engines_output_tail_drops_the_nanobind_leak_report(tmp_path):
    noise = ["nanobind: leaked 4 instances!", "nanobind: leaked 514 functions!",
             *[f' - leaked function "f{i}"' for i in range(300)], " - ... skipped remainder",
             "nanobind: this is likely caused by a reference counting issue in the binding code.",
             "See https://nanobind.readthedocs.io/en/latest/refleaks.html"]
    (tmp_path / "engine-0.out").write_text("\n".join(["loading", "ValueError: the real reason", *noise]) + "\n")
    (tmp_path / "engine-1.out").write_text("RuntimeError: another reason\n")
    (tmp_path / "daemon.out").write_text("\n".join(noise) + "\n")

    text = daemon._engines_tail(tmp_path)

    assert "--- engine-0.out" in text and "--- engine-1.out" in text
    assert "ValueError: the real reason" in text and "RuntimeError: another reason" in text
    assert "leaked" not in text and "nanobind" not in text


def test_the_first_exception_line_is_the_root_cause_even_behind_vllms_log_prefix(tmp_path):
    (tmp_path / "engine-0.out").write_text("\n".join([
        "INFO 12-02 06:41:50 [model.py:1] loading",
        "(Worker pid=25696) ERROR 12-02 06:41:53 [multiproc_executor.py:953] Traceback (most recent call last):",
        "(Worker pid=25696) ERROR 12-02 06:41:53 [multiproc_executor.py:953]     worker = WorkerProc(*args, **kwargs)",
        "(Worker pid=25696) ERROR 12-02 06:41:53 [multiproc_executor.py:953] RuntimeError: Cannot find any model "
        "weights with `/models/x`",
        "(EngineCore pid=25684) ERROR 12-02 06:41:55 [core.py:1510] Exception: WorkerProc initialization failed",
        "RuntimeError: Engine core initialization failed. See root cause above.",
        *[f' - leaked function "f{i}"' for i in range(50)],
    ]) + "\n")

    text = daemon._engines_tail(tmp_path, lines=2)

    assert text.startswith("--- engine-0.out (first error: RuntimeError: Cannot find any model weights with "
                           "`/models/x`)")
    assert text.endswith("RuntimeError: Engine core initialization failed. See root cause above.")


def test_output_without_an_exception_has_no_first_error(tmp_path):
    (tmp_path / "engine-3.out").write_text("INFO loading\nINFO killed by the supervisor\n")
    assert daemon._engines_tail(tmp_path).startswith("--- engine-3.out\n")
