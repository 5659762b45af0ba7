"""tinker_cookbook.distillation, unmodified, against the real stack on the embedded model.

* On-policy distillation (`distillation.train_on_policy.main`): the student samples, the teacher scores the samples
  with `compute_logprobs`, the advantage is the negative reverse KL. With the base model as teacher and a fresh
  LoRA as student the two are the same model, so the first step's KL is 0 up to float rounding (sampler logprobs ==
  compute_logprobs). With a teacher that is a sampler checkpoint trained to emit one token, the KL must fall.
* SDFT (`distillation.sdft.main`): the teacher (the base model, shown a golden answer) returns its top-K prompt
  logprobs (`topk_prompt_logprobs`), which become `cross_entropy` soft targets of shape [N, K].

Prompts are local (the cookbook's own PromptOnlyDataset / SDFTDataset over in-test strings), so nothing downloads.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import chz
import pytest

from tests.e2e.cookbook.conftest import assert_steps_contiguous_from_zero, read_metrics, require_cookbook

require_cookbook()

from tinker_cookbook.rl.types import RLDatasetBuilder  # noqa: E402  (after the skip when the extra is absent)

PROMPTS = ["Say something:", "Tell me a story:", "Write a word:", "Go on:"]
RENDERER = "role_colon"
# Sampler logprobs vs compute_logprobs of the same weights: one compiled model, different batch shapes (float32).
SAME_MODEL_KL_TOL = 1e-3
TEACHER_STEPS = 2


@chz.chz
class LocalPromptsBuilder(RLDatasetBuilder):
    """The cookbook's PromptOnlyDataset (what its deepmath/tulu3 builders return) over local prompts."""

    model_name: str
    groups_per_batch: int = 2
    group_size: int = 4
    n_batches: int = 8

    async def __call__(self):
        from tinker_cookbook import renderers
        from tinker_cookbook.distillation.datasets import PromptOnlyDataset
        from tinker_cookbook.tokenizer_utils import get_tokenizer

        tokenizer = get_tokenizer(self.model_name)
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(self.groups_per_batch * self.n_batches)]
        return PromptOnlyDataset(
            prompts=prompts,
            batch_size=self.groups_per_batch,
            group_size=self.group_size,
            renderer=renderers.get_renderer(RENDERER, tokenizer=tokenizer),
            tokenizer=tokenizer,
            dataset_name="local",
        ), None


def on_policy_config(cookbook_env, base_model, log_path, *, steps, teacher_path=None, learning_rate=2e-2):
    from tinker_cookbook.distillation import train_on_policy
    from tinker_cookbook.distillation.datasets import DistillationDatasetConfig, TeacherConfig

    dataset = DistillationDatasetConfig(
        dataset_builder=LocalPromptsBuilder(model_name=base_model),
        teacher_config=TeacherConfig(base_model=base_model, load_checkpoint_path=teacher_path),
        groups_per_batch=2,
    )
    return train_on_policy.Config(
        learning_rate=learning_rate,
        dataset_configs=[dataset],
        model_name=base_model,
        recipe_name="tinkerflow-e2e",
        renderer_name=RENDERER,
        max_tokens=12,
        lora_rank=8,
        log_path=str(log_path),
        base_url=cookbook_env.base_url,
        eval_every=0,
        save_every=0,
        max_steps=steps,
    )


def kl_by_step(log_path: Path) -> dict[int, float]:
    rows = read_metrics(log_path)
    assert_steps_contiguous_from_zero(rows)
    return {r["step"]: r["teacher_kl"] for r in rows if "teacher_kl" in r}


@pytest.mark.timeout(900)
def test_on_policy_distillation_from_the_base_model_starts_at_zero_kl(cookbook_env, base_model, tmp_path):
    from tinker_cookbook.distillation import train_on_policy

    config = on_policy_config(cookbook_env, base_model, tmp_path / "log", steps=2)
    asyncio.run(train_on_policy.main(config))
    kl = kl_by_step(tmp_path / "log")
    assert sorted(kl) == [0, 1], kl
    assert abs(kl[0]) < SAME_MODEL_KL_TOL, kl  # student == teacher at step 0


def _train_teacher(service_client, base_model, token: int) -> str:
    """A sampler checkpoint that emits `token` after any of the prompts: the distillation target."""
    from tinker import types

    training = service_client.create_lora_training_client(base_model=base_model, rank=8, seed=0).result()
    tok = training.get_tokenizer()
    data = []
    for p in PROMPTS:
        seq = tok.encode(p) + [token] * 12
        weights = [0.0] * (len(seq) - 13) + [1.0] * 12
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(seq[:-1]),
                loss_fn_inputs={"target_tokens": seq[1:], "weights": weights},  # pyright: ignore[reportArgumentType]  (Datum.__post_init__ converts lists; the field is typed TensorData only)
            )
        )
    # The target is a token the base model already emits often: the student then samples it and the reverse-KL
    # advantage pulls it up. Towards a token it never samples (8 steps at 5e-2, 36 nats/token away; 2 steps at 2e-2,
    # 9 nats away) the loop's gradient (no baseline) only pushes the sampled tokens down and the KL did not fall.
    for _ in range(TEACHER_STEPS):
        training.forward_backward(data, "cross_entropy").result(timeout=300)
        training.optim_step(types.AdamParams(learning_rate=2e-2)).result(timeout=300)
    return training.save_weights_for_sampler("teacher").result(timeout=300).path


# Slow: at 6 steps the KL first rises while the student searches for the teacher's token, then falls (3.76, 4.90,
# 4.19, 0.32, 0.18 in one run); in one CI run it had not fallen by the last two steps. The default set keeps the
# base-model teacher (exact KL 0) and SDFT (top-k); this case runs in the slow set.
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_on_policy_distillation_towards_a_sampler_checkpoint_lowers_the_kl(
    cookbook_env, base_model, service_client, tmp_path
):
    from tinker_cookbook.distillation import train_on_policy

    from tests.e2e.cookbook.easy_env import probe_targets

    tok = service_client.create_lora_training_client(base_model=base_model, rank=1).result().get_tokenizer()
    [frequent] = probe_targets(service_client, base_model, [tuple(tok.encode(p)) for p in PROMPTS], k=1)
    teacher = _train_teacher(service_client, base_model, token=frequent)
    steps = 6  # measured at 5: KL 3.76, 4.90, 4.19, 0.32, 0.18 (it rises before the student finds the token)
    config = on_policy_config(cookbook_env, base_model, tmp_path / "log", steps=steps, teacher_path=teacher)
    asyncio.run(train_on_policy.main(config))
    kl = kl_by_step(tmp_path / "log")
    assert sorted(kl) == list(range(steps)), kl
    assert all(math.isfinite(v) for v in kl.values()), kl
    assert kl[0] > 1.0, f"the teacher must differ from the base model: {kl}"
    last = (kl[steps - 2] + kl[steps - 1]) / 2
    assert last < 0.7 * kl[0], f"distillation did not bring the student towards the teacher: {kl}"


@pytest.mark.timeout(900)
def test_sdft_top_k_distillation(cookbook_env, base_model, tmp_path):
    from tinker_cookbook import renderers
    from tinker_cookbook.distillation import sdft
    from tinker_cookbook.recipes.sdft.datasets import SDFTDataset
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    topk, steps = 4, 2
    renderer = renderers.get_renderer(RENDERER, tokenizer=get_tokenizer(base_model))
    dataset = SDFTDataset(
        questions=PROMPTS,
        golden_answers=["yes", "once upon a time", "word", "on and on"],
        batch_size=2,
        group_size=2,
        renderer=renderer,
    )
    config = sdft.Config(
        model_name=base_model,
        recipe_name="tinkerflow-e2e",
        renderer_name=RENDERER,
        lora_rank=8,
        base_url=cookbook_env.base_url,
        learning_rate=1e-3,
        max_tokens=12,
        topk=topk,
        log_path=str(tmp_path / "log"),
        eval_every=0,
        save_every=0,
        max_steps=steps,
    )
    asyncio.run(sdft.main(config, sdft_dataset=dataset))
    rows = [r for r in read_metrics(tmp_path / "log") if "sdft/topk" in r]
    assert [r["step"] for r in rows] == list(range(steps)), rows
    for r in rows:
        assert r["sdft/topk"] == topk
        # Soft targets came back: the teacher's renormalised top-K entropy is in (0, log K].
        assert 0.0 < r["sdft/mean_teacher_entropy"] <= math.log(topk) + 1e-4, r
        assert r["sdft/total_completion_tokens"] > 0
