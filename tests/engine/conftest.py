"""Real-engine fixtures: one daemon with two real vLLM engines (float32, the bundled
SmolLM2) shared by every engine test of the session, and vLLM's own reference outputs.

These tests need `scripts/setup.sh` to have run (vLLM installed, model converted);
without it they fail with that message rather than skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.daemon_helpers import Daemon, shm_entries

MODEL_DIR = Path(os.environ.get("SEER_CACHE_DIR", Path.home() / ".cache" / "seer")) / "models" / "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 1024

QUESTIONS = [
    "What is 12 times 7?",
    "Name three primary colors.",
    "Write one sentence about the sea.",
    "If a train travels 60 km in 1 hour, how far does it go in 3 hours?",
]
# Prompts no other test sends: the engines' prefix caches hold nothing of their answers,
# so a chunk that moves must get its prefix from the host KV pool.
MIGRATION_QUESTIONS = [
    "Explain why the sky is blue in two sentences.",
    "List four animals that live in the ocean and say one fact about each.",
    "Describe how to make a cup of tea, step by step.",
]

# Greedy trajectories with a fixed tool answer after each turn (test_trajectories_vllm.py),
# also run by one vLLM engine alone before Seer's engines start.
TRAJECTORY_QUESTIONS = ["What is 6 times 8? Use the calculator.", "Spell the word ocean backwards."]
TRAJECTORY_TOOL = "The tool answered: 48."
TRAJECTORY_TURNS = 3
TRAJECTORY_MAX_TOKENS = 20


@pytest.fixture(scope="session")
def model_dir() -> Path:
    if not (MODEL_DIR / ".seer-complete").exists():
        pytest.fail(f"the model is not prepared in {MODEL_DIR}; run `bash scripts/setup.sh` first")
    return MODEL_DIR


def _chat(model_dir: Path, questions: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for q in questions]


@pytest.fixture(scope="session")
def chat_prompts(model_dir: Path) -> list[list[int]]:
    return _chat(model_dir, QUESTIONS)


@pytest.fixture(scope="session")
def migration_prompts(model_dir: Path) -> list[list[int]]:
    return _chat(model_dir, MIGRATION_QUESTIONS)


@pytest.fixture(scope="session")
def migration_reference(all_references: list[dict]) -> list[dict]:
    return all_references[len(QUESTIONS):]


@pytest.fixture(scope="session")
def reference_outputs(all_references: list[dict]) -> list[dict]:
    return all_references[:len(QUESTIONS)]


@pytest.fixture(scope="session")
def all_references(vllm_alone: dict) -> list[dict]:
    return vllm_alone["outputs"]


@pytest.fixture(scope="session")
def trajectory_reference(vllm_alone: dict) -> list[dict]:
    """``TRAJECTORIES`` run greedily by one vLLM engine alone (``reference_generate.py``)."""
    return vllm_alone["trajectories"]


@pytest.fixture(scope="session")
def vllm_alone(model_dir: Path, chat_prompts: list[list[int]], migration_prompts: list[list[int]]) -> dict:
    """Greedy outputs of vLLM's LLM.generate (64 tokens) and greedy multi-turn trajectories,
    computed before Seer's engines start."""
    from seer.controlplane.tokenizer import HFTokenizer
    from seer.protocol import ChatMessage

    tok = HFTokenizer(str(model_dir))
    tool = [ChatMessage(role="tool", content=TRAJECTORY_TOOL)]
    trajectories = [{"prompt": p, "turns": TRAJECTORY_TURNS, "max_tokens": TRAJECTORY_MAX_TOKENS,
                     "suffix": tok.encode_turn_suffix(tool, False), "suffix_eos": tok.encode_turn_suffix(tool, True)}
                    for p in _chat(model_dir, TRAJECTORY_QUESTIONS)]
    spec = {"model": str(model_dir), "dtype": "float32", "max_model_len": MAX_MODEL_LEN,
            "prompts": chat_prompts + migration_prompts, "max_tokens": 64, "trajectories": trajectories,
            "eos": tok.eos_token_id}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("reference_generate.py"))],
                          input=json.dumps(spec), capture_output=True, text=True, timeout=600,
                          env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("SEER_REFERENCE "))
    return json.loads(line.removeprefix("SEER_REFERENCE "))


def vllm_config(path: Path, *, engines: int = 2, extra: str = "") -> Path:
    """``path`` written as the seer.toml of real vLLM engines on this CPU (float32, the
    suite's ``MAX_MODEL_LEN``, 1 GiB of KV each), followed by ``extra`` (more sections)."""
    path.write_text(f"""
[model]
dtype = "float32"
max_model_len = {MAX_MODEL_LEN}

[engines]
backend = "vllm"
count = {engines}
kv_cache_gib = 1.0
{extra}""")
    return path


@pytest.fixture(scope="session")
def vllm_daemon(tmp_path_factory: pytest.TempPathFactory, reference_outputs):
    root = tmp_path_factory.mktemp("vllm")
    config = root / "seer.toml"
    vllm_config(config, extra="""
[scheduler]
chunk_size_tokens = 16
# Every chunk of a chunked policy moves to the other engine: the strongest test of
# lossless migration through the host KV pool (the group baseline is not chunked).
placement = "migrate"

[kv_pool]
min_load_tokens = 1  # load any gap from the pool, so every migration exercises it

[openai]  # tests/engine/test_openai_vllm.py; port 0: any free port (daemon.json's openai_url)
enabled = true

[metrics]  # tests/engine/test_metrics_vllm.py; port 0: any free port (daemon.json's metrics_url)
enabled = true
port = 0
""")
    daemon = Daemon(root / "run", config)
    daemon.shm_before = shm_entries()  # after the reference run: only the daemon's own segments count
    daemon.start()
    yield daemon
    daemon.stop()
