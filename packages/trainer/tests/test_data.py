"""Data: files and folders -> rows with provenance, mixing, malformed rows named, tokenisation
(templates, chat, multi-turn masks, pairs, KTO), batches (padded vs packed), order and resume."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from treadle.trainer.data.batching import by_count, by_tokens, pack_batch, pad_batch, split_to
from treadle.trainer.data.formatting import Formatter, kto_samples, pair_samples, sft_samples
from treadle.trainer.data.order import StepOrder, eval_share
from treadle.trainer.data.samples import Sample, TokenSeq
from treadle.trainer.data.sources import DataError, Row, load_mixture, load_rows, mix


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_file_folder_and_split_rows_remember_where_they_came_from(tmp_path):
    _jsonl(tmp_path / "train.jsonl", [{"a": "x"}, {"a": "y"}])
    _jsonl(tmp_path / "test.jsonl", [{"a": "z"}])
    rows = load_rows(str(tmp_path), "train")
    assert [r.data["a"] for r in rows] == ["x", "y"] and rows[1].index == 1 and rows[1].file.endswith("train.jsonl")
    assert [r.data["a"] for r in load_rows(str(tmp_path), "test")] == ["z"]
    with pytest.raises(DataError, match="no data file for split 'validation'"):
        load_rows(str(tmp_path), "validation")


def test_parquet_and_plain_folder(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"a": ["p", "q"]}), tmp_path / "part-0.parquet")
    _jsonl(tmp_path / "part-1.jsonl", [{"a": "r"}])
    assert [r.data["a"] for r in load_rows(str(tmp_path))] == ["p", "q", "r"]


def test_save_to_disk_folders_read_by_split(tmp_path):
    """A DatasetDict saved with save_to_disk reads by split (its json files are not rows, the test
    split does not leak into train); a saved Dataset reads as train; other splits are refused."""
    import datasets

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"a": ["x", "y"]}),
                               "test": datasets.Dataset.from_dict({"a": ["z"]})})
    dd.save_to_disk(str(tmp_path / "dd"))
    assert [r.data["a"] for r in load_rows(str(tmp_path / "dd"), "train")] == ["x", "y"]
    assert [r.data["a"] for r in load_rows(str(tmp_path / "dd"), "test")] == ["z"]
    with pytest.raises(DataError, match="without split 'validation' \\(splits: train, test\\)"):
        load_rows(str(tmp_path / "dd"), "validation")
    dd["train"].save_to_disk(str(tmp_path / "ds"))
    rows = load_rows(str(tmp_path / "ds"))
    assert [r.data["a"] for r in rows] == ["x", "y"] and rows[1].index == 1
    with pytest.raises(DataError, match="has no splits"):
        load_rows(str(tmp_path / "ds"), "test")
    from treadle.trainer.data.sources import data_files

    assert {p.name for p in data_files(str(tmp_path / "dd"), "test")} >= {"state.json", "dataset_info.json"}


def test_bad_json_line_is_named(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"a": "x"}\n{"a": oops}\n')
    with pytest.raises(DataError, match=r"d\.jsonl row 1: not valid JSON"):
        load_rows(str(f))


def test_missing_or_wrong_key_names_file_row_and_key(tmp_path, tokenizer):
    f = _jsonl(tmp_path / "d.jsonl", [{"question": "q", "response": "r"}, {"question": "q2"}, {"question": "q", "response": 3}])
    fmt = Formatter(tokenizer, input_template=None, apply_chat_template=False)
    rows = load_rows(str(f))
    with pytest.raises(DataError, match=r"d\.jsonl row 1: key 'response': missing or null"):
        sft_samples(rows, fmt, input_key="question", output_key="response", multiturn=False, pretrain=False, max_len=64)
    with pytest.raises(DataError, match=r"d\.jsonl row 2: key 'response': expected a non-empty str, got 3"):
        sft_samples(rows[2:], fmt, input_key="question", output_key="response", multiturn=False, pretrain=False, max_len=64)


def test_mixing_follows_probabilities_and_repeats_small_sets():
    a = [Row(data={"k": f"a{i}"}, file="a", index=i) for i in range(1000)]
    b = [Row(data={"k": f"b{i}"}, file="b", index=i) for i in range(10)]
    out = mix([a, b], [0.7, 0.3], max_samples=600, seed=1)
    share_b = sum(r.file == "b" for r in out) / len(out)
    assert len(out) == 600 and 0.25 < share_b < 0.35
    firsts = [r.index for r in out if r.file == "b"][:12]
    assert firsts == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]  # in order, starting over when exhausted
    assert [r.index for r in mix([a], [1.0], max_samples=3, seed=0)] == [0, 1, 2]
    assert mix([a, b], [0.7, 0.3], 600, 1) == out  # deterministic


def test_load_mixture_of_two_files(tmp_path):
    fa = _jsonl(tmp_path / "a.jsonl", [{"x": i} for i in range(20)])
    fb = _jsonl(tmp_path / "b.jsonl", [{"x": 100 + i} for i in range(20)])
    rows = load_mixture([str(fa), str(fb)], [0.5, 0.5], "train", max_samples=30, seed=0)
    assert len(rows) == 30 and {r.file for r in rows} == {str(fa), str(fb)}


def test_text_template_targets_only_the_answer_and_eos(tokenizer):
    fmt = Formatter(tokenizer, input_template="User: {}\nAssistant: ", apply_chat_template=False)
    row = Row(data={"q": "repeat fox", "r": "fox"}, file="f", index=0)
    (s,), dropped = sft_samples([row], fmt, input_key="q", output_key="r", multiturn=False, pretrain=False, max_len=99)
    prompt = tokenizer("User: repeat fox\nAssistant: ", add_special_tokens=False)["input_ids"]
    answer = tokenizer("fox", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    seq = s.seqs[0]
    assert seq.ids.tolist() == prompt + answer and dropped == 0
    assert seq.target.tolist() == [False] * len(prompt) + [True] * len(answer)
    (p,), _ = sft_samples([row], fmt, input_key="q", output_key="r", multiturn=False, pretrain=True, max_len=99)
    assert p.seqs[0].target.tolist() == [False] + [True] * (len(seq.ids) - 1)


def _decoded_targets(tok, seq: TokenSeq) -> str:
    return tok.decode(seq.ids[seq.target].tolist())


def test_chat_multiturn_learns_every_assistant_turn_else_only_the_last(tokenizer, data):
    fmt = Formatter(tokenizer, input_template=None, apply_chat_template=True)
    row = load_rows(str(data.chat))[0]
    msgs = row.data["messages"]
    (last,), _ = sft_samples([row], fmt, input_key="messages", output_key=None, multiturn=False, pretrain=False, max_len=999)
    (both,), _ = sft_samples([row], fmt, input_key="messages", output_key=None, multiturn=True, pretrain=False, max_len=999)
    assert _decoded_targets(tokenizer, last.seqs[0]) == msgs[3]["content"] + "<|im_end|>\n"
    assert _decoded_targets(tokenizer, both.seqs[0]) == msgs[1]["content"] + "<|im_end|>\n" + msgs[3]["content"] + "<|im_end|>\n"
    assert last.seqs[0].ids.tolist() == tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=False)
    with pytest.raises(DataError, match="no assistant message"):
        sft_samples([Row(data={"m": [{"role": "user", "content": "hi"}]}, file="c.jsonl", index=4)], fmt,
                    input_key="m", output_key=None, multiturn=True, pretrain=False, max_len=99)


def test_truncation_and_dropping(tokenizer):
    fmt = Formatter(tokenizer, input_template=None, apply_chat_template=False)
    rows = [Row(data={"q": "repeat " * 30, "r": "fox"}, file="f", index=0),
            Row(data={"q": "hi", "r": "fox golf hotel india"}, file="f", index=1)]
    out, dropped = sft_samples(rows, fmt, input_key="q", output_key="r", multiturn=False, pretrain=False, max_len=8)
    assert dropped == 1 and len(out) == 1 and len(out[0].seqs[0].ids) <= 8 and out[0].index == 0


def test_pairs_share_the_prompt_and_read_the_margin(tokenizer, data):
    fmt = Formatter(tokenizer, input_template=None, apply_chat_template=True)
    rows = load_rows(str(data.pref))[:3]
    out, _ = pair_samples(rows, fmt, prompt_key="prompt", chosen_key="chosen", rejected_key="rejected",
                          margin_key="margin", max_len=999)
    c, r = out[0].seqs
    start_c, start_r = int(c.target.argmax()), int(r.target.argmax())
    assert start_c == start_r and c.ids[:start_c].tolist() == r.ids[:start_r].tolist()
    assert _decoded_targets(tokenizer, c) == rows[0].data["chosen"] + "<|im_end|>\n" and out[0].margin == 0.5


def test_kto_pairs_each_prompt_with_the_next_rows_answer(tokenizer, data):
    fmt = Formatter(tokenizer, input_template=None, apply_chat_template=False)
    rows = load_rows(str(data.kto))[:3]
    out, _ = kto_samples(rows, fmt, input_key="input", output_key="output", label_key="label", max_len=999)
    assert [s.desirable for s in out] == [r.data["label"] for r in rows]
    mismatched = out[0].seqs[1]
    assert _decoded_targets(tokenizer, mismatched) == rows[1].data["output"] + "<|im_end|>"
    assert mismatched.ids[: int(mismatched.target.argmax())].tolist() == out[0].seqs[0].ids[: int(out[0].seqs[0].target.argmax())].tolist()
    with pytest.raises(DataError, match="key 'label': expected true/false or 1/0, got 7"):
        kto_samples([Row(data={"input": "a", "output": "b", "label": 7}, file="k", index=0)], fmt,
                    input_key="input", output_key="output", label_key="label", max_len=9)


def _sample(lengths: list[int], index: int = 0) -> Sample:
    seqs = tuple(TokenSeq.of(list(range(1, n + 1)), [True] * n) for n in lengths)
    return Sample(seqs=seqs, index=index)


def test_padded_and_packed_layouts():
    samples = [_sample([3, 2], 0), _sample([1, 4], 1)]
    pad = pad_batch(samples, pad_id=0)
    assert pad.input_ids.shape == (4, 4) and pad.attention_mask.sum().item() == 10
    assert pad.last_index.tolist() == [2, 5, 8, 15] and pad.seq_index[1].tolist() == [1, 1, -1, -1]
    pack = pack_batch(samples, fillers=1)
    assert pack.input_ids.shape == (1, 10) and pack.attention_mask is None
    assert pack.position_ids[0].tolist() == [0, 1, 2, 0, 1, 0, 0, 1, 2, 3]
    assert pack.last_index.tolist() == [2, 4, 5, 9] and pack.sample_weight.tolist() == [1.0, 0.0]
    # first token of every sequence is never a target (it would be predicted across sequences)
    assert pack.target_mask[0, [0, 3, 5, 6]].tolist() == [False] * 4
    flat_pad = pad.input_ids.reshape(-1)[pad.attention_mask.reshape(-1).bool()]
    assert flat_pad.tolist() == pack.input_ids[0].tolist()


def test_token_budget_groups_and_equal_counts():
    samples = [_sample([n], i) for i, n in enumerate([5, 5, 3, 8, 2, 2])]
    groups = by_tokens(samples, budget=10)
    assert [[s.index for s in g] for g in groups] == [[0, 1], [2], [3, 4], [5]]
    assert [[s.index for s in g] for g in by_count(samples, 4)] == [[0, 1, 2, 3], [4, 5]]
    split = split_to(by_tokens(samples, 100), 3)  # one group of 25 tokens -> 3, halving the biggest
    assert [[s.index for s in g] for g in split] == [[0], [1, 2], [3, 4, 5]]
    assert [s.index for g in split for s in g] == list(range(6))
    with pytest.raises(ValueError):
        split_to([samples[:2]], 3)


def test_step_order_is_deterministic_disjoint_and_resumable():
    order = StepOrder(num_samples=20, batch_size=8, world=2, seed=3)
    assert order.steps_per_epoch == 2
    epoch0 = [order.rank_share(0, s, r) for s in range(2) for r in range(2)]
    flat = [i for share in epoch0 for i in share]
    assert len(flat) == len(set(flat)) == 16 and all(len(s) == 4 for s in epoch0)
    again = StepOrder(num_samples=20, batch_size=8, world=2, seed=3)
    assert again.rank_share(0, 1, 1) == epoch0[3]  # a resumed run sees the same samples
    assert order.rank_share(1, 0, 0) != order.rank_share(0, 0, 0)
    assert np.array_equal(order.permutation(1), again.permutation(1))
    with pytest.raises(ValueError, match="fewer than --train.batch_size"):
        StepOrder(num_samples=4, batch_size=8, world=2, seed=0)


def test_eval_share_pads_with_weightless_fillers():
    assert eval_share(5, 2, 0) == ([0, 2, 4], 0)
    assert eval_share(5, 2, 1) == ([1, 3, 1], 1)


def test_sample_cache_round_trips_every_field_without_pickle(tmp_path):
    from treadle.trainer.data import cache

    samples = [Sample(seqs=(TokenSeq.of([5, 6, 7], [False, True, True]), TokenSeq.of([5, 9], [False, True])),
                      index=0, margin=0.5, desirable=False),
               Sample(seqs=(TokenSeq.of([1, 2], [False, True]), TokenSeq.of([3, 4, 8, 8], [False, False, True, True])),
                      index=1)]
    path = cache.save(tmp_path / "c" / "x.npz", {"train": samples, "eval": []}, dropped=3)
    splits, dropped = cache.load(path)
    assert dropped == 3 and splits["eval"] == [] and not list(path.parent.glob(".*tmp"))
    for a, b in zip(samples, splits["train"], strict=True):
        assert (a.index, a.margin, a.desirable, len(a.seqs)) == (b.index, b.margin, b.desirable, len(b.seqs))
        for qa, qb in zip(a.seqs, b.seqs, strict=True):
            assert qb.ids.dtype == np.int64 and np.array_equal(qa.ids, qb.ids) and np.array_equal(qa.target, qb.target)
    with np.load(path, allow_pickle=False) as z:  # plain arrays only: loading never unpickles
        assert all(z[k].dtype != object for k in z.files)


def test_cache_fingerprint_follows_files_tokenizer_and_settings(tmp_path, tokenizer):
    import copy
    import os

    from treadle.trainer.data import cache

    f = _jsonl(tmp_path / "d.jsonl", [{"a": "x"}])

    def key(tok=tokenizer, settings=None) -> str:
        stamps = [cache.file_stamp(str(f), [f]), cache.file_stamp("org/hub-name", None)]
        return cache.fingerprint(settings=settings or {"max_len": 8}, tokenizer=tok, stamps=stamps)

    base = key()
    assert key() == base and key(settings={"max_len": 9}) != base
    other = copy.deepcopy(tokenizer)
    other.chat_template = "{{ messages }}"
    assert key(tok=other) != base
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))  # the data file changed
    assert key() != base
