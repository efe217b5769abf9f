"""The trainer's weight sender (issue 7) against real rollout daemons (``treadle-rollout serve``,
hf backend, serving tiny model "a" in fp32 and in bf16).

In this process, on plain modules (no process group): names as the checkpoint's, LoRA merged
without touching the trained module, fp32 -> bf16, a stale group rejoined, typed errors from a
name mismatch and a failed canary. Under torchrun (``weight_sync_scenarios.py``): a ZeRO-3
engine on 2 gloo ranks (and 1, slow) sending bucketed, per tensor and inline.

After a sync, the daemon's prompt logprobs must equal the sender model's own (fp32: 1e-4) and
its weight digest must equal the digest of the weights that should have arrived (bit-exact).
Tests share the two daemons; weight versions only grow (``next_version``).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from treadle_testing import load_by_path, load_tool

from treadle.common.config import ConfigError
from treadle.common.errors import BadRequest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
PROBE = list(range(5, 60))
CANARY = tuple(range(3, 40))
TOL = 1e-4


scenarios = load_by_path("treadle_trainer_weight_sync_scenarios", HERE / "weight_sync_scenarios.py")


class Daemon:
    """One ``treadle-rollout serve`` subprocess and a blocking client of it."""

    def __init__(self, args: list[str]) -> None:
        from treadle.rollout.client import SyncRolloutClient

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.endpoint = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        self.proc = subprocess.Popen([sys.executable, "-m", "treadle.rollout", "serve", "--endpoint", self.endpoint,
                                      "--backend", "hf", "--health_interval_s", "1", *args],
                                     start_new_session=True, stdin=subprocess.DEVNULL)
        self.client = SyncRolloutClient(self.endpoint)
        try:
            self.client.wait_ready(120)
            self.initial_digest = self.client.weight_digest()
        except BaseException:
            self.stop()
            raise

    def next_version(self) -> int:
        return int(self.client.health()["version"]) + 1

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


class CountingClient:
    """A client that counts the sender's joins (a rejoin is a new group)."""

    def __init__(self, client: Any) -> None:
        self.client, self.joins = client, 0

    def join_weight_group(self, *args: Any, **kwargs: Any) -> Any:
        self.joins += 1
        return self.client.join_weight_group(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


@pytest.fixture(scope="module")
def model_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny model "b" (seed 1): the trainer's; the daemons serve "a" (the ``tiny`` fixture)."""
    tiny = load_tool("tiny_model")
    return tiny.build("tiny", tmp_path_factory.mktemp("tiny_b"), seed=1).out


@pytest.fixture(scope="module")
def daemon(tiny: Path) -> Daemon:
    d = Daemon(["--model", str(tiny), "--engines", "1"])
    yield d
    d.stop()


@pytest.fixture(scope="module")
def bf16_daemon(tiny: Path) -> Daemon:
    d = Daemon(["--model", str(tiny), "--engines", "1", "--engine.dtype", "bfloat16"])
    yield d
    d.stop()


@pytest.fixture(scope="module")
def lean_daemon(tiny: Path) -> Daemon:
    """No weights kept in the front end: a gloo group of the sender and the engines alone."""
    d = Daemon(["--model", str(tiny), "--engines", "1", "--no_keep_weights"])
    yield d
    d.stop()


def causal_lm(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def with_lora(model: torch.nn.Module) -> torch.nn.Module:
    """peft adapters on every linear layer, with B nonzero (peft starts it at 0: a no-op)."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return peft_model


def sender(model: Any, client: Any, **cfg: Any) -> Any:
    from treadle.trainer.weights.sender import SenderConfig, WeightSender

    return WeightSender(model, config=SenderConfig(**cfg), client=client, zero_stage=0, is_main=True)


def checkpoint_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What ``save_pretrained`` writes (a tied lm_head left out, as in the checkpoint)."""
    return {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}


def arrived(d: Daemon, model: torch.nn.Module) -> None:
    """The daemon holds exactly the model's weights (its digest against the checkpoint's)."""
    assert list(d.client.weight_digest().values()) == [scenarios.hf_digest(checkpoint_state(model), True)]


def gap(d: Daemon, model: torch.nn.Module) -> float:
    got = d.client.prompt_logprobs(np.asarray(PROBE))
    return float(np.abs(got - scenarios.own_logprobs(model, PROBE)).max())


# ------------------------------------------------------------------ no daemon


@pytest.mark.parametrize("name,hf", [
    ("module.base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight", "model.layers.0.self_attn.q_proj.weight"),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", None),
    ("base_model.model.lm_head.modules_to_save.default.weight", "lm_head.weight"),
    ("base_model.model.lm_head.original_module.weight", None),
    ("model.norm.weight", "model.norm.weight"),
])
def test_hf_names_strip_the_wrappers(name, hf):
    from treadle.trainer.weights.plan import hf_name

    assert hf_name(name) == hf


def test_plan_lists_exactly_what_the_engine_spec_wants(model_b):
    from treadle.rollout.engine.weights import WeightMismatch, spec_from_checkpoint
    from treadle.trainer.weights.plan import plan

    model = causal_lm(model_b)
    for dtype, name in ((None, None), (torch.bfloat16, "bfloat16")):
        for m in (model, with_lora(copy.deepcopy(model))):
            items = plan(m, dtype)
            spec_from_checkpoint(model_b, name).check_header([i.name for i in items], [i.dtype_name for i in items],
                                                              [i.shape for i in items])
            names = [i.name for i in items]
            assert set(names) == set(checkpoint_state(model)) and "lm_head.weight" not in names
    items = plan(model, torch.bfloat16)
    with pytest.raises(WeightMismatch, match="dtype bfloat16"):  # the fp32 engine's spec refuses them
        spec_from_checkpoint(model_b).check_header([i.name for i in items], [i.dtype_name for i in items],
                                                   [i.shape for i in items])


def test_lora_merged_value_is_pefts_merge_and_the_module_is_untouched(model_b):
    from treadle.trainer.weights.gather import host_copy
    from treadle.trainer.weights.plan import plan

    peft_model = with_lora(causal_lm(model_b))
    before = {k: v.clone() for k, v in peft_model.state_dict().items()}
    merged = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    items = plan(peft_model)
    for it in items:
        torch.testing.assert_close(host_copy(it), merged[it.name], rtol=0, atol=1e-6)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[q], before[f"base_model.model.{q.replace('.weight', '.base_layer.weight')}"])
    after = peft_model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_config_refuses_bad_values():
    from treadle.trainer.weights.sender import SenderConfig

    for bad in ({"dtype": "int8"}, {"bucket_bytes": -1}, {"canary_token_ids": (5,)}, {"port": 70000},
                {"timeout_s": 0}, {"mode": "later"}, {"transport": "ray"}):
        with pytest.raises(ConfigError):
            SenderConfig(**bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_cuda_ipc_transport_needs_cuda(model_b):
    from treadle.trainer.weights.sender import SenderConfig

    assert SenderConfig(transport="cuda_ipc").transport == "cuda_ipc"
    with pytest.raises(ConfigError, match="cuda_ipc needs CUDA"):
        sender(causal_lm(model_b), object(), transport="cuda_ipc")



def test_per_gpu_copies_merge_one_set_per_gpu_in_rank_order():
    """Every rank's handle set reaches rank 0; one set per GPU is sent (two ranks of one GPU: the
    first's), and a rank that shared none (its packing failed) fails the sync naming it."""
    from treadle.common import ipc
    from treadle.trainer.weights.cuda_ipc import merge_copies
    from treadle.trainer.weights.outcome import WeightSyncFailed

    def handle(gpu: str, n: int) -> bytes:
        return ipc.dumps(ipc.IpcHandle(format=ipc.FORMAT, device_uuid=gpu, numel=n, tensor_offset=0,
                                       storage_handle=b"h", storage_size_bytes=1 << 20, storage_offset_bytes=0,
                                       ref_counter_handle=b"r", ref_counter_offset=0, event_handle=b"",
                                       event_sync_required=False))

    a, b, c = ([handle(g, n) for n in (64, 128)] for g in ("gpu-a", "gpu-b", "gpu-a"))
    assert merge_copies([a, b, c]) == [*a, *b]
    with pytest.raises(WeightSyncFailed, match=r"rank\(s\) \[1\] shared no copy"):
        merge_copies([a, [], b])


GATHER = """
import os, sys, torch
from treadle.trainer.weights.outcome import Rank
rank = int(sys.argv[1])
torch.distributed.init_process_group("gloo", store=torch.distributed.FileStore(sys.argv[2], 2), rank=rank,
                                     world_size=2)
r = Rank(zero3=True, main=rank == 0, client=None, device=torch.device("cpu"), mode="wait")
print(repr(r.all_gather_bytes(b"" if rank else (bytes([0]) + b"rank zero's handles") * 3)))
torch.distributed.destroy_process_group()
"""


def test_ranks_gather_their_bytes_of_any_length(tmp_path):
    """``Rank.all_gather_bytes`` over 2 gloo ranks: each gets every rank's bytes, an empty one too."""
    procs = [subprocess.Popen([sys.executable, "-c", GATHER, str(i), str(tmp_path / "store")], stdout=subprocess.PIPE,
                              text=True) for i in range(2)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs == [repr([b"\x00rank zero's handles" * 3, b""])] * 2


# ------------------------------------------------------------------ against a daemon, in this process


def test_digest_helper_matches_the_engine(daemon, tiny):
    from safetensors.torch import load_file

    assert list(daemon.initial_digest.values()) == [scenarios.hf_digest(load_file(str(tiny / "model.safetensors")), True)]


def test_lora_arrives_as_the_merged_weight(daemon, model_b):
    peft_model = with_lora(causal_lm(model_b))
    v = daemon.next_version()
    with sender(peft_model, daemon.client, bucket_bytes=64 << 10, canary_token_ids=CANARY) as s:
        report = s.sync(v)
    merged = checkpoint_state(copy.deepcopy(peft_model).merge_and_unload())
    assert report.updated == ["e0"] and report.failed == [] and report.buckets > 1
    assert list(daemon.client.weight_digest().values()) == [scenarios.hf_digest(merged, True)]
    assert gap(daemon, peft_model) <= TOL
    assert report.canary_gap is not None and report.canary_gap <= TOL
    assert daemon.client.health()["version"] == v


def test_fp32_trainer_to_bf16_engine_and_a_failed_canary(bf16_daemon, model_b):
    from treadle.common.errors import EnginesQuarantined

    model, c = causal_lm(model_b), bf16_daemon.client
    v = bf16_daemon.next_version()
    with sender(model, c, dtype="bfloat16", canary_token_ids=CANARY, canary_tolerance=1e-7) as s, \
            pytest.raises(EnginesQuarantined, match="canary"):  # bf16 cannot match fp32 to 1e-7
        s.sync(v)
    assert "e0" in c.health()["quarantined"]
    with sender(model, c, dtype="bfloat16", canary_token_ids=CANARY) as s:  # default: 0.1 when narrowed
        report = s.sync(v + 1)
    health = c.health()
    assert report.updated == ["e0"] and health["status"] == "ok" and health["version"] == v + 1
    assert 1e-7 < report.canary_gap < 0.1  # the engine's measured gap comes back with the report
    assert report.bytes == sum(t.numel() * 2 for t in checkpoint_state(model).values())
    as_bf16 = {k: t.to(torch.bfloat16) for k, t in checkpoint_state(model).items()}
    assert list(c.weight_digest().values()) == [scenarios.hf_digest(as_bf16, True)]
    assert gap(bf16_daemon, model) < 0.1


def test_stale_group_is_rejoined_and_the_update_resent(daemon, model_b):
    model, counting = causal_lm(model_b), CountingClient(daemon.client)
    v = daemon.next_version()
    with sender(model, counting, bucket_bytes=64 << 10) as s:
        assert s.sync(v).updated == ["e0"] and counting.joins == 1
        daemon.client.scale(2)  # membership changed: the daemon answers WeightGroupStale
        try:
            report = s.sync(v + 1)
            digests = daemon.client.weight_digest()
        finally:
            daemon.client.scale(1)
        assert counting.joins == 2 and sorted(report.updated) == ["e0", "e1"]
        assert sorted(digests.values()) == [scenarios.hf_digest(checkpoint_state(model), True)] * 2
        assert s.sync(v + 2).updated == ["e0"] and counting.joins == 3  # shrinking is a change too
        daemon.client.leave_weight_group()  # as after a daemon restart: no group at all
        assert s.sync(v + 3).updated == ["e0"] and counting.joins == 4
    assert daemon.client.health()["version"] == v + 3


class KillingClient(CountingClient):
    """Kills the daemon's only engine (SIGKILL) right before the first weight update reaches the
    daemon, and waits until the daemon has seen it go: that sync finds no engine to take it."""

    def __init__(self, client: Any) -> None:
        super().__init__(client)
        self.killed = False

    def submit(self, name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "update_weights" and not self.killed:
            self.killed = True
            pid = self.client.stats()["engines"][0]["pid"]
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while self.client.health()["engines_ready"] and time.monotonic() < deadline:
                time.sleep(0.05)
        return self.client.submit(name, *args, **kwargs)


def test_a_sync_that_finds_no_engine_waits_for_one_and_sends_again(daemon, model_b):
    """The one engine dies as the update arrives (a node lost mid-sync): the sync does not fail
    the run; it waits until the restarted engine is ready, rejoins and delivers the weights."""
    model, killing = causal_lm(model_b), KillingClient(daemon.client)
    v = daemon.next_version()
    with sender(model, killing, bucket_bytes=64 << 10) as s:
        report = s.sync(v)
    # joins: the first group; its rejoin (stale: e0 left), refused with no engine up; the retry's
    assert killing.killed and report.updated == ["e0"] and killing.joins == 3
    arrived(daemon, model)
    assert daemon.client.health()["version"] == v


def test_a_released_sender_holds_no_buffers_and_sends_whole_weights_again(daemon, model_b):
    """``release`` (before a colocated trainer offloads its states) drops what the sender keeps
    between syncs; the next sync makes it again and the engine gets the new weights whole."""
    model = causal_lm(model_b)
    v = daemon.next_version()
    with sender(model, daemon.client, bucket_bytes=64 << 10) as s:
        assert s.sync(v).updated == ["e0"] and len(s._transport.buffers) == 2
        s.release()
        assert s._transport.buffers == []
        with torch.no_grad():
            model.model.norm.weight.add_(0.25)
        assert s.sync(v + 1).updated == ["e0"] and len(s._transport.buffers) == 2
    assert list(daemon.client.weight_digest().values()) == [scenarios.hf_digest(checkpoint_state(model), True)]


def test_two_senders_take_turns_on_one_daemon(daemon, model_b):
    """Each join replaces the daemon's group (the other sender's is left); the sender whose group
    was replaced is told so at its next update and rejoins; every update arrives whole."""
    model, first, second = causal_lm(model_b), CountingClient(daemon.client), CountingClient(daemon.client)
    v = daemon.next_version()
    with sender(model, first, bucket_bytes=64 << 10) as a, sender(model, second, bucket_bytes=64 << 10) as b:
        for k, s in enumerate([a, b, a, b]):
            with torch.no_grad():
                model.model.norm.weight.add_(0.25)  # news at every update
            assert s.sync(v + k).updated == ["e0"], k
            assert list(daemon.client.weight_digest().values()) == [scenarios.hf_digest(checkpoint_state(model), True)]
        assert (first.joins, second.joins) == (2, 2)
    assert daemon.client.health()["version"] == v + 3


def test_name_mismatch_is_a_typed_error_and_the_sender_stays_usable(daemon, model_b):
    model, counting = causal_lm(model_b), CountingClient(daemon.client)
    v = daemon.next_version()
    model.model.extra = torch.nn.Parameter(torch.zeros(3))  # not in the engine's model
    with sender(model, counting, bucket_bytes=64 << 10) as s:
        with pytest.raises(BadRequest, match=r"model\.extra: no such tensor"):
            s.sync(v)
        assert daemon.client.health()["version"] == v - 1
        del model.model.extra
        assert s.sync(v).updated == ["e0"]
        assert counting.joins == 1  # every bucket was drained by the engine: the group survived
    assert list(daemon.client.weight_digest().values()) == [scenarios.hf_digest(checkpoint_state(model), True)]


# ------------------------------------------------------------------ ZeRO-3 under torchrun


def run_zero3(daemon: Daemon, model: Path, out: Path, nproc: int, run_torchrun: Any) -> list[dict]:
    v = daemon.next_version()
    run_torchrun([str(HERE / "weight_sync_scenarios.py"), "--model", str(model), "--endpoint", daemon.endpoint,
                  "--version", str(v), "--out", str(out)], nproc=nproc)
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
    main = results[0]
    assert main["world"] == nproc
    for name in ("bucketed", "next_version", "per_tensor", "inline"):
        r = main[name]
        assert r["report"]["version"] == r["version"] and r["report"]["updated"] == ["e0"], name
        assert r["gap"] <= TOL and r["digest_ok"], name
        # when the engine got the update, started and ended its load, checked the canary: in
        # order, within the sync (wall clock against the sync's own timer: a little slack)
        stamps = r["report"]["engine_seconds"]["e0"]
        times = [stamps[k] for k in ("called", "loading", "loaded", "done")]
        assert times == sorted(times) and times[0] >= -0.05 and times[-1] <= r["report"]["seconds"] + 0.05, name
    assert main["bucketed"]["report"]["buckets"] > 1 and main["per_tensor"]["report"]["buckets"] == 26
    assert main["inline"]["version"] == v + 3
    assert main["after_wrong"] == v + 3  # the refused version changed nothing
    assert main["lora"]["gap"] <= TOL and main["lora"]["version"] == v + 5
    assert main["lora"]["digest_ok"]  # the ZeRO-3 LoRA export (merged) holds exactly what the engine loaded
    for r in results:  # every rank took the same branch
        assert r["same_version"] == "BadRequest" and r["wrong_dtype"] == "WeightMismatch"  # its own wire code now
        assert r["bucketed"]["report"]["tensors"] == 26
    return results


def test_zero3_two_ranks_send_intact_weights(daemon, model_b, tmp_path, run_torchrun):
    results = run_zero3(daemon, model_b, tmp_path, 2, run_torchrun)
    assert results[1]["bucketed"]["report"]["updated"] == []  # only rank 0 talks to the daemon
    assert results[1]["bucketed"]["report"]["engine_seconds"] == {}


@pytest.mark.slow
def test_zero3_one_rank_sends_intact_weights(daemon, model_b, tmp_path, run_torchrun):
    run_zero3(daemon, model_b, tmp_path, 1, run_torchrun)


def test_a_broadcast_whose_client_is_closed_answers_with_the_error_at_once():
    from treadle.common.errors import ServiceClosed
    from treadle.common.records import CollectiveWeights
    from treadle.trainer.weights.collective import _Broadcast
    from treadle.trainer.weights.outcome import Rank

    class Closed:  # the rollout client after close(): submit refuses
        def submit(self, *args: Any, **kwargs: Any) -> Any:
            raise ServiceClosed("the event-loop thread has stopped")

    rank = Rank(zero3=False, main=True, client=Closed(), device=torch.device("cpu"), mode="wait")
    update = CollectiveWeights(version=1, names=["w"], dtypes=["uint8"], shapes=[[4]], bucket_sizes=[1])
    b = _Broadcast(rank, update, None, [torch.zeros(4, dtype=torch.uint8)], None)
    assert not b.wait_accepted()  # answered without accepting: nothing is broadcast
    answer, err = b.result()
    assert answer == {} and isinstance(err, ServiceClosed) and b.free() is None
