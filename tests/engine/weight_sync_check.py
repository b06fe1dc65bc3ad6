"""Seer's weight updates on one real vLLM engine (``VLLMBackend`` in this process), for
tests/engine/test_weight_sync.py: run as a script, prints one JSON object.

Scenarios, in order, each on the weights the previous one left:
- ``own``: the model's own weights through a shared-memory segment: the greedy output
  and its logprobs stay those of the checkpoint;
- ``trained``: perturbed weights (what an optimizer step does): the engine's logprobs of
  its greedy tokens equal a float32 Hugging Face forward pass of the same weights;
- ``in_flight``: an update while a request is generating: that request finishes on one
  set of weights (the pause waits for it), never a mix;
- ``refused``: a missing tensor, an unknown one, one of another shape, a segment
  rewritten since its source: each refused before anything is loaded (output unchanged);
- ``half_loaded``: an update that fails after half the tensors were loaded into the
  model: the engine reloads the weights it served, output unchanged, still healthy;
- ``unrecoverable``: the same when the served weights are gone too: the engine stops
  serving (``healthy()`` False, ``generate`` raises) instead of serving a half-loaded model;
- ``file``: the checkpoint path still loads (seconds reported, as for the segments).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time


def hf_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    import torch

    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def perturb(model, seed: int) -> None:
    """Noise of 2 % of each tensor's spread on every weight, as a (large) optimizer step."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.02 * p.float().std().clamp(min=1e-3))


async def main(spec: dict) -> dict:
    import torch
    from structlog.testing import capture_logs
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from seer.engines.vllm_backend import VLLMBackend
    from seer.integrations.weights import policy_tensors, segment_items, write_segment
    from seer.protocol import ChunkTask, EngineSampling, pack_token_ids
    from seer.weights_segment import SegmentWriter

    model_dir = spec["model"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for q in spec["questions"]]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    backend = VLLMBackend(model_dir, dtype="float32", max_model_len=1024, enforce_eager=True,
                          gpu_memory_utilization=0.5, logprobs_mode="raw", kv_cache_gib=1.0)
    await backend.start()
    task_ids = iter(range(1, 10**6))
    out: dict = {}

    async def greedy(prompt: list[int], max_tokens: int = 16):
        sampling = EngineSampling(max_tokens=max_tokens, temperature=0.0, top_p=1.0, top_k=-1, min_tokens=0,
                                  seed=None, stop=[], stop_token_ids=[], ignore_eos=True)
        task = ChunkTask(task_id=next(task_ids), request_id="r", group_id="g", prompt_token_ids=pack_token_ids(prompt),
                         sampling=sampling)
        result = await backend.generate(task)
        return result.token_ids, result.logprobs

    async def all_greedy():
        return [await greedy(p) for p in prompts]

    writer = SegmentWriter()
    try:
        before = await all_greedy()
        # own: the checkpoint's weights through the segment
        seconds = []
        with capture_logs() as events:
            for _ in range(spec["repeats"]):
                t0 = time.perf_counter()
                source, num_bytes = write_segment(writer, hf)
                t1 = time.perf_counter()
                await backend.load_weights(str(source))
                writer.accepted()
                seconds.append((t1 - t0, time.perf_counter() - t1))
        phases = [{k: e[k] for k in ("pause_ms", "load_ms", "resume_ms")} for e in events
                  if e.get("event") == "weights_loaded"]
        own = await all_greedy()
        out["own"] = {"same_tokens": [a[0] == b[0] for a, b in zip(before, own)],
                      "max_logprob_diff": max(abs(x - y) for a, b in zip(before, own) for x, y in zip(a[1], b[1])),
                      "num_bytes": num_bytes, "write_s": [w for w, _ in seconds], "load_s": [u for _, u in seconds],
                      "phases": phases}

        # trained: perturb every weight as an optimizer step would, then compare with HF
        perturb(hf, seed=0)
        source, _ = write_segment(writer, hf)
        await backend.load_weights(str(source))
        writer.accepted()
        trained = await all_greedy()
        diffs = [max(abs(x - y) for x, y in zip(lp, hf_logprobs(hf, p, t))) for p, (t, lp) in zip(prompts, trained)]
        out["trained"] = {"changed": [a[0] != b[0] or a[1] != b[1] for a, b in zip(before, trained)],
                          "max_logprob_diff_vs_hf": max(diffs)}

        # in_flight: an update arriving while a request generates waits for it
        long_old = await greedy(prompts[0], 48)
        saved = [(n, t.clone()) for n, t in policy_tensors(hf)]
        perturb(hf, seed=1)
        new_source, _ = write_segment(writer, hf)
        running = asyncio.create_task(greedy(prompts[0], 48))
        await asyncio.sleep(spec["in_flight_delay_s"])
        await backend.load_weights(str(new_source))
        writer.accepted()
        finished = await running
        long_new = await greedy(prompts[0], 48)
        out["in_flight"] = {"old_or_new": finished[0] in (long_old[0], long_new[0]),
                            "finished_on": "old" if finished[0] == long_old[0] else "new",
                            "new_differs": long_new[0] != long_old[0]}
        with torch.no_grad():  # back to `trained`
            state = dict(saved)
            for name, p in hf.named_parameters():
                if name in state:
                    p.copy_(state[name])
        source, _ = write_segment(writer, hf)
        await backend.load_weights(str(source))
        writer.accepted()
        reference = await all_greedy()

        # refused: bad inputs never reach the model
        good = list(policy_tensors(hf))
        bad_sets = {
            "missing": good[1:],
            "unknown": good + [("model.extra.weight", torch.zeros(3))],
            "reshaped": [(n, t[:-1] if n == good[-1][0] else t) for n, t in good],
        }
        errors = {}
        for label, tensors in bad_sets.items():
            bad = writer.write(segment_items(tensors))
            try:
                await backend.load_weights(str(bad))
            except RuntimeError as exc:
                errors[label] = str(exc)
        stale = writer.write(segment_items(good))
        writer.write(segment_items(good))  # the same segment again: `stale` names an older write
        try:
            await backend.load_weights(str(stale))
        except RuntimeError as exc:
            errors["stale"] = str(exc)
        out["refused"] = {"errors": errors, "unchanged": await all_greedy() == reference}

        # half_loaded: a load that dies after half the tensors reached the model
        half_writer = SegmentWriter()
        half = half_writer.write(segment_items([(n, t * 3.0) for n, t in good[: len(good) // 2]]))
        engine = backend._engine
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        def failing_loader(source):
            async def load():
                await engine.start_weight_update()
                await engine.update_weights(WeightTransferUpdateRequest(
                    update_info={"segment": half.segment, "generation": half.generation}))
                raise RuntimeError("injected failure after half the tensors")
            return load

        real_loader = backend._segment_loader
        backend._segment_loader = lambda source: failing_loader(source) if source.segment == half.segment \
            else real_loader(source)
        try:
            await backend.load_weights(str(half))
        except RuntimeError as exc:
            half_error = str(exc)
        else:
            half_error = ""
        out["half_loaded"] = {"error": half_error, "healthy": backend.healthy(),
                              "unchanged": await all_greedy() == reference}

        # unrecoverable: the served segment is gone when the update fails
        writer.close()
        try:
            await backend.load_weights(str(half))
        except RuntimeError as exc:
            unrecoverable_error = str(exc)
        else:
            unrecoverable_error = ""
        try:
            await greedy(prompts[0])
        except RuntimeError as exc:
            refused_work = str(exc)
        else:
            refused_work = ""
        out["unrecoverable"] = {"error": unrecoverable_error, "healthy": backend.healthy(), "generate": refused_work}
        half_writer.close()
        backend._segment_loader = real_loader
        backend._served_source = model_dir  # let the file scenario run on a working engine

        # file: the checkpoint path (a fresh reload of the served checkpoint)
        file_s = []
        for _ in range(spec["repeats"]):
            t0 = time.perf_counter()
            await backend.load_weights(os.path.join(model_dir, "model.safetensors"))
            file_s.append(time.perf_counter() - t0)
        out["file"] = {"load_s": file_s, "healthy": backend.healthy(),
                       "same_as_before": [a[0] for a in await all_greedy()] == [b[0] for b in before]}
        out["median_segment_sync_s"] = statistics.median(w + u for w, u in seconds)
    finally:
        writer.close()
        await backend.shutdown()
    return out


if __name__ == "__main__":
    result = asyncio.run(main(json.loads(sys.stdin.read())))
    print("RESULT " + json.dumps(result))
