"""Sampling seeds and sampling fields, by value: every sampled sequence of a run gets its own seed,
any run seed fits what vLLM accepts, and every engine is told the full set of sampling fields."""

import pytest

from grpo.config import ConfigError, validate
from grpo.rollout.base import Sampling, sampling_fields
from grpo.rollout.servers import prompt_requests
from grpo.train import sampling_seed
from tests.conftest import compose_cfg

INT64_MAX = 2**63 - 1  # vLLM's completion request: seed <= INT64_MAX


def sequence_seed(seed, step, rank, prompt, j, world, prompts, n):
    """What the engines draw completion j of `prompt` from: the step's seed + prompt * n (ours) + j (vLLM's)."""
    return sampling_seed(seed, step, rank, world, prompts, n) + prompt * n + j


def test_every_sequence_of_a_realistic_run_has_its_own_seed():
    """1,000 steps x 64 ranks x 1,024 prompts x 16 completions (1.05e9 sequences), by arithmetic: the
    seed is the run seed's offset plus the sequence's number in mixed radix (step, rank, prompt, j),
    so the smallest and largest seeds span exactly as many values as there are sequences and neighbours in every digit are 1
    sequence apart: pairwise distinct."""
    steps, world, prompts, n = 1000, 64, 1024, 16
    shape = (world, prompts, n)
    for seed in (0, 7, 20251123, 2**31 - 1):
        low = sequence_seed(seed, 0, 0, 0, 0, *shape)
        high = sequence_seed(seed, steps - 1, world - 1, prompts - 1, n - 1, *shape)
        assert low == seed * 2**32
        assert high - low + 1 == steps * world * prompts * n < 2**32
        assert high <= INT64_MAX
        # each digit's carry lands on the next sequence: no gap, no overlap
        assert sequence_seed(seed, 5, 3, 0, n - 1, *shape) + 1 == sequence_seed(seed, 5, 3, 1, 0, *shape)
        assert sequence_seed(seed, 5, 3, prompts - 1, n - 1, *shape) + 1 == sequence_seed(seed, 5, 4, 0, 0, *shape)
        assert sequence_seed(seed, 5, world - 1, prompts - 1, n - 1, *shape) + 1 == sequence_seed(seed, 6, 0, 0, 0, *shape)
    # two run seeds never share a stream within 2**32 sequences
    assert sequence_seed(1, 0, 0, 0, 0, *shape) - sequence_seed(0, steps - 1, world - 1, prompts - 1, n - 1, *shape) > 0


def test_the_old_layout_failed_where_this_one_holds():
    """The layout before: ((seed * 1_000_003 + step) * 256 + rank) * 65_536, prompt i at + i, completion
    j at + j. seed=20251123 overflowed int64 (vLLM answered 400), and prompt 1's completion 0 shared
    prompt 0's completion 1 stream."""
    old = lambda seed, step, rank: ((seed * 1_000_003 + step) * 256 + rank) * 65_536  # noqa: E731
    assert old(20251123, 0, 0) > INT64_MAX
    assert sequence_seed(0, 1, 0, 1, 0, 1, 8, 4) != sequence_seed(0, 1, 0, 0, 1, 1, 8, 4)
    assert sampling_seed(20251123, 0, 0, 1, 32, 16) <= INT64_MAX


def test_a_steps_seed_by_value():
    """Run seed 3, step 41, rank 1 of 2, 16 prompts x 16: 3 * 2**32 + (41 * 2 + 1) * 256 = 12884901888 + 21248.
    The seed depends on nothing but these numbers, so a resumed run redoing step 41 draws the same
    streams (that a resumed run draws the same prompts and metrics is
    tests/test_dynamic_sampling.py::test_dynamic_sampling_run_resumes_drawing_the_same_prompts and grpo.verify's resume)."""
    assert sampling_seed(3, 41, 1, 2, 16, 16) == 12_884_923_136
    assert sampling_seed(3, 41, 0, 2, 16, 16) == 12_884_923_136 - 256  # rank 0's streams just before


def test_servers_get_one_request_per_prompt_with_its_own_seed():
    # prompts 4..7 of the batch on this server, 16 completions each
    assert prompt_requests([4, 5, 6, 7], 1000, 16) == [([4], 1064), ([5], 1080), ([6], 1096), ([7], 1112)]
    assert prompt_requests([4, 5, 6, 7], None, 16) == [([4, 5, 6, 7], None)]  # unseeded (evaluation): one request


def test_colocated_seeds_each_prompt_n_apart():
    from grpo.rollout.colocated import sampling_params

    params = sampling_params(4, Sampling(max_new_tokens=3, seed=100), num_prompts=3)
    assert [p.seed for p in params] == [100, 104, 108]
    assert [p.repetition_penalty for p in params] == [1.0] * 3 and params[0].min_p == 0.0


def test_every_field_that_shapes_the_distribution_is_sent():
    """A request that leaves one out gets the model folder's value from a server run without
    `--generation-config vllm` (a hub model's repetition_penalty, min_p...)."""
    fields = sampling_fields(Sampling(max_new_tokens=4, temperature=0.7, top_p=0.9, top_k=5))
    assert fields == {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.0, "repetition_penalty": 1.0,
                      "presence_penalty": 0.0, "frequency_penalty": 0.0}


@pytest.mark.parametrize("seed", [-1, 2**31])
def test_a_seed_out_of_range_is_refused(seed):
    with pytest.raises(ConfigError, match=r"seed=.*give a seed from 0 to 2147483647"):
        validate(compose_cfg(f"seed={seed}"))
    validate(compose_cfg("seed=20251123"))
