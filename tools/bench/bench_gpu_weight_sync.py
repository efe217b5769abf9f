#!/usr/bin/env python3
"""Benchmark (issues 10, 30, 31): weight sync of a ~1.5B-parameter bf16 model from a ZeRO-3
trainer to rollout daemons, against raw transfers of the same bytes measured in the same run.

Under ``torchrun --nproc_per_node 2`` on a 2-GPU machine. Rank 0 writes a Qwen2-shaped model
(random init from a config, no download; seed 0) and starts two ``treadle-rollout serve``
daemons (``--backend``, bf16, one engine each): "nccl" on GPU 1 and "ipc" on GPU 0 (rank 0's),
plus two raw receivers (this file, ``--raw nccl|ipc``) on the same GPUs. Every rank builds a
trainer model from the same config (seed 1), wrapped in a ZeRO-3 DeepSpeed engine. Then:

1. correctness: sync bucketed to both daemons (``WeightSender``: collective over NCCL, and
   cuda_ipc), compare each daemon's weight digest with the trainer's (``full_state_dict``; the
   hf backend) and its prompt logprobs with the trainer's; change one tensor, sync per tensor,
   compare again;
2. timing, one warm-up round then ``--repeats`` rounds (order reversed every other round) of:
   ``raw_nccl`` (a plain ``WeightGroup`` broadcast of the same bytes in the same buckets to the
   raw receiver on GPU 1, until it acknowledged), ``raw_ipc`` (the raw receiver on GPU 0 maps
   the same buckets with ``open_handles`` and copies them into its own buffer, until it
   acknowledged), ``gather`` (the ZeRO-3 gathers alone, as the sender walks them) and
   ``gather_pack`` (+ packing on rank 0), ``nccl`` and ``ipc`` (a full ``WeightSender.sync``:
   gather, pack, transfer, the engine's load, the daemon's answer), each bucketed
   (``--bucket-mb``) and per tensor.

With ``--nproc_per_node 1`` on one GPU it runs the cuda_ipc path alone (the "ipc" daemon and raw
receiver on GPU 0). ``--backend vllm`` serves the daemons with vLLM (its digests are not
comparable with the trainer's: logprobs are). Medians are reported with the ratios the issues
set goals for (NCCL path <= 1.3x raw NCCL, IPC path <= 1.5x raw IPC). ``--cpu`` is a dry run on
CPU (tiny shape, gloo, one daemon, no IPC). Rank 1 waits on CPU (gloo) barriers.

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node 2 tools/bench/bench_gpu_weight_sync.py \\
        --json bench_gpu_weight_sync.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import hashlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]

PROBE = list(range(5, 69))
SHAPE_1P5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, vocab_size=151936)  # Qwen2.5-1.5B's shape
SHAPE_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512)
LAYOUTS = ("bucketed", "per_tensor")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hf_digest(state: dict[str, torch.Tensor]) -> str:
    """The hf engine's ``weight_digest`` of a tied model holding ``state``."""
    state = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
    h = hashlib.sha256()
    for name, t in sorted(state.items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def spans(sizes: list[int]) -> list[tuple[int, int]]:
    out, off = [], 0
    for n in sizes:
        out.append((off, n))
        off += n
    return out


# ------------------------------------------------------------------ raw receivers (own processes)


def raw_receiver(kind: str, ctl_port: int) -> None:
    """Receive what rank 0's raw ops send, op by op as ``plan`` lists them; acknowledge each."""
    import msgpack

    from treadle.common.ipc import open_handles
    from treadle.common.records import WeightGroupSpec
    from treadle.common.weights import WeightGroup

    store = dist.TCPStore("127.0.0.1", ctl_port, is_master=False, timeout=datetime.timedelta(seconds=900))
    plan = json.loads(store.get("plan"))
    device = torch.device("cuda", 0) if plan["backend"] == "nccl" else torch.device("cpu")
    dst = {k: torch.empty(sum(v), dtype=torch.uint8, device=device) for k, v in plan["layouts"].items()}
    views = {k: [dst[k][o:o + n] for o, n in spans(v)] for k, v in plan["layouts"].items()}
    if kind == "nccl":
        group = WeightGroup(WeightGroupSpec(host="127.0.0.1", port=plan["group_port"], world_size=2, rank=1,
                                            backend=plan["backend"]))
        ack = torch.ones(1, device=device)
        for k, layout in enumerate(plan["nccl"]):
            store.get(f"go{k}")  # post nothing (no spinning NCCL kernel) before rank 0 sends
            store.set(f"ready{k}", b"1")
            for v in views[layout]:
                group.broadcast(v)
            group.broadcast(ack, src=1)
        torch.cuda.synchronize() if device.type == "cuda" else None
        group.close()
    else:
        for k, layout in enumerate(plan["ipc"]):
            flats = open_handles(msgpack.unpackb(store.get(f"ipc{k}")), device)
            for d, s in zip(views[layout], flats, strict=True):
                d.copy_(s)
            torch.cuda.synchronize(device)
            flats.clear()
            store.set(f"ipcack{k}", b"1")
    store.set(f"{kind}_done", b"1")


# ------------------------------------------------------------------ rank 0: processes


def spawn(cmd: list[str], gpu: int | None) -> subprocess.Popen:
    env = dict(os.environ, TREADLE_LOG_LEVEL="WARNING")
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    return subprocess.Popen(cmd, env=env, start_new_session=True, stdin=subprocess.DEVNULL)


def start_daemon(model: Path, gpu: int | None, cpus: str, backend: str) -> tuple[subprocess.Popen, str]:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "treadle.rollout", "serve", "--endpoint", endpoint, "--model", str(model),
           "--backend", backend, "--engines", "1", "--engine.dtype", "bfloat16", "--engine.max_model_len", "512",
           "--health_interval_s", "1", "--cpus", *cpus.split(","), "--no_keep_weights"]
    if gpu is not None:
        cmd += ["--gpu_ids", str(gpu)]
        # vLLM eager: a compiled 1.5B engine on two pinned cores did not start within 5 minutes (GPU run 4)
        cmd += ["--engine.device", "cuda"] if backend == "hf" else ["--engine.gpu_memory_utilization", "0.3",
                                                                   "--engine.enforce_eager"]
    return spawn(cmd, None), endpoint


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(20)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


# ------------------------------------------------------------------ every rank


def build_trainer(shape: dict, device: torch.device, seed: int):  # noqa: ANN201
    from transformers import AutoModelForCausalLM, Qwen2Config

    from treadle.trainer.config.deepspeed import DeepSpeedConfig
    from treadle.trainer.config.optim import OptimizerConfig
    from treadle.trainer.strategy.deepspeed import build_engine

    torch.manual_seed(seed)
    cfg = Qwen2Config(**shape, tie_word_embeddings=True, max_position_embeddings=4096)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    # the training engine, optimizer included: ZeRO-3 then keeps each rank's partitions in flat
    # buffers, as in a real run (without an optimizer every partition is a tensor of its own)
    engine = build_engine(model, DeepSpeedConfig(zero_stage=3, param_dtype="bf16"), OptimizerConfig(),
                          micro_batch=1, grad_accum=1, world=dist.get_world_size(), total_steps=10)
    return cfg, engine


class Bench:
    """The measurements, run in lockstep on every rank (rank 0 alone talks to the others)."""

    def __init__(self, a: argparse.Namespace, engine, cfg, main: bool, device: torch.device) -> None:  # noqa: ANN001
        from treadle.common.weights import plan_buckets
        from treadle.trainer.weights.gather import bucket_bytes
        from treadle.trainer.weights.plan import plan

        self.a, self.engine, self.cfg, self.main, self.device = a, engine, cfg, main, device
        self.cpu_group = dist.new_group(backend="gloo") if device.type == "cuda" else None
        self.items = plan(engine.module, torch.bfloat16)
        nbytes = [it.nbytes for it in self.items]
        self.sizes = {"bucketed": plan_buckets(nbytes, int(a.bucket_mb * (1 << 20))), "per_tensor": [1] * len(nbytes)}
        self.bucket_bytes = {"bucketed": int(a.bucket_mb * (1 << 20)), "per_tensor": 0}
        self.layout_bytes = {}
        for name, sizes in self.sizes.items():
            lo, out = 0, []
            for s in sizes:
                out.append(bucket_bytes(self.items[lo:lo + s]))
                lo += s
            self.layout_bytes[name] = out
        self.versions = {"nccl": 0, "ipc": 0}  # per daemon
        self.raw_k = {"nccl": 0, "ipc": 0}

    def barrier(self) -> None:
        dist.barrier(group=self.cpu_group)

    def sync_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def gather(self, layout: str, buffer: torch.Tensor | None) -> float:
        """The sender's walk of every bucket (ZeRO-3 gathers); with ``buffer``, rank 0 packs each
        into its place there; seconds."""
        from treadle.trainer.weights.gather import pack, walk

        self.barrier()
        self.sync_device()
        start = time.perf_counter()
        for (lo, hi), (off, _) in zip(walk(self.items, self.sizes[layout], zero3=True),
                                      spans(self.layout_bytes[layout]), strict=True):
            if buffer is not None and self.main:
                pack(self.items[lo:hi], buffer[off:])
        self.sync_device()
        return time.perf_counter() - start

    def digest(self) -> str | None:
        from treadle.trainer.checkpoint.export import full_state_dict

        state = full_state_dict(self.engine, zero_stage=3, is_main=self.main)
        return hf_digest(state) if self.main else None

    def own_logprobs(self) -> torch.Tensor:
        x = torch.as_tensor(PROBE, device=self.device)[None]
        with torch.no_grad():
            lp = torch.log_softmax(self.engine.module(input_ids=x).logits[0, :-1].double(), -1)
        return lp.gather(1, x[0, 1:, None]).squeeze(1).cpu()

    def perturb(self) -> None:
        """Change one tensor on every rank (each its own partition), so the next sync is news."""
        for name, p in self.engine.module.named_parameters():
            if name.endswith("model.norm.weight"):
                with torch.no_grad():
                    p.ds_tensor.add_(0.125)

    def sync(self, sender, daemon: str, layout: str) -> dict:  # noqa: ANN001
        """One ``WeightSender.sync`` to ``daemon`` after ``--idle-ms`` of quiet (as after training)."""
        sender.config = dataclasses.replace(sender.config, bucket_bytes=self.bucket_bytes[layout])
        self.versions[daemon] += 1
        time.sleep(self.a.idle_ms / 1e3)
        self.barrier()
        start = time.perf_counter()
        r = sender.sync(self.versions[daemon])
        self.sync_device()
        stamps = next(iter(r.engine_seconds.values()), {})  # one engine: when the update reached it, ...
        return {"s": time.perf_counter() - start, "gather_s": r.gather_seconds, "send_s": r.send_seconds,
                "buckets": r.buckets, **{f"engine_{k}_s": v for k, v in stamps.items()}}

    # -- raw transfers (rank 0 and a raw receiver; the other ranks wait)

    def raw_nccl(self, layout: str, group, store, src: dict) -> dict | None:  # noqa: ANN001
        self.barrier()
        if not self.main:
            return None
        k = self.raw_k["nccl"]
        self.raw_k["nccl"] += 1
        store.set(f"go{k}", b"1")
        store.get(f"ready{k}")
        ack = torch.zeros(1, device=self.device)
        start = time.perf_counter()
        for o, n in spans(self.layout_bytes[layout]):
            group.broadcast(src[layout][o:o + n])
        group.broadcast(ack, src=1)  # the receiver's acknowledgement
        self.sync_device()
        return {"s": time.perf_counter() - start, "ack": float(ack.item())}

    def raw_ipc(self, layout: str, store, src: dict) -> dict | None:  # noqa: ANN001
        import msgpack

        from treadle.common.ipc import encode_buckets

        self.barrier()
        if not self.main:
            return None
        k = self.raw_k["ipc"]
        self.raw_k["ipc"] += 1
        start = time.perf_counter()
        store.set(f"ipc{k}", msgpack.packb(encode_buckets(src[layout], spans(self.layout_bytes[layout]))))
        store.get(f"ipcack{k}")
        return {"s": time.perf_counter() - start}


def schedule(repeats: int, ipc: bool, nccl: bool = True) -> list[list[tuple[str, str]]]:
    """Rounds of (op, layout); round 0 is the warm-up; every other round runs reversed. Without
    ``nccl`` (a 1-rank trainer on one GPU): the gathers, raw IPC and the cuda_ipc sync alone."""
    ops = (["raw_nccl", "gather", "gather_pack", "nccl"] if nccl else ["gather", "gather_pack"]) + (
        ["raw_ipc", "ipc"] if ipc else [])
    one = [(op, layout) for op in ops for layout in LAYOUTS]
    return [one if r % 2 == 0 else one[::-1] for r in range(repeats + 1)]


# ------------------------------------------------------------------ the run


def write_model(shape: dict, folder: Path, device: torch.device) -> None:
    """The daemons' model: the trainer's shape, seed 0 (the trainer is seed 1: every weight differs)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    cfg = Qwen2Config(**shape, tie_word_embeddings=True, max_position_embeddings=4096)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()


def correctness(bench: Bench, senders: dict, clients: dict) -> dict:
    """Bucketed then (after changing one tensor) per-tensor syncs to each daemon: digests after
    each (the hf backend), then logprobs."""
    out: dict = {}
    for layout in LAYOUTS:
        if layout == "per_tensor":
            bench.perturb()
        want = bench.digest()
        for name, sender in senders.items():
            r = bench.sync(sender, name, layout)
            if bench.main:
                row = {"first_sync_s": r["s"], "buckets": r["buckets"]}
                if bench.a.backend == "hf":
                    row["digest_ok"] = list(clients[name].weight_digest().values()) == [want]
                out[f"{name}_{layout}"] = row
    mine = bench.own_logprobs()
    for name, client in clients.items():
        got = torch.tensor(client.prompt_logprobs(torch.as_tensor(PROBE).numpy()).copy(), dtype=torch.float64)
        out[f"{name}_logprob_gap"] = float((got - mine).abs().max())
    return out


def summarise(rows: list[dict], bench: Bench) -> dict:
    med = {}
    for key in {(r["op"], r["layout"]) for r in rows}:
        sel = [r for r in rows if (r["op"], r["layout"]) == key]
        med[f"{key[0]}/{key[1]}"] = {k: statistics.median(r[k] for r in sel if k in r)
                                     for k in sel[0] if k.endswith("_s") or k == "s"}
    ratios = {}
    for t in ("nccl", "ipc"):
        for layout in LAYOUTS:
            e2e, raw = med.get(f"{t}/{layout}"), med.get(f"raw_{t}/{layout}")
            if e2e is None or raw is None:
                continue
            floor = med[f"gather_pack/{layout}"]["s"] + raw["s"]
            ratios[f"{t}/{layout}"] = {"end_to_end_vs_raw": e2e["s"] / raw["s"],
                                       "transfer_vs_raw": e2e["send_s"] / raw["s"],
                                       "end_to_end_vs_gather_pack_plus_raw": e2e["s"] / floor}
    total = sum(it.nbytes for it in bench.items)
    return {"bytes": total, "tensors": len(bench.items), "buckets": {k: len(v) for k, v in bench.sizes.items()},
            "medians_s": med, "ratios": ratios, "goals": {"nccl": 1.3, "ipc": 1.5}}


def timing(bench: Bench, senders: dict, group, store, src: dict) -> list[dict]:  # noqa: ANN001
    rows = []
    for r, ops in enumerate(schedule(bench.a.repeats, "ipc" in senders, "nccl" in senders)):
        for op, layout in ops:
            if op == "raw_nccl":
                res = bench.raw_nccl(layout, group, store, src)
            elif op == "raw_ipc":
                res = bench.raw_ipc(layout, store, src)
            elif op in ("gather", "gather_pack"):
                res = {"s": bench.gather(layout, src[layout] if op == "gather_pack" and bench.main else None)}
            else:
                res = bench.sync(senders[op], op, layout)
            if bench.main and r > 0:
                rows.append({"round": r, "op": op, "layout": layout, **res})
    return rows


def run(a: argparse.Namespace) -> dict | None:
    from treadle.common.records import WeightGroupSpec
    from treadle.common.weights import WeightGroup
    from treadle.rollout.client import SyncRolloutClient
    from treadle.trainer.strategy.deepspeed import init_distributed
    from treadle.trainer.weights.sender import SenderConfig, WeightSender

    info = init_distributed()
    main, device, gpu = info.is_main, info.device, info.device.type == "cuda"
    nccl = not gpu or info.world > 1  # one rank on one GPU: the cuda_ipc path alone (no GPU to receive over NCCL)
    raws = [k for k in ("nccl", "ipc") if (k == "nccl" and nccl) or (k == "ipc" and gpu)]
    shape = dict(SHAPE_TINY if a.cpu else SHAPE_1P5B, **({"vocab_size": a.vocab} if a.vocab else {}),
                 **({"num_hidden_layers": a.layers} if a.layers else {}))
    procs, clients, senders, store, group, started = [], {}, {}, None, None, time.perf_counter()
    try:
        if main:
            write_model(shape, Path(a.workdir) / "model", device)
            ctl_port, group_port = free_port(), free_port()
            store = dist.TCPStore("127.0.0.1", ctl_port, is_master=True, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=900))
            daemons = {}
            if nccl:
                daemons["nccl"] = start_daemon(Path(a.workdir) / "model", 1 if gpu else None,
                                               "12,13" if gpu else "1", a.backend)
            if gpu:
                daemons["ipc"] = start_daemon(Path(a.workdir) / "model", 0, "14,15", a.backend)
            procs += [p for p, _ in daemons.values()]
            for kind in raws:
                procs.append(spawn([sys.executable, __file__, "--raw", kind, "--ctl-port", str(ctl_port)],
                                   {"nccl": 1, "ipc": 0}[kind] if gpu else None))
        cfg, engine = build_trainer(shape, device, seed=1)
        bench = Bench(a, engine, cfg, main, device)
        backend = "nccl" if gpu else "gloo"
        if main:
            for name, (_, endpoint) in daemons.items():
                clients[name] = SyncRolloutClient(endpoint)
                clients[name].wait_ready(900)
            seq = [layout for rnd in schedule(a.repeats, gpu, nccl) for op, layout in rnd]
            ops = [op for rnd in schedule(a.repeats, gpu, nccl) for op, _ in rnd]
            store.set("plan", json.dumps({"backend": backend, "group_port": group_port, "layouts": bench.layout_bytes,
                                          "nccl": [s for s, o in zip(seq, ops, strict=True) if o == "raw_nccl"],
                                          "ipc": [s for s, o in zip(seq, ops, strict=True) if o == "raw_ipc"]}))
            if nccl:
                group = WeightGroup(WeightGroupSpec(host="127.0.0.1", port=group_port, world_size=2, rank=0,
                                                    backend=backend))
        ready_s = time.perf_counter() - started
        bucket = int(a.bucket_mb * (1 << 20))
        if nccl:
            senders["nccl"] = WeightSender(engine, config=SenderConfig(backend=backend, bucket_bytes=bucket,
                                                                       dtype="bfloat16"),
                                           client=clients.get("nccl"), zero_stage=3, is_main=main)
        if gpu:
            senders["ipc"] = WeightSender(engine, config=SenderConfig(transport="cuda_ipc", bucket_bytes=bucket,
                                                                      dtype="bfloat16"),
                                          client=clients.get("ipc"), zero_stage=3, is_main=main)
        checks = correctness(bench, senders, clients if main else {})
        src = {k: torch.empty(sum(v), dtype=torch.uint8, device=device) if main else None
               for k, v in bench.layout_bytes.items()}
        for layout in LAYOUTS:
            bench.gather(layout, src[layout])
        rows = timing(bench, senders, group, store, src)
        if not main:
            return None
        return {"shape": shape, "world": info.world, "device": torch.cuda.get_device_name(0) if gpu else "cpu",
                "torch": torch.__version__, "backend": a.backend, "bucket_mb": a.bucket_mb, "repeats": a.repeats,
                "setup_s": ready_s, "correctness": checks, **summarise(rows, bench), "rows": rows}
    finally:
        for s in senders.values():
            s.close()
        for c in clients.values():
            c.close()
        for p in procs[len(procs) - len(raws):]:  # the raw receivers end by themselves
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(30)
        for p in procs:
            stop(p)
        if group is not None:
            group.close()


def report_lines(res: dict) -> list[str]:
    lines = [f"{res['tensors']} tensors, {res['bytes'] / 1e9:.2f} GB bf16, buckets {res['buckets']}",
             f"correctness: {json.dumps(res['correctness'])}",
             f"{'op/layout (median ms)':<24}{'total':>10}{'gather':>10}{'send':>10}"
             "   the engine's stamps, ms into the sync"]
    for k in sorted(res["medians_s"]):
        m = res["medians_s"][k]
        engine = [(f, m[f"engine_{f}_s"]) for f in ("received", "called", "loading", "loaded", "done")
                  if f"engine_{f}_s" in m]
        lines.append(f"{k:<24}" + "".join(f"{m.get(f, 0) * 1e3:>10.1f}"
                                           for f in ("s", "gather_s", "send_s"))
                     + ("   " + ", ".join(f"{f} {t * 1e3:.1f}" for f, t in engine) if engine else ""))
    for k, r in res["ratios"].items():
        lines.append(f"{k}: end-to-end/raw {r['end_to_end_vs_raw']:.2f}x, transfer/raw {r['transfer_vs_raw']:.2f}x, "
                     f"end-to-end/(gather+pack + raw) {r['end_to_end_vs_gather_pack_plus_raw']:.2f}x")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7, help="timed rounds (after one warm-up round)")
    p.add_argument("--bucket-mb", type=float, default=256.0, help="bucket size of the bucketed layout, MiB")
    p.add_argument("--vocab", type=int, default=0, help="override the vocabulary size (0: the shape's)")
    p.add_argument("--layers", type=int, default=0, help="override the number of layers (0: the shape's); "
                   "--cpu --layers 28 has the 1.5B's 338 tensors at tiny widths: the sync's host overhead")
    p.add_argument("--cpu", action="store_true", help="dry run on CPU: tiny shape, gloo, no IPC")
    p.add_argument("--idle-ms", type=float, default=50.0, help="quiet before each sync (as after training), ms")
    p.add_argument("--workdir", default="/tmp/treadle_bench_gpu_ws")
    p.add_argument("--json", default="")
    p.add_argument("--backend", choices=("hf", "vllm"), default="hf", help="the daemons' engine backend")
    p.add_argument("--raw", choices=("nccl", "ipc"), help=argparse.SUPPRESS)
    p.add_argument("--ctl-port", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.raw:
        raw_receiver(a.raw, a.ctl_port)
        return 0
    from treadle.common.log import setup_logging
    from treadle.trainer.strategy.deepspeed import shutdown_distributed

    setup_logging("WARNING")
    try:
        res = run(a)
    finally:
        shutdown_distributed()
    if res is not None:
        res["date"] = datetime.datetime.now().isoformat(timespec="seconds")
        print("\n".join(report_lines(res)), flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
