"""The daemon's pure parts, without processes: failover bookkeeping, placement, config, errors,
the command line's flag set, and the client's import weight."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import numpy as np
import pytest

from treadle.common.config import ConfigError, flag_names, parse
from treadle.common.errors import (
    BadRequest,
    CanaryMismatch,
    EngineDead,
    EnginesQuarantined,
    InternalError,
    NoEngine,
    NoWeightGroup,
    WeightGroupStale,
    WeightMismatch,
)
from treadle.common.records import GenerateRequest, GenerateResult, SamplingParams
from treadle.rollout import dispatch
from treadle.rollout.config import EngineOptions, ScaleConfig, ServeConfig, engine_fields, placement

# ------------------------------------------------------------------------------ failover


class FakeEngine:
    """A handle whose ``generate`` stream follows a script: yield some samples, then maybe die."""

    def __init__(self, engine_id, script):
        self.engine_id, self.script = engine_id, script
        self.load, self.parts, self.seen = 0, set(), []

    async def _gen(self, sub):
        self.seen.append(sub)
        for step in self.script(sub):
            if isinstance(step, BaseException):
                raise step
            await asyncio.sleep(0)
            yield GenerateResult(response_token_ids=np.array([step], dtype=np.int32), index=step,
                                 key=sub.key, engine_id=self.engine_id)

    def stream(self, method, sub):
        assert method == "generate"
        return self._gen(sub)


class FakeRouter:
    def __init__(self, *engines):
        self.queue, self.failed, self.failovers = list(engines), [], 0

    async def pick(self, n, min_version):
        h = self.queue[0] if len(self.queue) == 1 else self.queue.pop(0)
        h.load += n
        return h

    def engine_failed(self, handle, exc):
        self.failed.append(handle.engine_id)

    def note_failover(self, samples):
        self.failovers += samples


def run_job(req, router, max_retries=3):
    async def go():
        return [r async for r in dispatch.generate(req, router, max_retries)]

    return asyncio.run(go())


REQ = GenerateRequest(prompt_token_ids=np.array([1, 2, 3], dtype=np.int32),
                      sampling=SamplingParams(n=4, seed=10, max_tokens=4), key="job")


def test_failover_keeps_delivered_samples_and_regenerates_the_rest_with_shifted_seeds():
    # e0 sends samples 0 and 2 (and 2 again), then reports itself dead; e1 serves the rest.
    dying = FakeEngine("e0", lambda sub: [0, 2, 2, EngineDead("gone")])
    spare = FakeEngine("e1", lambda sub: [0])
    router = FakeRouter(dying, spare)
    out = run_job(REQ, router)
    assert sorted(r.index for r in out) == [0, 1, 2, 3]  # each once, the duplicate 2 dropped
    assert all(r.key == "job" for r in out)
    assert [(s.sampling.n, s.sampling.seed) for s in spare.seen] == [(1, 11), (1, 13)]  # s + i
    assert {r.index: r.engine_id for r in out} == {0: "e0", 2: "e0", 1: "e1", 3: "e1"}
    assert router.failed == ["e0"] and router.failovers == 2
    assert dying.load == 0 and spare.load == 0 and not dying.parts and not spare.parts


def test_unseeded_requests_stay_unseeded_on_failover():
    sub = dispatch.single_sample(GenerateRequest(prompt_token_ids=np.array([1]), sampling=SamplingParams(n=3)), 2)
    assert (sub.sampling.n, sub.sampling.seed) == (1, None)


def test_failover_gives_up_after_max_retries():
    always_dying = FakeEngine("e0", lambda sub: [EngineDead("gone")])
    with pytest.raises(EngineDead, match="max_retries 2"):
        run_job(REQ, FakeRouter(always_dying), max_retries=2)


def test_a_bad_request_is_not_failed_over():
    refusing = FakeEngine("e0", lambda sub: [BadRequest("prompt too long")])
    router = FakeRouter(refusing)
    with pytest.raises(BadRequest, match="too long"):
        run_job(REQ, router)
    assert router.failovers == 0 and router.failed == []


def test_an_engine_that_ends_early_is_an_internal_error():
    with pytest.raises(InternalError, match=r"without samples \[1, 3\]"):
        run_job(REQ, FakeRouter(FakeEngine("e0", lambda sub: [0, 2])))


# ------------------------------------------------------------------------------ placement / config


def test_placement_gives_each_engine_its_own_cores_when_there_are_enough():
    cores = [0, 1, 2, 3]
    assert [placement(k, 2, 1, cores).cpus for k in range(2)] == [(0, 1), (2, 3)]
    assert [placement(k, 2, 1, cores).cpu_bind for k in range(2)] == ["0,1", "2,3"]
    tp = [placement(k, 2, 2, cores) for k in range(2)]
    assert [(p.cpu_bind, p.threads_per_rank) for p in tp] == [("0|1", 1), ("2|3", 1)]


def test_placement_shares_cores_round_robin_when_there_are_too_few():
    assert [placement(k, 3, 1, [0, 1]).cpus for k in range(3)] == [(0,), (1,), (0,)]
    assert placement(0, 1, 1, [0, 1]).cpus == (0, 1)
    assert placement(1, 2, 1, [0, 1], gpu_ids=(0, 1, 2, 3)).gpus == (1,)
    assert placement(1, 2, 2, [], gpu_ids=(0, 1, 2, 3)).gpus == (2, 3)
    unbound = placement(0, 2, 1, [0, 1], bind=False)
    assert (unbound.cpus, unbound.cpu_bind) == ((), None)


def test_engine_fields_fit_each_backends_config():
    from treadle.rollout.engine.hf_engine import HfEngineConfig
    from treadle.rollout.worker import engine_config

    where = placement(1, 2, 1, [0, 1])
    cfg = ServeConfig(model="/m", engines=2, backend="hf", engine=EngineOptions(eos_token_ids=(2,)))
    hf = engine_config("hf", engine_fields(cfg, "e1", where))
    assert isinstance(hf, HfEngineConfig) and (hf.engine_id, hf.dtype, hf.eos_token_ids) == ("e1", "float32", (2,))
    vllm = engine_fields(ServeConfig(model="/m", engines=2, tensor_parallel_size=1), "e1", where)
    assert (vllm["cpu_threads_bind"], vllm["omp_num_threads"], vllm["multiprocess"]) == ("1", 1, False)


@pytest.mark.parametrize("flags,needle", [
    ([], "--model is required"),
    (["--model", "m", "--engines", "0"], "--engines must be >= 1"),
    (["--model", "m", "--backend", "hf", "--tensor-parallel-size", "2"], "--backend hf"),
    (["--model", "m", "--engine.max_model_len", "1"], "--engine.max_model_len"),
    (["--model", "m", "--engine.max_lora_rank", "4"], "--engine.max_lora_rank must be one of"),
    (["--model", "m", "--metrics_port", "9", "--metrics_host", "0.0.0.0"], "pass --metrics_open"),
    (["--model", "m", "--engine_placement", "ray", "--gpu_ids", "0"], "--engine_placement ray: --gpu_ids place"),
    (["--model", "m", "--engine_placement", "ray", "--cpus", "0", "--no_cpu_bind"], "--cpus, --no_cpu_bind place"),
    (["--model", "m", "--ray.num_gpus_per_rank", "1"], "give --engine_placement ray"),
    (["--model", "m", "--engine_placement", "ray", "--ray.node_labels", "role"], "each label is KEY=VALUE"),
    (["--model", "m", "--engine_placement", "ray", "--ray.num_cpus_per_rank", "0"], "--ray.num_cpus_per_rank must be > 0"),
    (["--model", "m", "--engine_placement", "ray", "--ray.colocate", "a:0"], "--ray.colocate 'a:0': each item is"),
    (["--model", "m", "--engine_placement", "ray", "--engines", "2", "--ray.colocate", "0"],
     "--ray.colocate gives 1 places for --engines 2"),
    (["--model", "m", "--engine_placement", "ray", "--ray.colocate", "0:0,1"], "an engine needs 1 GPU"),
    (["--model", "m", "--engine_placement", "ray", "--ray.colocate", "0:0", "--ray.num_gpus_per_rank", "1"],
     "cannot go with it"),
])
def test_serve_config_refuses_bad_values_naming_the_flag(flags, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        parse(ServeConfig, flags)


def test_a_ray_engine_bundle_is_its_ranks_resources():
    cfg = parse(ServeConfig, ["--model", "m", "--engine_placement", "ray", "--tensor_parallel_size", "2",
                              "--ray.num_gpus_per_rank", "1", "--ray.num_cpus_per_rank", "2"])
    assert cfg.ray.bundle(cfg.ranks_per_engine) == {"CPU": 4.0, "GPU": 2.0}
    assert parse(ServeConfig, ["--model", "m", "--engine_placement", "ray"]).ray.bundle(1) == {"CPU": 1.0}


def test_colocated_ray_engines_name_a_bundle_and_gpus_each():
    cfg = parse(ServeConfig, ["--model", "m", "--engine_placement", "ray", "--engines", "3", "--tensor_parallel_size",
                              "2", "--ray.colocate", "0:0,1", "0:2,3", "1:0,1"])
    assert [(s.bundle, s.gpus) for s in cfg.ray.slots()] == [(0, ("0", "1")), (0, ("2", "3")), (1, ("0", "1"))]
    cpu = parse(ServeConfig, ["--model", "m", "--engine_placement", "ray", "--engines", "2", "--ray.colocate", "0", "1"])
    assert [(s.bundle, s.gpus) for s in cpu.ray.slots()] == [(0, ()), (1, ())]
    pytest.importorskip("ray")
    from treadle.rollout.ray_engines import own_group

    assert own_group(cpu.ray.__class__()) is None  # engines in placement groups of their own
    with pytest.raises(ConfigError, match="it runs in none"):  # a daemon started by hand, not in a Ray actor
        own_group(cpu.ray)


def test_admission_is_sized_from_the_pool_unless_given():
    """96 vLLM engines of 256 sequences run 24,576 at once: admission is twice that, not a fixed
    8192 that held them at a third; a small pool keeps 8192; a given limit stands."""
    big = parse(ServeConfig, ["--model", "m", "--engines", "96"])
    assert big.admission_limit == 2 * 96 * 256
    assert parse(ServeConfig, ["--model", "m", "--engines", "2", "--backend", "hf"]).admission_limit == 8192
    assert parse(ServeConfig, ["--model", "m", "--engines", "96", "--max_in_flight_samples", "10"]).admission_limit == 10
    with pytest.raises(ConfigError, match="--max_in_flight_samples must be >= 1"):
        parse(ServeConfig, ["--model", "m", "--max_in_flight_samples", "0"])


def test_open_metrics_need_the_explicit_flag():
    cfg = parse(ServeConfig, ["--model", "m", "--metrics_port", "9", "--metrics_host", "0.0.0.0", "--metrics_open"])
    assert (cfg.metrics_host, cfg.metrics_open) == ("0.0.0.0", True)
    assert parse(ServeConfig, ["--model", "m", "--metrics_host", "0.0.0.0"]).metrics_port is None  # metrics off


def test_issue_spelling_of_the_serve_flags_parses():
    cfg = parse(ServeConfig, ["--model", "m", "--engines", "3", "--tensor-parallel-size", "2", "--backend", "vllm"])
    assert (cfg.engines, cfg.tensor_parallel_size, cfg.ranks_per_engine, cfg.backend) == (3, 2, 2, "vllm")
    assert parse(ScaleConfig, ["--engines", "4"]).engines == 4


SERVE_FLAGS = [
    "--backend", "--config", "--cpu_bind", "--cpus", "--curve_dir", "--drain_timeout_s", "--endpoint", "--engine.device",
    "--engine.dtype", "--engine.enable_prefix_caching", "--engine.enable_sleep_mode", "--engine.enforce_eager",
    "--engine.eos_token_ids", "--engine.gpu_memory_utilization", "--engine.kv_cache_memory_bytes",
    "--engine.max_batch_samples", "--engine.max_lora_rank", "--engine.max_model_len", "--engine.max_num_seqs",
    "--engine.multiprocess",
    "--engine.no_enable_prefix_caching", "--engine.no_enable_sleep_mode", "--engine.no_enforce_eager",
    "--engine.no_multiprocess", "--engine.seed", "--engine_placement", "--engines", "--exit_with_pid", "--gpu_ids", "--health_interval_s",
    "--health_timeout_s", "--help", "--keep_weights", "--max_in_flight_samples", "--max_restarts",
    "--max_retries", "--metrics_host", "--metrics_open", "--metrics_port", "--model", "--no_cpu_bind", "--no_keep_weights", "--no_metrics_open",
    "--pipeline_parallel_size", "--ray.address", "--ray.colocate", "--ray.node_labels", "--ray.num_cpus_per_rank",
    "--ray.num_gpus_per_rank", "--route_timeout_s", "--run_dir", "--start_timeout_s", "--tensor_parallel_size", "-h",
]


def test_the_serve_flag_set_is_pinned():
    assert flag_names(ServeConfig) == SERVE_FLAGS


def test_the_cli_refuses_unknown_commands_and_bad_flags():
    run = [sys.executable, "-m", "treadle.rollout"]
    unknown = subprocess.run([*run, "launch"], capture_output=True, text=True)
    assert unknown.returncode == 2 and "unknown command" in unknown.stderr
    bad = subprocess.run([*run, "serve", "--engines", "2"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--model is required" in bad.stderr
    # A non-loopback address without CURVE keys is refused before any engine starts, naming the flag.
    exposed = subprocess.run([*run, "serve", "--model", "/nonexistent", "--endpoint", "tcp://0.0.0.0:5999"],
                             capture_output=True, text=True, timeout=60)
    assert exposed.returncode == 2 and "without --curve_dir" in exposed.stderr


# ------------------------------------------------------------------------------ errors / client


def test_rollout_errors_survive_the_wire_as_their_own_classes():
    from treadle.common.errors import error_for

    for cls in (WeightGroupStale, NoWeightGroup, EnginesQuarantined, CanaryMismatch, WeightMismatch, NoEngine):
        sent = cls("details")
        back = error_for(sent.code, sent.message, sent.retryable)
        assert type(back) is cls and back.message == sent.message
    plain = error_for("bad_request", "weight group is stale: a message naming another error's words")
    assert type(plain) is BadRequest  # recognised by code, never by message


def test_the_client_imports_no_torch_vllm_or_transformers():
    code = ("import sys, treadle.rollout.client; "
            "print(sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------------------ request checks


@pytest.mark.parametrize("level", ["x", "2", 1.5, 2.0, True, None, [1], 7, 0])
def test_sleep_with_a_bad_level_is_a_bad_request_naming_it(level, tmp_path):
    from treadle.common.records import Control
    from treadle.rollout.server import RolloutServer

    server = RolloutServer(parse(ServeConfig, ["--model", "m", "--run_dir", str(tmp_path)]))
    with pytest.raises(BadRequest, match=r"integer level, got level=") as e:
        asyncio.run(server.sleep(Control(op="sleep", args={"level": level}), None))
    assert repr(level) in str(e.value) and server.pool.sleeping == 0  # refused before anything changed


def test_the_weight_group_relays_per_node_only_when_engines_span_nodes():
    from treadle.common.records import WeightGroupSpec
    from treadle.rollout.updates import relay_layout

    flat = relay_layout([("e0", "local"), ("e1", "local"), ("e2", "local")], 1)  # one node: nothing to save
    assert (flat.ranks, flat.relays, flat.world_size) == ({"e0": 1, "e1": 2, "e2": 3}, {}, 4)
    two = relay_layout([("e0", "a"), ("e1", "b"), ("e2", "a"), ("e3", "a"), ("e4", "b"), ("e5", "c")], 1)
    assert two.relays == {"relay/a": ("e0", "e2", "e3"), "relay/b": ("e1", "e4")}
    assert two.ranks == {"e0": 1, "e1": 2, "e2": 1, "e3": 2, "e4": 1, "e5": 3} and two.world_size == 4
    top = WeightGroupSpec(host="h", port=9, world_size=5, rank=0)  # + the keeper
    relay, follower, alone = (two.spec_of(e, top) for e in ("e0", "e3", "e5"))
    assert (relay.rank, relay.relay_prefix, relay.relay_size, relay.prefix) == (1, "relay/a", 3, "")
    assert (follower.rank, follower.world_size, follower.prefix, follower.relay_prefix) == (2, 3, "relay/a", "")
    assert (alone.rank, alone.world_size, alone.prefix) == (3, 5, "")
    # two workers an engine: a relay's worker 0 alone is in the sender's group, its worker 1 is
    # rank 1 of the node's group, the node's next engine ranks 2-3; e2, alone on b, relays to its worker 1
    tp2 = relay_layout([("e0", "a"), ("e1", "a"), ("e2", "b")], 2)
    assert tp2.relays == {"relay/a": ("e0", "e1"), "relay/b": ("e2",)}
    assert (tp2.ranks, tp2.world_size) == ({"e0": 1, "e1": 2, "e2": 2}, 3)
    top = WeightGroupSpec(host="h", port=9, world_size=3, rank=0)
    relay, follower = tp2.spec_of("e0", top), tp2.spec_of("e1", top)
    assert (relay.rank, relay.relay_size) == (1, 4) and (follower.rank, follower.world_size) == (2, 4)
    from treadle.common.weights import worker_spec

    w1 = worker_spec(relay, 1)  # the relay engine's second worker: rank 1 of the node's group
    assert (w1.prefix, w1.rank, w1.world_size, w1.relay_prefix) == ("relay/a", 1, 4, "")
    assert worker_spec(follower, 1).rank == 3 and worker_spec(top.with_rank(1), 1).rank == 2
    assert relay_layout([("e0", "a"), ("e1", "a")], 2).relays == {}  # one node: flat


def test_status_names_each_engines_node():
    from treadle.rollout.cli import format_status

    engine = {"engine_id": "e0", "state": "ready", "pid": 7, "version": 3, "load": 0, "running": 0, "tokens_per_s": 0.0,
              "reason": "", "node": "85a85821a82d586e1aaccc8c9b4b5ecc7d54"}
    stats = {"version": 3, "engines_ready": 1, "engines": [engine], "in_flight": 0, "queue_depth": 0,
             "tokens_per_s": 0.0, "failovers": 0, "restarts": 0}
    table = format_status({"health": {"status": "ok"}, "stats": stats})
    assert "node" in table.splitlines()[1] and "85a85821a82d " in table.splitlines()[2]
