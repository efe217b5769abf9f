#!/usr/bin/env python3
"""vLLM smoke test on one GPU with random-weight Qwen2-architecture models.

Builds the models with transformers (no hub access), then with vllm.LLM:
  gen    : 256 prompts x 256 new tokens from token ids, tokens/s
  sleep  : sleep(level=1) / wake_up(), sleep(level=2) / wake_up() + reload_weights
  reload : collective_rpc("reload_weights", weights_path=...) to a second model and back
  ipc    : RLHF weight transfer API (weight_transfer_config backend "ipc"):
           start_weight_update / update_weights (CUDA IPC handles from this
           process, the "trainer") / finish_weight_update, unpacked and packed
Each phase's results go to OUT/<tag>.json as they come.

Run after install_on_device.sh and `source env.sh`, e.g.
  python3 tools/gpu_vllm/smoke.py --tag eager --phases gen,sleep,reload,ipc
  python3 tools/gpu_vllm/smoke.py --tag compiled --eager 0 --phases gen
"""
import argparse
import json
import os
import sys
import time
import traceback

SHAPES = {
    # Qwen2.5-0.5B's shape
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True),
    # Qwen2.5-1.5B's shape
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, intermediate_size=8960, tie_word_embeddings=True),
}
VOCAB = 151936
EOS = 151643


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/smoke-out"))
    p.add_argument("--models", default="/tmp/models")
    p.add_argument("--shape", default="0.5b", choices=sorted(SHAPES))
    p.add_argument("--eager", type=int, default=1)
    p.add_argument("--attn", default=None, help="e.g. FLASH_ATTN, TRITON_ATTN")
    p.add_argument("--phases", default="gen,sleep,reload,ipc")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--gpu-mem", type=float, default=0.3)
    p.add_argument("--budget-s", type=float, default=480,
                   help="skip phases once this many seconds have passed")
    p.add_argument("--tag", default="run")
    return p.parse_args()


def build_model(path, shape, seed):
    if os.path.exists(os.path.join(path, "config.json")):
        return 0.0
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    t = time.time()
    cfg = Qwen2Config(vocab_size=VOCAB, max_position_embeddings=4096,
                      bos_token_id=EOS, eos_token_id=EOS, **SHAPES[shape])
    torch.manual_seed(seed)
    with torch.device("cuda"):
        m = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    m.save_pretrained(path)
    del m
    torch.cuda.empty_cache()
    return time.time() - t


def weight_checksum(model):
    """Per-parameter (sum, sum of squares) in float64, run inside the worker."""
    import torch
    out = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            x = p.detach().double()
            out.append((name, float(x.sum()), float((x * x).sum())))
    return out


def gpu_used_mib():
    import pynvml
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    used = pynvml.nvmlDeviceGetMemoryInfo(h).used / 2**20
    pynvml.nvmlShutdown()
    return round(used)


def main():
    a = parse()
    os.makedirs(a.out, exist_ok=True)
    t_start = time.time()
    res = {"args": vars(a)}
    phases = a.phases.split(",")

    def save():
        with open(os.path.join(a.out, f"{a.tag}.json"), "w") as f:
            json.dump(res, f, indent=1)

    def left():
        return a.budget_s - (time.time() - t_start)

    # LLM.apply_model (weight checksums) and the IPC handles in update_weights
    # travel pickled to the engine process: vLLM refuses that without this.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    if "ipc" in phases:
        # vllm/distributed/weight_transfer/ipc_engine.py does `import ray` at the
        # top (only its 'ray' send mode uses it); ray is not on the image.
        try:
            import ray  # noqa: F401
        except ImportError:
            stub = "/tmp/stubs"
            os.makedirs(f"{stub}/ray", exist_ok=True)
            with open(f"{stub}/ray/__init__.py", "w") as f:
                f.write("# stub: vllm's IPC weight-transfer engine imports ray at top\n")
            sys.path.insert(0, stub)
            os.environ["PYTHONPATH"] = stub + ":" + os.environ.get("PYTHONPATH", "")
            res["ray_stub"] = True

    dir_a = os.path.join(a.models, f"qwen2-{a.shape}-a")
    dir_b = os.path.join(a.models, f"qwen2-{a.shape}-b")
    res["build_s_a"] = round(build_model(dir_a, a.shape, 1), 2)
    if "reload" in phases or "ipc" in phases:
        res["build_s_b"] = round(build_model(dir_b, a.shape, 2), 2)
    res["model_bytes"] = sum(os.path.getsize(os.path.join(dir_a, f)) for f in os.listdir(dir_a))
    save()

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    res["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__}
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(0, EOS, (a.prompt_len,), generator=g).tolist()}
               for _ in range(a.prompts)]
    small = prompts[:8]
    greedy = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True,
                            detokenize=False)
    probe = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, detokenize=False)

    kw = dict(model=dir_a, dtype="bfloat16", gpu_memory_utilization=a.gpu_mem,
              enforce_eager=bool(a.eager), skip_tokenizer_init=True, max_model_len=1024,
              max_num_seqs=256, seed=0, enable_prefix_caching=False)
    if "sleep" in phases:
        kw["enable_sleep_mode"] = True
    if "ipc" in phases:
        kw["weight_transfer_config"] = {"backend": "ipc"}
    if a.attn:
        kw["attention_config"] = {"backend": a.attn}
    res["llm_kwargs"] = {k: v for k, v in kw.items()}
    res["gpu_used_mib_before_llm"] = gpu_used_mib()
    t = time.time()
    llm = LLM(**kw)
    res["llm_init_s"] = round(time.time() - t, 2)
    res["gpu_used_mib_after_llm"] = gpu_used_mib()
    save()

    def ids(outs):
        return [list(o.outputs[0].token_ids) for o in outs]

    def run_probe():
        return ids(llm.generate(small, probe, use_tqdm=False))

    def csum():
        return llm.apply_model(weight_checksum)[0]

    # warm-up, then the reference outputs of model A
    t = time.time()
    llm.generate(small, SamplingParams(max_tokens=16, ignore_eos=True, detokenize=False),
                 use_tqdm=False)
    res["warmup_s"] = round(time.time() - t, 2)
    ref_a = run_probe()
    res["ref_a_head"] = ref_a[0][:8]
    # random weights give near-tied logits, so greedy tokens are a weak check;
    # the weight checksums below are the real one
    res["probe_repeatable"] = run_probe() == ref_a
    try:
        t = time.time()
        cs_a = csum()
        res["checksum_s"] = round(time.time() - t, 2)
        res["params_in_vllm_model"] = len(cs_a)
    except Exception as e:
        cs_a = None
        res["checksum_error"] = repr(e)
    save()

    if "gen" in phases:
        for name, sp in (("greedy", greedy),
                         ("sample_t1", SamplingParams(temperature=1.0, max_tokens=a.max_tokens,
                                                      ignore_eos=True, detokenize=False, seed=0))):
            t = time.time()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            dt = time.time() - t
            n_out = sum(len(o.outputs[0].token_ids) for o in outs)
            res[f"gen_{name}"] = {"prompts": len(prompts), "prompt_len": a.prompt_len,
                                  "new_tokens": n_out, "seconds": round(dt, 3),
                                  "new_tokens_per_s": round(n_out / dt, 1),
                                  "all_tokens_per_s": round((n_out + a.prompt_len * len(prompts)) / dt, 1)}
            print("GEN", name, res[f"gen_{name}"], flush=True)
            save()

    if "sleep" in phases and left() > 60:
        r = {}
        try:
            r["used_mib_awake"] = gpu_used_mib()
            t = time.time()
            llm.sleep(level=1)
            r["sleep1_s"] = round(time.time() - t, 2)
            r["used_mib_asleep1"] = gpu_used_mib()
            t = time.time()
            llm.wake_up()
            r["wake1_s"] = round(time.time() - t, 2)
            r["used_mib_woken1"] = gpu_used_mib()
            r["same_after_sleep1"] = run_probe() == ref_a
            r["weights_same_after_sleep1"] = csum() == cs_a
            t = time.time()
            llm.sleep(level=2)
            r["sleep2_s"] = round(time.time() - t, 2)
            r["used_mib_asleep2"] = gpu_used_mib()
            t = time.time()
            llm.wake_up()
            r["wake2_s"] = round(time.time() - t, 2)
            t = time.time()
            llm.collective_rpc("reload_weights")
            r["reload_after_sleep2_s"] = round(time.time() - t, 2)
            r["same_after_sleep2_reload"] = run_probe() == ref_a
            r["weights_same_after_sleep2_reload"] = csum() == cs_a
        except Exception as e:
            r["error"] = repr(e)
            r["trace"] = traceback.format_exc()[-3000:]
        res["sleep"] = r
        print("SLEEP", {k: v for k, v in r.items() if k != "trace"}, flush=True)
        save()

    ref_b = cs_b = None
    if "reload" in phases and left() > 40:
        r = {}
        try:
            t = time.time()
            llm.collective_rpc("reload_weights", kwargs={"weights_path": dir_b})
            r["reload_b_s"] = round(time.time() - t, 2)
            ref_b = run_probe()
            cs_b = csum()
            r["b_differs_from_a"] = ref_b != ref_a
            r["weights_b_differ_from_a"] = cs_b != cs_a
            t = time.time()
            llm.collective_rpc("reload_weights", kwargs={"weights_path": dir_a})
            r["reload_a_s"] = round(time.time() - t, 2)
            r["same_as_a_after_reload_a"] = run_probe() == ref_a
            r["weights_same_as_a_after_reload_a"] = csum() == cs_a
        except Exception as e:
            r["error"] = repr(e)
            r["trace"] = traceback.format_exc()[-3000:]
        res["reload"] = r
        print("RELOAD", {k: v for k, v in r.items() if k != "trace"}, flush=True)
        save()

    if "ipc" in phases and left() > 40:
        r = {}
        try:
            from dataclasses import asdict

            from safetensors.torch import load_file
            from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

            def send(sd, packed):
                t = time.time()
                llm.start_weight_update()
                IPCWeightTransferEngine.trainer_send_weights(
                    iter(sd.items()),
                    {"send_mode": lambda info: llm.update_weights({"update_info": asdict(info)}),
                     "packed": packed})
                llm.finish_weight_update()
                torch.cuda.synchronize()
                return round(time.time() - t, 2)

            # the "trainer" holds the weights on the GPU, as a colocated trainer would
            sd_b = load_file(os.path.join(dir_b, "model.safetensors"), device="cuda")
            sd_a = load_file(os.path.join(dir_a, "model.safetensors"), device="cuda")
            r["tensors"] = len(sd_b)
            r["bytes"] = sum(v.numel() * v.element_size() for v in sd_b.values())
            r["send_b_unpacked_s"] = send(sd_b, False)
            out_b = run_probe()
            r["b_differs_from_a"] = out_b != ref_a
            r["weights_differ_from_a"] = csum() != cs_a
            if ref_b is not None:
                r["ipc_b_equals_reload_b"] = out_b == ref_b
                r["weights_ipc_b_equal_reload_b"] = csum() == cs_b
            r["send_a_packed_s"] = send(sd_a, True)
            r["same_as_a_after_ipc_a"] = run_probe() == ref_a
            r["weights_same_as_a_after_ipc_a"] = csum() == cs_a
            del sd_a, sd_b
        except Exception as e:
            r["error"] = repr(e)
            r["trace"] = traceback.format_exc()[-3000:]
        res["ipc"] = r
        print("IPC", {k: v for k, v in r.items() if k != "trace"}, flush=True)
        save()

    res["total_s"] = round(time.time() - t_start, 1)
    save()
    print("DONE", json.dumps({k: v for k, v in res.items() if k not in ("args", "llm_kwargs")})[:3000],
          flush=True)


if __name__ == "__main__":
    main()
