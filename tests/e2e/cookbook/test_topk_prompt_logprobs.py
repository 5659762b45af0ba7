"""topk_prompt_logprobs through the SDK, shaped as the cookbook's distillation code reads it
(distillation/train_off_policy.py, sdft.py): one entry per prompt token, None at position 0, then k
(token, logprob) pairs in descending order, the actual prompt token's logprob consistent with prompt_logprobs."""

from __future__ import annotations

import pytest


@pytest.mark.timeout(600)
def test_topk_prompt_logprobs_rows_per_prompt_position(stack, service_client, base_model):
    from tinker import types

    sampler = service_client.create_sampling_client(base_model=base_model)
    prompt = [5, 17, 42, 99, 3, 250, 7]
    res = sampler.sample(
        types.ModelInput.from_ints(prompt),
        num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=1),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=4,
    ).result(timeout=300)
    rows, plp = res.topk_prompt_logprobs, res.prompt_logprobs
    assert len(rows) == len(prompt) and rows[0] is None and plp[0] is None
    for i in range(1, len(prompt)):
        assert len(rows[i]) == 4
        lps = [lp for _, lp in rows[i]]
        assert lps == sorted(lps, reverse=True)
        assert plp[i] <= lps[0] + 1e-5  # the prompt token is at most as likely as the most likely one
        by_token = dict(rows[i])
        if prompt[i] in by_token:
            assert by_token[prompt[i]] == pytest.approx(plp[i], abs=1e-5)
