"""Tokenising in worker processes (``--data.dataloader_num_workers``, ``data.workers``): the same
samples for any worker count, the first bad row named as without workers, a progress bar, and
the flag read from the command line (and refused by ``ppo``, which tokenises nothing itself)."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest

from treadle.common.config import ConfigError
from treadle.trainer.config import parse_command
from treadle.trainer.data import workers
from treadle.trainer.data.formatting import Formatter, kto_samples, pair_samples, sft_samples
from treadle.trainer.data.sources import DataError, Row, load_rows


def _same(a, b) -> None:
    """Two (samples, dropped) results hold equal samples, field by field."""
    (sa, da), (sb, db) = a, b
    assert da == db and len(sa) == len(sb)
    for x, y in zip(sa, sb, strict=True):
        assert (x.index, x.margin, x.desirable, len(x.seqs)) == (y.index, y.margin, y.desirable, len(y.seqs))
        for p, q in zip(x.seqs, y.seqs, strict=True):
            assert np.array_equal(p.ids, q.ids) and np.array_equal(p.target, q.target)


@pytest.fixture
def pools(monkeypatch):
    """The process counts of the pools ``map_rows`` starts (the real spawn pools still run)."""
    started: list[int] = []
    real = multiprocessing.get_context

    class Spy:
        def __init__(self, method):
            self.ctx = real(method)

        def Pool(self, processes, **kw):  # noqa: N802  (multiprocessing's name)
            started.append(processes)
            return self.ctx.Pool(processes, **kw)

    monkeypatch.setattr(workers.multiprocessing, "get_context", Spy)
    return started


def test_samples_are_the_same_for_any_number_of_workers(tokenizer, data, pools):
    text = [Formatter(tokenizer, input_template="Q: {}\nA: ", apply_chat_template=False, workers=n) for n in (0, 3)]
    chat = [Formatter(tokenizer, input_template=None, apply_chat_template=True, workers=n) for n in (0, 2)]
    sft_rows = load_rows(str(data.sft))
    assert workers.chunk_size(len(sft_rows), 3) < len(sft_rows) // 3  # several chunks per worker: order is tested
    # max_len 20 drops some rows: sample numbering after the drops must not depend on the chunks
    sft = [sft_samples(sft_rows, f, input_key="question", output_key="response", multiturn=False, pretrain=False,
                       max_len=20) for f in text]
    assert 0 < sft[0][1] < len(sft_rows)
    _same(*sft)
    _same(*[sft_samples(load_rows(str(data.chat)), f, input_key="messages", output_key=None, multiturn=True,
                        pretrain=False, max_len=999) for f in chat])
    _same(*[pair_samples(load_rows(str(data.pref)), f, prompt_key="prompt", chosen_key="chosen",
                         rejected_key="rejected", margin_key="margin", max_len=999) for f in chat])
    # KTO pairs each prompt with the next kept row's answer: across chunk boundaries too
    _same(*[kto_samples(load_rows(str(data.kto)), f, input_key="input", output_key="output", label_key="label",
                        max_len=999) for f in text])
    assert pools == [3, 2, 2, 3]  # one pool per worker run, of the asked size; none for 0 workers


def test_the_first_bad_row_is_named_as_without_workers(tokenizer, capsys):
    rows = [Row(data={"q": f"q{i}", "r": "fox"}, file="d.jsonl", index=i) for i in range(200)]
    rows[137] = Row(data={"q": "q"}, file="d.jsonl", index=137)
    rows[180] = Row(data={"q": "q", "r": 3}, file="d.jsonl", index=180)
    for n in (0, 2):
        fmt = Formatter(tokenizer, input_template=None, apply_chat_template=False, workers=n)
        with pytest.raises(DataError, match=r"d\.jsonl row 137: key 'r': missing or null"):
            sft_samples(rows, fmt, input_key="q", output_key="r", multiturn=False, pretrain=False, max_len=64)
    fmt = Formatter(tokenizer, input_template=None, apply_chat_template=False, workers=2)
    out, _ = sft_samples(rows[:100], fmt, input_key="q", output_key="r", multiturn=False, pretrain=False, max_len=64)
    assert len(out) == 100
    assert "tokenise (2 workers)" in capsys.readouterr().err  # the progress bar, counting rows


def test_the_flag_sets_the_workers_and_leaves_the_cache_key(tiny, tokenizer):
    from treadle.trainer.trainers import build

    base = ["--actor.model_name_or_path", str(tiny), "--data.dataset", "d.jsonl"]
    plain = parse_command("sft", base)
    four = parse_command("sft", [*base, "--data.dataloader_num_workers", "4"])
    assert build.tokenizer_and_formatter(plain)[1].workers == 0
    assert build.tokenizer_and_formatter(four)[1].workers == 4
    # the samples do not depend on the count, so a cache written with 4 workers serves 0
    assert build.data_fingerprint(plain, tokenizer) == build.data_fingerprint(four, tokenizer)
    with pytest.raises(ConfigError, match=r"--data\.dataloader_num_workers -1: .*>= 0|must be >= 0"):
        parse_command("sft", [*base, "--data.dataloader_num_workers", "-1"])


def test_ppo_refuses_the_flag_naming_it():
    args = ["--actor.model_name_or_path", "m", "--data.prompt_dataset", "p.jsonl", "--reward.remote_url", "r.py",
            "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "4",
            "--actor.num_gpus_per_node", "1", "--rollout.batch_size", "8", "--train.batch_size", "8"]
    parse_command("ppo", args)
    with pytest.raises(ConfigError, match=r"--data\.dataloader_num_workers 2: treadle-train ppo tokenises no data"):
        parse_command("ppo", [*args, "--data.dataloader_num_workers", "2"])
