"""Agents as programs: any process that speaks OpenAI's chat API plays an episode through a gateway.

``ProgramExecutor`` runs a user's agent command once per episode, as its own process group:

- it opens a gateway session for the episode (``Gateway.open_session``) with the run's sampling
  parameters, and starts the command with ``OPENAI_BASE_URL`` = the session's own base URL
  (``http://HOST:PORT/s/<session>/v1``), ``OPENAI_API_KEY`` = the gateway's token (or a
  placeholder) and ``TREADLE_SESSION_ID``: an unmodified OpenAI client (the ``openai`` SDK reads
  both variables) stays inside the episode's session whatever requests it makes;
- the episode goes to the program's standard input as one JSON line
  ``{"prompt": ..., "label": ..., "info": {...}}``;
- the program ends by printing its result as the last line of its standard output, a JSON
  object ``{"reward": float, "score"?: float, "extra_logs"?: {name: float}}``, and exiting 0;
- the session's recorded tokens (prompt, each sampled turn with its logprobs, the text between
  turns with loss mask 0: ``gateway.session``) become the Trajectory, with that reward.

At most ``max_procs`` programs run at once (``--train.agent_max_procs``); an episode's timeout
starts when it gets a slot.

An episode fails (a Trajectory with ``finish_reason="error"``, ``info["failed_stage"] ==
"agent"``) when the program exits non-zero (the error names the code and ends with its
standard error's last lines), prints no JSON object with a numeric ``reward`` last, makes no
chat request, or rewrites the conversation's history (the session then holds several segments,
which are not one trajectory); the episode's timeout (``episode_timeout_s``) kills the
program's whole process group. The program is the user's own code, run with their rights, like
OpenRLHF's agent files: it is not sandboxed, only bounded in time and output size.

Not here: the HTTP routes (``gateway.server``), token stitching (``gateway.session``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
from collections.abc import Mapping, Sequence
from typing import Any

from treadle.agents.api import Episode
from treadle.agents.executor import EpisodeState, ExecutorBase, floats_of
from treadle.common.records import Trajectory

STDOUT_LIMIT = 1 << 20
"""Bytes of a program's standard output kept (its last line is the result)."""
STDERR_TAIL = 2000
"""Characters of a failing program's standard error quoted in the error."""
MAX_PROCS = 64
"""Agent programs running at once by default: each is a process (tens of MB), and a GRPO step can
hold thousands of episodes; enough in flight to keep the engines batching."""


class AgentProgramError(RuntimeError):
    """The agent program broke the contract (see the module docstring)."""


def parse_result(stdout: str) -> tuple[float, float | None, dict[str, float]]:
    """(reward, score, extra_logs) from the last non-empty line of ``stdout``: a JSON object with a
    finite numeric "reward"; AgentProgramError naming what was wrong and the line otherwise."""
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    if not lines:
        raise AgentProgramError('printed nothing; end with a JSON line {"reward": ...}')
    last = lines[-1].strip()
    try:
        obj = json.loads(last)
    except ValueError:
        raise AgentProgramError(f'its last line is not JSON: {last[:200]!r}; end with {{"reward": ...}}') from None
    reward = obj.get("reward") if isinstance(obj, dict) else None
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise AgentProgramError(f'its last line has no finite numeric "reward": {last[:200]!r}')
    score = obj.get("score")
    if score is not None and (isinstance(score, bool) or not isinstance(score, (int, float))):
        raise AgentProgramError(f'"score" must be a number, got {score!r}')
    try:
        logs = floats_of(obj.get("extra_logs"))
    except (TypeError, ValueError) as e:
        raise AgentProgramError(f'"extra_logs" must map names to numbers: {e}') from None
    return float(reward), None if score is None else float(score), logs


class ProgramExecutor(ExecutorBase):
    """Episodes played by ``command`` through ``gateway`` (see the module docstring)."""

    def __init__(self, *, command: Sequence[str], gateway: Any, env: Mapping[str, str] | None = None,
                 max_procs: int = MAX_PROCS, **kw: Any) -> None:
        super().__init__(**kw)
        if not command:
            raise ValueError("ProgramExecutor needs a command")
        if max_procs < 1:
            raise ValueError(f"ProgramExecutor: max_procs must be >= 1, got {max_procs}")
        self.command, self.gateway, self.env = list(command), gateway, dict(env or {})
        self._slots = asyncio.Semaphore(max_procs)

    async def run(self, episode: Episode) -> Trajectory:
        """One episode once one of the ``max_procs`` program slots is free (the episode's timeout
        starts then: waiting for a slot is not the program's time)."""
        async with self._slots:
            return await super().run(episode)

    def _env(self, sid: str) -> dict[str, str]:
        """This process's environment, ``env``, and the session's address."""
        return {**os.environ, **self.env, "OPENAI_BASE_URL": f"{self.gateway.url}/s/{sid}/v1",
                "OPENAI_API_KEY": self.gateway.token or "treadle", "TREADLE_SESSION_ID": sid}

    async def _run_program(self, st: EpisodeState) -> str:
        """Start the command, feed it the episode, wait; its standard output (AgentProgramError on a
        non-zero exit). Cancelled (the episode's timeout): the process group is killed."""
        ep = st.episode
        line = json.dumps({"prompt": ep.prompt, "label": ep.label, "info": ep.info}, default=str) + "\n"
        proc = await asyncio.create_subprocess_exec(
            *self.command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=self._env(st.uid), start_new_session=True, limit=STDOUT_LIMIT)
        try:
            out, err = await proc.communicate(line.encode())
        finally:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        if proc.returncode != 0:
            tail = err.decode(errors="replace")[-STDERR_TAIL:]
            raise AgentProgramError(f"exited with code {proc.returncode}; its standard error ends:\n{tail}")
        return out[-STDOUT_LIMIT:].decode(errors="replace")

    async def _play(self, st: EpisodeState) -> Trajectory:
        st.stage = "agent"
        self.gateway.open_session(st.uid, self.sampling)
        try:
            out = await self._run_program(st)
            reward, score, logs = parse_result(out)
            session = self.gateway.sessions.get(st.uid)
            if session is None or not session.segments:
                raise AgentProgramError("made no chat request through its session (OPENAI_BASE_URL)")
            if len(session.segments) > 1:
                raise AgentProgramError(f"rewrote the conversation's history: {len(session.segments)} segments "
                                        "(drift events in info); one episode must be one growing conversation")
            st.builder = session.segments[0]
            self.stats.turns += session.turns
            st.extra_logs = logs
            return st.builder.build(reward=reward, score=score, finish_reason=session.finish[0], uid=st.uid,
                                    group_id=st.episode.group_id, extra_logs=logs,
                                    info=self._info(st, drift=list(session.drift)))
        finally:
            self.gateway.sessions.pop(st.uid, None)
