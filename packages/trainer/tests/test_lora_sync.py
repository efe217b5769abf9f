"""Adapter-only weight sync and adapter export (issue 33, LoRA cheaply synced).

The sender (``SenderConfig(adapters=True)``) sends a LoRA model's adapter alone to a real rollout
daemon (hf backend) serving the base model; after each sync the daemon must compute what the
trainer's model computes (prompt logprobs within fp32 tolerance), over the collective (gloo)
and inline transports, with the canary checked and the digest moved. The export writes the
adapter alone in PEFT's layout beside the merged weights; PEFT loads it onto the base model and
gets the trainer's logits.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from treadle_testing import load_by_path

from treadle.common.config import ConfigError

HERE = Path(__file__).resolve().parent
ws = load_by_path("treadle_trainer_test_weight_sender_for_lora", HERE / "test_weight_sender.py")
PROBE, CANARY, TOL = ws.PROBE, ws.CANARY, ws.TOL
model_b = ws.model_b  # the fixture: tiny model "b", another base


@pytest.fixture(scope="module")
def daemon(tiny: Path):
    d = ws.Daemon(["--model", str(tiny), "--engines", "1"])
    yield d
    d.stop()


def lora(tiny: Path, seed: int = 3) -> torch.nn.Module:
    """Tiny model "a" (the daemon's base) with LoRA adapters on every linear layer, B nonzero."""
    model = ws.with_lora(ws.causal_lm(tiny))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return model


def test_adapter_plan_is_pefts_adapter_file(tiny):
    from peft import get_peft_model_state_dict

    from treadle.trainer.weights.plan import adapter_plan, plan

    model = lora(tiny)
    items, adapter = adapter_plan(model)
    saved = get_peft_model_state_dict(model)
    assert [it.name for it in items] == list(saved)
    for it in items:
        torch.testing.assert_close(it.value(), saved[it.name], rtol=0, atol=0)
    assert adapter.rank == 4 and adapter.alpha == 8
    assert adapter.target_modules == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    assert sum(it.nbytes for it in items) * 5 < sum(it.nbytes for it in plan(model))  # tiny: 5.6x smaller
    with pytest.raises(ConfigError, match="--ds.lora.rank"):
        adapter_plan(ws.causal_lm(tiny))


def test_adapter_sync_serves_the_trainers_model(daemon, tiny):
    model, c = lora(tiny), daemon.client
    before = c.weight_digest()
    for transport, seed in (("collective", 3), ("inline", 4)):
        model = lora(tiny, seed)
        v = daemon.next_version()
        with ws.sender(model, c, transport=transport, adapters=True, canary_token_ids=CANARY) as s:
            report = s.sync(v)
        assert report.updated == ["e0"] and report.failed == [] and c.health()["version"] == v
        assert report.canary_gap is not None and report.canary_gap <= 1e-3
        assert ws.gap(daemon, model) <= TOL
        merged = copy.deepcopy(model).merge_and_unload()
        assert ws.gap(daemon, merged) <= TOL
        assert c.weight_digest() != before
    base = ws.causal_lm(tiny)  # a full sync replaces the model and drops the adapter: the base again
    with ws.sender(base, c, canary_token_ids=CANARY) as s:
        s.sync(daemon.next_version())
    assert ws.gap(daemon, base) <= TOL
    assert list(c.weight_digest().values()) != list(before.values())  # PEFT's layers stay, their B at 0


def test_an_adapter_on_another_base_fails_its_canary(daemon, tiny, model_b):
    """The engines keep their own base: an adapter trained on another one is caught by the canary."""
    from treadle.common.errors import EnginesQuarantined

    other = ws.with_lora(ws.causal_lm(model_b))
    with ws.sender(other, daemon.client, adapters=True, canary_token_ids=CANARY) as s, \
            pytest.raises(EnginesQuarantined, match="canary"):
        s.sync(daemon.next_version())
    with ws.sender(lora(tiny), daemon.client, adapters=True, canary_token_ids=CANARY) as s:
        assert s.sync(daemon.next_version()).updated == ["e0"]  # a good one brings the engine back


def test_export_writes_the_adapter_beside_the_merged_model(tiny, tokenizer, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from treadle.trainer.checkpoint.export import (
        ADAPTER_DIR,
        full_state_dict,
        lora_adapter,
        save_causal_lm,
    )

    model = lora(tiny)
    engine = SimpleNamespace(module=model)
    state = full_state_dict(engine, zero_stage=0, is_main=True)
    adapter = lora_adapter(engine, zero_stage=0, is_main=True)
    out = save_causal_lm(state, model.get_base_model().config, tokenizer, tmp_path / "final", adapter=adapter)
    folder = out / ADAPTER_DIR
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in folder.iterdir()}
    assert json.loads((folder / "adapter_config.json").read_text())["r"] == 4
    ids = torch.tensor([PROBE])
    with torch.no_grad():
        want = model(ids).logits
        loaded = PeftModel.from_pretrained(ws.causal_lm(tiny), str(folder)).eval()
        torch.testing.assert_close(loaded(ids).logits, want, rtol=0, atol=1e-5)
        merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        torch.testing.assert_close(merged(ids).logits, want, rtol=0, atol=1e-4)
    assert lora_adapter(SimpleNamespace(module=ws.causal_lm(tiny)), zero_stage=0, is_main=True) is None
    assert not (save_causal_lm(state, model.get_base_model().config, None, tmp_path / "plain") / ADAPTER_DIR).exists()


cli = load_by_path("treadle_trainer_test_config_cli_for_lora", HERE / "test_config_cli.py")


@pytest.mark.parametrize("extra,needle", [
    ([], "needs --ds.lora.rank > 0"),
    (["--ds.lora.rank", "4", "--ds.load_in_4bit"], "--vllm.sync_adapters with --ds.load_in_4bit"),
    (["--ds.lora.rank", "1024"], "vLLM serves LoRA ranks up to 512"),
])
def test_sync_adapters_refusals_name_the_flags(extra, needle):
    from treadle.trainer.config import parse_ppo

    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        parse_ppo([*cli.ppo_argv(), "--vllm.sync_adapters", *extra])


def test_a_daemon_the_trainer_starts_serves_the_adapters_rank():
    import dataclasses

    from treadle.trainer.config import parse_ppo
    from treadle.trainer.daemon import daemon_spec, serve_args

    spec = daemon_spec(parse_ppo([*cli.ppo_argv(), "--vllm.sync_adapters", "--ds.lora.rank", "12"]))
    args = serve_args(spec, "tcp://h:1")
    assert args[args.index("--engine.max_lora_rank") + 1] == "16"  # vLLM's next rank up
    assert "--engine.max_lora_rank" not in serve_args(dataclasses.replace(spec, backend="hf"), "tcp://h:1")
    assert "--engine.max_lora_rank" not in serve_args(daemon_spec(parse_ppo(cli.ppo_argv())), "tcp://h:1")


ppo = load_by_path("treadle_trainer_test_ppo_for_lora", HERE / "test_ppo.py")
task = ppo.task  # the fixture: prompts and a digit-counting reward


def test_a_lora_ppo_run_syncs_adapters_to_vllm(tiny, task, helpers, tmp_path):
    """PPO with LoRA (ZeRO-3) and --vllm.sync_adapters against a vLLM daemon serving the base with
    LoRA on: every step samples from the trainer's model (logprob gap and canary within fp32's
    1e-3), and the export holds the adapter alone as well."""
    pytest.importorskip("vllm")
    with ppo.serving(tiny, helpers, "--backend", "vllm", "--engine.max_lora_rank", "8",
                     "--engine.enforce_eager") as endpoint:
        ppo.run_ppo(ppo.ppo_args(tiny, task, tmp_path, endpoint, "--data.max_samples", "12", "--ds.lora.rank", "8",
                                 "--ds.lora.alpha", "16", "--vllm.sync_adapters", "--actor.adam.lr", "3e-2"), helpers)
    rows = ppo.metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["logprob_gap/max"] <= 1e-3 and 0.0 <= r["sync/canary_gap"] <= 1e-3 for r in rows)
    assert rows[-1]["kl"] > 0.0  # the adapter moved the policy, and the engines followed it
    # the adapter alone went (tiny, rank 8: 14 modules x 8 x (in + out) fp32 <= 70 KB; the merged model: 430 KB)
    assert all(r["sync/bytes"] < 100_000 for r in rows)
    assert (tmp_path / "model" / "adapter" / "adapter_model.safetensors").is_file()


def test_adapters_into_an_fp32_vllm_daemon_on_a_gpu_are_refused_before_anything_loads():
    """vLLM's GPU LoRA kernels take fp16 / bf16 only (measured: its engine died at its first
    forward); the trainer refuses that pair at start-up, where it knows it is on CUDA."""
    from treadle.trainer.config import parse_ppo
    from treadle.trainer.trainers.ppo_build import sync_route

    argv = [*cli.ppo_argv(), "--vllm.sync_adapters", "--ds.lora.rank", "8", "--vllm.backend", "vllm"]
    cfg = parse_ppo([*argv, "--ds.param_dtype", "fp32"])
    with pytest.raises(ConfigError, match="--ds.param_dtype fp32"):
        sync_route(cfg, cuda=True)
    assert sync_route(cfg, cuda=False) == ("collective", "gloo")  # vLLM's CPU build serves fp32 LoRA
    sync_route(parse_ppo([*argv, "--ds.param_dtype", "bf16"]), cuda=True)  # bf16: served
