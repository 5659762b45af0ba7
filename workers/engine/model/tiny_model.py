"""Deterministic tiny checkpoints of the model families, laid out exactly as Hugging Face lays one out.

`make_tiny_model(out_dir)` writes ``config.json``, ``generation_config.json``, ``model.safetensors`` and a
tokenizer (``tokenizer.json``, ``tokenizer_config.json``) that ``transformers.AutoModelForCausalLM`` and
``AutoTokenizer`` load with ``from_pretrained(out_dir)`` fully offline, with no missing or unexpected keys. Which
architecture is the family's (`Family.tiny`: its config.json and tensor names, from families/<name>/tiny.py); the
shape (SHAPE), tokenizer, weights and writing are shared, here. The embedded default's (families.EMBEDDED_DEFAULT)
stands in for Qwen3-0.6B in tests, CI and the acceptance scripts (``acceptance/pig_latin.py``,
``acceptance/rl_loop.py``): same architecture and file layout, a few hundred kilobytes of weights, built in about a
second.

Why the weights are drawn with std 0.25 and not HF's ``initializer_range`` of 0.02: with std
0.02 on a hidden-128 model the embedding rows are tiny, so the logits are nearly flat (capped near 2.5): greedy
decoding repeats one token for ever, sampling is close to uniform over the vocabulary, and an RL loop cannot move
it (in ``rl_loop.py`` the reachable reward is bounded by the unembedding geometry, about 0.007). With std ~0.25
the logits have a real spread (std over the vocabulary of a few nats), greedy decoding wanders, and parity,
sampling and RL tests can both fail and succeed: ``rl_loop.py`` goes from ~0.02 to ~1.0 mean reward within 5-8
steps on a reference server. Norm weights are 1.0, as HF initialises them.

The tokenizer is a byte-level BPE like Qwen's (same pre-tokenizer regex, ByteLevel decoder, so any text
round-trips), trained locally and deterministically on ``data/english.txt`` (plain English prose bundled with the
package) to 2045 tokens, followed by Qwen's special tokens ``<|endoftext|>`` (eos, pad, and bos in the config,
as Qwen3 does), ``<|im_start|>`` and ``<|im_end|>``: 2048 ids in all, equal to the model's ``vocab_size``.

The output is byte-identical across runs with the same ``seed``/``init_std`` (and the same installed
``tokenizers``/``transformers``). The directory is built next to ``out_dir`` and renamed into place, so a crash
never leaves half a model; a ``tinkerflow_tiny.json`` marker records the parameters, and calling again on a
directory that already holds the same model returns at once without rewriting anything.

    python -m tinkerflow.workers.engine.model.tiny_model OUT_DIR [--family NAME] [--seed N] [--init-std X]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import pathlib
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .families import EMBEDDED_DEFAULT, TinyCheckpoint, family_named, served_names
from .tiny_shapes import SHAPE
from .tiny_tokenizer import CHAT_TEMPLATE, DATA_FILE, EOS_TOKEN, SPECIAL_TOKENS, build_tokenizer

logger = logging.getLogger(__name__)

#: Bump when the files written change for the same parameters, so old directories are rebuilt.
FORMAT_VERSION = 1
MARKER = "tinkerflow_tiny.json"

REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def _data_sha256() -> str:
    return hashlib.sha256(DATA_FILE.read_bytes()).hexdigest()


def _marker_params(seed: int, init_std: float, tiny: TinyCheckpoint) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "seed": int(seed),
        "init_std": float(init_std),
        "shape": dict(SHAPE),
        "special_tokens": list(SPECIAL_TOKENS),
        "english_txt_sha256": _data_sha256(),
        **tiny.marker,  # the family's, only where it has one, so directories written before families stay valid
    }


def _is_complete(path: pathlib.Path, params: dict[str, Any]) -> bool:
    """True when `path` holds a finished tiny model made with exactly `params`."""
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker == params and all((path / name).is_file() for name in REQUIRED_FILES)


# ---------------------------------------------------------------------------------------------------------------
# The parts


def generation_config_dict(eos_token_id: int) -> dict[str, Any]:
    """generation_config.json like Qwen3-0.6B-Base's (greedy by default; eos = pad = <|endoftext|>)."""
    import transformers

    return {
        "bos_token_id": eos_token_id,
        "do_sample": False,
        "eos_token_id": eos_token_id,
        "pad_token_id": eos_token_id,
        "transformers_version": transformers.__version__,
    }


def make_weights(
    shapes: list[tuple[str, tuple[int, ...]]],
    seed: int = 0,
    init_std: float = 0.25,
    progress: bool = False,
    norm_weight: Callable[[str], float] = lambda name: 1.0,
) -> dict[str, np.ndarray]:
    """float32 weights: matrices ~ N(0, init_std) from `np.random.default_rng(seed)` in `shapes` order, norm weights
    `norm_weight(name)` (1.0: the identity of a plain RMSNorm)."""
    rng = np.random.default_rng(seed)
    weights: dict[str, np.ndarray] = {}
    for name, shape in _progress(shapes, progress, "tiny model weights"):
        if name.endswith("norm.weight"):
            weights[name] = np.full(shape, norm_weight(name), dtype=np.float32)
        else:
            weights[name] = rng.normal(0.0, init_std, size=shape).astype(np.float32)
    return weights


# ---------------------------------------------------------------------------------------------------------------
# Writing


def _progress(items, enabled: bool, desc: str):
    if not enabled:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, leave=False)


def _write_json(path: pathlib.Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _finish_tree(path: pathlib.Path) -> None:
    """Give the files ordinary permissions (mkdtemp makes 0700, safetensors 0600) and flush them to disk."""
    path.chmod(0o755)
    for p in sorted(path.rglob("*")):
        if p.is_file():
            p.chmod(0o644)
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    with contextlib.suppress(OSError):  # directories cannot be fsync'd on every platform
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_model(
    tmp: pathlib.Path, tiny: TinyCheckpoint, seed: int, init_std: float, params: dict[str, Any], progress: bool
) -> None:
    from safetensors.numpy import save_file
    from transformers import PreTrainedTokenizerFast

    tok = build_tokenizer(SHAPE["vocab_size"], tiny.extra_tokens)
    eos_id = tok.token_to_id(EOS_TOKEN)
    assert eos_id is not None  # the vocabulary built above includes EOS
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=SHAPE["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
        chat_template=tiny.chat_template or CHAT_TEMPLATE,
    )
    hf_tok.save_pretrained(str(tmp))

    _write_json(tmp / "config.json", tiny.config(eos_id))
    _write_json(tmp / "generation_config.json", generation_config_dict(eos_id))
    for name, content in tiny.extra_json.items():
        _write_json(tmp / name, content)
    weights = make_weights(tiny.parameter_shapes(), seed, init_std, progress, tiny.norm_weight)
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    _write_json(tmp / MARKER, params)  # last: its presence means the rest is there
    _finish_tree(tmp)


def _atomic_install(tmp: pathlib.Path, out: pathlib.Path) -> None:
    """Move the finished `tmp` to `out`, replacing an empty directory or an older tiny model there."""
    if out.exists():
        if out.is_dir() and not any(out.iterdir()):
            with contextlib.suppress(OSError):
                out.rmdir()
        elif out.is_dir() and (out / MARKER).exists():
            trash = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, trash / out.name)  # out is now absent; a racing builder may take its place first
            shutil.rmtree(trash, ignore_errors=True)
        else:
            raise FileExistsError(f"{out} exists and does not hold a tinkerflow tiny model; refusing to replace it")
    os.rename(tmp, out)  # fails (rather than merges) if someone else created a non-empty `out` meanwhile


def make_tiny_model(
    out_dir: str | os.PathLike,
    *,
    family: str = EMBEDDED_DEFAULT,
    seed: int = 0,
    init_std: float = 0.25,
    progress: bool = False,
    vision: bool = False,
) -> pathlib.Path:
    """Write (or find) `family`'s tiny checkpoint in `out_dir` and return its path (ValueError: the family has none).

    Deterministic: the same `seed` and `init_std` give byte-identical files. If `out_dir` already holds a complete
    tiny model made with the same parameters it is returned untouched; one made with other parameters is replaced;
    any other non-empty directory raises `FileExistsError`.
    """
    tiny = _tiny_of(family, vision)
    if tiny is None:
        have = tiny_families(vision=vision)
        kind = "vision-language tiny checkpoint" if vision else "tiny checkpoint"
        raise ValueError(f"model family {family!r} has no {kind}; those that have: {', '.join(have) or 'none'}")
    out = pathlib.Path(out_dir).expanduser().absolute()
    params = _marker_params(seed, init_std, tiny)
    if _is_complete(out, params):
        logger.debug("tiny model already present at %s", out)
        return out

    t0 = time.perf_counter()
    logger.info("building tiny %s model (seed=%d, init_std=%g) at %s", family, seed, init_std, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write_model(tmp, tiny, seed, init_std, params, progress)
        try:
            _atomic_install(tmp, out)
        except OSError:
            if _is_complete(out, params):  # another process finished the same model first
                logger.debug("tiny model at %s was written concurrently; keeping that one", out)
                return out
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("tiny model written to %s in %.2fs", out, time.perf_counter() - t0)
    return out


def _tiny_of(family: str, vision: bool) -> TinyCheckpoint | None:
    found = family_named(family)
    return found.tiny_vision if vision else found.tiny


def tiny_families(*, vision: bool = False) -> list[str]:
    """The families that have a tiny checkpoint (`vision`: a vision-language one), sorted."""
    return [name for name in served_names() if _tiny_of(name, vision) is not None]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write a deterministic tiny checkpoint (the ones tests use).")
    parser.add_argument("out_dir")
    parser.add_argument(
        "--family", default=EMBEDDED_DEFAULT, choices=sorted({*tiny_families(), *tiny_families(vision=True)})
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init-std", type=float, default=0.25)
    parser.add_argument("--vision", action="store_true", help="the family's vision-language tiny checkpoint")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    path = make_tiny_model(
        args.out_dir,
        family=args.family,
        seed=args.seed,
        init_std=args.init_std,
        progress=sys.stderr.isatty(),
        vision=args.vision,
    )
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
