"""An RL environment for tinker-cookbook's rl.train whose reward the embedded tiny model can raise in a few steps.

Reward = share of the completion's tokens in a target set; the target set is the tokens the untrained model emits
most often (the task of the RL acceptance loop), so it is reachable whatever the tokenizer.
Built with the cookbook's own Env / EnvGroupBuilder / RLDataset / RLDatasetBuilder types.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import chz
import tinker
from tinker_cookbook.rl.types import Env, EnvGroupBuilder, RLDataset, RLDatasetBuilder, StepResult


class TargetTokensEnv(Env):
    def __init__(self, prompt: tuple[int, ...], targets: frozenset[int]):
        self.prompt, self.targets = prompt, targets

    async def initial_observation(self):
        return tinker.ModelInput.from_ints(list(self.prompt)), []  # no stop: every completion is max_tokens long

    async def step(self, action, *, extra=None) -> StepResult:
        tokens = list(action)
        reward = sum(t in self.targets for t in tokens) / max(len(tokens), 1)
        return StepResult(
            reward=reward, episode_done=True, next_observation=tinker.ModelInput.from_ints([]), next_stop_condition=[]
        )


@dataclass(frozen=True)
class TargetTokensGroup(EnvGroupBuilder):
    prompt: tuple[int, ...]
    targets: frozenset[int]
    group_size: int

    async def make_envs(self) -> Sequence[Env]:
        return [TargetTokensEnv(self.prompt, self.targets) for _ in range(self.group_size)]

    def logging_tags(self) -> list[str]:
        return ["target_tokens"]


class TargetTokensDataset(RLDataset):
    def __init__(
        self, prompts: list[tuple[int, ...]], targets: frozenset[int], batch_size: int, group_size: int, n_batches: int
    ):
        self.prompts, self.targets = prompts, targets
        self.batch_size, self.group_size, self.n_batches = batch_size, group_size, n_batches

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        return [
            TargetTokensGroup(
                self.prompts[(index * self.batch_size + i) % len(self.prompts)], self.targets, self.group_size
            )
            for i in range(self.batch_size)
        ]

    def __len__(self) -> int:
        return self.n_batches


@chz.chz
class TargetTokensDatasetBuilder(RLDatasetBuilder):
    prompts: list[tuple[int, ...]]
    targets: list[int]
    batch_size: int = 4
    group_size: int = 4
    n_batches: int = 100

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        return TargetTokensDataset(
            self.prompts, frozenset(self.targets), self.batch_size, self.group_size, self.n_batches
        ), None


def probe_targets(
    service_client: tinker.ServiceClient,
    base_model: str,
    prompts: list[tuple[int, ...]],
    k: int = 4,
    max_tokens: int = 24,
) -> list[int]:
    """The k tokens the base model (an untrained LoRA is the base model) emits most often."""
    import collections

    sampler = service_client.create_sampling_client(base_model=base_model)
    params = tinker.SamplingParams(max_tokens=max_tokens, temperature=1.0, stop=[], seed=0)
    futures = [
        sampler.sample(tinker.ModelInput.from_ints(list(p)), num_samples=4, sampling_params=params) for p in prompts
    ]
    counts = collections.Counter(t for f in futures for s in f.result().sequences for t in s.tokens)
    return [t for t, _ in counts.most_common(k)]


def policy_reward(
    service_client: tinker.ServiceClient,
    base_model: str,
    prompts: list[tuple[int, ...]],
    targets: list[int],
    model_path: str | None = None,
    *,
    num_samples: int = 16,
    max_tokens: int = 24,
    seed: int = 1234,
) -> float:
    """The env's mean reward for a policy (the base model, or the sampler checkpoint at `model_path`) with a fixed
    sampling seed. The base model and a trained checkpoint are judged on the same seeded draws, so comparing the two
    measures what training did to the weights, not the luck of the samples one training step happened to see."""
    sampler = service_client.create_sampling_client(base_model=base_model, model_path=model_path)
    params = tinker.SamplingParams(max_tokens=max_tokens, temperature=1.0, stop=[], seed=seed)
    futures = [
        sampler.sample(tinker.ModelInput.from_ints(list(p)), num_samples=num_samples, sampling_params=params)
        for p in prompts
    ]
    wanted = frozenset(targets)
    rewards = [
        sum(t in wanted for t in s.tokens) / max(len(s.tokens), 1) for f in futures for s in f.result().sequences
    ]
    return sum(rewards) / len(rewards)
