"""The OpenAI-compatible endpoint through the real stack, driven by the real `openai` client package.

Cross-checks: a completion on a sampler checkpoint saved with the unmodified tinker SDK equals what the SDK's own
SamplingClient samples from that checkpoint (greedy, same prompt tokens); a chat completion equals a completion on the
chat-template-rendered prompt; streamed text equals the non-streamed text. Tenancy: another key gets 404 on the
first tenant's checkpoint, and each tenant gets one OpenAI session however many calls it makes.
"""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest
import tinker
from tinker import types

from tests.e2e.conftest import OTHER_API_KEY

pytestmark = pytest.mark.e2e
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def oai(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=stack.api_key, timeout=600, max_retries=2)


@pytest.fixture(scope="module")
def tokenizer(base_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base_model)


@pytest.fixture(scope="module")
def sampler_checkpoint(training_client) -> str:
    """A sampler checkpoint saved with the SDK from the session's shared training client (saving changes nothing in
    it; other tests have trained it when the whole suite runs)."""
    return training_client.save_weights_for_sampler("openai-e2e").result().path


def test_models_and_a_greedy_completion_on_the_base_model(oai, base_model, tokenizer):
    assert [m.id for m in oai.models.list().data] == [base_model]
    out = oai.completions.create(model=base_model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0)
    choice = out.choices[0]
    assert out.object == "text_completion" and len(out.choices) == 1
    assert out.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert out.usage.completion_tokens == 8 and choice.finish_reason == "length"
    assert "".join(choice.logprobs.tokens) == choice.text
    assert len(choice.logprobs.token_logprobs) == 8 and all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    # Token ids as the prompt give the same answer as the text they encode.
    again = oai.completions.create(model=base_model, prompt=tokenizer.encode(PROMPT), max_tokens=8, temperature=0)
    assert again.choices[0].text == choice.text


def test_checkpoint_completion_equals_the_sdk_sampling_client(oai, service_client, sampler_checkpoint, tokenizer):
    prompt = tokenizer.encode(PROMPT)
    sdk = service_client.create_sampling_client(model_path=sampler_checkpoint).result()
    seq = (
        sdk.sample(
            prompt=types.ModelInput.from_ints(prompt),
            num_samples=1,
            sampling_params=types.SamplingParams(max_tokens=12, temperature=0.0, seed=7),
        )
        .result()
        .sequences[0]
    )
    out = oai.completions.create(model=sampler_checkpoint, prompt=PROMPT, max_tokens=12, temperature=0, seed=7)
    assert out.choices[0].text == tokenizer.decode(seq.tokens, skip_special_tokens=True)
    assert out.usage.completion_tokens == len(seq.tokens)


def test_chat_completion_applies_the_chat_template_and_n_choices(oai, base_model, tokenizer):
    # A short conversation: its rendered prompt (13 tokens) shares the sampler's compiled prompt bucket with the
    # other tests' prompts, so this test compiles nothing new.
    messages = [{"role": "user", "content": "hello"}]
    chat = oai.chat.completions.create(model=base_model, messages=messages, max_completion_tokens=10, temperature=0)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    plain = oai.completions.create(
        model=base_model, prompt=tokenizer.encode(rendered, add_special_tokens=False), max_tokens=10, temperature=0
    )
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == plain.choices[0].text
    assert chat.usage.prompt_tokens == plain.usage.prompt_tokens
    several = oai.chat.completions.create(
        model=base_model, messages=messages, max_tokens=6, temperature=1.0, n=2, seed=3, logprobs=True
    )
    assert [c.index for c in several.choices] == [0, 1]
    assert all(len(c.logprobs.content) == 6 for c in several.choices if c.finish_reason == "length")
    assert several.usage.completion_tokens == sum(len(c.logprobs.content) for c in several.choices)


def test_streaming_chunks_join_to_the_whole_answer(oai, base_model):
    whole = oai.completions.create(model=base_model, prompt=PROMPT, max_tokens=10, temperature=0).choices[0].text
    chunks = list(oai.completions.create(model=base_model, prompt=PROMPT, max_tokens=10, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length" and len(chunks) > 2
    stream = oai.chat.completions.create(
        model=base_model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    events = list(stream)
    assert events[0].choices[0].delta.role == "assistant"
    assert events[-1].usage.completion_tokens == 5 and events[-1].choices == []
    assert [e.choices[0].finish_reason for e in events[:-1]][-1] == "length"


def test_stop_strings_cut_the_text_before_the_stop(oai, base_model):
    whole = oai.completions.create(model=base_model, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    stop = whole[len(whole) // 2 : len(whole) // 2 + 2]
    assert stop.strip(), f"greedy text {whole!r} has no usable stop string"
    out = oai.completions.create(model=base_model, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop, "@@@"])
    assert out.choices[0].text == whole[: whole.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_another_tenant_gets_404_on_the_checkpoint_and_bad_input_names_the_param(
    stack, oai, base_model, sampler_checkpoint
):
    other = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=OTHER_API_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        other.completions.create(model=sampler_checkpoint, prompt=PROMPT, max_tokens=4)
    assert _param(e.value) == "model"
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=4)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="tml-wrong", max_retries=0).models.list()
    bad = [
        ({"temperature": 5}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 100000}, "n"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"prompt": [10**9]}, "prompt"),
    ]
    for extra, param in bad:
        args = {"model": base_model, "prompt": PROMPT, "max_tokens": 4, **extra}
        with pytest.raises(openai.BadRequestError) as e:
            oai.completions.create(**args)
        assert _param(e.value) == param, (extra, e.value.body)
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(
            model=base_model, messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=3
        )
    assert _param(e.value) == "top_logprobs"
    # The tenant's calls (above and in this module) share one OpenAI session; the other tenant made none.
    assert _openai_sessions(stack) == 1


def _param(error: openai.APIStatusError) -> Any:
    """The `param` of an error answer; the SDK types `body` as `object | None`, ours is always the JSON error object."""
    assert isinstance(error.body, dict), error.body
    return error.body["param"]


def _openai_sessions(stack) -> int:
    """Distinct OpenAI-endpoint sessions (workflow ids): a tenant's session that ended idle and was started again
    under its id is one session in two executions (the Anthropic routes, whose tests run first, share it)."""
    from temporalio.client import Client

    async def count() -> int:
        client = await Client.connect(stack.temporal_address)
        return len({w.id async for w in client.list_workflows("WorkflowId STARTS_WITH 'session/openai-'")})

    return asyncio.run(count())


def test_the_sdk_and_the_openai_endpoint_can_share_a_base_model(stack, base_model):
    # Sanity: an SDK sampler still works beside the OpenAI session (the shared submission path).
    client = tinker.ServiceClient(base_url=stack.base_url, api_key=stack.api_key)
    s = client.create_sampling_client(base_model=base_model).result()
    out = s.sample(
        prompt=types.ModelInput.from_ints([5, 6, 7]),
        num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=3, temperature=0.0),
    ).result()
    assert len(out.sequences[0].tokens) == 3


@pytest.mark.slow  # scoring prompts compiles the sampler's prompt-logprobs programs
def test_echo_scores_the_prompt_as_the_sdk_does_for_lm_eval_loglikelihood(oai, service_client, base_model, tokenizer):
    prompt = tokenizer.encode(PROMPT + " jumps")
    sdk = service_client.create_sampling_client(base_model=base_model).result()
    ref = sdk.sample(
        prompt=types.ModelInput.from_ints(prompt),
        num_samples=1,
        include_prompt_logprobs=True,
        topk_prompt_logprobs=2,
        sampling_params=types.SamplingParams(max_tokens=1, temperature=0.0),
    ).result()
    out = oai.completions.create(model=base_model, prompt=prompt, max_tokens=0, echo=True, logprobs=2, temperature=0)
    lp = out.choices[0].logprobs
    assert out.choices[0].text == tokenizer.decode(prompt) and out.usage.completion_tokens == 0
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(prompt)
    # Same engine path as the SDK's: equal up to the float32 the wire carries.
    assert lp.token_logprobs[1:] == pytest.approx(ref.prompt_logprobs[1:], abs=1e-6)
    for alternatives, ref_row in zip(lp.top_logprobs[1:], ref.topk_prompt_logprobs[1:], strict=True):
        assert sorted(alternatives.values()) == pytest.approx(sorted(v for _, v in ref_row), abs=1e-6)


@pytest.fixture(scope="module")
def small_stack(tmp_path_factory):
    """A stack of its own with a 2-sample queue limit and a 5 s session timeout."""
    from tinkerflow.cli.launch import launch

    s = launch(
        tmp_path_factory.mktemp("openai-small") / "state",
        api_key="tml-openai-small",
        extra=["--max-queued-samples", "2", "--session-timeout-s", "5"],
    )
    yield s
    s.stop()


@pytest.mark.slow
def test_a_full_queue_answers_429_with_retry_after_and_retrying_clients_all_complete(small_stack):
    url, key = f"{small_stack.base_url}/v1", small_stack.api_key
    model = small_stack.served_model()

    async def wave(client: openai.AsyncOpenAI, n: int) -> list:
        return await asyncio.gather(
            *(
                client.completions.create(model=model, prompt=f"story {i}", max_tokens=4, temperature=1.0, seed=i)
                for i in range(n)
            ),
            return_exceptions=True,
        )

    def limited(results: list) -> list:
        return [r for r in results if isinstance(r, openai.RateLimitError)]

    async def both() -> tuple[list, list]:
        patient = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=50, timeout=600)
        hasty = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0, timeout=600)
        first = asyncio.ensure_future(wave(patient, 10))  # queues up behind the first compile
        waves: list[asyncio.Future] = []
        # Waves of clients that do not retry, each a second apart while the first wave waits, until one is refused.
        for _ in range(300):
            await asyncio.sleep(1.0)
            if first.done() or any(limited(w.result()) for w in waves if w.done()):
                break
            waves.append(asyncio.ensure_future(wave(hasty, 10)))
        return await first, [r for w in waves for r in await w]

    patient, hasty = asyncio.run(both())
    assert all(isinstance(r, openai.types.Completion) for r in patient), patient
    refused = limited(hasty)
    assert refused, hasty
    assert refused[0].response.headers["retry-after"] == "1" and refused[0].body["code"] == "rate_limit_exceeded"
    assert all(isinstance(r, (openai.types.Completion, openai.RateLimitError)) for r in hasty), hasty


@pytest.mark.slow
def test_the_tenant_session_ends_when_idle_and_the_next_call_starts_it_again(small_stack):
    import time

    oai = openai.OpenAI(base_url=f"{small_stack.base_url}/v1", api_key=small_stack.api_key, timeout=600)
    model = small_stack.served_model()
    usage = oai.completions.create(model=model, prompt="a", max_tokens=2).usage
    assert usage is not None and usage.completion_tokens == 2
    time.sleep(12)  # past the 5 s session timeout: the session ends (and its heartbeat throttle has lapsed)
    usage = oai.completions.create(model=model, prompt="a", max_tokens=2).usage
    assert usage is not None and usage.completion_tokens == 2
    runs = _openai_session_runs(small_stack)
    assert len(runs) >= 2 and {r[0] for r in runs} == {runs[0][0]}, runs  # one session id, started again


def _openai_session_runs(stack) -> list[tuple[str, str]]:
    from temporalio.client import Client

    async def rows() -> list[tuple[str, str]]:
        client = await Client.connect(stack.temporal_address)
        return [(w.id, w.run_id) async for w in client.list_workflows("WorkflowId STARTS_WITH 'session/openai-'")]

    return asyncio.run(rows())
