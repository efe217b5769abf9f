"""OpenRLHF's ``openrlhf.utils.logging_utils.init_logger``: a logger in treadle's logging tree."""

from __future__ import annotations

import logging

from treadle.common.log import get_logger


def init_logger(name: str) -> logging.Logger:
    """The logger ``name`` (under ``treadle.``), printed by treadle's handler like treadle's own records."""
    return get_logger(name)


__all__ = ["init_logger"]
