"""Flags that were accepted and never read, now doing what they say (issue 29):

- ``--rollout.vllm_generate_batch_size``: prompts per generation round; below ``--rollout.batch_size``
  a synchronous step takes several rounds, above it (async) a round over-samples and the producer
  waits for the steps to consume it, within the staleness bound;
- ``--critic.save_value_network``: the critic exported in HF format, loadable as a sequence
  classifier whose scores are the critic's values;
- ``--reward.offload``: the reward model visits the accelerator only while it scores.

The field walk that found them, and the flags refused instead, are in ``test_config_fields.py``.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from treadle.common.rpc import LoopThread
from treadle.trainer.config import parse_ppo
from treadle.trainer.config.deepspeed import DeepSpeedConfig
from treadle.trainer.rl.generation import Generator, Group, Prompt, PromptStream
from treadle.trainer.trainers.ppo import PPOTrainer

FP32 = DeepSpeedConfig(param_dtype="fp32", attn_implementation="sdpa")
PPO = ["--actor.model_name_or_path", "m", "--data.prompt_dataset", "p.jsonl", "--reward.remote_url", "r.py",
       "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "2",
       "--actor.num_gpus_per_node", "1", "--rollout.batch_size", "4", "--train.batch_size", "8"]


def _prompts(n: int) -> list[Prompt]:
    return [Prompt(prompt=f"p{i}", label=None) for i in range(n)]


def _wait_until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


class _Executor:
    """Finishes every episode at once; records the uids it ran."""

    def __init__(self) -> None:
        self.uids: list[str] = []

    async def run(self, episode: Any) -> Any:
        self.uids.append(episode.uid)
        return SimpleNamespace(uid=episode.uid, finish_reason="stop")


@pytest.fixture
def generator():
    lt = LoopThread(name="test-generator")
    ex = _Executor()
    gen = Generator(executor=ex, eval_executor=ex, n=1, lt=lt)
    yield gen, ex
    gen.stop()
    lt.stop()


def _started(ex: _Executor) -> int:
    return len(ex.uids)


def _settled(ex: _Executor, expected: int) -> None:
    """The producer started ``expected`` groups and, given time, no more."""
    _wait_until(lambda: _started(ex) >= expected)
    time.sleep(0.2)
    assert _started(ex) == expected


def test_async_rounds_over_sample_and_wait_for_the_steps_to_consume_them(generator):
    gen, ex = generator
    gen.publish(0)
    # rounds of 6 prompts, steps of 4 groups, 1 version ahead: at most (1 + 1) x 4 groups unconsumed
    gen.start_async(PromptStream(_prompts(40), episodes=1, seed=0), batch=6, per_step=4, max_ahead=1)
    _settled(ex, 6)  # a second round would put 12 > 8 ahead
    for _ in range(4):
        assert isinstance(gen.next_group(timeout=5), Group)
    _settled(ex, 6)  # taken, but the step is not trained yet
    gen.publish(1)  # step 1 consumed 4: 6 + 6 - 4 = 8
    _settled(ex, 12)
    for _ in range(6):
        gen.next_group(timeout=5)
    gen.publish(2)  # 10 consumed: 12 + 6 - 10 = 8
    _settled(ex, 18)
    for _ in range(8):  # the trainer takes every group started (a filter dropped them): it must not wait
        gen.next_group(timeout=5)
    _settled(ex, 24)


def test_async_rounds_of_one_step_keep_the_version_bound(generator):
    """The default (a step's prompts a round): round b starts once step b - max_ahead is trained, as
    the version gate it replaces did."""
    gen, ex = generator
    gen.publish(0)
    gen.start_async(PromptStream(_prompts(40), episodes=1, seed=0), batch=4, per_step=4, max_ahead=1)
    _settled(ex, 8)
    for _ in range(4):
        gen.next_group(timeout=5)
    gen.publish(1)
    _settled(ex, 12)


def _sync_trainer(*extra: str) -> tuple[PPOTrainer, list[int]]:
    """A PPOTrainer's rank-0 gathering side over fakes; the sizes of the rounds it generates."""
    cfg = parse_ppo([*PPO, *extra])
    rounds: list[int] = []

    def collect(items):
        rounds.append(len(items))
        return [Group(seq=seq, trajectories=[SimpleNamespace(uid=f"{seq}.0", finish_reason="stop", score=1.0,
                                                             reward=1.0)]) for seq, _ in items]

    trainer = PPOTrainer.__new__(PPOTrainer)
    trainer.cfg, trainer.version, trainer.pending = cfg, 0, collections.deque()
    trainer.p = SimpleNamespace(generator=SimpleNamespace(collect=collect),
                                trajlog=SimpleNamespace(append_group=lambda seq, trajs: None))
    trainer.stream = PromptStream(_prompts(16), episodes=1, seed=0)
    return trainer, rounds


def test_sync_steps_generate_in_rounds_of_the_generate_batch_size():
    trainer, rounds = _sync_trainer("--rollout.vllm_generate_batch_size", "2")
    trajs, dropped, _ = trainer.gather_batch()
    assert len(trajs) == 4 and not dropped and rounds == [2, 2]
    default, rounds = _sync_trainer()
    default.gather_batch()
    assert rounds == [4]


def test_critic_is_exported_as_a_sequence_classifier(tiny, tokenizer, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from treadle.trainer.models.critic import Critic

    torch.manual_seed(0)
    critic = Critic.from_pretrained(str(tiny), FP32).eval()
    cfg = parse_ppo([*PPO, "--algo.advantage.estimator", "gae", "--critic.model_name_or_path", str(tiny),
                     "--critic.save_value_network", "--ckpt.output_dir", str(tmp_path / "final"),
                     "--ds.param_dtype", "fp32"])
    trainer = PPOTrainer.__new__(PPOTrainer)
    trainer.cfg, trainer.dist = cfg, SimpleNamespace(is_main=True)
    trainer.p = SimpleNamespace(critic=SimpleNamespace(module=critic), tokenizer=tokenizer)
    trainer.export_critic(Path(cfg.critic_output_dir))
    out = tmp_path / "final_critic"
    hf = AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert hf.config.num_labels == 1 and (out / "tokenizer_config.json").is_file()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.allclose(critic(input_ids=ids)[0], hf.score(hf.model(input_ids=ids).last_hidden_state)[0, :, 0],
                              atol=1e-5)


class _Recorded(torch.nn.Linear):
    def __init__(self) -> None:
        super().__init__(2, 1)
        self.moves: list[str] = []

    def to(self, *args: Any, **kwargs: Any) -> Any:
        self.moves.append(str(args[0]))
        return super().to(*args, **kwargs)


def test_an_offloaded_reward_model_visits_the_device_only_to_score():
    from treadle.trainer.models.reward_model import on_device

    m = _Recorded()
    with on_device(m, torch.device("cpu"), offload=True):
        assert m.moves == ["cpu"]
    assert m.moves == ["cpu", "cpu"]
    kept = _Recorded()
    with on_device(kept, torch.device("cpu"), offload=False):
        pass
    assert kept.moves == []


@pytest.mark.gpu
def test_an_offloaded_reward_model_lives_in_cpu_memory_between_uses():
    from treadle.trainer.models.reward_model import on_device

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    m = torch.nn.Linear(4, 1)
    with on_device(m, torch.device("cuda"), offload=True):
        assert m.weight.is_cuda
        score = m(torch.ones(1, 4, device="cuda"))
    assert not m.weight.is_cuda and score.is_cuda


def test_a_reward_file_importing_what_treadle_lacks_is_refused_before_anything_loads(tmp_path, monkeypatch):
    """``build_parts`` refuses the file before the tokenizer or any model loads."""
    from treadle.common.config import ConfigError
    from treadle.trainer.trainers import build, ppo_build

    bad = tmp_path / "reward.py"
    bad.write_text("from openrlhf.utils import no_such_helper\n\n\ndef reward_func(queries, prompts, labels):\n"
                   "    return {'rewards': [0.0] * len(queries)}\n")
    args = [*PPO]
    args[args.index("r.py")] = str(bad)
    cfg = parse_ppo(args)
    monkeypatch.setattr(build, "start", lambda *a, **k: SimpleNamespace(is_main=True, world=1))
    monkeypatch.setattr(ppo_build, "load_tokenizer", lambda *a, **k: pytest.fail("loaded past the reward check"))
    with pytest.raises(ConfigError, match=r"--reward.remote_url .*no_such_helper"):
        ppo_build.build_parts(cfg)
    good = tmp_path / "good.py"
    good.write_text("from openrlhf.utils import extract_boxed_answer\n\n\ndef reward_func(queries, prompts, labels):\n"
                    "    return {'rewards': [0.0] * len(queries)}\n")
    args[args.index(str(bad))] = str(good)
    ppo_build.check_reward_file(parse_ppo(args))  # what treadle serves passes
    args[args.index(str(good))] = str(tmp_path / "missing.py")
    with pytest.raises(ConfigError, match="does not exist"):
        ppo_build.check_reward_file(parse_ppo(args))


def test_packages_a_run_needs_are_checked_at_start(monkeypatch, tmp_path):
    """A wheel install without matplotlib (or tensorboard, with its flag) is refused at start with
    the pip line, not after training when the curves are drawn."""
    from treadle.common.config import ConfigError
    from treadle.trainer.trainers import build

    cfg = parse_ppo([*PPO, "--logger.tensorboard_dir", str(tmp_path / "tb")])
    installed = {"matplotlib", "tensorboard"}
    assert build.missing_packages(cfg, find=lambda m: m if m in installed else None) == []
    missing = build.missing_packages(cfg, find=lambda m: None)
    assert missing == ["the curves every run draws (curves.png) needs matplotlib: pip install 'treadle-trainer[train]'",
                       "--logger.tensorboard_dir needs tensorboard: pip install 'treadle-trainer[tensorboard]'"]
    assert build.missing_packages(parse_ppo(PPO), find=lambda m: None) == missing[:1]  # tensorboard only when asked
    monkeypatch.setattr(build, "missing_packages", lambda c: missing)
    monkeypatch.setattr(build, "init_distributed", lambda **k: pytest.fail("joined the process group"))
    with pytest.raises(ConfigError, match=r"needs matplotlib: pip install 'treadle-trainer\[train\]'; --logger"):
        build.start(cfg)


def test_liger_is_refused_at_start_without_cuda_or_the_package(monkeypatch, tiny):
    """``--ds.use_liger_kernel`` (Triton kernels) is refused before the process group or any model:
    on a machine without CUDA, and without liger-kernel; every model folder the flags name is checked."""
    from treadle.common.config import ConfigError
    from treadle.trainer.models import loading
    from treadle.trainer.trainers import build

    cfg = parse_ppo([*PPO, "--ds.use_liger_kernel", "--reward.prm_model_name_or_path", "prm",
                     "--algo.advantage.estimator", "reinforce"])
    assert build.model_paths(cfg)[-1] == "prm" and len(build.model_paths(cfg)) == 2
    monkeypatch.setattr(build, "missing_packages", lambda c: [])
    monkeypatch.setattr(build, "init_distributed", lambda **k: pytest.fail("joined the process group"))
    with pytest.raises(ConfigError, match=r"^--ds\.use_liger_kernel needs CUDA"):
        build.start(cfg)
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"needs liger-kernel: pip install 'treadle-trainer\[liger\]'"):
        loading.check_liger([str(tiny)], cuda=True)


def test_the_episode_timeout_is_the_flags():
    """``--rollout.episode_timeout_s`` reaches the executor (it was 600 s, fixed in code: a 70B response
    of 6k tokens on a loaded pool failed its episode; docs/scaling.md); 0 is no limit, < 0 refused."""
    from treadle.common.config import ConfigError
    from treadle.trainer.trainers import ppo_build

    for value in ("0", "3600"):
        cfg = parse_ppo([*PPO, "--reward.remote_url", "math", "--rollout.episode_timeout_s", value])
        ex = ppo_build.executor(cfg, sampler=None, chat=None, sampling=ppo_build.sampling_of(cfg, temperature=1.0))
        assert ex.config.episode_timeout_s == float(value)
    with pytest.raises(ConfigError, match=r"--rollout\.episode_timeout_s must be >= 0 \(0: no limit\), got -1"):
        parse_ppo([*PPO, "--rollout.episode_timeout_s", "-1"])
