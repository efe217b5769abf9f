"""``python -m treadle.agents serve ...`` (same as ``treadle-agents``)."""

from treadle.agents.cli import main

main()
