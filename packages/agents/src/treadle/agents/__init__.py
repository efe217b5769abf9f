"""treadle.agents: single- and multi-turn agent executors, environments, OpenAI-compatible gateway.

Modules: ``api`` (the typed environment API), ``chat`` (tokens at the turn boundary),
``builder`` (Trajectory assembly), ``sampler`` (one turn through the rollout client),
``executor`` (SingleTurnExecutor, MultiTurnExecutor), ``rewards`` (reward sources),
``openrlhf`` (OpenRLHF's agent API and agent-file loader), ``envs`` (example environments),
``gateway`` + ``cli`` (``treadle-agents serve``), ``client`` (light gateway client).
Importing this package imports none of them (the client must stay light).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("treadle-agents")
except PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+src"
