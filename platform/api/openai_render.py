"""From sampled token sequences to OpenAI's response objects and stream chunks.

Text is the tokenizer's decode of the whole sequence (special tokens skipped). Per-token pieces (for logprobs and
for stream deltas) come from an incremental decode (the prefix/read-offset method vLLM uses), so a character that
spans tokens appears once, in the piece of the token that completes it; the pieces always join to the text. OpenAI
returns text up to, not including, a stop sequence, while the engine stops on the token that completes it: the text
and its pieces are cut at the first stop sequence here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Tokens before the one being decoded that its piece is decoded with (a UTF-8 character is at most 4 bytes).
_WINDOW = 6
_MAX_CHAR_TOKENS = 4


@dataclass(frozen=True)
class Rendered:
    """One choice: its text, one piece and one logprob per token kept, and why it ended."""

    text: str
    pieces: list[str]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    completion_tokens: int
    stop_sequence: str | None = None  # the stop sequence the text was cut at (Anthropic's answer names it)


def token_pieces(tokenizer: Any, tokens: list[int]) -> list[str]:
    """One text piece per token such that "".join(pieces) == decode(tokens)."""

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    pieces: list[str] = []
    prefix, read = 0, 0
    for i in range(len(tokens)):
        before = decode(tokens[prefix:read])
        after = decode(tokens[prefix : i + 1])
        # A trailing U+FFFD is a character still incomplete, unless the tokens since the last piece are already more
        # than one UTF-8 character's bytes (then the model really produced invalid bytes: emit them as they are).
        if len(after) > len(before) and (not after.endswith("\ufffd") or i + 1 - read >= _MAX_CHAR_TOKENS):
            pieces.append(after[len(before) :])
            prefix, read = max(0, i + 1 - _WINDOW), i + 1
        else:
            pieces.append("")  # an incomplete character: it is emitted with the token that completes it
    whole = decode(tokens)
    joined = "".join(pieces)
    if tokens and joined != whole and whole.startswith(joined):  # the sequence ends inside a character
        pieces[-1] += whole[len(joined) :]
    elif joined != whole:  # a decoder that is not concatenative (cleanup rules): one piece, still correct
        pieces = [""] * len(tokens)
        if tokens:
            pieces[-1] = whole
    return pieces


def render(
    tokenizer: Any, tokens: list[int], logprobs: list[float] | None, stop_reason: str, stops: list[str] | None
) -> Rendered:
    pieces = token_pieces(tokenizer, tokens)
    text = "".join(pieces)
    finish = "stop" if stop_reason == "stop" else "length"
    found = [(at, s) for s in stops or () if (at := text.find(s)) >= 0]
    cut, matched = min(found, key=lambda f: f[0]) if found else (-1, None)
    if cut >= 0:
        kept, length = [], 0
        for piece in pieces:
            if length >= cut:
                break
            kept.append(piece[: cut - length])
            length += len(piece)
        pieces, text, finish = kept, text[:cut], "stop"
    lps = list(logprobs or [0.0] * len(tokens))[: len(pieces)]
    return Rendered(text, pieces, lps, finish, len(tokens), matched)


def completion_logprobs(r: Rendered, offset: int = 0) -> dict[str, Any]:
    """The legacy completions logprobs object (top alternatives are not computed: top_logprobs is null)."""
    offsets, at = [], offset
    for piece in r.pieces:
        offsets.append(at)
        at += len(piece)
    return {"tokens": r.pieces, "token_logprobs": r.logprobs, "top_logprobs": None, "text_offset": offsets}


def chat_logprobs(pieces: list[str], logprobs: list[float]) -> dict[str, Any]:
    return {
        "content": [
            {"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
            for p, lp in zip(pieces, logprobs, strict=True)
        ],
        "refusal": None,
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def echo_logprobs(
    tokenizer: Any,
    prompt: list[int],
    prompt_lps: list[float | None] | None,
    topk: list[list[tuple[int, float]] | None] | None,
    r: Rendered,
) -> dict[str, Any]:
    """The logprobs object of an `echo` completion: the prompt's tokens (their logprobs, None for the first, which
    has no context) followed by the completion's. top_logprobs holds the engine's top-k alternatives at each prompt
    position (what lm-eval-harness reads to score a continuation); generated tokens have none computed ({})."""
    pieces = token_pieces(tokenizer, prompt) + r.pieces
    lps: list[float | None] = list(prompt_lps or [None] * len(prompt)) + list(r.logprobs)
    lps[0] = None
    out = completion_logprobs(Rendered("", pieces, lps, r.finish_reason, 0))  # type: ignore[arg-type]
    if topk is not None:

        def alternatives(row: list[tuple[int, float]] | None) -> dict[str, float] | None:
            if row is None:
                return None
            return {tokenizer.decode([t], skip_special_tokens=False): lp for t, lp in row}

        out["top_logprobs"] = [alternatives(row) for row in topk] + [{} for _ in r.pieces]
    return out
