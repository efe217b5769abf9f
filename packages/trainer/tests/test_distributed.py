"""Training on 2 gloo ranks (torchrun) with the tiny model: the invariances and behaviours of
issue 6, from one launch of ``dist_scenarios.py`` (see its docstring for what each scenario runs).

- splitting a step differently (micro-batch size, token-budget packing) gives the gradient of
  the plain token-mean loss of the whole step;
- ZeRO-0 and ZeRO-3, padded and packed (fixed or dynamic batches) give the same losses;
- a run resumed from a checkpoint continues exactly like the uninterrupted run;
- RM, DPO and KTO lower their losses, and their exports load in transformers;
- the RM run's metrics also went to an offline W&B run (the API key not among them);
- a ZeRO-3-sharded reference scores like the replicated one while each rank keeps half of it;
- only rank 0 tokenises the datasets; rank 1 reads its cache file and gets identical samples;
- SFT with AutoTP over both ranks trains and exports like SFT without it.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
WANDB_KEY = "0123456789abcdef0123456789abcdef01234567"  # the fake key dist_scenarios.py gives the RM run


@pytest.fixture(scope="module")
def results(tiny, data, tmp_path_factory, run_torchrun):
    out = tmp_path_factory.mktemp("scenarios")
    run_torchrun([str(HERE / "dist_scenarios.py"), "--model", str(tiny), "--data", str(data.sft.parent), "--out", str(out)])
    return json.loads((out / "results.json").read_text())


def _losses(run: str) -> dict[int, float]:
    rows = [json.loads(line) for line in (Path(run) / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def test_two_ranks(results):
    assert results["world"] == 2


def test_gradient_is_the_same_however_the_step_is_split(results):
    g = results["grad_split"]
    assert g["micro_batches"]["micro1"] == 4 and g["micro_batches"]["micro4"] == 1
    assert g["micro_batches"]["packed_budget"] >= 2
    assert g["ref_norm"] > 0.1
    for name, diff in g["max_diff"].items():
        assert diff < 1e-6 * max(1.0, g["ref_norm"]), name


def test_zero0_and_zero3_give_the_same_losses(results):
    t = results["trajectories"]
    assert t["zero0"][-1] < t["zero0"][0]
    assert t["zero3"] == pytest.approx(t["zero0"], rel=1e-5)


def test_packed_and_padded_give_the_same_losses(results):
    t = results["trajectories"]
    assert t["zero2_packed"] == pytest.approx(t["zero0"], rel=1e-5)
    assert t["zero2_dynamic"] == pytest.approx(t["zero0"], rel=1e-5)


def test_resumed_run_equals_the_uninterrupted_one(results):
    r = results["resume"]
    full, part = _losses(r["full"]), _losses(r["part"])
    assert r["final_step"] == 8 and sorted(part) == [5, 6, 7, 8]
    assert [part[s] for s in part] == pytest.approx([full[s] for s in part], rel=1e-6, abs=1e-7)
    from safetensors.torch import load_file

    a = load_file(str(Path(r["full"]) / "model" / "model.safetensors"))
    b = load_file(str(Path(r["part"]) / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    kept = sorted(p.name for p in (Path(r["full"]) / "ckpt").glob("step_*"))
    assert kept == ["step_00000004", "step_00000006", "step_00000008"]  # --ckpt.max_num 3


@pytest.mark.parametrize("recipe", ["rm", "dpo", "kto"])
def test_each_recipe_lowers_its_loss(results, recipe):
    losses = list(_losses(results["recipes"][recipe]).values())
    assert len(losses) == 12
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < first - 0.05, losses


def test_reward_model_trained_with_zero3_loads_and_ranks_pairs(results, data, tokenizer):
    from transformers import AutoModelForSequenceClassification

    from treadle.trainer.data.formatting import Formatter, pair_samples
    from treadle.trainer.data.sources import load_rows

    model = AutoModelForSequenceClassification.from_pretrained(Path(results["recipes"]["rm"]) / "model").eval()
    assert model.config.num_labels == 1 and model.config.reward_std > 0
    fmt = Formatter(tokenizer, input_template=None, apply_chat_template=False)
    pairs, _ = pair_samples(load_rows(str(data.pref))[:24], fmt, prompt_key="prompt", chosen_key="chosen",
                            rejected_key="rejected", margin_key=None, max_len=512)
    with torch.no_grad():
        def score(seq):
            return model(input_ids=torch.as_tensor(seq.ids)[None]).logits[0, 0].item()

        right = sum(score(p.seqs[0]) > score(p.seqs[1]) for p in pairs)
    assert right / len(pairs) > 0.7
    assert (Path(results["recipes"]["rm"]) / "ckpt" / "curves.png").stat().st_size > 0


@pytest.mark.parametrize("recipe", ["dpo", "kto"])
def test_policy_exports_load_and_moved_away_from_the_start(results, tiny, recipe):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = Path(results["recipes"][recipe]) / "model"
    AutoModelForCausalLM.from_pretrained(out)
    start, trained = load_file(str(tiny / "model.safetensors")), load_file(str(out / "model.safetensors"))
    key = "model.layers.0.mlp.up_proj.weight"
    assert (start[key] - trained[key]).abs().max() > 1e-4


def test_zero3_reference_scores_like_the_replica_and_keeps_a_partition(results):
    r = results["reference_zero3"]
    assert r["max_diff"] == {"sharded": pytest.approx(0.0, abs=1e-6), "offloaded": pytest.approx(0.0, abs=1e-6)}
    # what a rank keeps after a forward: its 1/2 of every tensor + norms/biases kept whole (< 10 x hidden)
    assert all(n < 0.52 * r["full_numel"] for n in r["resident_numel"]), r
    assert r["offload_device"] == "cpu"
    # the ranks had different batch counts: the precomputation must have equalised them (else a hang)
    assert len(set(r["unequal_batches"])) == 2
    assert r["precompute_nonzero"] == 13 and r["precompute_max_diff"] < 1e-6


def _wandb_records(path: Path) -> list:
    """The protobuf records of a ``.wandb`` run file: a 7-byte header, then 32 KiB blocks of
    LevelDB-log chunks (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    out, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (length == 0 and kind == 0):  # block trailer padding
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(pending)
            out.append(rec)
            pending = b""
    return out


def test_rm_run_logged_its_metrics_to_an_offline_wandb_run(results):
    pytest.importorskip("wandb")
    root = Path(results["recipes"]["rm"]) / "ckpt"
    (run_file,) = root.glob("wandb/offline-run-*/run-*.wandb")
    records = _wandb_records(run_file)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.run_group, run.display_name) == ("treadle-test", "g1", "rm-offline")
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    logged = {h["_step"]: h["loss"] for h in history if "loss" in h}
    assert logged == pytest.approx(_losses(str(root.parent))) and len(logged) == 12
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["logger"]["wandb"]["key"] is None and config["train"]["max_epochs"] == 2
    assert WANDB_KEY.encode() not in run_file.read_bytes()


def test_only_rank0_tokenises_and_both_ranks_get_the_same_samples(results):
    t = results["tokenise_once"]
    assert t["first_calls"] == [2, 0]  # train + eval on rank 0, nothing on rank 1
    assert t["digest"][0] == t["digest"][1] and t["sizes"] == [32, 64]
    assert len(t["cache_files"]) == 1 and t["cache_files"][0].endswith(".npz")
    assert t["second_calls"] == [0, 0] and t["second_same"]  # a rebuild reuses the file
    assert t["errors"][0].startswith("DataError: ") and "bad.jsonl row 1: key 'response'" in t["errors"][0]
    assert "failed on another rank" in t["errors"][1]


def test_autotp_sft_matches_the_untensor_parallel_run(results):
    t = results["autotp"]
    assert t["rows"] == {"1": [128, 128], "2": [64, 64]}  # MLP rows: whole vs split across the two ranks
    # fp32: AutoTP only reorders sums (partial products all-reduced), ~1e-7 relative per step; a
    # gradient scaled by the wrong rank count would change the gradient norms by 2x.
    assert t["losses"]["2"] == pytest.approx(t["losses"]["1"], rel=1e-5)
    assert t["grad_norms"]["2"] == pytest.approx(t["grad_norms"]["1"], rel=1e-5)
    assert t["losses"]["1"][-1] < t["losses"]["1"][0]
    # exported from the shards, the weights equal the plain run's: off by Adam's reaction to those
    # rounding differences only (updates are ~1e-3 per step; a missing or misplaced shard is O(1))
    assert t["export_keys_equal"] and t["export_max_diff"] < 1e-4
