"""Direct weight updates (``RolloutClient.update_weights(direct=True)``) against a real daemon of
two hf engines (``direct_daemon``): the update goes to each engine's worker and the front end
books it afterwards; a stale version is refused by the engines and books nothing; a killed and
restarted engine is reached, and the route read again after the daemon says it is stale; a
canary failure quarantines as a relayed update's does; relayed updates still work in between.

Inline updates stand in for cuda_ipc ones (which a CPU engine refuses): the path is the same.
"""

from __future__ import annotations

import os
import signal

import numpy as np

from treadle.common.errors import BadRequest
from treadle.common.records import WeightUpdate
from treadle.rollout.client import EnginesQuarantined
from treadle.rollout.direct import is_local, reachable

PROMPT = np.array([5, 6, 7, 8, 9, 10, 11], dtype=np.int32)
TOL = 1e-4


def _update(weights, version, **kw) -> WeightUpdate:
    return WeightUpdate(version=version, names=list(weights), dtypes=["float32"] * len(weights),
                        shapes=[list(t.shape) for t in weights.values()], tensors=list(weights.values()), **kw)


def _states(stats) -> dict[str, tuple[str, int]]:
    return {e["engine_id"]: (e["state"], e["version"]) for e in stats["engines"]}


def test_local_endpoints_and_reachable_workers():
    assert is_local("ipc:///tmp/x.sock") and is_local("tcp://127.0.0.1:5570") and is_local("tcp://localhost:1")
    assert not is_local("tcp://10.0.0.1:5570") and not is_local("inproc://x")
    assert not reachable("ipc:///nonexistent/treadle/e0.sock") and reachable("tcp://127.0.0.1:1")


def test_direct_updates_reach_every_engine_and_the_daemon_books_them(direct_daemon, aio, models, ref, tools):
    a, b = tools.checkpoint(models["a"]), tools.checkpoint(models["b"])

    async def scenario(rc):
        first = await rc.update_weights(_update(b, 1), direct=True)
        route = rc._direct
        after_first = await rc.stats()  # waits for the booking
        greedy = (await rc.generate(PROMPT, None, min_version=1))[0]
        second = await rc.update_weights(_update(a, 2), direct=True)
        try:
            await rc.update_weights(_update(b, 2), direct=True)  # not newer: both engines refuse
            refused = None
        except BadRequest as e:
            refused = e
        return first, route, after_first, greedy, second, rc._direct, refused, await rc.stats(), await rc.weight_digest()

    first, route, after_first, greedy, second, route2, refused, stats, digests = direct_daemon.call(aio, scenario)
    assert first["direct"] and sorted(first["updated"]) == ["e0", "e1"] and first["version"] == 1
    assert all(list(first["loads"][e])[:3] == ["begun", "sent", "called"]
               and first["loads"][e]["begun"] <= first["loads"][e]["sent"] <= first["loads"][e]["called"]
               <= first["loads"][e]["done"] for e in ("e0", "e1"))
    assert after_first["version"] == 1 and set(_states(after_first).values()) == {("ready", 1)}
    assert greedy.weight_version == 1
    assert np.abs(tools.logprobs(ref["b"], PROMPT, greedy.response_token_ids, temperature=0.0)
                  - greedy.logprobs).max() <= TOL
    assert second["direct"] and second["version"] == 2 and route2 is route  # the route is kept
    assert refused is not None and "not newer" in str(refused)
    assert stats["version"] == 2 and set(_states(stats).values()) == {("ready", 2)}
    assert len(set(digests.values())) == 1


def test_a_restarted_engine_is_reached_and_the_route_read_again(direct_daemon, aio, models, ref, tools):
    """Runs after the test above (version 2, model a). The killed engine comes back on the
    checkpoint (version 0: the daemon kept no weights from a direct update), behind; the next
    direct update reaches it, through the old route (its worker serves on the same endpoint;
    the daemon then answers that the route is stale, and the one after reads it again) or
    through one read again when the old one's connection to it was still down."""
    import asyncio

    b = tools.checkpoint(models["b"])

    async def scenario(rc):
        await rc.update_weights(_update(b, 3), direct=True)
        route = rc._direct
        pid = {e["engine_id"]: e["pid"] for e in (await rc.stats())["engines"]}["e0"]
        os.kill(pid, signal.SIGKILL)
        while True:
            engines = {e["engine_id"]: e for e in (await rc.stats())["engines"]}
            if engines["e0"]["pid"] != pid and engines["e0"]["state"] in ("ready", "behind"):
                break
            await asyncio.sleep(0.2)
        behind = _states(await rc.stats())
        report = await rc.update_weights(_update(b, 4), direct=True)
        used = rc._direct  # the route this update went by (its booking has not run yet)
        booked = _states(await rc.stats())  # waits for the booking
        dropped = rc._direct is None
        again = await rc.update_weights(_update(b, 5), direct=True)
        relayed = await rc.update_weights(_update(b, 6))  # relayed, after direct ones
        return route, used, dropped, rc._direct, behind, report, booked, again, relayed, await rc.stats(), \
            await rc.weight_digest()

    route, used, dropped, route2, behind, report, booked, again, relayed, stats, digests = \
        direct_daemon.call(aio, scenario, timeout=240)
    assert behind["e0"] == ("behind", 0) and behind["e1"] == ("ready", 3)
    assert report["direct"] and sorted(report["updated"]) == ["e0", "e1"]
    assert set(booked.values()) == {("ready", 4)}
    # the old route (its connection to e0 back up by then): the booking says stale, the route is
    # dropped; or a route read again (e0's connection was still down): kept
    assert (used is route and dropped) or (used is not route and not dropped), (used is route, dropped)
    assert again["direct"] and sorted(again["updated"]) == ["e0", "e1"] and route2 is not None and route2 is not route
    assert "direct" not in relayed and sorted(relayed["updated"]) == ["e0", "e1"]
    assert stats["version"] == 6 and set(_states(stats).values()) == {("ready", 6)}
    assert len(set(digests.values())) == 1


def test_a_canary_failure_on_a_direct_update_quarantines_until_a_good_one(direct_daemon, aio, models, ref, tools):
    """Runs after the tests above (version 6, model b)."""
    a = tools.checkpoint(models["a"])
    canary = np.arange(40, 60, dtype=np.int32)
    wrong = tools.prompt_logprobs(ref["b"], canary).astype(np.float32)  # the engines will hold model a

    async def scenario(rc):
        try:
            await rc.update_weights(_update(a, 7, canary_token_ids=canary, canary_logprobs=wrong,
                                            canary_tolerance=1e-4), direct=True)
            raised = None
        except EnginesQuarantined as e:
            raised = e
        quarantined = _states(await rc.stats())
        right = tools.prompt_logprobs(ref["a"], canary).astype(np.float32)
        report = await rc.update_weights(_update(a, 8, canary_token_ids=canary, canary_logprobs=right,
                                                 canary_tolerance=1e-4), direct=True)
        return raised, quarantined, report, await rc.stats()

    raised, quarantined, report, stats = direct_daemon.call(aio, scenario, timeout=120)
    assert raised is not None and "e0" in str(raised) and "e1" in str(raised)
    assert {s for s, _ in quarantined.values()} == {"quarantined"}
    assert sorted(report["updated"]) == ["e0", "e1"]
    assert stats["version"] == 8 and set(_states(stats).values()) == {("ready", 8)}


def test_engines_that_keep_a_named_header_are_sent_updates_without_it(direct_daemon, aio, models, ref, tools):
    """Runs after the tests above (version 8, model a). An update that names its header
    (``header_id``) goes whole the first time; each engine answers that it keeps it, and the next
    update naming it goes without it (``header_kept``; the route's clients are watched). An
    engine the client wrongly believes to keep a header refuses (``HeaderUnknown``) before
    touching anything and is sent the whole update at once. A short update whose tensors do not
    fit the kept header is refused, and so is one sent through the front end (which relays and
    keeps whole updates); the engines keep serving their version."""
    from treadle.rollout.direct import _without_header

    a, b = tools.checkpoint(models["a"]), tools.checkpoint(models["b"])

    async def scenario(rc):
        await rc.update_weights(_update(b, 9, header_id="h1"), direct=True)
        route = rc._direct
        kept = dict(route.headers)
        sent = []  # (engine id, header left out) per update_weights call to a worker
        for i, client in route.clients.items():
            def watched(method, msg, *args, _i=i, _call=client.call, **kw):
                sent.append((_i, msg.header_kept))
                return _call(method, msg, *args, **kw)
            client.call = watched
        second = await rc.update_weights(_update(a, 10, header_id="h1"), direct=True)
        greedy = (await rc.generate(PROMPT, None, min_version=10))[0]
        sent_second, sent[:] = list(sent), []
        route.headers["e1"] = "h2"  # wrongly: e1 keeps h1
        third = await rc.update_weights(_update(b, 11, header_id="h2"), direct=True)
        sent_third, headers = list(sent), dict(route.headers)
        misfit = _without_header(_update({k: v[:1] for k, v in a.items()}, 12, header_id="h2"))
        refused = []
        for send in (lambda: route.clients["e0"].call("update_weights", misfit),
                     lambda: rc.update_weights(_without_header(_update(a, 12, header_id="h2")))):  # relayed
            try:
                await send()
            except BadRequest as e:
                refused.append(str(e))
        return kept, second, greedy, sent_second, third, sent_third, headers, refused, await rc.stats(), \
            await rc.weight_digest()

    kept, second, greedy, sent_second, third, sent_third, headers, refused, stats, digests = \
        direct_daemon.call(aio, scenario, timeout=120)
    assert kept == {"e0": "h1", "e1": "h1"}
    assert sorted(sent_second) == [("e0", True), ("e1", True)] and sorted(second["updated"]) == ["e0", "e1"]
    assert greedy.weight_version == 10
    assert np.abs(tools.logprobs(ref["a"], PROMPT, greedy.response_token_ids, temperature=0.0)
                  - greedy.logprobs).max() <= TOL
    # e0 keeps h1, so it got h2 whole; e1 got it short, refused, and got it whole
    assert sorted(sent_third) == [("e0", False), ("e1", False), ("e1", True)]
    assert sorted(third["updated"]) == ["e0", "e1"] and headers == {"e0": "h2", "e1": "h2"}
    assert len(refused) == 2 and "kept header 'h2'" in refused[0] and "relays and keeps whole updates" in refused[1]
    assert stats["version"] == 11 and set(_states(stats).values()) == {("ready", 11)}
    assert len(set(digests.values())) == 1


def test_direct_falls_back_to_relaying_where_it_cannot_go(aio, tmp_path):
    """Against a stand-in front end (a named fake: an ``RpcServer`` with the daemon's update
    stream, standing in for an older daemon and for one whose workers this process cannot see),
    ``direct=True`` relays: without ``weight_route`` (``UnknownMethod``) it stops asking; with a
    route to an ``ipc://`` path that is not there it relays this update."""
    from treadle.common.records import Control
    from treadle.common.rpc import RpcServer
    from treadle.rollout.client import RolloutClient

    relayed = []

    async def update_weights(msg, ctx):
        relayed.append(msg.version)
        yield Control(op="accepted", args={"version": msg.version})
        yield Control(op="updated", args={"version": msg.version, "updated": ["e0"], "failed": {}, "loads": {}})

    async def weight_route(msg, ctx):
        return Control(op="route", args={"epoch": 1, "engines": {"e0": f"ipc://{tmp_path}/gone/e0.sock"}})

    async def scenario(handlers):
        server = RpcServer(name="fake-front-end", endpoint=f"ipc://{tmp_path}/fe-{len(handlers)}.sock", handlers=handlers)
        endpoint = await server.start()
        try:
            async with RolloutClient(endpoint) as rc:
                first = await rc.update_weights(_update({"w": np.zeros(2, np.float32)}, 1), direct=True)
                second = await rc.update_weights(_update({"w": np.zeros(2, np.float32)}, 2), direct=True)
                return first, second, rc._direct_off
        finally:
            await server.close()

    first, second, off = aio(scenario({"update_weights": update_weights}))
    assert "direct" not in first and "direct" not in second and "older version" in off
    first, second, off = aio(scenario({"update_weights": update_weights, "weight_route": weight_route}))
    assert "direct" not in first and "direct" not in second and off == ""
    assert relayed == [1, 2, 1, 2]
