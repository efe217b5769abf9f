#!/usr/bin/env python3
"""Weight fan-out on CPU (issue 32): one flat gloo group against 1-16 receivers, and a per-node relay.

The flat group is today's collective transport: the trainer's rank 0 hosts a ``WeightGroup``
(``treadle.common.weights``: a TCPStore and a gloo process group) that every engine worker joins,
and broadcasts each bucket to all of them (``trainer.weights.collective``; the daemon's side is
``rollout.updates``). Here the members are plain processes running those same functions: the
sender packs the `small` preset's tensors (tools/tiny_model.py, 75 tensors, 50.4 MB fp32) into
buckets with ``pack_buckets`` and broadcasts them; each receiver takes them with
``receive_buckets`` (the engine's receive, without copying into a model) and acknowledges through
the sender's TCPStore. No rollout daemon or engine is started: 16 engines (each a torch process)
plus the daemon do not fit this 2-core machine beside anything else, and they would add their
load time, not the fan-out's.

Measured per receiver count R (1, 2, 4, 8, 16), medians of ``--rounds`` after a warm-up:
``join`` (every member's ``WeightGroup``, all started together: the TCPStore rendezvous and
gloo's full mesh of connections), ``sync`` (the sender's first broadcast until every receiver
acknowledged), CPU seconds of the sender and of all members together in that round (the work of
moving the bytes, less sensitive than ``sync`` to other load on the machine), and bytes: what each process wrote to its sockets (``/proc/self/io`` ``wchar``),
for the sender and summed over all. gloo's broadcast is a binomial tree (gloo/broadcast.cc): the
root sends ceil(log2(R+1)) copies and the whole message crosses each tree edge once, so the root's
bytes say which algorithm ran.

Relay (``--relays NxL``, e.g. 4x4): N node leaders join the sender's group; each leader
re-broadcasts every bucket it received into a group of its own with L-1 local receivers (a node's
other engines; on a GPU node this hop is NVLink / CUDA IPC, here it is loopback like the first).
Measured the same way, and compared with the model computed from the flat figures:
``T_relay(N, L) = T_flat(N) + T_flat(L - 1)`` (leader receives the whole update, then forwards it;
a pipelined relay forwarding bucket k while receiving k+1 approaches the larger of the two), with
an unmeasured ``T_flat(R)`` taken from a measured R of as many broadcast rounds (``levels``).

One host: every byte crosses loopback and two cores copy all of them, so absolute times here
are CPU memcpy and TCP stack costs, not a network's; the scaling with R and the byte counts are
what carries over (docs/scaling.md does the extrapolation).

    OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_fanout.py
    OMP_NUM_THREADS=1 .venv/bin/python tools/bench/bench_fanout.py --receivers 1 2 --rounds 3 --relays

Writes ``--json`` (default .cache/bench/fanout.json) and prints a table.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def io_bytes() -> tuple[int, int]:
    """(wchar, rchar): bytes this process passed to write / read system calls so far (sockets included)."""
    vals = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(vals["wchar"]), int(vals["rchar"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------ members (child processes)


@dataclass(frozen=True, kw_only=True)
class Member:
    """One process's part: ``role`` sender / receiver / leader (relay) / local (relay)."""

    role: str
    rank: int  # in the sender's group (leaders, receivers, sender) or in the leader's group (locals)
    world: int  # of that group
    port: int  # that group's TCPStore
    acks: int  # receivers that acknowledge each round (the sender waits for them)
    ack_port: int  # the sender's TCPStore, where every receiver acknowledges
    local_world: int = 0  # leaders: size of the group they host (itself + locals)
    local_port: int = 0
    ack_id: int = 0  # this receiver's index among the ``acks``
    rounds: int = 5
    layout: str = ""  # JSON file: the tensors' dtypes, shapes, bucket sizes (and the checkpoint, for the sender)
    go: str = ""  # a file whose existence starts the join (every member joins at once)


def member_main(m: Member) -> None:
    import torch
    import torch.distributed as dist

    from treadle.common.records import WeightGroupSpec
    from treadle.common.weights import WeightGroup, pack_buckets, receive_buckets

    torch.set_num_threads(1)
    layout = json.loads(Path(m.layout).read_text())
    dtypes, shapes, sizes = layout["dtypes"], layout["shapes"], layout["bucket_sizes"]
    tensors = None
    if m.role == "sender":
        from safetensors.torch import load_file

        state = load_file(layout["checkpoint"])
        tensors = [state[n] for n in layout["names"]]
    print("ready", flush=True)
    while not os.path.exists(m.go):
        time.sleep(0.01)

    def spec(rank: int, world: int, port: int) -> WeightGroupSpec:
        return WeightGroupSpec(host="127.0.0.1", port=port, world_size=world, rank=rank, backend="gloo", timeout_s=300)

    t0 = time.perf_counter()
    group = WeightGroup(spec(m.rank, m.world, m.port))
    local = WeightGroup(spec(0, m.local_world, m.local_port)) if m.role == "leader" else None
    join = time.perf_counter() - t0
    store = group._store if m.role == "sender" else dist.TCPStore("127.0.0.1", m.ack_port, is_master=False,
                                                                    timeout=__import__("datetime").timedelta(seconds=300))
    out: dict[str, Any] = {"role": m.role, "rank": m.rank, "join_s": join, "rounds": []}
    for r in range(m.rounds + 1):  # round 0 warms up
        w0, c0 = io_bytes()
        cpu0 = time.process_time()
        t = time.perf_counter()
        if m.role == "sender":
            for flat in pack_buckets(tensors, sizes):
                group.broadcast(flat)
            keys = [f"ack/{r}/{i}" for i in range(m.acks)]
            store.wait(keys)
            seconds = time.perf_counter() - t
            w1, c1 = io_bytes()
            cpu = time.process_time() - cpu0
            acks = [json.loads(store.get(k)) for k in keys]
            out["rounds"].append({"seconds": seconds, "sender_wchar": w1 - w0, "sender_cpu": cpu,
                                  "total_cpu": cpu + sum(a["cpu"] for a in acks),
                                  "total_wchar": w1 - w0 + sum(a["wchar"] for a in acks),
                                  "leader_wchar": sum(a["wchar"] for a in acks if a["role"] == "leader")})
        else:
            for _lo, _hi, views in receive_buckets(group, dtypes, shapes, sizes):
                if local is not None:  # relay: forward the bucket it just received to the node's locals
                    local.broadcast(_flat_of(views))
            w1, c1 = io_bytes()
            store.set(f"ack/{r}/{m.ack_id}", json.dumps({"role": m.role, "wchar": w1 - w0, "rchar": c1 - c0,
                                                                "cpu": time.process_time() - cpu0}))
    if m.role == "sender":
        print("RESULT " + json.dumps(out), flush=True)
        time.sleep(0.5)  # let the receivers read their last ack before the store goes
    for g in (local, group):
        if g is not None:
            g.close()


def _flat_of(views: list[Any]) -> Any:
    """The uint8 bucket buffer behind a bucket's views (``new_bucket`` made them from one flat tensor)."""
    import torch

    storage = views[0].untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),))


# ------------------------------------------------------------------------------ the orchestrator


@dataclass(frozen=True, kw_only=True)
class Args:
    """Weight fan-out over gloo on CPU: flat group vs per-node relay."""

    receivers: tuple[int, ...] = (1, 2, 4, 8, 16)
    rounds: int = 5
    """Timed syncs per configuration (after one warm-up); medians reported."""
    bucket_mb: float = 256.0
    """Bucket size (the sender's default, 256 MiB: the small preset is one bucket)."""
    relays: tuple[str, ...] = ("2x4", "4x4")
    """Relay layouts NxL (N leaders, L receivers per node, the leader included); empty: none."""
    model: str = ""
    """Folder with model.safetensors; empty: build the `small` preset into a temp folder."""
    json: str = ".cache/bench/fanout.json"


def build_model(out: Path) -> Path:
    import importlib.util

    spec = importlib.util.spec_from_file_location("tiny_model", ROOT / "tools" / "tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.build("small", out, seed=0).out


def write_layout(model: Path, bucket_bytes: int, out: Path) -> dict[str, Any]:
    from safetensors import safe_open

    from treadle.common.weights import plan_buckets, tensor_nbytes

    ckpt = model / "model.safetensors"
    names, dtypes, shapes = [], [], []
    with safe_open(str(ckpt), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is no dict)
            t = f.get_slice(name)
            names.append(name)
            dtypes.append({"F32": "float32", "BF16": "bfloat16", "F16": "float16"}[t.get_dtype()])
            shapes.append(list(t.get_shape()))
    nbytes = [tensor_nbytes(d, s) for d, s in zip(dtypes, shapes, strict=True)]
    layout = {"checkpoint": str(ckpt), "names": names, "dtypes": dtypes, "shapes": shapes,
              "bucket_sizes": plan_buckets(nbytes, bucket_bytes), "bytes": sum(nbytes)}
    out.write_text(json.dumps(layout))
    return layout


def launch(members: list[Member], tmp: Path) -> dict[str, Any]:
    """Start every member, wait until all imported torch, start the join together, return the sender's result."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, "--member", json.dumps(asdict(m))], env=env,
                              stdout=subprocess.PIPE, text=True) for m in members]
    try:
        for p in procs:
            line = p.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"a member did not start (said {line!r}); exit status {p.wait()}")
        Path(members[0].go).touch()
        result = None
        for p in procs:
            for line in p.stdout:
                if line.startswith("RESULT "):
                    result = json.loads(line[len("RESULT "):])
            if p.wait(600) != 0:
                raise RuntimeError(f"member exited with status {p.returncode}")
        assert result is not None
        return result
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        Path(members[0].go).unlink(missing_ok=True)


def flat_members(r: int, rounds: int, layout: str, go: str) -> list[Member]:
    port = free_port()
    common = dict(world=r + 1, port=port, acks=r, ack_port=port, rounds=rounds, layout=layout, go=go)
    return [Member(role="sender", rank=0, **common)] + [
        Member(role="receiver", rank=i + 1, ack_id=i, **common) for i in range(r)]


def relay_members(n: int, local: int, rounds: int, layout: str, go: str) -> list[Member]:
    port = free_port()
    acks = n * local
    top = dict(world=n + 1, port=port, acks=acks, ack_port=port, rounds=rounds, layout=layout, go=go)
    out = [Member(role="sender", rank=0, **top)]
    for i in range(n):
        lport = free_port()
        out.append(Member(role="leader", rank=i + 1, ack_id=i * local, local_world=local, local_port=lport, **top))
        out += [Member(role="receiver", rank=j, world=local, port=lport, acks=acks, ack_port=port,
                       ack_id=i * local + j, rounds=rounds, layout=layout, go=go) for j in range(1, local)]
    return out


def levels(receivers: int) -> int:
    """Rounds of gloo's binomial broadcast to ``receivers`` (plus the root): ceil(log2(receivers + 1))."""
    return (receivers).bit_length()


def same_levels(receivers: int, flat: dict[int, Any]) -> int | None:
    """A measured flat receiver count whose broadcast takes as many rounds as ``receivers``'s (itself if measured)."""
    if receivers in flat:
        return receivers
    return next((r for r in sorted(flat) if levels(r) == levels(receivers)), None)


def summary(result: dict[str, Any]) -> dict[str, float]:
    rounds = result["rounds"][1:]
    return {"join_s": result["join_s"], "sync_s": statistics.median(r["seconds"] for r in rounds),
            "sync_min_s": min(r["seconds"] for r in rounds),
            "sender_cpu_s": statistics.median(r["sender_cpu"] for r in rounds),
            "total_cpu_s": statistics.median(r["total_cpu"] for r in rounds),
            "sender_bytes": statistics.median(r["sender_wchar"] for r in rounds),
            "total_bytes": statistics.median(r["total_wchar"] for r in rounds)}


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--member":
        member_main(Member(**json.loads(sys.argv[2])))
        return
    import tyro

    args = tyro.cli(Args)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="treadle-bench-fanout-") as d:
        tmp = Path(d)
        model = Path(args.model) if args.model else build_model(tmp / "small")
        layout = write_layout(model, int(args.bucket_mb * 2**20), tmp / "layout.json")
        size = layout["bytes"]
        print(f"{len(layout['names'])} tensors, {size / 1e6:.1f} MB, {len(layout['bucket_sizes'])} bucket(s)", flush=True)
        go = str(tmp / "go")
        flat: dict[int, dict[str, float]] = {}
        for r in args.receivers:
            flat[r] = summary(launch(flat_members(r, args.rounds, str(tmp / "layout.json"), go), tmp))
            s = flat[r]
            print(f"  flat R={r:>2}: join {s['join_s']:.3f} s, sync {s['sync_s'] * 1e3:.1f} ms, sender sent "
                  f"{s['sender_bytes'] / size:.2f}x, all sent {s['total_bytes'] / size:.2f}x the update", flush=True)
        relays: dict[str, dict[str, float]] = {}
        for spec in args.relays:
            n, local = (int(x) for x in spec.split("x"))
            s = summary(launch(relay_members(n, local, args.rounds, str(tmp / "layout.json"), go), tmp))
            model_s = None
            top, low = same_levels(n, flat), same_levels(local - 1, flat) if local > 1 else 0
            if top is not None and low is not None:
                model_s = flat[top]["sync_s"] + (flat[low]["sync_s"] if low else 0.0)
            s["model_s"] = model_s
            relays[spec] = s
            print(f"  relay {spec}: sync {s['sync_s'] * 1e3:.1f} ms (model T_flat({n}) + T_flat({local - 1}) = "
                  f"{'-' if model_s is None else f'{model_s * 1e3:.1f} ms'}), sender sent "
                  f"{s['sender_bytes'] / size:.2f}x", flush=True)
    print(f"\n{'layout':>10} {'receivers':>9} {'join s':>8} {'sync ms':>9} {'MB/s per receiver':>18} "
          f"{'sender bytes / update':>22} {'all bytes / update':>19} {'sender CPU s':>13} {'all CPU s':>10}")
    for r, s in flat.items():
        print(f"{'flat':>10} {r:>9} {s['join_s']:>8.3f} {s['sync_s'] * 1e3:>9.1f} {size / s['sync_s'] / 1e6:>18.0f} "
              f"{s['sender_bytes'] / size:>22.2f} {s['total_bytes'] / size:>19.2f} {s['sender_cpu_s']:>13.3f} "
              f"{s['total_cpu_s']:>10.3f}")
    for spec, s in relays.items():
        n, local = (int(x) for x in spec.split("x"))
        print(f"{'relay ' + spec:>10} {n * local:>9} {s['join_s']:>8.3f} {s['sync_s'] * 1e3:>9.1f} "
              f"{size / s['sync_s'] / 1e6:>18.0f} {s['sender_bytes'] / size:>22.2f} {s['total_bytes'] / size:>19.2f} "
              f"{s['sender_cpu_s']:>13.3f} {s['total_cpu_s']:>10.3f}"
              + ("" if s["model_s"] is None else f"   model {s['model_s'] * 1e3:.1f} ms"))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bench": "fanout", "date": time.strftime("%Y-%m-%d"),
                               "machine": f"{os.cpu_count()}-core {platform.machine()}", "args": asdict(args),
                               "update_bytes": size, "tensors": len(layout["names"]),
                               "buckets": len(layout["bucket_sizes"]), "flat": flat, "relays": relays,
                               "seconds": round(time.perf_counter() - started, 1)}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
