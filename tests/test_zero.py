"""DeepSpeed ZeRO (parallel=zero2|zero3|zero3_offload) for real, over gloo: the config and its
conflicts, the design card's command as 1 and 2 processes, ZeRO-3 resume on 2 processes, and the
consolidated HF export that transformers and vLLM load. Invariance lives in test_parallel.py."""

import json
import os
import sys

import pytest
import torch
from omegaconf import OmegaConf

from grpo.config import AlgoConfig, ConfigError, ParallelConfig, validate
from grpo.parallel.zero import deepspeed_config, reference_config, zero_init_config
from tests.conftest import FAST, assert_rewards_vary, compose_cfg, measured
from tests.test_parallel import TORCHRUN, run


def ds_cfg(stage_name="zero3", **kw):
    return OmegaConf.structured(ParallelConfig(strategy=stage_name, **kw))


def test_config_from_the_groups():
    algo = OmegaConf.structured(AlgoConfig(max_grad_norm=0.7))
    cfg = deepspeed_config(ds_cfg(offload_optimizer=True), algo, 3, torch.float32)
    assert cfg["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False}}
    assert cfg["gradient_clipping"] == 0.7
    assert cfg["managed_gradient_accumulation"] is False
    # a NaN/inf global norm is an overflow DeepSpeed skips, in bf16 too (grpo/guards.py)
    assert cfg["bf16"] == {"enabled": False, "check_grad_overflow": True} and "data_types" not in cfg
    bf16 = deepspeed_config(ds_cfg(), algo, 2, torch.bfloat16)
    assert bf16["bf16"] == {"enabled": True, "check_grad_overflow": True}
    assert bf16["data_types"] == {"grad_accum_dtype": "fp32"}  # bf16 parameters, fp32 gradient sums


def test_zero_init_and_reference_configs():
    """Only stage 3 loads under zero.Init, with the strategy's own config; the reference's engine has
    no optimizer: stage 3 stays partitioned, stage 2 becomes a stage-0 replica."""
    algo = OmegaConf.structured(AlgoConfig())
    assert zero_init_config(ds_cfg("zero2"), algo, 2, torch.bfloat16) is None
    assert zero_init_config(ds_cfg(), algo, 3, torch.bfloat16) == deepspeed_config(ds_cfg(), algo, 3, torch.bfloat16)
    policy = deepspeed_config(ds_cfg(offload_optimizer=True), algo, 3, torch.bfloat16)
    ref = reference_config(policy)
    assert ref["zero_optimization"] == {"stage": 3} and "data_types" not in ref and ref["bf16"] == {"enabled": True, "check_grad_overflow": True}
    assert policy["zero_optimization"]["offload_optimizer"]  # the policy's config is left as it was
    assert reference_config(deepspeed_config(ds_cfg("zero2"), algo, 2, torch.float32))["zero_optimization"] == {"stage": 0}


def test_user_json_is_merged_and_conflicts_are_reported(tmp_path):
    algo = OmegaConf.structured(AlgoConfig(max_grad_norm=1.0))
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps({"zero_optimization": {"stage": "auto", "reduce_bucket_size": 123},
                              "gradient_clipping": 1.0, "wall_clock_breakdown": True}))
    merged = deepspeed_config(ds_cfg(deepspeed_config=str(ok)), algo, 3, torch.float32)
    assert merged["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 123}
    assert merged["wall_clock_breakdown"] is True

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_clipping": 0.5}))
    with pytest.raises(ConfigError) as e:
        deepspeed_config(ds_cfg(deepspeed_config=str(bad)), algo, 3, torch.float32)
    assert "zero_optimization.stage: JSON has 2, the config groups give 3" in str(e.value)
    assert "gradient_clipping: JSON has 0.5, the config groups give 1.0" in str(e.value)

    opt = tmp_path / "opt.json"
    opt.write_text(json.dumps({"optimizer": {"type": "Adam"}}))
    with pytest.raises(ConfigError, match="remove 'optimizer'"):
        deepspeed_config(ds_cfg(deepspeed_config=str(opt)), algo, 3, torch.float32)

    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ConfigError, match="could not be read as JSON"):
        deepspeed_config(ds_cfg(deepspeed_config=str(broken)), algo, 3, torch.float32)


def test_user_json_batch_keys(tmp_path):
    """HF Trainer's "auto" batch keys are dropped (DeepSpeed would compare the string "auto" with numbers: a
    TypeError); a number for them is refused, naming the algo keys that set the batch (else DeepSpeed's
    assertion `train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size`)."""
    algo = OmegaConf.structured(AlgoConfig())
    auto = tmp_path / "auto.json"
    auto.write_text(json.dumps({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                                "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}))
    merged = deepspeed_config(ds_cfg(deepspeed_config=str(auto)), algo, 3, torch.float32)
    assert "train_batch_size" not in merged  # DeepSpeed computes it: 1 x 1 x world size
    assert merged["train_micro_batch_size_per_gpu"] == 1 and merged["gradient_accumulation_steps"] == 1
    assert merged["gradient_clipping"] == algo.max_grad_norm
    for key, value in (("train_batch_size", 64), ("gradient_accumulation_steps", 4)):
        path = tmp_path / f"{key}.json"
        path.write_text(json.dumps({key: value}))
        with pytest.raises(ConfigError) as e:
            deepspeed_config(ds_cfg(deepspeed_config=str(path)), algo, 3, torch.float32)
        assert str(path) in str(e.value) and f"'{key}': {value}" in str(e.value) and "algo.* (batch_size, group_size" in str(e.value)
    same = tmp_path / "same.json"  # the values grpo sets itself are no conflict
    same.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}))
    assert deepspeed_config(ds_cfg(deepspeed_config=str(same)), algo, 3, torch.float32)["gradient_accumulation_steps"] == 1


def test_deepspeed_options_need_a_zero_strategy(tmp_path):
    """A parallel.* setting only other strategies read changes nothing: refused, naming who reads it."""
    from grpo.config import ParallelConfig
    from grpo.parallel.base import OWN_SETTINGS

    with pytest.raises(ConfigError, match=r"parallel.offload_optimizer=True is read by parallel=zero2\|zero3\|zero3_offload "
                                          r"only; parallel=ddp ignores it"):
        validate(compose_cfg("parallel=ddp", "parallel.offload_optimizer=true"))
    with pytest.raises(ConfigError, match="parallel.cpu_shm_allreduce=True is read by parallel=zero2"):
        validate(compose_cfg("parallel=single", "parallel.cpu_shm_allreduce=true"))
    for strategy in ("single", "zero2"):
        with pytest.raises(ConfigError, match=f"parallel.allreduce_bucket_mb=200.0 is read by parallel=ddp only; "
                                              f"parallel={strategy} ignores it"):
            validate(compose_cfg(f"parallel={strategy}", "parallel.allreduce_bucket_mb=200"))
    validate(compose_cfg("parallel=zero2", "parallel.cpu_shm_allreduce=true"))
    assert {key: getattr(ParallelConfig(strategy="x"), key) for key in OWN_SETTINGS} == \
        {key: default for key, (default, _) in OWN_SETTINGS.items()}  # the table's defaults are the schema's
    with pytest.raises(ConfigError, match="is not a file"):
        validate(compose_cfg("parallel=zero3", f"parallel.deepspeed_config={tmp_path}/missing.json"))
    cfg = compose_cfg("parallel=zero3_offload")
    assert cfg.parallel.strategy == "zero3" and cfg.parallel.offload_optimizer


@pytest.mark.starts_process
def test_design_card_command_as_one_process_and_export_loads(tmp_path, cache_dir, learning_policy):
    """`python -m grpo.train parallel=zero3 rollout=colocated`, one process without a launcher;
    the exported folder loads in transformers with the trained weights, and in vLLM."""
    out = run([sys.executable, "-m", "grpo.train", *FAST, "parallel=zero3", "rollout=colocated",
               f"hydra.run.dir={tmp_path}", f"model.cache_dir={cache_dir}"])
    assert "eval accuracy" in out.stdout
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["weight_version"] for r in rows if "loss" in r] == [0, 1, 2]
    assert all(d < 1e-3 for d in measured([r for r in rows if "loss" in r]))
    assert_rewards_vary([r for r in rows if "loss" in r])  # else the export would rightly equal the start
    ckpt = tmp_path / "checkpoints" / "step_00000003"
    assert (ckpt / "COMPLETE").exists() and (ckpt / "deepspeed").is_dir()

    from transformers import AutoModelForCausalLM

    summary = json.load(open(tmp_path / "summary.json"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    start = AutoModelForCausalLM.from_pretrained(summary["model_path"])
    moved = max((a - b).abs().max().item() for a, b in zip(exported.state_dict().values(), start.state_dict().values()))
    assert moved > 1e-4, "the export should hold the trained weights, not the starting ones"
    assert exported.num_parameters() == start.num_parameters()

    code = ("import os; os.environ['VLLM_ENABLE_V1_MULTIPROCESSING']='0'\n"
            "from vllm import LLM, SamplingParams\n"
            f"llm = LLM(model={str(tmp_path / 'model')!r}, dtype='float32', enforce_eager=True, "
            "gpu_memory_utilization=0.1, max_model_len=64)\n"
            "out = llm.generate(['12+34='], SamplingParams(max_tokens=4, temperature=0))\n"
            "print('VLLM-OUT', len(out[0].outputs[0].token_ids))")
    assert "VLLM-OUT" in run([sys.executable, "-c", code]).stdout


@pytest.mark.starts_process
def test_design_card_command_as_two_torchrun_processes(tmp_path, cache_dir):
    """The whole batch goes to each rank's colocated engine at once; ZeRO-3 weights are gathered
    bucket by bucket (a 1 MB bucket: several buckets for the 2 MB model) into both engines."""
    run([*TORCHRUN, "--standalone", "--nproc_per_node", "2", "-m", "grpo.train", *FAST, "parallel=zero3",
         "rollout=colocated", "parallel.sync_bucket_mb=1",
         f"hydra.run.dir={tmp_path}", f"model.cache_dir={cache_dir}"])
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    trained = [r for r in rows if "loss" in r]
    assert [r["weight_version"] for r in trained] == [0, 1, 2]
    assert all(d < 1e-3 for d in measured(trained))
    assert all(r["completion_len"] > 0 for r in trained)
    files = os.listdir(tmp_path / "checkpoints" / "step_00000003" / "deepspeed")
    assert sum("zero_pp_rank_" in f for f in files) >= 2, files  # one shard per rank


@pytest.mark.starts_process
def test_zero3_two_process_resume_matches_an_uninterrupted_run(tmp_path, cache_dir):
    """2 ranks, ZeRO-3: stop after 2 steps, resume to 4 in the same folder; metrics and final
    weights equal a straight 4-step run's. Under the linear schedule (a warm-up of 1) the 2-step run's
    steps are the 4-step run's (lr/2, lr), and its end is lr 0: the resumed steps 3-4 must take the
    4-step schedule's 2/3 and 1/3 of lr through DeepSpeed's own optimizer and scheduler load
    (`resume_schedule`), not the checkpoint's 0."""
    common = [*FAST, "parallel=zero3", f"model.cache_dir={cache_dir}"]
    launch = [*TORCHRUN, "--standalone", "--nproc_per_node", "2", "-m", "grpo.train"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run([*launch, *common, "steps=4", f"hydra.run.dir={straight}"])
    run([*launch, *common, "steps=2", f"hydra.run.dir={resumed}"])
    out = run([*launch, *common, "steps=4", f"hydra.run.dir={resumed}"])
    assert "resumed from" in out.stdout + out.stderr

    def trained(folder):
        rows = [json.loads(line) for line in open(folder / "metrics.jsonl")]
        return {r["step"]: (r["loss"], r["reward/mean"], r["grad_norm"], r["lr"]) for r in rows if "loss" in r}

    a, b = trained(straight), trained(resumed)
    assert sorted(b) == [1, 2, 3, 4]
    for step in (3, 4):
        assert a[step] == pytest.approx(b[step], rel=1e-5, abs=1e-7), step
    from safetensors.torch import load_file

    wa, wb = load_file(straight / "model" / "model.safetensors"), load_file(resumed / "model" / "model.safetensors")
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-6


@pytest.mark.starts_process
def test_zero3_loads_partitioned_and_scores_a_sharded_reference(tmp_path, learning_policy):
    """2 ranks, bf16, beta > 0 (tests/zero3_load.py): the policy is built under zero.Init (each rank
    holds half the elements, nothing whole) with the folder's weights; the engine sums gradients in
    fp32; the reference is partitioned too, ranks with 6 and 2 micro-batches score it in lockstep,
    and before any step the KL to it is 0."""
    out = tmp_path / "result.json"
    run([*TORCHRUN, "--standalone", "--nproc_per_node", "2", "tests/zero3_load.py", learning_policy, str(out)])
    r = json.load(open(out))
    assert r["placeholders"] and r["reference_placeholders"]
    assert r["local_elements"] <= r["full_elements"] / 2 + 1000, r  # a shard (padded), not the model
    assert r["max_diff_to_folder"] == 0.0
    assert r["data_types"] == ["torch.bfloat16", "torch.float32"]
    assert r["kl"] < 1e-6 and r["loss"] != 0.0, r


@pytest.mark.starts_process
# make test: parallel=zero2 (e2e_smoke)
# slow: zero3_offload (an option of ZeRO-3: its optimizer state on the CPU, which the CPU machine holds anyway)
@pytest.mark.parametrize("parallel", [pytest.param("zero2", marks=pytest.mark.e2e_smoke), pytest.param("zero3_offload", marks=pytest.mark.slow)])
def test_two_process_runs_of_the_other_zero_strategies(tmp_path, cache_dir, parallel):
    run([*TORCHRUN, "--standalone", "--nproc_per_node", "2", "-m", "grpo.train", *FAST, f"parallel={parallel}",
         f"hydra.run.dir={tmp_path}", f"model.cache_dir={cache_dir}"])
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    files = os.listdir(tmp_path / "checkpoints" / "step_00000003" / "deepspeed")
    assert sum("optim_states" in f for f in files) == 2, files  # each rank saved its optimizer shard
    assert (tmp_path / "model" / "model.safetensors").exists()
