"""``--engine_placement ray``: the daemon's engines as Ray actors, on a Ray cluster the daemon starts.

A real daemon (``treadle-rollout serve --engine_placement ray --ray.address local``, two hf
engines on tiny model "a"): each engine is a worker under an ``EngineActor`` in a placement
group of its own, serving tcp with CURVE keys the daemon made. The test updates the weights to
model "b", then SIGKILLs one engine's Ray actor (what a lost node does to it) while 256
requests are in flight: every sample arrives exactly once, and the slot comes back under a new
actor at version 1, with bit-identical weights. The several-node version (a node removed, a node
added) is in ``integration/tests/test_ray_multinode.py``.
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import tempfile

import numpy as np
import psutil
import pytest

from treadle.common.records import InlineWeights, SamplingParams

pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_daemon(aio, models, tools, monkeypatch_module):
    from .conftest import _daemon

    tmp = tempfile.mkdtemp(prefix="trd", dir="/tmp")  # Ray's socket paths must stay short
    monkeypatch_module.setenv("RAY_TMPDIR", tmp)
    monkeypatch_module.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch_module.setenv("RAY_AUTH_MODE", "disabled")
    d = _daemon("ray", ["--model", str(models["a"]), "--engines", "2", "--backend", "hf", "--route_timeout_s", "120",
                        "--health_interval_s", "1", "--engine_placement", "ray", "--ray.address", "local",
                        "--start_timeout_s", "120"], aio, tools, 2)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_engines_are_ray_actors_and_a_dead_actor_loses_no_sample(ray_daemon, aio, models, ref, tools):
    b = tools.checkpoint(models["b"])
    update = InlineWeights(version=1, names=list(b), dtypes=["float32"] * len(b),
                           shapes=[list(t.shape) for t in b.values()], tensors=list(b.values()))
    report = ray_daemon.call(aio, lambda rc: rc.update_weights(update))
    assert report["version"] == 1 and sorted(report["updated"]) == ["e0", "e1"]

    async def scenario(rc):
        before = {e["engine_id"]: e for e in (await rc.stats())["engines"]}
        delivered = collections.Counter()

        async def one(i):
            got = []
            async for r in rc.stream(np.array([7, 8, 9 + i % 300], dtype=np.int32),
                                     SamplingParams(n=1 + (i % 4 == 0), max_tokens=24, seed=i), key=f"q{i}"):
                got.append(r)
                delivered["n"] += 1
            return got

        tasks = [asyncio.create_task(one(i)) for i in range(256)]
        while delivered["n"] < 32:
            await asyncio.sleep(0.005)
        actor = psutil.Process(before["e0"]["pid"]).parent()  # the worker's parent: its EngineActor
        assert "ray" in " ".join(actor.cmdline()).lower() or actor.name().startswith("ray"), actor.cmdline()
        os.kill(actor.pid, signal.SIGKILL)
        results = await asyncio.gather(*tasks)
        await rc.wait_ready(120, engines=2)
        return before, results, await rc.stats(), await rc.weight_digest()

    before, results, stats, digests = ray_daemon.call(aio, scenario, timeout=300)
    # The workers serve tcp on their node's address (not the daemon's ipc folder), reported per engine.
    assert all(e["node"] not in ("", "local") for e in before.values()), before
    for i, res in enumerate(results):
        assert sorted(r.index for r in res) == list(range(1 + (i % 4 == 0))), (i, [r.index for r in res])
        assert all(r.key == f"q{i}" and r.weight_version == 1 for r in res)
    assert stats["failovers"] > 0, "the kill landed after the batch: nothing was failed over"
    e0 = next(e for e in stats["engines"] if e["engine_id"] == "e0")
    assert e0["restarts"] == 1 and e0["pid"] != before["e0"]["pid"]
    assert {e["state"] for e in stats["engines"]} == {"ready"} and {e["version"] for e in stats["engines"]} == {1}
    assert len(digests) == 2 and len(set(digests.values())) == 1  # the restarted engine caught up bit for bit


def test_an_engine_dying_mid_broadcast_does_not_hold_the_update_for_the_groups_timeout(ray_daemon, aio, models,
                                                                                       tools):
    """A gloo collective update to e0 (rank 1), e1 (rank 2) and the keeper (rank 3): gloo's tree
    has rank 1 relay the buckets to rank 3. e0 is killed after the daemon accepted the update
    and before the sender broadcasts: the ranks it starves are given up on after the grace
    (killed, or for the keeper dropped), so the update answers long before the group's 120 s
    timeout; the pool then comes back whole, and a rejoined group takes the next version."""
    import time

    from treadle.common.errors import EngineDead
    from treadle.common.records import CollectiveWeights
    from treadle.common.weights import WeightGroup, plan_buckets

    a = tools.checkpoint(models["a"])
    header = {"names": list(a), "dtypes": ["float32"] * len(a), "shapes": [list(t.shape) for t in a.values()]}
    sizes = plan_buckets([t.numel() * 4 for t in a.values()], 64 << 10)

    async def join(rc):
        return await rc.join_weight_group(_node_ip(), tools.free_port(), timeout_s=120, sender=WeightGroup)

    def broadcast(group, before=None):
        if before is not None:
            before()
        try:
            tools.send_buckets(group, list(a.values()), sizes)
        except Exception as e:  # a dead peer may fail the sender's sends: the daemon must still answer
            return e
        return None

    joined, group = ray_daemon.call(aio, join)
    assert joined["members"] == {"e0": 1, "e1": 2} and joined["keeper_rank"] == 3
    stats = ray_daemon.call(aio, lambda rc: rc.stats())
    version = stats["version"] + 1
    e0_pid = next(e["pid"] for e in stats["engines"] if e["engine_id"] == "e0")

    def kill_e0():
        os.kill(e0_pid, signal.SIGKILL)
        time.sleep(1.0)

    async def push(rc, v, before=None):
        upd = CollectiveWeights(version=v, **header, bucket_sizes=sizes, group=group.spec)
        return await rc.update_weights(upd, send=lambda: broadcast(group, before), timeout=300)

    start = time.monotonic()
    try:
        report = ray_daemon.call(aio, lambda rc: push(rc, version, kill_e0), timeout=300)
    except EngineDead as e:  # every member was lost: e0 killed, e1 starved and killed
        report = {"error": str(e)}
    answered = time.monotonic() - start
    group.close()
    print(f"update with e0 killed mid-broadcast answered in {answered:.1f} s: {report}")
    assert answered < 60, f"the update waited {answered:.0f} s: the starved ranks were not given up on"
    assert "e0" not in report.get("updated", [])

    async def back(rc):
        await rc.wait_ready(120, engines=2)
        return await rc.stats()

    stats = ray_daemon.call(aio, back, timeout=150)
    assert {e["state"] for e in stats["engines"]} == {"ready"}
    joined, group = ray_daemon.call(aio, join)
    report = ray_daemon.call(aio, lambda rc: push(rc, stats["version"] + 1))
    group.close()
    assert sorted(report["updated"]) == ["e0", "e1"]
    digests = ray_daemon.call(aio, lambda rc: rc.weight_digest())
    assert len(set(digests.values())) == 1


def _node_ip() -> str:
    """This machine's address as Ray sees it (the engines serve and join there, off loopback)."""
    import ray

    return ray.util.get_node_ip_address()


def test_engines_on_two_nodes_take_collective_updates_through_one_relay_per_node(aio, models, tools):
    """Four hf engines on a Ray cluster of two nodes (``ray.cluster_utils.Cluster``, 2 CPUs each,
    so two engines a node): the weight group the daemon builds has one relay per node in the
    sender's group (sender + 2 relays + the keeper: 4 ranks, not 6), each passing the buckets on
    to its node's other engine; every engine ends with bit-identical weights, model "b"'s."""
    from ray.cluster_utils import Cluster

    from treadle.common.records import CollectiveWeights
    from treadle.common.weights import WeightGroup, plan_buckets

    from .conftest import _daemon

    tmp = tempfile.mkdtemp(prefix="trc", dir="/tmp")
    with pytest.MonkeyPatch.context() as mp:
        for name, value in (("RAY_TMPDIR", tmp), ("RAY_USAGE_STATS_ENABLED", "0"), ("RAY_AUTH_MODE", "disabled")):
            mp.setenv(name, value)
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
        d = None
        try:
            cluster.add_node(num_cpus=2)
            d = _daemon("ray4", ["--model", str(models["a"]), "--engines", "4", "--backend", "hf",
                                 "--engine_placement", "ray", "--ray.address", cluster.address,
                                 "--start_timeout_s", "120"], aio, tools, 4)
            b = tools.checkpoint(models["b"])
            header = {"names": list(b), "dtypes": ["float32"] * len(b), "shapes": [list(t.shape) for t in b.values()]}
            sizes = plan_buckets([t.numel() * 4 for t in b.values()], 64 << 10)

            async def sync(rc):
                before = await rc.weight_digest()
                joined, group = await rc.join_weight_group(_node_ip(), tools.free_port(), timeout_s=60,
                                                           sender=WeightGroup)
                upd = CollectiveWeights(version=1, **header, bucket_sizes=sizes, group=group.spec)
                report = await rc.update_weights(upd, send=lambda: tools.send_buckets(group, list(b.values()), sizes))
                stats = await rc.stats()
                digests = await rc.weight_digest()
                await rc.leave_weight_group()
                group.close()
                return before, joined, report, stats, digests

            before, joined, report, stats, digests = d.call(aio, sync, timeout=200)
        finally:
            if d is not None:
                d.stop()
            cluster.shutdown()
    nodes = {e["engine_id"]: e["node"] for e in stats["engines"]}
    relays = stats["weight_group"]["relays"]
    assert len(set(nodes.values())) == 2 and len(relays) == 2, (nodes, relays)
    assert all(len(ids) == 2 and len({nodes[i] for i in ids}) == 1 for ids in relays.values())  # per node
    assert joined["world_size"] == 4 and joined["keeper_rank"] == 3  # sender + one relay a node + keeper
    assert sorted(report["updated"]) == ["e0", "e1", "e2", "e3"]
    assert len(set(digests.values())) == 1 and len(digests) == 4
    assert set(digests.values()) != set(before.values())  # changed: model "b"'s, not "a"'s any more
