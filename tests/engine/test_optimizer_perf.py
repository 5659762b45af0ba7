"""optim_step touches one slot: no whole-state copies, donated buffers updated in place, one compile for every
slot and hyper-parameter, other slots' weights, moments and step counts bit-for-bit untouched."""

from __future__ import annotations

import re

import jax
import numpy as np

from tinkerflow.workers.engine.training.optimizer import adamw_slot_values, pack_hparams, write_slot_values
from tinkerflow.workers.engine.types import AdamConfig, Datum, ForwardBackwardInput, LoraConfig

ADAM = AdamConfig(learning_rate=1e-2, weight_decay=0.1, grad_clip_norm=1.0)


def train(engine, slot: int, seed: int = 0) -> None:
    tokens = np.random.default_rng(seed).integers(1, 300, 13).astype(np.int32)
    [res] = engine.forward_backward(
        [
            ForwardBackwardInput(
                slot=slot,
                data=[Datum(tokens=tokens[:-1], inputs={"target_tokens": tokens[1:]})],
                loss_fn="cross_entropy",
            )
        ]
    )
    assert not isinstance(res, Exception), res


def whole_state_copies(hlo: str, num_slots: int) -> list[str]:
    """Copy instructions whose result has a multi-slot LoRA buffer's shape ([S, in, R] or [S, R, out])."""
    return re.findall(rf"= f32\[{num_slots},\d+,\d+\]\{{[^}}]*\}} copy\(", hlo)


def test_step_halves_copy_no_multi_slot_buffer(engine):
    engine.create_adapter(1, LoraConfig(rank=4, seed=1))
    train(engine, 1)
    packed = pack_hparams((1e-3, 0.9, 0.999, 1e-8, 0.1, 1.0), 4, (True, True, True))
    args = (engine.adapters.lora, engine.adapters.grads, engine.adapters.opt, np.int32(1), packed)
    read = adamw_slot_values.lower(*args).compile().as_text()
    values, count, _ = adamw_slot_values(*args)
    write = write_slot_values.lower(*args[:4], values, count, placement=engine._layout).compile().as_text()
    s = engine.max_lora_adapters
    assert "dynamic-update-slice" in write  # pyright: ignore[reportOperatorIssue] (private jax API / as_text() is a str here)
    assert whole_state_copies(read, s) == [] and whole_state_copies(write, s) == []  # pyright: ignore[reportArgumentType] (private jax API / as_text() is a str here)


def test_step_updates_the_donated_state_in_place(engine):
    engine.create_adapter(1, LoraConfig(rank=4, seed=1))
    train(engine, 1)
    before = [
        jax.tree.leaves(t)[0]
        for t in (engine.adapters.lora, engine.adapters.grads, engine.adapters.opt.mu, engine.adapters.opt.nu)
    ]
    shardings = [
        x.sharding for x in jax.tree.leaves((engine.adapters.lora, engine.adapters.grads, engine.adapters.opt))
    ]
    engine.optim_step(1, ADAM)
    assert all(x.is_deleted() for x in before), "the LoRA state, accumulator and moments are donated"
    # The compiled train and sample steps take the new state as it is: same shardings as before.
    assert [
        x.sharding for x in jax.tree.leaves((engine.adapters.lora, engine.adapters.grads, engine.adapters.opt))
    ] == shardings


def test_one_compile_serves_every_slot_rank_and_hyper_parameter(engine):
    engine.create_adapter(0, LoraConfig(rank=2, seed=0, train_mlp=False))
    engine.create_adapter(1, LoraConfig(rank=4, seed=1))
    train(engine, 0)
    engine.optim_step(0, ADAM)
    sizes = adamw_slot_values._cache_size(), write_slot_values._cache_size()  # pyright: ignore[reportAttributeAccessIssue] (private jax API / as_text() is a str here)
    for slot, lr, wd, clip in [(1, 1e-3, 0.0, 0.0), (0, 5e-4, 0.01, 2.0), (1, 0.1, 0.5, 0.5)]:
        train(engine, slot, seed=slot)
        adam = AdamConfig(learning_rate=lr, beta1=0.8, beta2=0.99, weight_decay=wd, grad_clip_norm=clip)
        engine.optim_step(slot, adam)
    assert (adamw_slot_values._cache_size(), write_slot_values._cache_size()) == sizes  # pyright: ignore[reportAttributeAccessIssue] (private jax API / as_text() is a str here)


def test_step_leaves_other_slots_moments_and_counts_untouched(engine):
    engine.create_adapter(0, LoraConfig(rank=4, seed=0))
    engine.create_adapter(1, LoraConfig(rank=4, seed=1))
    train(engine, 0)
    train(engine, 1, seed=1)
    engine.optim_step(0, ADAM)

    def take(slot):
        return [
            np.asarray(x[slot])
            for x in jax.tree.leaves((engine.adapters.opt, engine.adapters.lora, engine.adapters.grads))
        ]

    other = take(0)
    for step in range(1, 4):
        metrics = engine.optim_step(1, ADAM)
        assert metrics["step"] == step and metrics["grad_norm"] >= 0
        assert all(np.array_equal(a, b) for a, b in zip(other, take(0)))
    assert int(engine.adapters.opt.count[0]) == 1 and int(engine.adapters.opt.count[1]) == 3
    # The step's grad_norm and count are plain floats fetched together.
    assert isinstance(metrics["grad_norm"], float) and isinstance(metrics["step"], float)
