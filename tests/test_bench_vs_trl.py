"""`python -m grpo.bench vs-trl`: what TRL's GRPOConfig is given for a composed run, and the runs it
refuses (grpo/bench/vs_trl.py). trl is not installed here: the mapping is a pure function of the config."""

import pytest

from grpo.bench.vs_trl import per_batch, trl_settings, unmatched
from grpo.config import compose_config


def cfg(*overrides: str):
    return compose_config(["run_dir=unused", *overrides])


def test_trl_is_given_clip_higher_the_passes_and_the_schedule_of_the_run():
    """algo=dapo with 2 passes over each batch: TRL got epsilon 0.2 alone (its epsilon_high then
    defaults to 0.2, not DAPO's 0.28), one pass, and half the optimizer steps, and was timed as like for like."""
    got = trl_settings(cfg("algo=dapo", "algo.num_iterations=2", "algo.lr_schedule=constant", "seed=3"), 5, [1.0, 0.1])
    assert {k: got[k] for k in ("epsilon", "epsilon_high", "num_iterations", "max_steps", "loss_type",
                                "mask_truncated_completions", "lr_scheduler_type", "seed", "reward_weights")} == {
        "epsilon": 0.2, "epsilon_high": 0.28, "num_iterations": 2, "max_steps": 10, "loss_type": "dapo",
        "mask_truncated_completions": True, "lr_scheduler_type": "constant_with_warmup", "seed": 3,
        "reward_weights": [1.0, 0.1]}
    default = trl_settings(cfg(), 12, [1.0])
    assert (default["epsilon"], default["epsilon_high"], default["num_iterations"], default["max_steps"]) == (0.2, 0.2, 1, 12)
    assert default["use_bias_correction_kl"] is False and default["importance_sampling_level"] == "token"
    assert trl_settings(cfg("algo=gspo"), 1, [1.0])["importance_sampling_level"] == "sequence"


@pytest.mark.parametrize("override, named", [
    ("algo.adv_estimator=rloo", "algo.adv_estimator=rloo"),
    ("algo=reinforce_pp", "algo.adv_estimator=reinforce_pp"),
    ("algo.dynamic_sampling=true", "algo.dynamic_sampling=true"),
    ("algo.num_minibatches=2", "algo.num_minibatches=2"),
    ("algo.max_staleness=1", "algo.max_staleness=1"),
    ("algo=cispo", "algo.pg_loss=cispo"),
    ("algo.is_level=token", "algo.is_level=token"),
    ("algo.trust_region=behaviour", "algo.trust_region=behaviour"),
    ("env=guess", "env.name=guess"),
    ("model.dtype=bfloat16", "model.dtype=bfloat16"),
    ("model.lora.rank=4", "model.lora.rank=4"),
])
def test_settings_trl_cannot_match_are_refused_with_what_to_change(override, named):
    """Each is refused by name, with the setting that makes the run one TRL can time, before either side runs."""
    reasons = unmatched(cfg(override))
    assert len(reasons) == 1 and reasons[0].startswith(named) and "; set " in reasons[0], reasons
    with pytest.raises(SystemExit, match="cannot run this configuration") as refused:
        trl_settings(cfg(override), 3, [1.0])
    assert named in str(refused.value)
    assert unmatched(cfg()) == [] and unmatched(cfg("algo=dapo")) == []


def test_trl_step_times_are_summed_per_generated_batch():
    """TRL times each optimizer step; with 2 passes a batch is 2 of them (the first batch left out)."""
    assert per_batch([5.0, 1.0, 2.0, 3.0, 4.0, 0.5], 2) == [5.0, 4.5]
    assert per_batch([5.0, 1.0, 2.0], 1) == [1.0, 2.0]
