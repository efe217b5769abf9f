"""`make demo`: SFT a tiny model on generated additions, then GRPO it with a math verifier.

    make demo                                  # builds .venv and .cache/models/tiny, then runs this
    .venv/bin/python tools/demo.py --help      # sizes, rates, the teacher's error rate

Steps, each with a progress bar and its time: (a) build the tiny model if missing; (b) generate
the dataset (``demo_task``: a teacher that forgets half its carries writes the SFT answers; RL
and eval prompts carry the true sums); (c) ``treadle-train sft``; (d) start ``treadle-rollout
serve`` (vLLM's CPU build) on the SFT model and measure held-out accuracy; (e) ``treadle-train
ppo`` as GRPO on that daemon (ZeroMQ rollouts, the built-in ``math`` verifier reward, DeepSpeed
ZeRO-2, a gloo weight broadcast after every step); (f) start a fresh daemon on the exported model
and measure again (its weight digest is checked against the one the broadcasts produced);
(g) print the before/after table and write ``results.json`` and ``demo.png``. Everything lands
in ``--out`` (runs/demo); the trainers' and daemons' logs in its ``logs/``.

Exit status 0 when greedy accuracy after GRPO is above before, 1 when not, 2 when a step failed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import demo_report
import tyro
import vllm_cpu
from demo_steps import (
    Daemon,
    EvalResult,
    Recipe,
    StepFailed,
    evaluate,
    ppo_command,
    run_logged,
    sft_command,
)
from demo_task import DataFiles, Dataset, TaskConfig, make_dataset, write_dataset
from tiny_model import PresetName, build

OUTPUTS = ("data", "sft", "rl", "logs", "results.json", "demo.png")  # what a rerun replaces under --out


@dataclass(frozen=True, slots=True, kw_only=True)
class Args:
    """SFT then GRPO a tiny model on additions; print accuracy before and after GRPO."""

    model: Path = Path(".cache/models/tiny")  # starting model; built (random init) when missing
    preset: PresetName = "tiny"  # tools/tiny_model.py preset used when the model is built here
    out: Path = Path("runs/demo")  # run folder (its previous demo outputs are replaced)
    eval_size: int = 500  # held-out problems
    carry_error: float = 0.5  # share of carrying SFT answers where the teacher forgets the carry
    require_improvement: bool = True  # exit 1 unless greedy accuracy rises (tests of the plumbing turn it off)
    gpu: bool = False  # on GPU 0: bf16 trainers, a vLLM engine beside them, weights over CUDA IPC
    recipe: Recipe = field(default_factory=Recipe)


class Steps:
    """One progress bar per step (description, bar, count, elapsed, status); records timings."""

    def __init__(self) -> None:
        from rich.console import Console  # noqa: PLC0415
        from rich.progress import (  # noqa: PLC0415
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        self.console = Console()
        if not self.console.is_terminal:  # a log file or CI: room for the bar and the status column
            self.console = Console(width=140)
        self.progress = Progress(SpinnerColumn(finished_text="[green]✓"), TextColumn("{task.description:<40}"),
                                 BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("{task.fields[status]}"), console=self.console)
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def step(self, name: str, total: int | None = None) -> Iterator[Any]:
        task = self.progress.add_task(name, total=total, status="")
        start = time.perf_counter()

        def update(advance: float = 0, completed: float | None = None, status: str | None = None) -> None:
            fields: dict[str, Any] = {"advance": advance}
            if completed is not None:
                fields["completed"] = completed
            if status is not None:
                fields["status"] = status
            self.progress.update(task, **fields)

        yield update
        self.seconds[name] = round(time.perf_counter() - start, 1)
        done = self.progress.tasks[task].total or 1
        self.progress.update(task, total=done, completed=done)


def _clear(out: Path) -> None:
    for name in OUTPUTS:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def _ensure_model(args: Args) -> str:
    if (args.model / "config.json").is_file():
        return "reused"
    info = build(args.preset, args.model, seed=0)
    return f"built {info.num_parameters:,} parameters"


def _sft_status(rows: list[dict[str, Any]]) -> str:
    return f"loss {rows[-1]['loss']:.3f}"


def _ppo_status(rows: list[dict[str, Any]]) -> str:
    evals = [r["eval/pass@1"] for r in rows if "eval/pass@1" in r]
    text = f"reward {rows[-1].get('reward/mean', float('nan')):.3f}"
    return text + (f"  eval {evals[-1]:.1%}" if evals else "")


def _prepare(args: Args, steps: Steps, env: dict[str, str]) -> tuple[Dataset, DataFiles]:
    """Steps (a)-(c): the model, the dataset, the SFT run; returns (dataset, its files)."""
    r, out = args.recipe, args.out
    with steps.step("(a) tiny model") as s:
        s(status=_ensure_model(args))
    with steps.step("(b) dataset") as s:
        task = TaskConfig(seed=r.seed, eval_size=args.eval_size, sft_rows=r.sft_steps * r.sft_batch,
                          carry_error=args.carry_error)
        ds = make_dataset(task)
        files = write_dataset(ds, out / "data")
        s(status=f"{len(ds.sft)} SFT rows, {len(ds.rl)} RL prompts, {len(ds.eval)} held out")
    with steps.step("(c) SFT treadle-train sft", total=r.sft_steps) as s:
        run_logged("treadle-train sft", sft_command(r, model=args.model, data=files.sft, out=out / "sft", gpu=args.gpu),
                   out / "logs" / "sft.log", out / "sft" / "ckpt" / "metrics.jsonl",
                   lambda rows: s(completed=rows[-1]["step"], status=_sft_status(rows)), env)
    return ds, files


def _measure(steps: Steps, name: str, daemon: Daemon, tokenizer: Any, rows: list[dict[str, str]],
             r: Recipe) -> EvalResult:
    with steps.step(name, total=2 * len(rows)) as e:
        result = evaluate(daemon.endpoint, tokenizer, rows, r, lambda: e(advance=1))
        e(status=f"greedy {result.greedy:.1%}  sampled {result.sampled:.1%}")
    return result


def _grpo(args: Args, steps: Steps, ds: Dataset, files: DataFiles, endpoint: str, env: dict[str, str]) -> list[dict[str, Any]]:
    """Step (e): ``treadle-train ppo`` on the running daemon; returns its metric rows."""
    r, out = args.recipe, args.out
    seen: list[dict[str, Any]] = []
    with steps.step("(e) GRPO treadle-train ppo", total=r.rl_steps) as g:
        def on_rows(new: list[dict[str, Any]]) -> None:
            seen.extend(new)
            g(completed=new[-1]["step"], status=_ppo_status(seen))

        cmd = ppo_command(r, model=out / "sft" / "model", prompts=files.rl, num_prompts=len(ds.rl),
                          eval_data=files.eval, endpoint=endpoint, out=out / "rl", gpu=args.gpu)
        return run_logged("treadle-train ppo", cmd, out / "logs" / "ppo.log", out / "rl" / "ckpt" / "metrics.jsonl",
                          on_rows, env)


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """What the steps measured."""

    before: EvalResult  # the SFT model, served by the first daemon
    after: EvalResult  # the exported GRPO model, served by a fresh daemon
    rows: list[dict[str, Any]]  # the GRPO run's metrics.jsonl rows
    weights_match: bool  # the fresh daemon's weight digest equals the last broadcast's
    labels: dict[str, str]  # eval prompt -> true sum


def run(args: Args, steps: Steps) -> Outcome:
    """Every step in order."""
    r, out = args.recipe, args.out
    env = dict(os.environ)  # vllm_cpu.apply_env() filled in the CPU settings; the children inherit them
    ds, files = _prepare(args, steps, env)
    with Daemon(out / "sft" / "model", out / "logs" / "rollout-sft.log", seed=r.seed, env=env, gpu=args.gpu) as daemon:
        with steps.step("(d) rollout daemon on the SFT model") as s:
            from transformers import AutoTokenizer  # noqa: PLC0415  (loads while the daemon starts)

            tokenizer = AutoTokenizer.from_pretrained(out / "sft" / "model")
            daemon.wait_ready()
            s(status=daemon.endpoint)
        before = _measure(steps, "    accuracy before GRPO", daemon, tokenizer, ds.eval, r)
        rows = _grpo(args, steps, ds, files, daemon.endpoint, env)
        served = daemon.weight_digest()  # what the last weight broadcast left in the engine
    with Daemon(out / "rl" / "model", out / "logs" / "rollout-rl.log", seed=r.seed, env=env, gpu=args.gpu) as daemon:
        with steps.step("(f) rollout daemon on the exported model") as s:
            daemon.wait_ready()
            same = daemon.weight_digest() == served
            s(status="weights = the last broadcast" if same else "[red]weights differ from the last broadcast")
        after = _measure(steps, "    accuracy after GRPO", daemon, tokenizer, ds.eval, r)
    return Outcome(before=before, after=after, rows=rows, weights_match=same,
                   labels={row["prompt"]: row["label"] for row in ds.eval})


def report(args: Args, steps: Steps, res: Outcome, seconds: float, load: tuple[float, ...]) -> int:
    """Tables, PNG, results.json; returns the exit status."""
    before, after = res.before, res.after
    console = steps.console
    console.print(demo_report.results_table(before, after, args.eval_size))
    console.print(demo_report.examples_table(demo_report.example_rows(before, after, res.labels)))
    png = demo_report.plot(res.rows, before, after, args.out / "demo.png",
                           f"GRPO on {args.model.name}: greedy accuracy {before.greedy:.1%} -> {after.greedy:.1%}")
    extra = {"weights_match": res.weights_match, "seconds": {**steps.seconds, "total": round(seconds, 1)},
             "load_average": {"start": load, "end": os.getloadavg()}, "recipe": dataclasses.asdict(args.recipe),
             "eval_size": args.eval_size, "carry_error": args.carry_error, "model": str(args.model)}
    demo_report.write_results(args.out / "results.json", before=before, after=after, extra=extra)
    console.print(f"{args.out / 'results.json'}, {png}, trainer curves in {args.out / 'rl' / 'ckpt' / 'curves.png'}")
    if not res.weights_match:
        console.print("[yellow]the exported model's weights differ from those the last broadcast left in the engine: "
                      f"a weight-sync or export bug; compare {args.out / 'logs'}")
    console.print(f"total {seconds:.0f} s (load average {load[0]:.1f} at the start, {os.getloadavg()[0]:.1f} now)")
    if demo_report.improved(before, after):
        console.print(f"[green]GRPO raised greedy accuracy {before.greedy:.1%} -> {after.greedy:.1%}")
        return 0
    console.print(f"[red]greedy accuracy did not rise ({before.greedy:.1%} -> {after.greedy:.1%}): too few GRPO "
                  f"steps for this recipe, or a regression; see {args.out / 'demo.png'} and {args.out / 'logs'}")
    return 1 if args.require_improvement else 0


def main() -> int:
    args = tyro.cli(Args, use_underscores=True)  # flags spelled like treadle-train's
    if not args.gpu:
        vllm_cpu.apply_env()  # OMP_NUM_THREADS=1, offline hub, quiet vLLM: before torch is imported anywhere
    start, load = time.perf_counter(), os.getloadavg()
    _clear(args.out)
    steps = Steps()
    try:
        with steps.progress:
            res = run(args, steps)
    except StepFailed as e:
        steps.console.print(f"[red]{e}")
        return 2
    except KeyboardInterrupt:  # the daemons and trainers were stopped on the way out
        steps.console.print("[red]interrupted")
        return 130
    return report(args, steps, res, time.perf_counter() - start, load)


if __name__ == "__main__":
    raise SystemExit(main())
