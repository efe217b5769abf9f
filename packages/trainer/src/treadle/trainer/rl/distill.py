"""On-policy distillation: a frozen teacher's log-probs on the student's own samples as a per-token
reverse-KL advantage (``--teacher.model_name_or_path``, ``--teacher.kl_coef``).

The student pi samples y; the teacher T scores the same tokens (one forward, no gradients). The
reverse KL KL(pi || T) = E_{y ~ pi}[sum_t log pi(y_t) - log T(y_t)] has the policy gradient
E[sum_t d_t grad log pi(y_t)] with d_t = log pi(y_t) - log T(y_t) (the k1 estimate, ``rl.kl``),
when the future terms are dropped, i.e. with discount 0. So each sampled token gets

    a^T_t = -beta_T * clamp(d_t, -KL_BOUND, KL_BOUND)

added to its advantage, after the estimator (its baseline, whitening or group normalisation) and
unnormalised: A_t = A^task_t + a^T_t, then the usual clipped, importance-weighted policy loss.
That is Thinking Machines' "On-Policy Distillation" (Lu et al., 2025: the negative reverse KL as
per-token advantage, discount 0, kl_penalty_coef 1, added to the task advantages) and verl's
``distillation_loss.use_policy_gradient`` with ``loss_mode k1`` (its default way, -k1 detached as
the advantage of a policy-gradient term). Because it bypasses the estimator, every estimator
takes it, GRPO's included; with no task reward (or a constant one) the task advantages are 0 and
the run is pure distillation. The critic's returns (gae) do not include it: with discount 0 no
value is needed.

d_t uses the trainer's logprobs of the sampling policy (``old_logp``, as the reference KL does)
and the teacher's at the same sampling temperature; both are detached: the signal is a reward,
its gradient comes only through log pi in the policy loss. The reference KL
(``--algo.kl.*``) is independent: it stays in the reward or the loss as configured (set
``--algo.kl.init_coef 0`` for the teacher alone). The clamp is the reference KL's bound.

Not here: the teacher's forward (``rl.update.score``), loading it (``trainers.ppo_build``).
"""

from __future__ import annotations

from torch import Tensor

from treadle.trainer.rl._masked import as_float, check_shapes, zero_pad
from treadle.trainer.rl.kl import KL_BOUND, kl_k1


def distill_advantages(logp: Tensor, teacher_logp: Tensor, mask: Tensor, coef: float,
                       bound: float | None = KL_BOUND) -> Tensor:
    """a_t = -coef * clamp(logp_t - teacher_logp_t, -bound, bound) on action tokens, 0 on padding.

    ``logp``, ``teacher_logp``: ``[B, L]`` log-probs of the sampled tokens under the student and
    the teacher; ``mask``: ``[B, L]`` bool. Returns ``[B, L]`` float (detached inputs expected)."""
    m = check_shapes(mask, logp=logp, teacher_logp=teacher_logp)
    return zero_pad(-coef * kl_k1(logp, teacher_logp, bound), m)


def reverse_kl(logp: Tensor, teacher_logp: Tensor, mask: Tensor) -> float:
    """Token mean over the batch's action tokens of d_t = logp_t - teacher_logp_t (unclamped): the
    k1 estimate of KL(pi || T) per response token, on samples of pi. ``[B, L]`` in, a float out."""
    m = check_shapes(mask, logp=logp, teacher_logp=teacher_logp)
    d = zero_pad(as_float(logp) - as_float(teacher_logp), m)
    return float(d.sum() / m.sum().clamp(min=1))
