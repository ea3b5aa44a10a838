"""Every config file composes and validates; bad values fail early with a message saying what to change."""

import pytest
from hydra.errors import ConfigCompositionException

from grpo.config import GROUPS, ConfigError, validate
from tests.conftest import CONF, ROOT, compose_cfg

EXPECTED_OPTIONS = {  # update when adding a config file: the count guards against silently skipped files
    "model": 3,
    "task": 6,
    "reward": 3,
    "rollout": 4,
    "parallel": 5,
    "algo": 7,
    "logger": 2,
}


def group_files():
    return [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]


def test_every_group_has_its_expected_options():
    found = {g: len(list((CONF / g).glob("*.yaml"))) for g in GROUPS}
    assert found == EXPECTED_OPTIONS
    assert len(group_files()) == sum(EXPECTED_OPTIONS.values()) == 30


@pytest.mark.parametrize("group, option", group_files())
def test_every_config_file_composes(group, option, tmp_path):
    from omegaconf import OmegaConf

    extra = {("task", "jsonl"): [f"task.path={tmp_path / 'x.jsonl'}"],
             ("model", "hub"): [f"model.path={tmp_path}"],  # a local folder: no hub lookup here
             ("rollout", "remote"): ["rollout.remote.urls=[http://127.0.0.1:9]"]}.get((group, option), [])
    cfg = compose_cfg(f"{group}={option}", *extra)
    values = OmegaConf.to_container(OmegaConf.load(CONF / group / f"{option}.yaml"))
    values.pop("defaults")
    composed = OmegaConf.to_container(cfg[group])
    for key, value in values.items():  # every value in the file reached the composed config
        if not any(o.startswith(f"{group}.{key}") for o in extra):  # the test's own override
            assert composed[key] == value or (isinstance(value, dict) and value.items() <= composed[key].items()), key
    if (group, option) != ("task", "jsonl"):  # its file is the user's to give
        validate(cfg)


EXPERIMENTS = [  # update when adding an experiment: the count guards against silently skipped files
    "addition_tiny",
    "addition_tiny_colocated",
    "countdown_tinyzero",
    "deepseekmath7b_math_remote",
    "qwen05b_gsm8k_colocated",
    "qwen15b_gsm8k_zero3_dedicated",
    "smollm2_arithmetic_cpu",
    "smollm2_arithmetic_lora_cpu",
]


def test_experiments_are_all_counted():
    assert sorted(p.stem for p in (ROOT / "experiments").glob("*.yaml")) == EXPERIMENTS
    assert len(EXPERIMENTS) == 8


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes_and_validates(name, monkeypatch):
    """Composes and validates each file; only the hub lookup of the model id is left out (no network
    here), and the ids are checked for their shape instead."""
    import grpo.config

    looked_up = []
    monkeypatch.setattr(grpo.config, "_check_hub_model", looked_up.append)
    cfg = compose_cfg(f"experiment={name}")
    validate(cfg)
    assert looked_up == ([] if cfg.model.path in ("tiny", "smollm2-135m") else [cfg.model.path])
    header = (ROOT / "experiments" / f"{name}.yaml").read_text()
    assert "# Reproduces:" in header and "Resources:" in header, "every experiment names its target and resources"


def test_unknown_key_is_an_error():
    with pytest.raises(ConfigCompositionException) as e:
        compose_cfg("algo.learning_rate=1e-3")
    assert "Could not override 'algo.learning_rate'" in str(e.value)
    assert "Key 'learning_rate' not in 'AlgoConfig'" in str(e.value.__cause__)


def test_unknown_option_is_an_error():
    with pytest.raises(ConfigCompositionException, match="rollout"):
        compose_cfg("rollout=nonexistent")


@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout.backend=vllmx", "rollout.backend='vllmx' is not one of"),
        ("algo.loss_type=ppo", "algo.loss_type='ppo' is not one of"),
        ("algo.batch_size=30", "algo.batch_size=30 is not a multiple of algo.group_size=16"),
        ("algo.group_size=1", "at least 2 completions"),
        ("algo.num_minibatches=3", "algo.num_minibatches=3 must be >= 1 and divide the 32 prompts"),
        ("algo.clip_eps_high=0.1", "clip_eps_high"),
        ("model.path=/does/not/exist", "model.path='/does/not/exist' is neither 'tiny', a packaged model ['smollm2-135m'], an existing local folder"),
        ("reward.funcs=[{name: nosuchreward}]", "reward 'nosuchreward' is not one of"),
        ("reward.funcs=[{name: nosuch.module.fn}]", "could not be imported"),
        ("reward.funcs=[]", "reward.funcs is empty"),
        ("rollout=colocated|rollout.vllm.memory_fraction=1.5", "rollout.vllm.memory_fraction=1.5 must be between 0 and 1"),
        ("rollout.temperature=0", "rollout.temperature > 0"),
        ("algo.is_level=token|rollout.top_p=0.9", "algo.is_level needs rollout.top_p=1"),
        ("algo.max_staleness=-1", "algo.max_staleness=-1 must be >= 0"),
        ("algo.max_staleness=2|rollout=dedicated|algo.trust_region=proximal",
         "with algo.trust_region=proximal trains on batches sampled by weights up to 2 version(s) old with nothing "
         "correcting for it: set algo.is_level=token"),
        ("algo.trust_region=behaviour|algo.is_level=token", "so algo.is_level=token would weight twice: set algo.is_level=none"),
        ("algo.trust_region=sampler", "algo.trust_region='sampler' is not one of"),
        ("algo.behaviour_clip_eps=1.5", "algo.behaviour_clip_eps=1.5 must be in (0, 1), or null"),
        ("algo=cispo|algo.max_staleness=1|rollout=dedicated|algo.behaviour_clip_eps=0.1",
         "CISPO's weight is bounded by algo.clip_eps / clip_eps_high"),
        ("algo.adv_estimator=rloo", "algo.adv_estimator=rloo sets its own scale"),
        ("algo.adv_estimator=gae", "algo.adv_estimator='gae' is not one of"),
        ("algo=cispo|algo.ratio_level=sequence", "algo.pg_loss=cispo weights each token's gradient"),
    ],
)
def test_bad_values_say_what_to_change(override, message):
    cfg = compose_cfg(*override.split("|"))
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert message in str(e.value)


def test_asynchronous_rollouts_validate_with_engines_in_other_processes(recwarn):
    validate(compose_cfg("algo.max_staleness=2", "algo.is_level=token", "rollout=dedicated"))
    validate(compose_cfg("algo.max_staleness=1", "algo.is_level=sequence", "rollout=remote", "rollout.remote.urls=[http://h:1]"))
    validate(compose_cfg("algo.max_staleness=1", "rollout=dedicated"))  # auto: clipped around the sampler
    validate(compose_cfg("algo=cispo", "algo.max_staleness=1", "rollout=dedicated"))  # with CISPO's own bounds
    assert not [w for w in recwarn if "max_staleness" in str(w.message)]


@pytest.mark.parametrize("backend", ["hf", "colocated"])
def test_in_process_backends_take_staleness_without_the_overlap_and_say_so(backend):
    with pytest.warns(UserWarning) as caught:
        validate(compose_cfg("algo.max_staleness=1", "algo.is_level=token", f"rollout={backend}"))
    message = " ".join(str(w.message) for w in caught)
    assert f"rollout={backend} generates in the trainer's own process and device, so generation takes turns with the " \
           "update (no speed-up). For the overlap use rollout=dedicated or rollout=remote" in message


def test_unloadable_hub_id_is_reported(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no network retries
    with pytest.raises(ConfigError, match="could not be loaded"):
        validate(compose_cfg("model.path=nobody-here/no-such-model-xyz"))


def test_sleep_mode_needs_a_gpu():
    """A hardware check, made where the hardware is: when the engine is built, not in validate()
    (which grpo.launch also runs on a login node without the job's GPUs)."""
    import torch

    from grpo.rollout.colocated import ColocatedBackend

    cfg = compose_cfg("rollout=colocated", "rollout.vllm.sleep=true")
    validate(cfg)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="vLLM's CPU build has no sleep mode"):
            ColocatedBackend(cfg.rollout, None, None, "unused")


def test_reward_by_dotted_path():
    cfg = compose_cfg("reward.funcs=[{name: grpo.rewards.exact_match.exact_match, weight: 0.5}]")
    validate(cfg)


def test_typed_values_are_checked_at_compose_time():
    with pytest.raises(ConfigCompositionException):
        compose_cfg("algo.lr=fast")


def test_every_launcher_config_composes():
    from hydra import compose, initialize_config_dir

    found = sorted(p.stem for p in (CONF / "hydra" / "launcher").glob("*.yaml"))
    assert found == ["local", "slurm"]  # update when adding a launcher file
    for name in found:
        with initialize_config_dir(str(CONF), version_base="1.3"):
            cfg = compose("config", overrides=[f"hydra/launcher={name}", "run_dir=unused"], return_hydra_config=True)
        assert cfg.hydra.launcher.timeout_min == 60 and cfg.hydra.launcher._target_.endswith(name.capitalize() + "Launcher")
    assert cfg.hydra.launcher.additional_parameters == {"requeue": True} and len(cfg.hydra.launcher.setup) == 2
