"""OpenAI's server-sent events for `stream=True` on /v1/completions and /v1/chat/completions (routes_openai.py).

The engine returns whole sequences, so the chunks (one per token piece and choice) follow once it has answered; until
then an SSE comment every KEEPALIVE_S keeps proxies from cutting the idle connection.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from fastapi.responses import StreamingResponse

from tinkerflow.api.openai_models import OpenAIError
from tinkerflow.api.openai_render import Rendered, chat_logprobs, usage

KEEPALIVE_S = 15.0


def stream(
    meta: dict[str, Any], pending: Coroutine[Any, Any, list[Rendered]], prompt_tokens: int, req: Any, chat: bool
) -> StreamingResponse:
    """OpenAI's server-sent events: one chunk per token piece and choice, a last chunk per choice with its
    finish_reason, the usage chunk when stream_options.include_usage, then `data: [DONE]`."""

    def event(body: dict[str, Any]) -> str:
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

    def chunk(index: int, piece: str | None, lp: float | None, finish: str | None, first: bool = False) -> str:
        if chat:
            delta: dict[str, Any] = (
                {"role": "assistant", "content": ""} if first else ({"content": piece} if piece is not None else {})
            )
            choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
            if req.logprobs and piece is not None and lp is not None:
                choice["logprobs"] = chat_logprobs([piece], [lp])
        else:
            choice = {"index": index, "text": piece or "", "finish_reason": finish, "logprobs": None}
            if req.logprobs is not None and piece is not None and lp is not None:
                choice["logprobs"] = {
                    "tokens": [piece],
                    "token_logprobs": [lp],
                    "top_logprobs": None,
                    "text_offset": [0],
                }
        return event({**meta, "choices": [choice]})

    async def events() -> AsyncIterator[str]:
        task = asyncio.ensure_future(pending)
        try:
            # An SSE comment while the engine works (a first compile can take minutes): proxies and load balancers
            # that cut idle connections keep this one, and clients ignore comments.
            while not (await asyncio.wait({task}, timeout=KEEPALIVE_S))[0]:
                yield ": waiting for the engine\n\n"
            rendered = task.result()
        except OpenAIError as e:
            yield event(e.body())
            yield "data: [DONE]\n\n"
            return
        finally:
            task.cancel()  # the client went away: stop waiting (the sampled result is simply not read)
        for i, r in enumerate(rendered):
            if chat:
                yield chunk(i, None, None, None, first=True)
            for piece, lp in zip(r.pieces, r.logprobs, strict=True):
                if piece:
                    yield chunk(i, piece, lp, None)
            yield chunk(i, None, None, r.finish_reason)
        options = req.stream_options
        if options is not None and options.include_usage:
            yield event(
                {**meta, "choices": [], "usage": usage(prompt_tokens, sum(r.completion_tokens for r in rendered))}
            )
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
