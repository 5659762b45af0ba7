"""The JAX worker's checkpoint path (activities/checkpoint_io.py) end to end below Temporal: engine state staged
with orbax / PEFT, committed to a checkpoint root on local disk or on GCS (gcp-storage-emulator), loaded back."""

from __future__ import annotations

import numpy as np
import pytest

from tinkerflow.activities import checkpoint_io
from tinkerflow.common.checkpoints import CheckpointError, CheckpointStore, now_rfc3339
from tinkerflow.workers.engine.types import AdamConfig, Datum, ForwardBackwardInput, LoraConfig

SRC, DST = 2, 3


@pytest.fixture(params=["file", "gs"])
def store(request, tmp_path) -> CheckpointStore:
    root = (tmp_path / "ckpts").as_uri() if request.param == "file" else f"{request.getfixturevalue('gcs')}/io"
    return CheckpointStore(root)


def manifest(path: str) -> dict:
    return {
        "tinker_path": path,
        "owner": "o",
        "base_model": "tiny",
        "lora": {},
        "time": now_rfc3339(),
        "step": 0,
        "expires_at": None,
        "user_metadata": {},
    }


def test_training_state_and_sampler_weights_round_trip_through_storage(engine, store, rng):
    engine.create_adapter(SRC, LoraConfig(rank=4, seed=3, train_mlp=False))
    tokens = rng.integers(0, 300, size=12).astype(np.int32)
    for _ in range(2):
        datum = Datum(tokens=tokens[:-1], inputs={"target_tokens": tokens[1:]})
        engine.forward_backward([ForwardBackwardInput(slot=SRC, data=[datum], loss_fn="cross_entropy")])
        engine.optim_step(SRC, AdamConfig(learning_rate=1e-2))
    state_path = "tinker://s:train:0/weights/two"
    saved = checkpoint_io.save(engine, store, SRC, manifest(state_path), overwrite=False)
    assert saved.has_optimizer and saved.lora["train_mlp"] is False and saved.size_bytes > 0
    assert [m.tinker_path for m in store.list("s:train:0")] == [state_path]

    info = checkpoint_io.load(engine, store, DST, state_path, optimizer=True)
    assert info["step"] == 2 and info["lora"]["rank"] == 4
    a, b = engine.export_slot(SRC), engine.export_slot(DST)
    for name in a.weights:
        np.testing.assert_array_equal(a.weights[name], b.weights[name])
        np.testing.assert_array_equal(a.mu[name], b.mu[name])

    sampler_path = "tinker://s:train:0/sampler_weights/s1"
    checkpoint_io.save(engine, store, SRC, manifest(sampler_path), overwrite=False)
    with pytest.raises(CheckpointError, match="no optimizer state"):
        checkpoint_io.load(engine, store, DST, sampler_path, optimizer=True)
    checkpoint_io.load_snapshot(engine, store, sampler_path)
    engine.drop_snapshot(sampler_path)
    engine.free_adapter(SRC)
    engine.free_adapter(DST)


def test_external_weights_with_age_recipients_are_stored_only_as_age_files(engine, tmp_path):
    """save_weights_external(age_encryption_recipients=[...]): every file is `<name>.age`, decryptable by each
    recipient's identity into exactly the plain export's bytes (what tinker-cookbook's weights.download needs)."""
    import pyrage

    store = CheckpointStore((tmp_path / "ckpts").as_uri())
    engine.create_adapter(SRC, LoraConfig(rank=2, seed=5))
    alice, bob = pyrage.x25519.Identity.generate(), pyrage.x25519.Identity.generate()
    plain_path, age_path = "tinker://s:train:0/external_weights/plain", "tinker://s:train:0/external_weights/sealed"
    plain = checkpoint_io.save(engine, store, SRC, manifest(plain_path), overwrite=False)
    sealed = checkpoint_io.save(
        engine,
        store,
        SRC,
        manifest(age_path),
        overwrite=False,
        age_recipients=[str(alice.to_public()), str(bob.to_public())],
    )
    assert sealed.format == "peft+age" and sorted(sealed.files) == sorted(f + ".age" for f in plain.files)
    for name in plain.files:
        with store.open_file(plain.path, name) as f:
            want = f.read()
        with store.open_file(sealed.path, name + ".age") as f:
            got = f.read()
        for identity in (alice, bob):
            assert pyrage.decrypt(got, [identity]) == want
    with pytest.raises(CheckpointError, match="age-encrypted"):
        checkpoint_io.load_snapshot(engine, store, age_path)
    engine.free_adapter(SRC)


def test_a_bad_age_recipient_is_named():
    import pyrage

    from tinkerflow.common.age_export import parse_recipients

    good = str(pyrage.x25519.Identity.generate().to_public())
    assert len(parse_recipients([good])) == 1
    with pytest.raises(CheckpointError, match=r"age_encryption_recipients\[1\] is not an age X25519 public key"):
        parse_recipients([good, "ssh-rsa AAAA"])
