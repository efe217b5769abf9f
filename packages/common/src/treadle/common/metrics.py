"""Metrics: a JSONL log that every run keeps, optional wandb/tensorboard, PNG curves, Prometheus.

- ``MetricsLogger``: ``log(step, {"loss": ...})`` appends one JSON line (always) and forwards to
  wandb / tensorboard when asked; ``close()`` flushes them.
- ``plot_curves(jsonl, png)``: one subplot per metric, step on the x axis (matplotlib, imported
  only when called).
- ``ServiceMetrics``: a Prometheus registry for a daemon with counters/gauges/histograms and a
  loopback-bound HTTP exposition endpoint.

Heavy or optional libraries (wandb, tensorboard, matplotlib) are imported lazily here.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


def _scalar(v: Any) -> float | int | None:
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, (int, float)):
        return v
    item = getattr(v, "item", None)  # numpy / torch scalars
    if callable(item):
        try:
            return item()
        except (ValueError, RuntimeError):
            return None
    return None


class MetricsLogger:
    """Append-only JSONL metrics, mirrored to wandb / tensorboard when configured."""

    def __init__(self, path: str | Path, *, wandb_run: Any = None, tensorboard_dir: str | Path | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("a", buffering=1)
        self._wandb = wandb_run
        self._tb = None
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415  (optional, heavy)

            self._tb = SummaryWriter(str(tensorboard_dir))

    def log(self, step: int, values: Mapping[str, Any]) -> dict[str, float | int]:
        """Record scalar ``values`` at ``step``; non-scalars are dropped. Returns what was written."""
        row: dict[str, float | int] = {}
        for k, v in values.items():
            s = _scalar(v)
            if s is not None and not (isinstance(s, float) and math.isnan(s)):
                row[k] = s
        self._fh.write(json.dumps({"step": step, "time": round(time.time(), 3), **row}) + "\n")
        if self._wandb is not None:
            self._wandb.log(row, step=step)
        if self._tb is not None:
            for k, v in row.items():
                self._tb.add_scalar(k, v, step)
        return row

    def close(self) -> None:
        self._fh.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a metrics JSONL file (a torn last line from a killed run is skipped)."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def plot_curves(jsonl: str | Path, png: str | Path, keys: Iterable[str] | None = None, title: str = "") -> Path:
    """Draw each metric in ``jsonl`` (or only ``keys``) against step into one PNG; returns its path."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    rows = read_jsonl(jsonl)
    names = list(keys) if keys is not None else sorted({k for r in rows for k in r} - {"step", "time"})
    cols = min(3, max(1, len(names)))
    nrows = max(1, math.ceil(len(names) / cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(4.5 * cols, 3.2 * nrows), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        pts = [(r["step"], r[name]) for r in rows if name in r]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="." if len(pts) < 50 else None)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


class ServiceMetrics:
    """A daemon's Prometheus metrics on its own registry (no global state).

    Names are prefixed with ``treadle_<service>_``. ``serve(port)`` exposes them over HTTP on
    loopback unless another host is given.
    """

    def __init__(self, service: str) -> None:
        self.prefix = f"treadle_{service}_"
        self.registry = CollectorRegistry()
        self._metrics: dict[str, Any] = {}

    def counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return self._get(Counter, name, doc, labels)

    def gauge(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return self._get(Gauge, name, doc, labels)

    def histogram(self, name: str, doc: str, labels: tuple[str, ...] = (), buckets: tuple[float, ...] | None = None) -> Histogram:
        extra = {"buckets": buckets} if buckets else {}
        return self._get(Histogram, name, doc, labels, **extra)

    def _get(self, kind: type, name: str, doc: str, labels: tuple[str, ...], **kw: Any) -> Any:
        metric = self._metrics.get(name)
        if metric is None:
            metric = kind(self.prefix + name, doc, labels, registry=self.registry, **kw)
            self._metrics[name] = metric
        return metric

    def serve(self, port: int, host: str = "127.0.0.1") -> tuple[Any, Any]:
        """Start the exposition HTTP server in a thread; returns (server, thread)."""
        return start_http_server(port, addr=host, registry=self.registry)

    def exposition(self) -> bytes:
        """The registry in Prometheus text format."""
        from prometheus_client import generate_latest  # noqa: PLC0415

        return generate_latest(self.registry)
