"""The reward model: a tiny Qwen2ForSequenceClassification scored directly and through the daemon."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from treadle.rewards.client import HttpRewardClient, SyncRewardClient
from treadle.rewards.config import RMConfig, ShapingConfig, WorkerConfig

torch = pytest.importorskip("torch")
TEXTS = ["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello there<|im_end|>",
         "a much longer text than the others, so that the batch is padded " * 3, "short"]


def reference_scores(path, texts, max_len=None):
    """One text per forward pass (no padding), straight from transformers; the last ``max_len`` tokens."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        ids = [tok(t, return_tensors="pt", add_special_tokens=False)["input_ids"] for t in texts]
        return [model(input_ids=i[:, -max_len:] if max_len else i).logits[0, 0].item() for i in ids]


def test_scorer_matches_unpadded_forward_passes(tiny_rm):
    from treadle.rewards.rm import RewardModelScorer

    scorer = RewardModelScorer(str(tiny_rm), micro_batch_size=8)
    got = scorer.score_texts(TEXTS)
    np.testing.assert_allclose(got, reference_scores(tiny_rm, TEXTS), atol=1e-5)
    assert len(set(np.round(got, 6))) == 3  # a random head still tells the texts apart
    assert scorer.provenance["architecture"] == "Qwen2ForSequenceClassification"
    assert len(scorer.provenance["sha256"]) == 64


def test_normalize_uses_the_saved_mean_and_std(tiny_rm, tmp_path):
    from treadle.rewards.rm import RewardModelScorer

    path = tmp_path / "rm"
    shutil.copytree(tiny_rm, path)
    with pytest.raises(ValueError, match="mean"):
        RewardModelScorer(str(path), normalize=True)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "mean": 0.5, "std": 2.0}))
    raw = RewardModelScorer(str(path)).score_texts(TEXTS[:1])[0]
    assert RewardModelScorer(str(path), normalize=True).score_texts(TEXTS[:1])[0] == pytest.approx((raw - 0.5) / 2.0)


def test_daemon_serves_the_model_alone_and_combined(serve, tiny_rm):
    ref = reference_scores(tiny_rm, TEXTS)
    d = serve(rm=RMConfig(path=str(tiny_rm), micro_batch_size=4))
    with SyncRewardClient(d.daemon.addresses.zmq) as z:
        res = z.score(TEXTS)
    np.testing.assert_allclose(res.rewards, ref, atol=1e-5)
    via_http = HttpRewardClient(d.daemon.addresses.http).get_reward(TEXTS)
    np.testing.assert_allclose(via_http["rewards"], ref, atol=1e-5)
    assert res.provenance["components"][0]["kind"] == "model"

    both = serve(functions=("format",), weights=(2.0,), rm=RMConfig(path=str(tiny_rm), weight=0.5),
                 workers=WorkerConfig(num_workers=1), score_from="format")
    with SyncRewardClient(both.daemon.addresses.zmq) as z:
        res = z.score(TEXTS)
    np.testing.assert_allclose(res.rewards, 0.5 * np.asarray(ref), atol=1e-5)  # no text has the format
    assert res.scores.tolist() == [0.0, 0.0, 0.0] and res.extra_logs["rm/reward"][0] == pytest.approx(ref[0], abs=1e-5)


def test_replicas_score_batches_at_once_and_alike(serve, tiny_rm):
    """``--rm.replicas 2`` (a reward model apart on 2 GPUs; 2 copies on CPU here): the daemon's
    batcher runs two batches at once, one per copy, and each text gets the one model's score."""
    import concurrent.futures

    from treadle.rewards.rm import replica_devices

    assert replica_devices("cpu", 3) == ["cpu"] * 3 and replica_devices("cuda:1", 1) == ["cuda:1"]
    ref = reference_scores(tiny_rm, TEXTS)
    d = serve(rm=RMConfig(path=str(tiny_rm), micro_batch_size=4, device="cpu", replicas=2))
    with SyncRewardClient(d.daemon.addresses.zmq) as z, concurrent.futures.ThreadPoolExecutor(4) as ex:
        results = list(ex.map(lambda _: z.score(TEXTS), range(4)))
    for res in results:
        np.testing.assert_allclose(res.rewards, ref, atol=1e-5)
    assert results[0].provenance["components"][0]["replicas"] == 2
    with pytest.raises(Exception, match="puts one copy on each GPU"):
        RMConfig(path="m", device="cuda:1", replicas=2)


def test_overlong_penalty_counts_the_model_tokenizers_tokens(serve, tiny_rm):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_rm)
    lengths = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in TEXTS]
    max_new, buffer = 20, 10
    d = serve(rm=RMConfig(path=str(tiny_rm)), shaping=ShapingConfig(overlong_buffer_len=buffer, max_new_tokens=max_new))
    with SyncRewardClient(d.daemon.addresses.zmq) as z:
        res = z.score(TEXTS)
    expected = [-min(max(n - (max_new - buffer), 0) / buffer, 1.0) for n in lengths]
    np.testing.assert_allclose(res.extra_logs["overlong_penalty"], expected, atol=1e-6)
    np.testing.assert_allclose(res.rewards, np.asarray(reference_scores(tiny_rm, TEXTS)) + expected, atol=1e-5)


def _with_config(src, dst, **changes):
    """A copy of the model folder ``src`` at ``dst`` with ``changes`` in config.json (None deletes a key)."""
    shutil.copytree(src, dst)
    cfg = {**json.loads((dst / "config.json").read_text()), **changes}
    (dst / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return dst


def test_openrlhfs_serve_rm_command_line_serves_get_reward(tiny_rm, tmp_path):
    """serve_remote_rm.sh's flags, with sdpa for flash_attention_2 (CPU), answer OpenRLHF's /get_reward."""
    from treadle.common.config import parse
    from treadle.rewards.config import ServeConfig
    from treadle.rewards.daemon import DaemonThread

    path = _with_config(tiny_rm, tmp_path / "rm", mean=0.5, std=2.0)
    cfg = parse(ServeConfig, ["--reward.model_name_or_path", str(path), "--port", "0", "--ds.param_dtype", "bf16",
                              "--ds.attn_implementation", "sdpa", "--reward.normalize_enable", "--data.max_len", "64",
                              "--batch_size", "2", "--zmq.endpoint", "tcp://127.0.0.1:0"])
    with DaemonThread(cfg) as d:
        reply = HttpRewardClient(d.daemon.addresses.http).get_reward(TEXTS)
        with SyncRewardClient(d.daemon.addresses.zmq) as z:
            prov = z.score(TEXTS).provenance
    expected = (np.asarray(reference_scores(tiny_rm, TEXTS, max_len=64)) - 0.5) / 2.0
    np.testing.assert_allclose(reply["rewards"], expected, atol=0.02)  # bf16
    rm = prov["components"][0]
    assert (rm["dtype"], rm["attn_implementation"], rm["normalize"], rm["max_len"], rm["micro_batch_size"]) == \
        ("bfloat16", "sdpa", True, 64, 2)


def test_an_openrlhf_format_checkpoint_loads_with_its_value_head(tiny_rm, tmp_path):
    """OpenRLHF's RewardModel saves the base config (no num_labels: 2 by default) and a head named by
    value_head_prefix; it scores as the same weights saved the HF way."""
    from safetensors.torch import load_file, save_file

    from treadle.rewards.rm import RewardModelScorer

    path = _with_config(tiny_rm, tmp_path / "openrlhf_rm", architectures=["RewardModel"], id2label=None,
                        label2id=None, value_head_prefix="value_head")
    weights = load_file(str(path / "model.safetensors"))
    weights["value_head.weight"] = weights.pop("score.weight")
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    np.testing.assert_allclose(RewardModelScorer(str(path)).score_texts(TEXTS), reference_scores(tiny_rm, TEXTS),
                               atol=1e-5)

    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "value_head_prefix"}))
    assert RewardModelScorer(str(path), value_head_prefix="value_head").score_texts(TEXTS[:1]) == \
        pytest.approx(reference_scores(tiny_rm, TEXTS[:1]), abs=1e-5)  # --ds.value_head_prefix
    with pytest.raises(ValueError, match=r"no weights for score\.weight \(unused in it: value_head\.weight\)"):
        RewardModelScorer(str(path))  # never a random head


def test_flash_attention_is_refused_where_it_cannot_run(tiny_rm):
    from treadle.rewards.rm import RewardModelScorer

    with pytest.raises(ValueError, match="flash_attention_2 needs a CUDA device and the flash-attn package.*use sdpa"):
        RewardModelScorer(str(tiny_rm), device="cpu", attn_implementation="flash_attention_2")
