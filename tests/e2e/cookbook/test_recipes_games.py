"""tinker-cookbook 0.6.1's game and preference RL recipes, unmodified, as a user runs their CLIs against the stack
(only the hub-only defaults overridden: the served tiny model, `renderer_name=role_colon`, and sizes a 2-core
machine finishes). The tiny model cannot play, so rewards stay near the format penalty: what is checked is the loop,
step by step, against the service (sampling many turns, training on the trajectories). Both are `slow`."""

from __future__ import annotations

import numpy as np
import pytest

from tests.e2e.cookbook.conftest import assert_steps_contiguous_from_zero, read_metrics, require_cookbook
from tests.e2e.cookbook.test_recipe_clis import run_recipe

require_cookbook()

SIZES = ["group_size=2", "max_tokens=12", "eval_every=0", "save_every=0", "behavior_if_log_dir_exists=delete"]


def rewards(rows: list[dict]) -> dict[int, float]:
    return {r["step"]: r["env/all/reward/total"] for r in rows if "env/all/reward/total" in r}


@pytest.mark.slow  # ~2 minutes: every turn's longer prompt is a new sampler bucket to compile
@pytest.mark.timeout(1500)
def test_guess_number(cookbook_env, base_model, tmp_path):
    """multiplayer_rl.guess_number: up to 10 turns of guesses, each answered by the env; an unparsable guess costs
    the format penalty (-1) and the game goes on."""
    log_path = tmp_path / "guess_number"
    run_recipe(
        "tinker_cookbook.recipes.multiplayer_rl.guess_number.train",
        [
            f"model_name={base_model}",
            "renderer_name=role_colon",
            "batch_size=2",
            "max_steps=2",
            f"log_path={log_path}",
            *SIZES,
        ],
        1400,
    )
    rows = read_metrics(log_path)
    assert assert_steps_contiguous_from_zero(rows) in ([0, 1], [0, 1, 2])
    got = rewards(rows)
    assert sorted(got) == [0, 1] and all(-10.0 <= r <= 1.0 for r in got.values()), got


@pytest.mark.slow  # ~1 minute of multi-turn sampling
@pytest.mark.timeout(1500)
def test_preference_shorter(cookbook_env, base_model, tmp_path):
    """preference.shorter: RL from pairwise comparisons of a group's completions, judged by a preference model that
    prefers the shorter one (all in the recipe, nothing to download)."""
    log_path = tmp_path / "shorter"
    run_recipe(
        "tinker_cookbook.recipes.preference.shorter.train",
        [
            f"model_name={base_model}",
            "renderer_name=role_colon",
            "batch_size=2",
            "group_size=2",
            "max_tokens=12",
            "eval_every=0",
            "max_steps=2",
            f"log_path={log_path}",
            "behavior_if_log_dir_exists=delete",
        ],
        1400,
    )
    rows = read_metrics(log_path)
    assert assert_steps_contiguous_from_zero(rows) in ([0, 1], [0, 1, 2])
    assert sorted(rewards(rows)) == [0, 1]


@pytest.mark.slow  # ~1-2 minutes: the CLI's two self-play steps, then a LoRA taught to end its turn at EOS
@pytest.mark.timeout(1500)
def test_text_arena_tictactoe_with_the_qwen3_renderer(cookbook_env, service_client, base_model, tmp_path):
    """multiplayer_rl.text_arena: self-play TicTacToe (textarena, offline) with the qwen3 renderer, every move sampled
    with the recipe's stop list `["]\\n"]`. The CLI runs its steps; then, through the recipe's own env, completer and
    stop condition, a policy that ends its turn at EOS (a LoRA taught to, since the tiny model rarely does) stops
    there: a non-empty stop list still stops at EOS (docs/wire-contract.md §Sampling), so the EOS token is the last one
    of the move and the qwen3 renderer parses it, as the env does on every move."""
    import asyncio

    from tinker import types
    from tinker_cookbook.completers import TinkerTokenCompleter
    from tinker_cookbook.recipes.multiplayer_rl.text_arena.env import STOP_CONDITION, TwoPlayerEnvGroupBuilder
    from tinker_cookbook.renderers import get_renderer
    from tinker_cookbook.rl.types import InitialObservationOverflow
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    log_path = tmp_path / "text_arena"
    run_recipe(
        "tinker_cookbook.recipes.multiplayer_rl.text_arena.train",
        [
            f"model_name={base_model}",
            "renderer_name=qwen3",
            "batch_size=2",
            "num_train_datapoints=4",
            "num_test_datapoints=2",
            "max_tokens=16",
            "eval_every=0",
            "save_every=0",
            "max_steps=2",
            f"log_path={log_path}",
            "behavior_if_log_dir_exists=delete",
        ],
        1400,
    )
    rows = read_metrics(log_path)
    assert assert_steps_contiguous_from_zero(rows) in ([0, 1], [0, 1, 2])
    got = rewards(rows)
    assert sorted(got) == [0, 1] and all(-2.0 <= r <= 1.0 for r in got.values()), got  # -2: an illegal move

    tokenizer = get_tokenizer(base_model)
    renderer = get_renderer("qwen3", tokenizer)
    eos = tokenizer.eos_token_id
    assert STOP_CONDITION == ["]\n"] and eos != tokenizer.convert_tokens_to_ids("<|im_end|>")

    async def first_moves(sampler, n: int, play_eos: bool = False) -> list:
        """The recipe's first observation and `n` first moves sampled as its rollouts sample them; with `play_eos`,
        a move that is EOS alone is played (an empty move: illegal, so the game ends at once)."""
        builder = TwoPlayerEnvGroupBuilder(game_name="TicTacToe-v0", renderer=renderer, num_envs=2, self_play=True)
        env = (await builder.make_envs())[0]
        first = await env.initial_observation()
        assert not isinstance(first, InitialObservationOverflow)
        ob, stop = first
        assert stop == STOP_CONDITION
        completer = TinkerTokenCompleter(sampler, max_tokens=16)
        moves = await asyncio.gather(*(completer(ob, stop) for _ in range(n)))
        if play_eos:
            step = await env.step(next(m.tokens for m in moves if m.tokens == [eos]))  # parsed by the qwen3 renderer
            assert step.episode_done and step.reward == -2.0
        return [ob, *moves]

    trainer = service_client.create_lora_training_client(base_model=base_model, rank=8).result()
    ob, *_ = asyncio.run(first_moves(trainer.save_weights_and_get_sampling_client().result(), 1))
    prompt = ob.to_ints()
    weights = np.zeros(len(prompt), np.float32)
    weights[-1] = 1.0
    datum = types.Datum(
        model_input=ob,
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(np.array(prompt[1:] + [eos], np.int64)),
            "weights": types.TensorData.from_numpy(weights),
        },
    )
    for _ in range(12):  # EOS right after the observation: the turn ends with no move
        trainer.forward_backward([datum], "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=0.05)).result()
    _, *moves = asyncio.run(first_moves(trainer.save_weights_and_get_sampling_client().result(), 8, play_eos=True))
    ended = [m for m in moves if m.tokens[-1:] == [eos]]
    assert len(ended) >= 4, [m.tokens for m in moves]
    for move in moves:
        assert eos not in move.tokens[:-1], move.tokens  # never sampled past EOS
        renderer.parse_response(move.tokens)  # at most one <|im_end|>: no RendererError
    assert all(m.stop_reason == "stop" for m in ended)
