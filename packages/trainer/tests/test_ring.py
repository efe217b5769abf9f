"""Ring attention (issue 8): the zigzag layout (in process), and on 2 and 4 gloo ranks (torchrun,
``ring_scenarios.py``) the kernel, the model roles and the trainers against their ring-less selves.

- the ring kernel's outputs and dq, dk, dv equal plain causal attention of the whole row
  (<= 1e-5, fp32) for one sequence, packed sequences and uneven lengths, rings of 2 and 4;
- the tiny Qwen2 under ring attention gives the same log-probs, entropies, values and
  parameter gradients as with SDPA;
- SFT with ring size 2 (ZeRO-2, ZeRO-3; 1 data-parallel slot x 2 on 2 ranks, 2 x 2 on 4 ranks)
  has the losses, gradient norms and eval loss of ring size 1; so do RM, DPO and KTO.

The 4-rank training runs are ``slow`` (four processes on a 2-core machine); the rest runs in
two launches of about 15-25 s each. ``-m gpu`` on 2 GPUs repeats the 2-rank checks over NCCL.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from treadle.trainer.ring.layout import lengths_from_positions, zigzag_layout

HERE = Path(__file__).resolve().parent
TOL = 1e-5


# -- layout (pure) ---------------------------------------------------------------------------


@pytest.mark.parametrize("lengths", [[16], [7], [3, 9, 1, 4], [1, 1, 1], [40, 2]])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_every_token_lands_on_exactly_one_slot_and_comes_back(lengths, size):
    lay = [zigzag_layout(torch.tensor(lengths), size, r) for r in range(size)]
    slots = torch.cat([x.local_index for x in lay])  # the all-gathered [R * T_local] order
    assert torch.equal(slots[lay[0].unshard_index], torch.arange(sum(lengths)))
    assert sorted(slots[slots >= 0].tolist()) == list(range(sum(lengths)))
    assert len({x.local_length for x in lay}) == 1  # equal-sized messages around the ring


def test_zigzag_gives_each_rank_an_early_and_a_late_chunk_of_every_sequence():
    # lengths 8 and 3 on a ring of 2: chunks of 2 and 1 (3 padded to 4); rank 0 keeps chunks 0 and 3.
    lay = zigzag_layout(torch.tensor([8, 3]), 2, 0)
    assert lay.positions[0].tolist() == [0, 1, 6, 7, 0, 3]
    assert lay.positions[1].tolist() == [2, 3, 4, 5, 1, 2]
    assert lay.local_index.tolist() == [0, 1, 6, 7, 8, -1]  # position 3 of the short sequence is padding
    assert lay.seq.tolist() == [0, 0, 0, 0, 1, 1]
    assert lay.front.tolist() == [0, 1, 4] and lay.back.tolist() == [2, 3, 5]
    assert lay.cu_seqlens.tolist() == [0, 4, 6] and lay.max_seqlen == 4


def test_causal_work_is_balanced_across_the_ring():
    size, n = 4, 64
    work = [sum(p + 1 for p in zigzag_layout(torch.tensor([n]), size, r).positions[r].tolist()) for r in range(size)]
    assert len(set(work)) == 1  # each rank's queries see the same number of keys in total


def _flash_mask(blk, a, b, lo, hi):
    """The mask cuda_flash's varlen kernels apply to a tile: same sequence, and on the diagonal
    step bottom-right causal within each sequence's (queries, keys) segment pair."""
    from treadle.trainer.ring.blocks import flash_segments

    cu_q, cu_k, _, _ = flash_segments(blk.seq_q[a:b], blk.seq_k[lo:hi])
    mask = torch.zeros(b - a, hi - lo, dtype=torch.bool)
    for s in range(cu_q.shape[0] - 1):
        q0, q1, k0, k1 = (int(x) for x in (cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]))
        seg = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool)
        mask[q0:q1, k0:k1] = seg.tril(diagonal=(k1 - k0) - (q1 - q0)) if blk.diagonal else seg
    return mask


@pytest.mark.parametrize("lengths", [[16], [7], [3, 9, 1, 4], [40, 2], [5, 64, 3]])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_cuda_flash_segments_apply_exactly_the_ring_masks(lengths, size):
    """Every tile of every ring step, cut as cuda_flash cuts them (one tile a step) and as the
    small-budget CPU plans do: the varlen kernels' segment masks equal the ring's masks."""
    from treadle.trainer.ring.blocks import plan

    for r in range(size):
        lay = zigzag_layout(torch.tensor(lengths), size, r)
        for budget in (1 << 40, 37):
            for blk in plan(lay, torch.device("cpu"), budget=budget, kernel="math").blocks:
                for a, b, lo, hi in blk.tiles:
                    assert torch.equal(_flash_mask(blk, a, b, lo, hi), blk.mask(a, b, lo, hi)), (r, budget)


def test_lengths_come_from_restarting_positions():
    assert lengths_from_positions(torch.tensor([[0, 1, 2, 0, 0, 1]])).tolist() == [3, 1, 2]
    with pytest.raises(ValueError, match="position 0"):
        lengths_from_positions(torch.tensor([[1, 2]]))


def test_recipes_without_ring_support_still_refuse_it():
    from types import SimpleNamespace

    from treadle.common.config import ConfigError
    from treadle.trainer.trainers.build import _refuse_unavailable

    ds = SimpleNamespace(ring_attn_size=2, use_liger_kernel=False, use_universal_ckpt=False, enable_sleep=False,
                         tensor_parallel_size=1)
    cfg = SimpleNamespace(ds=ds, actor=SimpleNamespace(aux_loss_coef=0.0))
    _refuse_unavailable(cfg, ring_supported=True)
    with pytest.raises(ConfigError, match="ring_attn_size"):
        _refuse_unavailable(cfg, ring_supported=False)


def test_a_ring_model_called_without_its_shard_fails_loudly(tiny):
    from treadle.trainer.config.deepspeed import DeepSpeedConfig
    from treadle.trainer.models.loading import load_causal_lm

    model = load_causal_lm(str(tiny), DeepSpeedConfig(param_dtype="fp32", packing_samples=True, ring_attn_size=2),
                           trainable=False)
    assert model.config._attn_implementation == "treadle_ring"
    with pytest.raises(RuntimeError, match="ring shard"):
        model(input_ids=torch.tensor([[5, 6, 7]]))


# -- distributed -------------------------------------------------------------------------------


def _launch(run_torchrun, tiny, data, out: Path, nproc: int, only: str, only_sft: str = "") -> dict:
    script = [str(HERE / "ring_scenarios.py")]
    if importlib.util.find_spec("datasets") is None:  # the GPU machine: jsonl read without HF datasets
        script = [str(HERE / "gpu_run.py"), *script]
    run_torchrun([*script, "--model", str(tiny), "--data", str(data.sft.parent), "--out", str(out), "--only", only,
                  "--only_sft", only_sft], nproc=nproc)
    return json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def two(tiny, data, tmp_path_factory, run_torchrun):
    return _launch(run_torchrun, tiny, data, tmp_path_factory.mktemp("ring2"), 2, "attention,model,sft,recipes")


@pytest.fixture(scope="module")
def four(tiny, data, tmp_path_factory, run_torchrun):
    return _launch(run_torchrun, tiny, data, tmp_path_factory.mktemp("ring4"), 4, "attention,model")


def _check_attention(results: dict, sizes: list[int]) -> None:
    att = results["attention"]
    assert sorted({int(k.split("/")[0][1:]) for k in att}) == sizes
    for case, d in att.items():
        assert d["scale"] > 0.5, case  # the comparison is not between zeros
        for what in ("out", "dq", "dk", "dv"):
            assert d[what] <= TOL, (case, what, d[what])


def _check_model(results: dict, sizes: list[int]) -> None:
    assert sorted(results["model"]) == [f"R{s}" for s in sizes]
    for size, d in results["model"].items():
        assert d["attn"] == 0 and d["missing_grads"] == 0, size
        assert d["grad_scale"] > 0.1
        for what in ("logprobs", "entropy", "values", "grads"):
            assert d[what] <= TOL, (size, what, d[what])


def _check_same_run(a: dict, b: dict) -> None:
    assert a["tokens"] == b["tokens"]
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    assert b["eval"]["eval_loss"] == pytest.approx(a["eval"]["eval_loss"], rel=1e-5)


def test_ring_kernel_equals_full_attention_on_a_ring_of_two(two):
    assert two["world"] == 2
    _check_attention(two, [2])


def test_ring_kernel_equals_full_attention_on_rings_of_two_and_four(four):
    assert four["world"] == 4
    _check_attention(four, [2, 4])


def test_model_roles_on_a_ring_equal_their_sdpa_selves(two, four):
    _check_model(two, [2])
    _check_model(four, [2, 4])


def test_sft_with_ring_two_matches_ring_one_on_two_ranks(two):
    s = two["sft"]
    assert s["ring1_zero2"]["loss"][-1] < s["ring1_zero2"]["loss"][0]  # it trains
    _check_same_run(s["ring1_zero2"], s["ring2_zero2"])
    _check_same_run(s["ring1_zero2"], s["ring2_zero3"])


@pytest.mark.parametrize("recipe", ["rm", "dpo", "kto"])
def test_preference_recipes_with_ring_two_match_ring_one(two, recipe):
    a, b = two["recipes"][f"{recipe}_ring1"], two["recipes"][f"{recipe}_ring2"]
    assert len(a) == 2 and a[0] != a[1]
    assert b == pytest.approx(a, rel=1e-5, abs=1e-6)


@pytest.mark.slow
def test_recipes_on_two_slots_of_ring_two_match_four_ranks_without(tiny, data, tmp_path, run_torchrun):
    r = _launch(run_torchrun, tiny, data, tmp_path, 4, "sft,recipes", "ring1_zero2,ring2_zero3")
    _check_same_run(r["sft"]["ring1_zero2"], r["sft"]["ring2_zero3"])
    for recipe in ("rm", "dpo", "kto"):
        a, b = r["recipes"][f"{recipe}_ring1"], r["recipes"][f"{recipe}_ring2"]
        assert b == pytest.approx(a, rel=1e-5, abs=1e-6), recipe


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_ring_on_two_gpus_over_nccl(tiny, data, tmp_path, run_torchrun):
    """The same equalities on 2 GPUs (NCCL; the PyTorch ring in fp32, where ring-flash-attn has no kernel)."""
    r = _launch(run_torchrun, tiny, data, tmp_path, 2, "attention,model,sft")
    _check_attention(r, [2])
    _check_model(r, [2])
    _check_same_run(r["sft"]["ring1_zero2"], r["sft"]["ring2_zero2"])
    _check_same_run(r["sft"]["ring1_zero2"], r["sft"]["ring2_zero3"])


def test_a_head_stride_that_does_not_divide_the_heads_is_refused_before_the_process_group(tiny, monkeypatch):
    """``--ds.ring_attn_head_stride`` is checked against the model's config.json at start (it was
    refused only inside the first forward, after the models had loaded)."""
    import json

    from treadle.common.config import ConfigError
    from treadle.trainer.config import parse_command
    from treadle.trainer.ring.attention import head_stride_error
    from treadle.trainer.trainers import build

    kv = json.loads((tiny / "config.json").read_text())["num_key_value_heads"]
    assert head_stride_error(kv, 2 * kv, kv) is None and head_stride_error(kv + 1, 2 * kv, kv) is not None
    cfg = parse_command("sft", ["--actor.model_name_or_path", str(tiny), "--data.dataset", "d",
                                "--ds.ring_attn_size", "2", "--ds.ring_attn_head_stride", str(kv + 1),
                                "--ds.packing_samples"])
    monkeypatch.setattr(build, "missing_packages", lambda c: [])
    monkeypatch.setattr(build, "init_distributed", lambda **k: pytest.fail("joined the process group"))
    with pytest.raises(ConfigError, match=rf"--ds\.ring_attn_head_stride {kv + 1} must divide the {kv} key/value "
                                          rf"heads .* of {tiny}"):
        build.start(cfg, ring_supported=True)
