"""The critic trained apart: trainer rank 0's client of a critic server (``--critic.remote_url``).

The server (``trainers.critic``, ``treadle-train critic``) is a DeepSpeed group of its own; rank
0 here is its only client. It sends the run's resolved flags once (``check`` before any model
loads, then ``setup`` while the actor loads), each step's batch for values, the returns for the
critic's optimizer steps (which run while the actor trains), and the checkpoint folder to save
into or load from. Only rank 0 talks to it; the values reach the other ranks by broadcast
(``rl.transfer.broadcast_arrays``).

Not here: the server, the critic's math (``rl.update``), when each call is made (``trainers.ppo``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from treadle.common.config import ConfigError, dump_yaml
from treadle.common.errors import BadRequest, TreadleError
from treadle.common.log import get_logger
from treadle.common.records import (
    CriticCheckpoint,
    CriticSetup,
    CriticTrainRequest,
    CriticValues,
    CriticValuesRequest,
    Trajectory,
)

log = get_logger(__name__)
WORK_TIMEOUT_S = 7200.0
"""How long one call may take on the server (a model load, a step's values or training): a dead
server fails a call at once (the connection drops); this only bounds one that hangs."""
READY_TIMEOUT_S = 600.0
"""How long the server may take to answer at all (its ranks starting)."""


def expected_world(cfg: Any) -> int | None:
    """The critic ranks ``--critic.num_nodes`` x ``--critic.num_gpus_per_node`` ask for (either one
    unset: the actor's), or None when neither is given (pure)."""
    c, a = cfg.critic, cfg.actor
    if c.num_nodes is None and c.num_gpus_per_node is None:
        return None
    return (c.num_nodes or a.num_nodes) * (c.num_gpus_per_node or a.num_gpus_per_node)


class RemoteCritic:
    """Rank 0's handle on the critic server at ``url``."""

    def __init__(self, url: str, curve: Any = None) -> None:
        from treadle.common.rpc import SyncRpcClient  # noqa: PLC0415

        self.url = url
        self._client = SyncRpcClient(url, name="critic", curve=curve, timeout_s=WORK_TIMEOUT_S)
        self._uids: list[str] = []
        self.session = uuid.uuid4().hex
        """This trainer's session: the server refuses requests of any other but its last setup's."""

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Until the server answers its health call; TimeoutError naming the address after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._client.call("health", timeout=5.0)
                return
            except (TreadleError, TimeoutError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"--critic.remote_url {self.url}: no critic server answered within {timeout:g} s "
                                       "(start it with treadle-train critic --endpoint ...)") from None
                time.sleep(0.5)

    def check(self, cfg: Any, *, total_opt_steps: int, pad_id: int) -> CriticSetup:
        """Send the run's flags for the server to check (before any model loads here); the setup
        to give ``setup_async``. ConfigError with the server's reason when it refuses them."""
        # the folders as this host resolves them: the server, elsewhere, may run in another directory
        ckpt = dataclasses.replace(cfg.ckpt, path=str(Path(cfg.ckpt.path).resolve()),
                                   output_dir=str(Path(cfg.ckpt.output_dir).resolve()))
        setup = CriticSetup(config=dump_yaml(dataclasses.replace(cfg, ckpt=ckpt)), total_opt_steps=total_opt_steps,
                            pad_id=pad_id, session=self.session)
        ready = self._call("check", setup)
        want = expected_world(cfg)
        if want is not None and ready.world != want:
            raise ConfigError(f"--critic.num_nodes x --critic.num_gpus_per_node = {want} ranks, but the critic server at "
                              f"--critic.remote_url {self.url} runs {ready.world}: make them agree")
        return setup

    def setup_async(self, setup: CriticSetup) -> concurrent.futures.Future[Any]:
        """The server builds (or keeps) the critic: the future's ``CriticReady``."""
        return self._client.submit("setup", setup)

    def values_async(self, trajs: Sequence[Trajectory]) -> concurrent.futures.Future[Any]:
        """The values of ``trajs`` (one step's batch, in order): the future's ``CriticValues``."""
        self._uids = [t.uid for t in trajs]
        return self._client.submit("values", CriticValuesRequest(trajectories=list(trajs), session=self.session))

    def train_async(self, step: int, returns: Sequence[np.ndarray]) -> concurrent.futures.Future[Any]:
        """The critic's optimizer steps of RL step ``step`` on the batch last valued, toward
        ``returns`` (one array per trajectory): the future's ``CriticTrainResult``."""
        flat = np.concatenate([np.asarray(r, np.float32) for r in returns] or [np.zeros(0, np.float32)])
        return self._client.submit("train", CriticTrainRequest(step=step, uids=self._uids, returns=flat, session=self.session))

    def save(self, path: str) -> None:
        self._call("save", CriticCheckpoint(path=path, session=self.session))

    def load(self, path: str) -> None:
        """Restore the critic from checkpoint folder ``path`` ("": its starting weights)."""
        self._call("load", CriticCheckpoint(path=path, session=self.session))

    def export(self, path: str) -> None:
        self._call("export", CriticCheckpoint(path=path, session=self.session))

    def _call(self, method: str, msg: Any) -> Any:
        return result(self._client.submit(method, msg), self.url, method)

    def close(self) -> None:
        self._client.close()


def result(fut: concurrent.futures.Future[Any], url: str, what: str) -> Any:
    """``fut``'s reply; a refusal as ConfigError naming the server and ``what`` was asked."""
    try:
        return fut.result()
    except BadRequest as e:
        raise ConfigError(f"the critic server at --critic.remote_url {url} refused {what}: {e.message}") from None


def split_values(reply: CriticValues, lengths: Sequence[int]) -> list[np.ndarray]:
    """The flat values of ``reply`` cut into one array per trajectory of ``lengths`` action tokens
    (ValueError when they do not add up: the server valued another batch)."""
    values = np.asarray(reply.values, dtype=np.float32)
    if values.shape[0] != sum(lengths):
        raise ValueError(f"the critic server sent {values.shape[0]} values for {sum(lengths)} action tokens")
    ends = np.cumsum(lengths)
    return [values[e - n:e].copy() for e, n in zip(ends, lengths, strict=True)]

