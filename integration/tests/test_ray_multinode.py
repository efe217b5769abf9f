"""Several Ray nodes: the trainer over two nodes, the daemons on a third, on one machine.

Fast part (no Ray started): the plan of a run across nodes: one torchrun per node with its
rendezvous, label selectors per bundle, daemons bound off loopback with the run's CURVE keys and
token, and the trainer given the client side and its weight-group address; refusals.

Slow part: ``ray.cluster_utils.Cluster`` with three nodes (head + 2, each its own raylet; on one
machine they share one address, which is not loopback here, so every daemon binds with CURVE),
labelled ``role=trainer`` (two) and ``role=engines``; ``treadle-launch --backend ray`` runs a
2-step GRPO run with the trainer's two ranks on the two trainer nodes (ZeRO-3 over gloo, one rank
each, torchrun's rendezvous across them), the rollout daemon (two hf engines) and the reward
daemon on the third node. Checked from run.json, the trainer's metrics and its log: where each
part ran, that the daemons bound their node's address with keys, and that every weight sync
reached both engines. Then the same launch resumed from its checkpoint (each trajectory trained
once), and (also marked chaos) the engines' node killed mid-run: today the run fails cleanly
(the daemon's exit status, nothing left running); and with ``--max_restarts 1`` and a node with
the same labels added back, the launch restarts, resumes from its checkpoint and finishes.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from pathlib import Path

import pytest

from treadle.common.config import ConfigError
from treadle.integration.config import parse_launch
from treadle.integration.plan import (
    Addresses,
    Keys,
    Rendezvous,
    bind,
    bundles_of,
    flag_value,
    make_plan,
    selectors_of,
    trainer_argv,
)

PPO = ["--actor.model_name_or_path", "M", "--data.prompt_dataset", "p.jsonl", "--algo.advantage.estimator",
       "group_norm", "--rollout.n_samples_per_prompt", "4", "--rollout.batch_size", "2", "--train.batch_size", "8",
       "--rollout.max_new_tokens", "8", "--data.prompt_max_len", "32", "--vllm.num_engines", "2"]
KEYS = Keys(curve_dir="/run/keys", token_file="/run/keys/http_token")
IP = "10.1.2.3"


def plan_of(*argv: str):
    return make_plan(parse_launch(list(argv)))


def test_a_trainer_over_two_nodes_is_one_torchrun_per_node_meeting_on_node_zero():
    plan = plan_of("--backend", "ray", "--trainer.nodes", "2", "--trainer.ranks", "2", "--", "rollout", "--",
                   "rewards", "--functions", "math", "--", "ppo", *PPO)
    assert plan.trainer_cfg.actor.num_nodes == 2 and plan.trainer_cfg.actor.num_gpus_per_node == 2
    addresses = Addresses(rollout=f"tcp://{IP}:7001", rewards=f"tcp://{IP}:7002")
    argv = trainer_argv(plan.cfg, addresses, python="py", rendezvous=Rendezvous(node_rank=1, master_addr="10.0.0.9",
                                                                                 master_port=29400),
                        keys=KEYS, sync_host="10.0.0.9")
    assert argv[:8] == ["py", "-m", "torch.distributed.run", "--nnodes=2", "--node_rank=1", "--master_addr=10.0.0.9",
                        "--master_port=29400", "--nproc_per_node=2"]
    flags = argv[11:]
    assert flag_value(flags, "--actor.num_nodes") == "2" and flag_value(flags, "--actor.num_gpus_per_node") == "2"
    assert flag_value(flags, "--vllm.endpoint") == f"tcp://{IP}:7001"
    assert flag_value(flags, "--vllm.curve_dir") == flag_value(flags, "--reward.curve_dir") == KEYS.curve_dir
    assert flag_value(flags, "--vllm.sync_host") == "10.0.0.9"  # rank 0's node: where the engines join
    # loopback daemons: no keys, no sync host (as on one machine before)
    loop = trainer_argv(plan.cfg, Addresses(rollout="tcp://127.0.0.1:7001", rewards="tcp://127.0.0.1:7002"),
                        python="py", rendezvous=Rendezvous(node_rank=0, master_addr="127.0.0.1", master_port=1),
                        keys=KEYS, sync_host="127.0.0.1")
    assert not {"--vllm.curve_dir", "--reward.curve_dir", "--vllm.sync_host"} & set(loop)
    with pytest.raises(ValueError, match="rendezvous"):
        trainer_argv(plan.cfg, addresses, python="py")


def test_bundles_are_one_per_trainer_node_with_the_labels_asked_for():
    plan = plan_of("--backend", "ray", "--trainer.nodes", "2", "--trainer.node_labels", "role=trainer",
                   "--rollout.node_labels", "role=engines", "zone=!b", "--", "rollout", "--", "rewards", "--functions",
                   "math", "--", "ppo", *PPO)
    bundles, index, _ = bundles_of(plan)
    assert index == {"trainer": 0, "trainer.1": 1, "rollout": 2, "rewards": 3}
    assert bundles == [{"CPU": 1.0}] * 4
    assert selectors_of(plan) == [{"role": "trainer"}, {"role": "trainer"}, {"role": "engines", "zone": "!b"}, {}]


@pytest.mark.parametrize("argv, message", [
    (["--backend", "ray", "--trainer.nodes", "2", "--", "ppo", *PPO, "--reward.remote_url", "math",
      "--actor.num_nodes", "3"], r"--actor.num_nodes 3 but --trainer.nodes 2"),
    (["--trainer.nodes", "2", "--", "ppo", *PPO, "--reward.remote_url", "math"], "the local backend runs on this"),
    (["--trainer.node_labels", "role=x", "--", "ppo", *PPO, "--reward.remote_url", "math"], "use --backend ray"),
    (["--backend", "ray", "--trainer.node_labels", "role", "--", "ppo", *PPO, "--reward.remote_url", "math"],
     "each label is KEY=VALUE"),
    (["--backend", "ray", "--trainer.nodes", "2", "--trainer.ranks", "2", "--", "rollout", "--", "ppo", *PPO,
      "--reward.remote_url", "math", "--actor.num_gpus_per_node", "2", "--train.colocate_all",
      "--vllm.num_engines", "1", "--vllm.tensor_parallel_size", "4"], "would span two of the trainer's nodes"),
    (["--backend", "ray", "--trainer.nodes", "2", "--", "rollout", "--cpus", "0", "--", "ppo", *PPO,
      "--reward.remote_url", "math", "--train.colocate_all"], "--engine_placement ray: --cpus place"),
    (["--backend", "ray", "--rollout.num_gpus", "2", "--", "rollout", "--engine_placement", "ray", "--", "ppo", *PPO,
      "--reward.remote_url", "math"], "each engine reserves its own GPUs"),
    (["--backend", "ray", "--", "rollout", "--engine_placement", "ray", "--", "ppo", *PPO, "--reward.remote_url",
      "math", "--train.colocate_all", "--vllm.num_engines", "1"], "colocate_all puts the engines on the trainer's GPUs"),
])
def test_what_cannot_be_placed_is_refused_at_parse_time(argv, message):
    with pytest.raises(ConfigError, match=message):
        plan_of(*argv)


def test_ray_placed_engines_leave_the_daemons_bundle_with_the_front_end_only():
    from treadle.integration.ray_backend import rollout_placement_flags

    plan = plan_of("--backend", "ray", "--rollout.node_labels", "role=daemons", "--", "rollout", "--engine_placement",
                   "ray", "--ray.num_gpus_per_rank", "1", "--ray.node_labels", "role=engines", "--", "ppo", *PPO,
                   "--reward.remote_url", "math")
    bundles, index, _ = bundles_of(plan)
    assert bundles[index["rollout"]] == {"CPU": 1.0} and plan.daemon("rollout").ray_engines
    assert selectors_of(plan)[index["rollout"]] == {"role": "daemons"}  # the engines' labels are the daemon's flag
    assert rollout_placement_flags(plan, {"rollout": {"gpu_ids": ["0"]}, "trainer": {"gpu_ids": ["1"]}}) == []
    assert flag_value(plan.daemon("rollout").args[1:], "--ray.node_labels") == "role=engines"


@pytest.mark.parametrize("tp, gpus, want", [
    (1, [["0", "1"], ["2", "3"]], ["0:0", "0:1", "1:2", "1:3"]),  # node 1's trainer part holds Ray's GPUs 2, 3
    (2, [["0", "1"], ["0", "1"]], ["0:0,1", "1:0,1"]),
    (1, [[], []], ["0", "0", "1", "1"]),  # CPU: the bundle only
])
def test_colocated_engines_over_two_trainer_nodes_sit_beside_each_nodes_ranks(tp, gpus, want):
    """``--train.colocate_all`` with the trainer on two nodes of two ranks: the rollout daemon
    shares trainer node 0's bundle, and its engines are Ray actors in each node's bundle on the
    GPUs of the ranks there (as the trainer parts' ``prepare`` reported them)."""
    from treadle.integration.plan import colocated_places
    from treadle.integration.ray_backend import rollout_placement_flags

    plan = plan_of("--backend", "ray", "--trainer.nodes", "2", "--trainer.ranks", "2", "--", "rollout", "--", "ppo",
                   *PPO, "--reward.remote_url", "math", "--train.colocate_all", "--vllm.num_engines", str(4 // tp),
                   "--vllm.tensor_parallel_size", str(tp))
    bundles, index, _ = bundles_of(plan)
    assert index == {"trainer": 0, "trainer.1": 1, "rollout": 0} and bundles == [{"CPU": 3.0}, {"CPU": 2.0}]
    where = {"trainer": {"gpu_ids": gpus[0]}, "trainer.1": {"gpu_ids": gpus[1]}, "rollout": {"gpu_ids": []}}
    assert rollout_placement_flags(plan, where) == ["--engine_placement", "ray", "--ray.colocate", *want]
    assert [(b, list(r)) for b, r in colocated_places(3, 2, 3, 2)] == [(0, [0, 1]), (1, [0, 1]), (2, [0, 1])]
    with pytest.raises(ConfigError, match="one engine worker beside each rank"):
        colocated_places(3, 1, 2, 2)


def test_a_trainer_part_failing_beside_colocated_engines_on_several_nodes_restarts_the_whole_run(tmp_path):
    """A trainer part that fails after a checkpoint is restarted alone, its daemons kept; not when
    the engines sit in the trainer's bundles over several nodes (their GPU ids are the parts')."""
    from treadle.integration.restart import TrainerRestarts
    from treadle.integration.supervise import Outcome

    died = Outcome(exit_code=1, failed="trainer.1", reason="died")
    answers = {}
    for colocate in (False, True):
        plan = plan_of("--backend", "ray", "--max_restarts", "2", "--trainer.nodes", "2", "--", "rollout", "--", "ppo",
                       *PPO, "--reward.remote_url", "math", "--ckpt.save_steps", "1", "--ckpt.path",
                       str(tmp_path / str(colocate)), *(["--train.colocate_all"] if colocate else []))
        restarts = TrainerRestarts(plan, None)
        (tmp_path / str(colocate) / "step_1").mkdir(parents=True)
        (tmp_path / str(colocate) / "step_1" / "state.json").write_text("{}")
        answers[colocate] = restarts.next_plan(died, 1, True) is not None
    assert answers == {False: True, True: False}


def test_a_daemon_bound_off_loopback_gets_the_runs_keys_and_token():
    from treadle.agents.gateway.config import GatewayConfig
    from treadle.common.config import parse
    from treadle.rewards.config import ServeConfig as RewardsServe
    from treadle.rollout.config import ServeConfig as RolloutServe

    plan = plan_of("--backend", "ray", "--", "rollout", "--model", "M", "--", "rewards", "--functions", "math", "--",
                   "agents", "--model", "M")
    roll, rew, agents = plan.daemons
    argv, a1 = bind(roll, IP, [7001], Addresses(), KEYS)
    assert a1.rollout == f"tcp://{IP}:7001" and flag_value(argv[1:], "--curve_dir") == KEYS.curve_dir
    assert parse(RolloutServe, argv[1:]).curve_dir == KEYS.curve_dir  # the daemon's own config takes it
    argv, a2 = bind(rew, IP, [7002, 7003], a1, KEYS)
    served = parse(RewardsServe, argv[1:])
    assert (served.zmq.endpoint, served.zmq.curve_dir) == (f"tcp://{IP}:7002", KEYS.curve_dir)
    assert (served.http.host, served.http.token_file) == (IP, KEYS.token_file) and a2.rewards_http == f"http://{IP}:7003"
    argv, a3 = bind(agents, IP, [7004], a1, KEYS)
    gateway = parse(GatewayConfig, argv[1:])
    assert (gateway.host, gateway.token_file, gateway.rollout_curve_dir) == (IP, KEYS.token_file, KEYS.curve_dir)
    assert a3.agents == f"http://{IP}:7004"
    with pytest.raises(ValueError, match="needs the run's keys"):
        bind(roll, IP, [7001], Addresses())


# ---------------------------------------------------------------------------------------------
# three Ray nodes on this machine


@contextlib.contextmanager
def _cluster(head: dict, *workers: dict, system_config: dict | None = None):
    """A Ray cluster on this machine (``ray.cluster_utils.Cluster``): the head with ``head``'s
    num_cpus / labels, one node per ``workers`` item; yields (cluster, its nodes, RAY_TMPDIR).

    RAY_TMPDIR points at a folder of its own, so the cluster's address file (which `ray.init()`
    without an address reads) is not the machine's: no other Ray user here finds this cluster.
    """
    from ray.cluster_utils import Cluster

    tmp = Path(tempfile.mkdtemp(prefix="trm", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    (tmp / "ray").mkdir()
    with pytest.MonkeyPatch.context() as mp:
        for name, value in (("RAY_TMPDIR", str(tmp)), ("RAY_USAGE_STATS_ENABLED", "0"),
                            ("RAY_AUTH_MODE", "disabled"), ("OMP_NUM_THREADS", "1")):
            mp.setenv(name, value)
        extra = {"_system_config": system_config} if system_config else {}
        cluster = Cluster(initialize_head=True, head_node_args={
            **head, "include_dashboard": False, "temp_dir": str(tmp / "ray"), **extra})
        try:
            nodes = [cluster.head_node, *(cluster.add_node(**w) for w in workers)]
            yield cluster, nodes, tmp
        finally:
            with contextlib.suppress(Exception):
                cluster.shutdown()
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _three_nodes():
    """Head + 2 nodes: two labelled role=trainer (1 CPU each: one trainer node's bundle fits on
    each), one role=engines (2 CPUs: both daemons)."""
    trainer, engines = {"num_cpus": 1, "labels": {"role": "trainer"}}, {"num_cpus": 2, "labels": {"role": "engines"}}
    with _cluster(trainer, trainer, engines) as (cluster, nodes, tmp):
        yield cluster, {k: n.node_id for k, n in zip(("head", "trainer", "engines"), nodes, strict=True)}, tmp


@pytest.fixture(scope="module")
def three_nodes():
    with _three_nodes() as nodes:
        yield nodes


def _ppo_zero3(helpers, tiny, task, out: Path) -> list[str]:
    """The small GRPO run of the other launcher tests, as two ranks of ZeRO-3 with two hf engines."""
    flags = helpers.ppo_flags(tiny, task, out)
    values = {"--ds.zero_stage": "3", "--train.micro_batch_size": "4", "--rollout.micro_batch_size": "4"}
    flags = [values.get(flags[i - 1], f) if i else f for i, f in enumerate(flags)]
    return [*flags, "--vllm.backend", "hf", "--vllm.num_engines", "2"]


def _log_records(path: Path, msg: str) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            row = json.loads(line)
            if isinstance(row, dict) and row.get("msg") == msg:
                rows.append(row)
    return rows


def _launch_across_nodes(three_nodes, helpers, tiny, task, out: Path, run: Path, *ppo: str) -> str:
    """treadle-launch on ``cluster``: trainer on the role=trainer nodes, daemons on role=engines;
    its output (asserting exit 0)."""
    cluster, _, ray_tmp = three_nodes
    args = ["--backend", "ray", "--ray.address", cluster.address, "--run_dir", str(run),
            "--trainer.nodes", "2", "--trainer.node_labels", "role=trainer",
            "--rollout.node_labels", "role=engines", "--rewards.node_labels", "role=engines",
            "--", "rollout", "--", "rewards", "--functions", str(task.reward), "--workers.num_workers", "1",
            "--", "ppo", *_ppo_zero3(helpers, tiny, task, out), *ppo]
    env = helpers.child_env(TREADLE_LOG_JSON="1", RAY_TMPDIR=str(ray_tmp))
    proc = helpers.launch(args, env=env)
    text = helpers.finish(proc, 600)
    assert proc.returncode == 0, text[-6000:]
    return text


@pytest.mark.slow
def test_grpo_with_the_trainer_on_two_nodes_and_the_daemons_on_a_third(three_nodes, tiny, task, helpers, tmp_path):
    node_ids = three_nodes[1]
    run = tmp_path / "run"
    _launch_across_nodes(three_nodes, helpers, tiny, task, tmp_path, run)

    record = helpers.run_json(run)
    comps = record["components"]
    assert {n: c["exit_code"] for n, c in comps.items()} == {"rollout": 0, "rewards": 0, "trainer": 0, "trainer.1": 0}
    # where: the two trainer nodes hold one torchrun each, the engines' node both daemons
    assert {comps["trainer"]["node_id"], comps["trainer.1"]["node_id"]} == {node_ids["head"], node_ids["trainer"]}
    assert comps["rollout"]["node_id"] == comps["rewards"]["node_id"] == node_ids["engines"]
    assert record["ray"]["label_selectors"] == [{"role": "trainer"}] * 2 + [{"role": "engines"}] * 2
    # addresses: the node's (from prepare), not assumed loopback; off loopback, so with the run's keys
    ip = record["placement"]["rollout"]["node_ip"]
    assert record["addresses"]["rollout"].startswith(f"tcp://{ip}:")
    assert record["addresses"]["rewards"].startswith(f"tcp://{record['placement']['rewards']['node_ip']}:")
    if ip not in ("127.0.0.1", "localhost"):
        keys = Path(record["keys"])
        assert (keys / "server.key_secret").is_file() and (keys / "client.key_secret").is_file()
        assert "--curve_dir" in comps["rollout"]["cmd"] and "--zmq.curve_dir" in comps["rewards"]["cmd"]
        assert "--vllm.curve_dir" in comps["trainer"]["cmd"] and "--vllm.sync_host" in comps["trainer.1"]["cmd"]
    rdzv = [a for a in comps["trainer.1"]["cmd"] if a.startswith(("--nnodes", "--node_rank", "--master_addr"))]
    assert rdzv == ["--nnodes=2", "--node_rank=1", f"--master_addr={record['placement']['trainer']['node_ip']}"]

    # training: 2 steps, both ranks in one world (ZeRO-3 over gloo), each step's weights on both engines
    rows = [json.loads(line) for line in (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["sync/bytes"] > 0 for r in rows)
    started = _log_records(run / "trainer.log", "weights sent")
    # a daemon the trainer did not start gets the trainer's weights first, then one sync per step
    assert [r["version"] for r in started] == list(range(1, len(rows) + 2))
    engines = {tuple(sorted(r["updated"])) for r in started}
    assert len(engines) == 1 and len(next(iter(engines))) == 2, engines  # every sync: both engines, none failed
    assert all(r["failed"] == [] for r in started)


@pytest.mark.slow
def test_colocated_engines_run_beside_the_trainers_ranks_on_each_of_its_nodes(three_nodes, tiny, task, helpers,
                                                                              tmp_path):
    """``--train.colocate_all`` with the trainer on the two role=trainer nodes (one rank each): the
    rollout daemon shares trainer node 0's bundle and starts its two engines as Ray actors in the
    bundles of both trainer nodes (``--ray.colocate 0 1``), one beside each rank; GRPO runs its two
    steps and every sync (gloo, from rank 0 across the nodes) reaches both engines."""
    import re

    cluster, node_ids, ray_tmp = three_nodes
    run = tmp_path / "run"
    args = ["--backend", "ray", "--ray.address", cluster.address, "--run_dir", str(run),
            "--trainer.nodes", "2", "--trainer.node_labels", "role=trainer", "--trainer.num_cpus_per_rank", "0.5",
            "--rollout.num_cpus", "0.5", "--rewards.node_labels", "role=engines",
            "--", "rollout", "--", "rewards", "--functions", str(task.reward), "--workers.num_workers", "1",
            "--", "ppo", *_ppo_zero3(helpers, tiny, task, tmp_path), "--train.colocate_all"]
    proc = helpers.launch(args, env=helpers.child_env(TREADLE_LOG_JSON="1", RAY_TMPDIR=str(ray_tmp)))
    text = helpers.finish(proc, 600)
    assert proc.returncode == 0, text[-6000:]

    record = helpers.run_json(run)
    comps = record["components"]
    trainer_nodes = [comps["trainer"]["node_id"], comps["trainer.1"]["node_id"]]
    assert set(trainer_nodes) == {node_ids["head"], node_ids["trainer"]}
    assert comps["rollout"]["node_id"] == trainer_nodes[0] and comps["rewards"]["node_id"] == node_ids["engines"]
    cmd = comps["rollout"]["cmd"]
    assert cmd[cmd.index("--ray.colocate"):cmd.index("--ray.colocate") + 3] == ["--ray.colocate", "0", "1"]
    engines = dict(re.findall(r"engine (e\d+): worker \d+ on Ray node (\w+)", (run / "rollout.log").read_text()))
    print(f"trainer parts on {[n[:8] for n in trainer_nodes]}, engines on {[engines[e][:8] for e in ('e0', 'e1')]}, "
          f"rollout daemon: {' '.join(cmd[cmd.index('--engine_placement'):cmd.index('--ray.colocate') + 3])}")
    assert [engines["e0"], engines["e1"]] == trainer_nodes, (engines, trainer_nodes)

    rows = [json.loads(line) for line in (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    sent = _log_records(run / "trainer.log", "weights sent")
    assert [r["version"] for r in sent] == list(range(1, len(rows) + 2))
    assert all(sorted(r["updated"]) == ["e0", "e1"] and r["failed"] == [] for r in sent), sent


@pytest.mark.slow
def test_a_run_across_nodes_resumes_from_its_checkpoint_training_each_trajectory_once(three_nodes, tiny, task,
                                                                                      helpers, tmp_path):
    """Two steps with a checkpoint after each; the same launch again with a second episode and
    ``--ckpt.load_enable``: the ranks (on two nodes) load step 2's ZeRO-3 shards and train steps
    3-4 only; the trajectory log has every trajectory trained once."""
    from treadle.trainer.rl.trajlog import TrajectoryLog

    _launch_across_nodes(three_nodes, helpers, tiny, task, tmp_path, tmp_path / "run1", "--ckpt.save_steps", "1")
    _launch_across_nodes(three_nodes, helpers, tiny, task, tmp_path, tmp_path / "run2", "--ckpt.save_steps", "1",
                         "--train.num_episodes", "2", "--ckpt.load_enable")
    rows = [json.loads(line) for line in (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    resumed = _log_records(tmp_path / "run2" / "trainer.log", "resumed")
    assert len(resumed) == 1 and resumed[0]["step"] == 2, resumed
    with TrajectoryLog(tmp_path / "ckpt" / "trajectories") as tl:
        lineage = tl.lineage(4)
        pending = tl.recover(4).pending
    used = [u for step in sorted(lineage) for u in lineage[step]]
    assert sorted(lineage) == [1, 2, 3, 4] and len(used) == 4 * 8
    assert len(set(used)) == len(used) and not pending


@pytest.mark.slow
def test_an_actor_on_another_machine_is_stopped_through_a_task_on_its_node(three_nodes, tmp_path):
    """What the launcher does for an actor outside its pid namespace (another host), here made to
    look so: SIGTERM reaches the actor through a task pinned to its node (the actor passes it on
    to its child, which exits 7), and kill() SIGKILLs what is under the actor the same way."""
    import psutil
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from treadle.integration.ray_backend import ActorHandle, ComponentActor

    cluster, node_ids, _ = three_nodes
    waits = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(7)); time.sleep(600)"
    deaf = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        handles, children = [], []
        for name, code in (("waits", waits), ("deaf", deaf)):
            actor = ComponentActor.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
                node_ids["engines"], soft=False)).remote()
            where = {**ray.get(actor.prepare.remote(0)), "host": "another machine"}
            ref = actor.run_process.remote(["-c", code], {}, str(tmp_path / f"{name}.log"))
            handles.append(handle := ActorHandle(name, actor, where, ref, tmp_path / f"{name}.log", []))
            assert not handle.local and where["node_id"] == node_ids["engines"]
            children.append(_wait_child(where["pid"]))
        waiting, deaf_one = handles
        waiting.terminate()
        assert ray.get(waiting.ref, timeout=60) == 7
        deaf_one.terminate()  # ignored by the child; the actor passes it on and keeps waiting
        assert deaf_one.poll() is None
        deaf_one.kill()
        assert deaf_one.poll() == -9  # the SIGKILLed child's status, or the actor's end (ray.kill) if Ray saw that first
        _, alive = psutil.wait_procs([children[1]], timeout=30)
        assert not alive
        waiting.kill()
    finally:
        ray.shutdown()


def _wait_child(pid: int):
    import time

    import psutil

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        kids = psutil.Process(pid).children()
        if kids:
            time.sleep(1.0)  # let it install its signal handler
            return kids[0]
        time.sleep(0.1)
    raise AssertionError(f"actor {pid} started no child")


@pytest.mark.slow
@pytest.mark.chaos
def test_losing_the_engines_node_mid_run_fails_the_run_and_leaves_nothing_behind(tiny, task, helpers, tmp_path):
    """Today's behaviour, not recovery: the engines' node's raylet (and every process of it) is
    killed after step 1 (``Cluster.remove_node``, not graceful); the launcher notices that a
    daemon died, tears the rest down and exits with that daemon's status."""
    import time

    import psutil

    with _three_nodes() as (cluster, _, ray_tmp):  # a cluster of its own: this test takes a node away
        run = tmp_path / "run"
        args = ["--backend", "ray", "--ray.address", cluster.address, "--run_dir", str(run),
                "--trainer.nodes", "2", "--trainer.node_labels", "role=trainer",
                "--rollout.node_labels", "role=engines", "--rewards.node_labels", "role=engines",
                "--", "rollout", "--", "rewards", "--functions", str(task.reward), "--workers.num_workers", "1",
                "--", "ppo", *_ppo_zero3(helpers, tiny, task, tmp_path), "--data.max_samples", "32"]
        proc = helpers.launch(args, env=helpers.child_env(TREADLE_LOG_JSON="1", RAY_TMPDIR=str(ray_tmp)))
        metrics = tmp_path / "ckpt" / "metrics.jsonl"
        helpers.wait_for(lambda: metrics.is_file() and metrics.read_text().strip(), 600, proc, "step 1")
        record = helpers.run_json(run)
        seen = [p for c in record["components"].values() for p in
                [psutil.Process(c["pid"]), *helpers.descendants(c["pid"])]]
        engines = next(n for n in cluster.worker_nodes if n.node_id == record["placement"]["rollout"]["node_id"])
        killed = time.monotonic()
        cluster.remove_node(engines, allow_graceful=False)
        out = helpers.finish(proc, 300)
        noticed_s = time.monotonic() - killed
        record = helpers.run_json(run)
        print(f"engines' node killed: launcher exit {proc.returncode} after {noticed_s:.1f} s; failed "
              f"{record['failed']} ({record['reason']}); steps done {len(metrics.read_text().splitlines())}")
        assert proc.returncode in (10, 11, 12), out[-4000:]
        assert record["failed"] in ("rollout", "rewards", "trainer", "trainer.1")
        time.sleep(1.0)
        assert not helpers.survivors(seen)


@pytest.mark.slow
def test_losing_the_engines_node_with_max_restarts_resumes_from_the_checkpoint_on_a_new_node(tiny, task, helpers,
                                                                                           tmp_path):
    """``--max_restarts 1``: the engines' node is removed after the first checkpoint and a node
    with the same labels added back; the launcher tears the rest down, places the plan again (the
    daemons on the new node, at new addresses), starts the trainer with ``--ckpt.load_enable`` and
    finishes every step with exit 0; each trajectory is trained once."""
    import time

    import psutil

    from treadle.integration.restart import checkpoint_step
    from treadle.trainer.rl.trajlog import TrajectoryLog

    with _three_nodes() as (cluster, _, ray_tmp):  # a cluster of its own: this test swaps a node
        run, ckpt = tmp_path / "run", tmp_path / "ckpt"
        args = ["--backend", "ray", "--ray.address", cluster.address, "--run_dir", str(run),
                "--max_restarts", "1", "--restart_backoff_s", "1", "--stop_timeout_s", "10",
                "--trainer.nodes", "2", "--trainer.node_labels", "role=trainer",
                "--rollout.node_labels", "role=engines", "--rewards.node_labels", "role=engines",
                "--", "rollout", "--", "rewards", "--functions", str(task.reward), "--workers.num_workers", "1",
                "--", "ppo", *_ppo_zero3(helpers, tiny, task, tmp_path), "--data.max_samples", "6",
                "--ckpt.save_steps", "1"]  # 3 steps, a checkpoint after each
        proc = helpers.launch(args, env=helpers.child_env(TREADLE_LOG_JSON="1", RAY_TMPDIR=str(ray_tmp)))
        helpers.wait_for(lambda: checkpoint_step(ckpt), 600, proc, "the first checkpoint")
        record = helpers.run_json(run)
        seen = [p for c in record["components"].values() for p in
                [psutil.Process(c["pid"]), *helpers.descendants(c["pid"])]]  # attempt 1's processes
        lost = record["placement"]["rollout"]["node_id"]
        engines = next(n for n in cluster.worker_nodes if n.node_id == lost)
        cluster.remove_node(engines, allow_graceful=False)
        time.sleep(2.0)
        fresh = cluster.add_node(num_cpus=2, labels={"role": "engines"})
        out = helpers.finish(proc, 600)
        assert proc.returncode == 0, out[-6000:]
        assert not helpers.survivors(seen)  # attempt 1 was torn down whole before attempt 2

        record = helpers.run_json(run)
        first, last = record["attempts"]
        print(f"engines' node replaced: attempt 1 {first['failed']} ({first['reason']}), exit codes "
              f"{first['exit_codes']}, resumed from step {first['checkpoint_step']}")
        assert record["attempt"] == 2 and record["exit_code"] == 0
        assert first["restarted"] and first["exit_code"] in (10, 11, 12) and first["checkpoint_step"] >= 1
        assert first["failed"] in ("rollout", "rewards", "trainer", "trainer.1")
        assert (last["restarted"], last["exit_code"]) == (False, 0)
        assert record["placement"]["rollout"]["node_id"] == record["placement"]["rewards"]["node_id"] == fresh.node_id
        assert "--ckpt.load_enable" in record["components"]["trainer"]["cmd"]
        assert "--ckpt.load_enable" not in json.loads((run / "attempt-1" / "run.json").read_text())[
            "components"]["trainer"]["cmd"]
        assert (run / "attempt-1" / "trainer.log").is_file() and (run / "attempt-1" / "run.json").is_file()
        resumed = _log_records(run / "trainer.log", "resumed")
        assert len(resumed) == 1 and resumed[0]["step"] == first["checkpoint_step"], resumed

    rows = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 3 and {r["step"] for r in rows} == {1, 2, 3}
    with TrajectoryLog(ckpt / "trajectories") as tl:
        lineage = tl.lineage(3)
        pending = tl.recover(3).pending
    used = [u for step in sorted(lineage) for u in lineage[step]]
    assert sorted(lineage) == [1, 2, 3] and len(used) == 3 * 8
    assert len(set(used)) == len(used) and not pending


@pytest.mark.slow
def test_engines_as_ray_actors_on_two_nodes_survive_losing_one_mid_round(tiny, task, helpers, tmp_path):
    """``-- rollout --engine_placement ray``: the daemon on a role=daemons node, its two engines
    Ray actors on the two role=engines nodes. While engine e0 has samples in flight (seen in the
    daemon's stats, asked over CURVE with the run's keys), its node is removed (its raylet and
    every process of it killed) and a new one added: the run goes on without a restart, e0's
    samples fail over to e1, the slot's replacement starts on the new node, catches up to the
    current weights and takes the next syncs, and every trajectory is trained once."""
    import os
    import re
    import signal
    import threading
    import time

    from treadle.common.rpc import load_client_keys
    from treadle.rollout.client import SyncRolloutClient
    from treadle.trainer.rl.trajlog import TrajectoryLog

    trainer = {"num_cpus": 1, "labels": {"role": "trainer"}}
    engines = {"num_cpus": 1, "labels": {"role": "engines"}}
    fast_death = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}
    steps = 32  # 2 episodes of the task's 32 prompts, 2 a step
    with _cluster(trainer, trainer, {"num_cpus": 2, "labels": {"role": "daemons"}}, engines, engines,
                  system_config=fast_death) as (cluster, nodes, ray_tmp):
        engine_nodes = {n.node_id: n for n in nodes[3:]}
        run, ckpt = tmp_path / "run", tmp_path / "ckpt"
        args = ["--backend", "ray", "--ray.address", cluster.address, "--run_dir", str(run),
                "--trainer.nodes", "2", "--trainer.node_labels", "role=trainer",
                "--rollout.node_labels", "role=daemons", "--rewards.node_labels", "role=daemons",
                "--", "rollout", "--engine_placement", "ray", "--ray.node_labels", "role=engines",
                "--", "rewards", "--functions", str(task.reward), "--workers.num_workers", "1",
                "--", "ppo", *_ppo_zero3(helpers, tiny, task, tmp_path), "--data.max_samples", "32",
                "--train.num_episodes", "2", "--rollout.max_new_tokens", "128"]  # long enough responses that a round is caught in flight
        proc = helpers.launch(args, env=helpers.child_env(TREADLE_LOG_JSON="1", RAY_TMPDIR=str(ray_tmp)))
        out: list[str] = []  # the engines' output reaches the launcher (Ray's log_to_driver): drain it
        drain = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
        drain.start()
        metrics = ckpt / "metrics.jsonl"
        helpers.wait_for(lambda: metrics.is_file() and metrics.read_text().strip(), 600, proc, "step 1")
        placed = dict(re.findall(r"engine (e\d+): worker \d+ on Ray node (\w+)", (run / "rollout.log").read_text()))
        assert set(placed.values()) == set(engine_nodes), placed  # one engine on each engines node
        record = helpers.run_json(run)
        rc = SyncRolloutClient(record["addresses"]["rollout"], curve=load_client_keys(record["keys"]))
        try:
            def e0(stats):
                return next(e for e in stats["engines"] if e["engine_id"] == "e0")

            busy = helpers.wait_for(lambda: (s := rc.stats()) and e0(s)["load"] > 0 and s, 120, proc,
                                    "samples in flight on e0")
            cluster.remove_node(engine_nodes[placed["e0"]], allow_graceful=False)
            # A machine that dies takes every process on it at once; here the worker (its own session,
            # which notices its actor's end within a second) goes with the node's Ray processes.
            with contextlib.suppress(ProcessLookupError):
                os.kill(e0(busy)["pid"], signal.SIGKILL)
            lost_at, lost_t = len(metrics.read_text().splitlines()), time.monotonic()
            time.sleep(2.0)
            fresh = cluster.add_node(**engines)
            back = helpers.wait_for(lambda: (s := rc.stats()) and e0(s)["restarts"] == 1 and e0(s)["state"] == "ready"
                                    and s, 180, proc, "e0 back on the new node")
            back_s = time.monotonic() - lost_t
        finally:
            rc.close()
        assert proc.wait(600) == 0, "".join(out)[-6000:]
        drain.join(10)

    print(f"e0's node removed after step {lost_at}; e0 back {back_s:.1f} s later at version {e0(back)['version']} "
          f"(pool {back['version']}); failovers {back['failovers']}")
    assert back["failovers"] > 0 and e0(back)["version"] == back["version"]
    assert lost_at < steps
    record = helpers.run_json(run)
    assert record.get("attempt", 1) == 1 and record["exit_code"] == 0  # no restart of the run
    log = (run / "rollout.log").read_text()
    assert re.search(r"engine e0 \(pid \d+ on \w+\) exited with status -9", log), log[-4000:]
    assert re.search(rf"engine e0: worker \d+ on Ray node {fresh.node_id}", log), log[-4000:]  # the replacement
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    # e0 came back at the pool's version (from the kept weights); every sync after that reached both
    later = [r for r in _log_records(run / "trainer.log", "weights sent") if r["version"] > e0(back)["version"]]
    assert later and all(sorted(r["updated"]) == ["e0", "e1"] for r in later), later
    with TrajectoryLog(ckpt / "trajectories") as tl:
        lineage = tl.lineage(steps)
        pending = tl.recover(steps).pending
    used = [u for step in sorted(lineage) for u in lineage[step]]
    assert sorted(lineage) == list(range(1, steps + 1)) and len(used) == steps * 8
    assert len(set(used)) == len(used) and not pending


RM_APART = ["--reward.model_name_or_path", "RM", "--reward.num_gpus_per_node", "1", "--actor.num_gpus_per_node", "2"]


def test_a_reward_model_apart_becomes_a_reward_daemon_and_the_rest_stays_in_the_ranks():
    plan = plan_of("--backend", "ray", "--trainer.ranks", "2", "--trainer.num_gpus_per_rank", "1",
                   "--rewards.node_labels", "role=rm", "--", "rollout", "--", "ppo", *PPO, *RM_APART,
                   "--algo.advantage.estimator", "gae", "--ds.param_dtype", "bf16", "--reward.normalize_enable")
    rewards = plan.daemon("rewards")
    assert rewards.args == ("serve", "--rm.path", "RM", "--rm.dtype", "bf16", "--rm.replicas", "1", "--rm.max_len", "40",
                            "--rm.normalize")
    assert rewards.num_gpus == 1 and selectors_of(plan)[bundles_of(plan)[1]["rewards"]] == {"role": "rm"}
    # more GPUs on its node: a copy of the model on each (the daemon scores that many batches at once)
    four = plan_of("--backend", "ray", "--trainer.ranks", "2", "--trainer.num_gpus_per_rank", "1", "--", "rollout",
                   "--", "ppo", *PPO, *RM_APART[:-4], "--reward.num_gpus_per_node", "4", "--actor.num_gpus_per_node",
                   "2").daemon("rewards")
    assert flag_value(four.args[1:], "--rm.replicas") == "4" and four.num_gpus == 4
    # over two nodes (ray): a reward daemon on each, 2 copies each; the trainer spreads its samples over both
    spread = plan_of("--backend", "ray", "--trainer.ranks", "2", "--trainer.num_gpus_per_rank", "1", "--", "rollout",
                     "--", "ppo", *PPO, *RM_APART[:-4], "--reward.num_nodes", "2", "--reward.num_gpus_per_node", "2",
                     "--actor.num_gpus_per_node", "2")
    two = spread.daemon("rewards")
    assert two.parts == ("rewards", "rewards.1") and two.num_gpus == 2 and two.part_ports("rewards.1") == 2
    bundles, index, _ = bundles_of(spread)
    assert [bundles[index[p]] for p in two.parts] == [{"CPU": 1.0, "GPU": 2.0}] * 2
    assert spread.trainer_cfg.reward.remote_reduce == "spread" and len(spread.trainer_cfg.reward.remote_urls) == 2
    argv = trainer_argv(spread.cfg, Addresses(rollout=f"tcp://{IP}:1", rewards=f"tcp://{IP}:2,tcp://10.0.0.2:3"),
                        python="py", keys=KEYS, sync_host=IP)
    argv = argv[argv.index("ppo") + 1:]
    assert flag_value(argv, "--reward.remote_url") == f"tcp://{IP}:2,tcp://10.0.0.2:3"
    assert flag_value(argv, "--reward.remote_reduce") == "spread"
    t = plan.trainer_cfg
    assert t.reward.model_name_or_path is None and t.reward.remote_url and t.reward.num_gpus_per_node is None
    assert t.critic.model_name_or_path == "RM"  # the critic still starts from the reward model, as OpenRLHF's
    assert plan.cfg.trainer.args == make_plan(plan.cfg).cfg.trainer.args  # idempotent (a restart plans again)
    # counts equal to the actor's: in the trainer's ranks, as before; colocated: the ranks' own check
    inside = plan_of("--backend", "ray", "--trainer.ranks", "2", "--", "rollout", "--", "ppo", *PPO, *RM_APART,
                     "--reward.num_gpus_per_node", "2")
    assert inside.daemon("rewards") is None and inside.trainer_cfg.reward.model_name_or_path == "RM"
    with pytest.raises(ConfigError, match="runs in the trainer's ranks"):
        plan_of("--backend", "ray", "--trainer.ranks", "2", "--", "rollout", "--", "ppo", *PPO, *RM_APART,
                "--train.colocate_all", "--vllm.num_engines", "2")


@pytest.mark.parametrize("extra, message", [
    (["--reward.num_nodes", "2", "--actor.num_gpus_per_node", "4"], "a reward daemon on each .* use --backend ray"),
])
def test_what_a_reward_model_apart_cannot_be_is_refused(extra, message):
    with pytest.raises(ConfigError, match=message):
        plan_of("--trainer.ranks", "4", "--", "rollout", "--", "ppo", *PPO, *RM_APART, *extra)
    with pytest.raises(ConfigError, match="a `-- rewards` section already"):
        plan_of("--backend", "ray", "--trainer.ranks", "2", "--", "rollout", "--", "rewards", "--functions", "math",
                "--", "ppo", *PPO, *RM_APART)


def test_train_ppo_ray_spreads_its_engines_as_ray_actors_unless_they_share_the_trainers_gpus():
    from treadle.integration.train_ppo_ray import launch_config
    from treadle.trainer.config import parse_ppo

    args = [*PPO, "--reward.remote_url", "math", "--actor.num_gpus_per_node", "2"]
    spread = make_plan(launch_config(args, parse_ppo(args), gpus=True))
    rollout = spread.daemon("rollout")
    assert rollout.ray_engines and rollout.num_gpus == 0  # each engine reserves its own GPU, on any node
    assert flag_value(rollout.args[1:], "--ray.num_gpus_per_rank") == "1"
    colocated = [*args, "--train.colocate_all"]
    shared = make_plan(launch_config(colocated, parse_ppo(colocated), gpus=True)).daemon("rollout")
    assert not shared.ray_engines and shared.num_gpus == 2  # the trainer's GPUs, through --gpu_ids
    two_nodes = [*colocated, "--actor.num_nodes", "2", "--vllm.num_engines", "4"]  # OpenRLHF's hybrid engine on 2 nodes
    plan = make_plan(launch_config(two_nodes, parse_ppo(two_nodes), gpus=True))
    assert plan.daemon("rollout").num_gpus == 4 and bundles_of(plan)[0] == [{"CPU": 3.0, "GPU": 2.0}, {"CPU": 2.0, "GPU": 2.0}]
    gae = [*args, "--algo.advantage.estimator", "gae", "--rollout.n_samples_per_prompt", "1", "--rollout.batch_size", "8",
           "--critic.num_nodes", "2", "--critic.num_gpus_per_node", "1"]  # OpenRLHF's critic on 2 nodes of 1 GPU
    plan = make_plan(launch_config(gae, parse_ppo([*gae[:-4]]), gpus=True))
    critic = plan.daemon("critic")
    assert critic.parts == ("critic", "critic.1") and critic.num_gpus == 1 and plan.trainer_cfg.critic.remote_url


def test_a_reference_given_gpus_of_its_own_is_a_reference_daemon_on_them():
    """``--ref.num_gpus_per_node 2`` beside an actor of 4 GPUs, with a KL term: a reference daemon of
    2 hf engines on a bundle of 2 GPUs, the trainer wired to it (``--ref.remote_url``) without the
    placement flags; counts equal to the actor's keep the reference in the ranks."""
    from treadle.integration.ray_backend import reference_gpu_flags

    base = ["--backend", "ray", "--trainer.ranks", "4", "--trainer.num_gpus_per_rank", "1", "--rollout.num_gpus", "2",
            "--", "rollout", "--", "ppo", *PPO, "--reward.remote_url", "math", "--algo.kl.init_coef", "0.01"]
    plan = plan_of(*base, "--ref.num_gpus_per_node", "2", "--ref.model_name_or_path", "R")
    ref = plan.daemon("reference")
    assert flag_value(ref.args[1:], "--model") == "R" and flag_value(ref.args[1:], "--backend") == "hf"
    assert flag_value(ref.args[1:], "--engines") == "2" and ref.num_gpus == 2
    bundles, index, _ = bundles_of(plan)
    assert bundles[index["reference"]] == {"CPU": 1.0, "GPU": 2.0}
    assert plan.trainer_cfg.ref.remote_url is not None and plan.trainer_cfg.ref.model_name_or_path is None
    assert not {"--ref.num_gpus_per_node", "--ref.model_name_or_path"} & set(plan.cfg.trainer.args)
    assert reference_gpu_flags(plan, {"reference": {"gpu_ids": ["4", "5"]}}) == ["--gpu_ids", "4", "5",
                                                                                   "--engine.device", "cuda"]
    assert plan_of(*base, "--ref.num_gpus_per_node", "4").daemon("reference") is None  # the actor's: in the ranks
    spread = plan_of(*base, "--ref.num_gpus_per_node", "2", "--ref.num_nodes", "2").daemon("reference")  # 4 on Ray
    assert [flag_value(spread.args[1:], f) for f in ("--engines", "--engine_placement", "--ray.num_gpus_per_rank",
                                                     "--engine.device")] == ["4", "ray", "1", "cuda"]
    assert spread.num_gpus == 0 and spread.ray_engines
    for extra, message in ((["--ref.num_gpus_per_node", "2", "--ref.offload"], "--ref.offload keeps the reference"),
                           (["--ref.num_gpus_per_node", "2", "--train.colocate_actor_ref"], "runs in the trainer's ranks")):
        with pytest.raises(ConfigError, match=message):
            plan_of(*base, *extra)
    own = plan_of("--", "rollout", "--", "reference", "--engines", "2", "--", "ppo", *PPO, "--reward.remote_url", "math",
                  "--algo.kl.init_coef", "0.01", "--ref.model_name_or_path", "R")  # a section of the user's own
    assert flag_value(own.daemon("reference").args[1:], "--model") == "R" and own.trainer_cfg.ref.remote_url
    with pytest.raises(ConfigError, match="the reference daemon serves one model"):
        plan_of("--", "rollout", "--", "reference", "--model", "S", "--", "ppo", *PPO, "--reward.remote_url", "math",
                "--algo.kl.init_coef", "0.01", "--ref.model_name_or_path", "R")
    with pytest.raises(ConfigError, match="spreads the reference's engines over Ray nodes: use --backend ray"):
        plan_of("--trainer.ranks", "2", "--", "rollout", "--", "ppo", *PPO, "--reward.remote_url", "math",
                "--algo.kl.init_coef", "0.01", "--ref.num_nodes", "2", "--ref.num_gpus_per_node", "1")
    with pytest.raises(ConfigError, match="serve the reference with --backend hf"):
        plan_of("--backend", "ray", "--", "rollout", "--", "reference", "--backend", "vllm", "--", "ppo", *PPO,
                "--reward.remote_url", "math", "--algo.kl.init_coef", "0.01", "--rollout.temperature", "0.9")


def test_a_critic_given_gpus_of_its_own_is_a_critic_server_on_them():
    """``--critic.num_nodes 2 --critic.num_gpus_per_node 2`` beside an actor of 4 GPUs (gae): a critic
    server of 2 parts, one bundle of 2 GPUs each, under torchrun meeting on the first part's node;
    the trainer wired to it (``--critic.remote_url``, its keys off loopback) and keeping the counts.
    On one node it starts its ranks itself (``--ranks``); counts equal to the actor's keep it in the
    ranks; what cannot go apart is refused."""
    from treadle.integration.ray_backend import start_critic

    gae = [*PPO, "--reward.remote_url", "math", "--algo.advantage.estimator", "gae", "--rollout.n_samples_per_prompt", "1",
           "--rollout.batch_size", "8"]
    base = ["--backend", "ray", "--trainer.ranks", "4", "--trainer.num_gpus_per_rank", "1", "--rollout.num_gpus", "2",
            "--", "rollout", "--", "ppo", *gae]
    plan = plan_of(*base, "--critic.num_gpus_per_node", "2", "--critic.num_nodes", "2")
    critic = plan.daemon("critic")
    assert (critic.nodes, critic.ranks, critic.num_gpus, critic.parts) == (2, 2, 2, ("critic", "critic.1"))  # per node
    bundles, index, _ = bundles_of(plan)
    assert [bundles[index[p]] for p in critic.parts] == [{"CPU": 2.0, "GPU": 2.0}] * 2
    assert plan.trainer_cfg.critic.remote_url is not None and plan.trainer_cfg.critic.num_nodes == 2
    argv, addresses = bind(critic, IP, [7005], Addresses(), KEYS)
    assert argv[-4:] == ["--endpoint", f"tcp://{IP}:7005", "--curve_dir", KEYS.curve_dir]
    flags = trainer_argv(plan.cfg, Addresses(rollout=f"tcp://{IP}:7001", critic=addresses.critic), python="py",
                         keys=KEYS, sync_host=IP)
    flags = flags[flags.index("ppo") + 1:]
    assert flag_value(flags, "--critic.remote_url") == f"tcp://{IP}:7005" and flag_value(flags, "--critic.curve_dir")

    class Sup:
        def __init__(self) -> None:
            self.cmds = {}

        def add(self, handle) -> None:
            self.cmds[handle.name] = handle.cmd

    class Actor:
        class run_process:  # noqa: N801  (a Ray method's .remote)
            @staticmethod
            def remote(*args):
                return None

    sup = Sup()
    where = {p: {"node_ip": f"10.0.0.{i + 1}", "ports": [7005, 29511] if not i else [], "pid": 1, "node_id": p}
             for i, p in enumerate(critic.parts)}
    start_critic(critic, sup, {p: Actor() for p in critic.parts}, where, Path("/run"), argv)
    assert sup.cmds["critic.1"][:7] == ["-m", "torch.distributed.run", "--nnodes=2", "--node_rank=1",
                                        "--master_addr=10.0.0.1", "--master_port=29511", "--nproc_per_node=2"]
    one = plan_of(*base, "--critic.num_gpus_per_node", "2").daemon("critic")
    assert one.command(["critic", "--ranks", "2"], python="py") == ["py", "-m", "treadle.trainer.cli", "critic", "--ranks", "2"]
    assert flag_value(one.args[1:], "--ranks") == "2"
    assert plan_of(*base, "--critic.num_gpus_per_node", "4").daemon("critic") is None  # the actor's: in the ranks
    with pytest.raises(ConfigError, match="the critic runs in the trainer's ranks"):
        plan_of(*base, "--critic.num_gpus_per_node", "2", "--train.colocate_critic_reward",
                "--reward.model_name_or_path", "R", "--reward.remote_url", "None")
    with pytest.raises(ConfigError, match="spreads the critic over Ray nodes: use --backend ray"):
        plan_of("--trainer.ranks", "2", "--", "rollout", "--", "ppo", *gae, "--critic.num_nodes", "2")
    with pytest.raises(ConfigError, match="this run has none"):
        plan_of("--", "rollout", "--", "critic", "--", "ppo", *PPO, "--reward.remote_url", "math")
    with pytest.raises(ConfigError, match="--critic.num_gpus_per_node = 2 ranks, but the critic server runs"):
        plan_of("--", "rollout", "--", "critic", "--", "ppo", *gae, "--critic.num_gpus_per_node", "2")


@pytest.mark.slow
def test_a_reference_over_two_nodes_scores_through_ray_placed_engines(tiny, task, helpers, tmp_path):
    """``--ref.num_nodes 2 --ref.num_gpus_per_node 1`` beside an actor of one rank: the launcher's
    reference daemon (its front end on the head, beside the trainer and the rollout daemon) runs
    its two engines as Ray actors, which land on the two other nodes (the head is full); the rank
    scores the KL through it: first-step KL ~0, both steps trained."""
    import re

    with _cluster({"num_cpus": 3}, {"num_cpus": 1}, {"num_cpus": 1}) as (cluster, nodes, ray_tmp):
        run = tmp_path / "run"
        flags = [*helpers.ppo_flags(tiny, task, tmp_path, "--vllm.backend", "hf", "--reward.remote_url",
                                    str(task.reward), "--ref.num_nodes", "2", "--ref.num_gpus_per_node", "1")]
        flags[flags.index("--algo.kl.init_coef") + 1] = "0.01"
        args = ["--backend", "ray", "--ray.address", cluster.address, "--run_dir", str(run), "--", "rollout",
                "--backend", "hf", "--", "ppo", *flags]
        proc = helpers.launch(args, env=helpers.child_env(TREADLE_LOG_JSON="1", RAY_TMPDIR=str(ray_tmp)))
        text = helpers.finish(proc, 600)
        assert proc.returncode == 0, text[-6000:]
        record = helpers.run_json(run)
        comps = record["components"]
        head = nodes[0].node_id
        assert comps["reference"]["node_id"] == comps["trainer"]["node_id"] == head
        cmd = comps["reference"]["cmd"]
        assert cmd[cmd.index("--engine_placement") + 1] == "ray" and cmd[cmd.index("--engines") + 1] == "2"
        placed = dict(re.findall(r"engine (e\d+): worker \d+ on Ray node (\w+)", (run / "reference.log").read_text()))
        assert sorted(placed.values()) == sorted(n.node_id for n in nodes[1:]), (placed, head)
    rows = [json.loads(line) for line in (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and abs(rows[0]["kl"]) < 1e-6, rows


@pytest.mark.slow
def test_a_critic_over_two_nodes_trains_apart_and_the_run_resumes_with_it(tiny, task, helpers, tmp_path):
    """``--critic.num_nodes 2 --critic.num_gpus_per_node 1`` beside an actor of one rank (gae): the
    launcher's critic server is two torchrun parts on the two nodes labelled role=critic, one world
    (ZeRO-3 over gloo) meeting on the first; its rank 0 binds its node's address with the run's
    CURVE keys, and the trainer values and trains the critic through it. The run saves each step;
    then the same launch resumed (--ckpt.load_enable, one more episode) loads the critic's state
    from the trainer's checkpoint into a new server and goes on training it."""
    critic = {"num_cpus": 1, "labels": {"role": "critic"}}
    with _cluster({"num_cpus": 3}, critic, critic) as (cluster, nodes, ray_tmp):
        def launch(*more: str) -> dict:
            flags = helpers.ppo_flags(tiny, task, tmp_path, "--vllm.backend", "hf", "--reward.remote_url",
                                      str(task.reward), "--critic.num_nodes", "2", "--critic.num_gpus_per_node", "1",
                                      "--ckpt.save_steps", "1", *more)
            values = {"--algo.advantage.estimator": "gae", "--ds.zero_stage": "3", "--train.micro_batch_size": "4"}
            flags = [values.get(flags[i - 1], f) if i else f for i, f in enumerate(flags)]
            args = ["--backend", "ray", "--ray.address", cluster.address, "--run_dir", str(tmp_path / "run"),
                    "--critic.node_labels", "role=critic", "--", "rollout", "--backend", "hf", "--", "ppo", *flags]
            proc = helpers.launch(args, env=helpers.child_env(TREADLE_LOG_JSON="1", RAY_TMPDIR=str(ray_tmp)))
            text = helpers.finish(proc, 600)
            assert proc.returncode == 0, text[-6000:]
            return helpers.run_json(tmp_path / "run")

        record = launch()
        comps = record["components"]
        assert set(comps) == {"rollout", "critic", "critic.1", "trainer"}
        on = {n.node_id for n in nodes[1:]}
        assert {comps["critic"]["node_id"], comps["critic.1"]["node_id"]} == on
        assert record["addresses"]["critic"].startswith(f"tcp://{record['placement']['critic']['node_ip']}:")
        cmd = comps["critic.1"]["cmd"]
        assert "--nnodes=2" in cmd and "--node_rank=1" in cmd
        if "--critic.curve_dir" not in comps["trainer"]["cmd"]:
            assert record["placement"]["critic"]["node_ip"] in ("127.0.0.1", "localhost")
        shutil.rmtree(tmp_path / "run")
        launch("--ckpt.load_enable", "--train.num_episodes", "2")
    rows = [json.loads(line) for line in (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["critic/loss"] > 0 for r in rows), rows
    assert sorted(p.name for p in (tmp_path / "ckpt" / "step_00000004" / "critic").glob("*optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]


@pytest.mark.slow
def test_a_reward_model_over_two_nodes_is_a_reward_daemon_on_each(tiny, task, helpers, tmp_path):
    """``--reward.num_nodes 2 --reward.num_gpus_per_node 1`` beside an actor of one rank: a reward
    daemon (the model, ``--rm.path``) on each of the two nodes labelled role=rm, each bound to its
    node's address; the trainer deals its samples over both (``--reward.remote_reduce spread``)
    and trains both steps."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    rm_dir = tmp_path / "rm"  # the tiny model with a seeded value head: a reward model
    AutoModelForSequenceClassification.from_pretrained(tiny, num_labels=1).save_pretrained(rm_dir)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(rm_dir)
    rm = {"num_cpus": 1, "labels": {"role": "rm"}}
    with _cluster({"num_cpus": 3}, rm, rm) as (cluster, nodes, ray_tmp):
        run = tmp_path / "run"
        flags = helpers.ppo_flags(tiny, task, tmp_path, "--vllm.backend", "hf", "--reward.model_name_or_path",
                                  str(rm_dir), "--reward.num_nodes", "2", "--reward.num_gpus_per_node", "1")
        args = ["--backend", "ray", "--ray.address", cluster.address, "--run_dir", str(run),
                "--rewards.node_labels", "role=rm", "--", "rollout", "--backend", "hf", "--", "ppo", *flags]
        proc = helpers.launch(args, env=helpers.child_env(TREADLE_LOG_JSON="1", RAY_TMPDIR=str(ray_tmp)))
        text = helpers.finish(proc, 600)
        assert proc.returncode == 0, text[-6000:]
        record = helpers.run_json(run)
    comps = record["components"]
    assert {comps["rewards"]["node_id"], comps["rewards.1"]["node_id"]} == {n.node_id for n in nodes[1:]}
    urls = comps["trainer"]["cmd"][comps["trainer"]["cmd"].index("--reward.remote_url") + 1].split(",")
    assert urls == record["addresses"]["rewards"].split(",") and len(set(urls)) == 2
    assert "spread" in comps["trainer"]["cmd"]
    rows = [json.loads(line) for line in (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["reward_failed"] == 0 for r in rows)
