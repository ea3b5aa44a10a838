"""Settings of a feature that is off are refused, naming the setting that turns it on (as algo.*'s are,
grpo/algo_config.py `inert_settings`): env.* with env=none (grpo/envs `check`) and model.freeze_vision=false
on a text model (grpo/models.py `check_freeze_vision`). model.lora.* at rank 0: tests/test_lora.py."""

import json
import re

import pytest

from grpo.config import ConfigError, known_model_config, validate
from grpo.models import check_freeze_vision
from tests.conftest import compose_cfg


@pytest.mark.parametrize("override, shown", [
    ("env.max_turns=8", "env.max_turns=8"), ("env.max_total_tokens=100", "env.max_total_tokens=100"),
    ("env.max_observation_tokens=8", "env.max_observation_tokens=8"), ("env.step_timeout_s=2", "env.step_timeout_s=2.0"),
    ("env.max_concurrency=1", "env.max_concurrency=1"), ("env.render=chat", "env.render='chat'"),
    ("env.role=tool", "env.role='tool'"),
])
def test_env_settings_with_env_none_are_refused(override, shown):
    with pytest.raises(ConfigError, match=f"^{re.escape(shown)} with env=none: single completions play no episode, .* "
                                          f"Pick an environment"):
        validate(compose_cfg(override))


def test_env_settings_are_taken_with_an_environment_or_at_their_defaults():
    validate(compose_cfg("experiment=guess_tiny", "env.max_turns=8"))
    validate(compose_cfg("env.max_turns=4", "env.step_timeout_s=10"))  # the schema's own values: nothing given


def test_training_the_vision_tower_of_a_text_model_is_refused(tmp_path):
    def check(*overrides):
        cfg = compose_cfg("model.freeze_vision=false", *overrides)
        check_freeze_vision(cfg, known_model_config(cfg.model))

    for text in (["model=tiny"], ["model=tiny_moe"]):
        with pytest.raises(ConfigError, match=r"model.freeze_vision=false with model.path=tiny(_moe)?, a text model: .* "
                                              r"Use a vision-language model"):
            check(*text)
    check("model=tiny_vlm")
    folder = tmp_path / "vlm"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"vision_config": {"depth": 1}, "text_config": {}}))
    check(f"model.path={folder}")
    (folder / "config.json").write_text(json.dumps({"num_attention_heads": 4}))
    with pytest.raises(ConfigError, match="a text model"):
        check(f"model.path={folder}")
    check("model.path=some-org/not-cached")  # config.json unknown here: checked when the model loads
    check_freeze_vision(compose_cfg(), {})  # the default (frozen) is no setting at all
