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


def reference_scores(path, texts):
    """One text per forward pass (no padding), straight from transformers."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return [model(**tok(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item() for t in texts]


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
