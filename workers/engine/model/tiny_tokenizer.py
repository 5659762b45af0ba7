"""The tiny model's tokenizer: a byte-level BPE like Qwen's (the same pre-tokenizer split, the ByteLevel decoder,
ChatML's special tokens), trained on the bundled English text, so any text round-trips and chat templates apply."""

from __future__ import annotations

import pathlib

DATA_FILE = pathlib.Path(__file__).resolve().parent / "data" / "english.txt"
VOCAB_SIZE = 2048  # the special tokens included

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")  # Qwen's order: appended after the BPE vocabulary

# Qwen2/Qwen3's pre-tokenizer split (digits one at a time, words with their leading space or punctuation mark).
QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ChatML, as Qwen uses it (no system-prompt or tool logic: enough for renderers that apply a chat template).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_tokenizer(vocab_size: int = VOCAB_SIZE, extra_tokens: tuple[str, ...] = ()):
    """Train the byte-level BPE on the bundled English text; returns a `tokenizers.Tokenizer` of `vocab_size` ids,
    the last of them SPECIAL_TOKENS and then `extra_tokens` (a family's chat format's)."""
    specials = (*SPECIAL_TOKENS, *extra_tokens)
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    bpe_size = vocab_size - len(specials)
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_size,
        min_frequency=0,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: any text round-trips
        special_tokens=[],
    )
    # One string, not lines: pre-tokens such as "\n\n" must be seen whole to be learned.
    tok.train_from_iterator([DATA_FILE.read_text(encoding="utf-8")], trainer=trainer)
    if tok.get_vocab_size() != bpe_size:
        raise RuntimeError(
            f"BPE training reached {tok.get_vocab_size()} tokens, wanted {bpe_size}: {DATA_FILE} is too small"
        )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    assert tok.get_vocab_size() == vocab_size
    return tok
