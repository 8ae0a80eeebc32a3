"""Trajectory distribution matching (TDM; Y. Luo et al., arXiv:2503.06674).

A K-step student with schedule ``1 = sigma_0 > sigma_1 > ... > sigma_K = 0`` is matched stage by
stage: the marginal of its state ``x_{k+1}`` at ``sigma_{k+1}`` should be the teacher's marginal at
that noise level, and since forward diffusion preserves that equality, both are compared after
diffusing further to a ``sigma_t`` inside the stage. Per transition ``k`` (upstream's "boundary"
``k + 1``), from the detached rollout state ``x_k``:

1. the student's live clean prediction and its implied noise (``flow.py``)
       v = v_theta(x_k, sigma_k),   x0 = x_k - sigma_k v,   eps_s = x0 + v      (eps_s detached);
   on the linear path ``x_{k+1} = (1 - sigma_{k+1}) x0 + sigma_{k+1} eps_s`` is exactly the Euler step;
2. a query level ``sigma_t`` in ``(sigma_{k+1}, sigma_k)`` (``tdm_query_interval: trajectory``) or
   ``(sigma_{k+1}, tdm_query_max_sigma)`` (``reverse``), drawn by ``sample_query_sigma``;
3. the conditional forward transition from ``x_{k+1}`` to ``sigma_t`` (``conditional_renoise``):
       x_t = (alpha_t / alpha_mid) x_{k+1} + beta xi,   beta^2 = sigma_t^2 - (alpha_t sigma_mid / alpha_mid)^2,
   with ``alpha = 1 - sigma``, ``sigma_mid = sigma_{k+1}``, ``xi ~ N(0, I)``; equivalently
   ``x_t = alpha_t x0 + sigma_t eps_mix``, ``eps_mix = (alpha_t sigma_mid / alpha_mid eps_s + beta xi) / sigma_t``;
4. generator (``tdm_generator_loss``): ``x0`` is revised towards ``x0 + (x0_real - x0_fake)`` with the
   real (teacher, guided) and fake scores' clean predictions at ``(x_t, sigma_t)``, normalised per
   sample by ``mean|x0 - x0_real|``, squared or pseudo-Huber (``use_huber``, ``huber_c``):
       d = x0 - sg(x0 + x0_real - x0_fake),
       L = mean_B [ mean_elems rho(d) / max(mean_elems |x0 - x0_real|, eps) ],
       rho(d) = d^2 / 2   or   sqrt(d^2 + c^2) - c;
   (the paper's eq. 9 gradient ``(s_fake - s_real)`` at the stage's diffused student marginal);
5. fake score (``tdm_fake_loss``): its clean prediction at the same ``x_t`` regresses the detached
   ``x0`` with the SNR weight ``min((1 - sigma_t)^2 / sigma_t^2, tdm_snr_gamma)`` and an importance
   ratio correcting the mixed noise ``eps_mix`` to a fresh Gaussian:
       log r = -1/2 mean_elems eps_mix^2 + 1/2 mean_elems xi^2,  clipped to +-log(tdm_importance_clip),
       L_fake = mean_B  r min(SNR, gamma) mean_elems (x0_fake - x0)^2.
   (Upstream averages the log-density ratio over elements, ``reduce_latent_values``, so it is a
   per-dimension ratio; kept as upstream has it.)

Upstream (Flow-Factory ``trainers/distillation/tdm.py``, ``tdm_trajectory.py``,
``tdm_time_sampling.py``, ``distribution_matching.py``) trains every one of the K transitions of a
rollout in one generator step (K accumulation units), ``ttur_fake_updates`` fake passes first.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .flow import as_batch_column, clean_from_velocity, mean_over_sample, noise_from_velocity

__all__ = ["QUERY_DISTRIBUTIONS", "QUERY_INTERVALS", "conditional_renoise", "query_interval", "revised_x0_loss",
           "sample_query_sigma", "snr_weight", "student_prediction", "tdm_fake_loss", "tdm_generator_loss"]

QUERY_INTERVALS = ("trajectory", "reverse")
QUERY_DISTRIBUTIONS = ("actual_uniform", "conditional_logit_normal", "source_uniform")


def student_prediction(x_k: Tensor, v: Tensor, sigma_k: Tensor | float) -> tuple[Tensor, Tensor]:
    """The student's clean prediction ``x0 = x_k - sigma_k v`` (keeps the gradient of ``v``) and the
    noise it implies ``eps_s = x0 + v`` (detached)."""
    x0 = clean_from_velocity(x_k.detach(), v, sigma_k)
    return x0, noise_from_velocity(x0, v).detach()


def query_interval(sigma_mid: Tensor, sigma_k: Tensor, interval: str = "trajectory",
                   max_sigma: float = 1.0) -> tuple[Tensor, Tensor]:
    """(lower, upper) noise levels a transition's score query is drawn between: the stage itself
    ``(sigma_{k+1}, sigma_k)`` or, for ``reverse``, ``(sigma_{k+1}, tdm_query_max_sigma)``."""
    if interval == "trajectory":
        upper = sigma_k
    elif interval == "reverse":
        upper = torch.full_like(sigma_mid, float(max_sigma))
    else:
        raise ValueError(f"tdm_query_interval must be one of {QUERY_INTERVALS}, got {interval!r}")
    if not bool((sigma_mid < upper).all()):
        raise ValueError(f"TDM query interval is empty: lower {sigma_mid.tolist()}, upper {upper.tolist()}")
    return sigma_mid, upper


def _shift(sigma: Tensor, gamma: float) -> Tensor:
    return gamma * sigma / (1 + (gamma - 1) * sigma)


def sample_query_sigma(lower: Tensor, upper: Tensor, distribution: str = "actual_uniform", *,
                       logit_mean: float = 0.0, logit_std: float = 1.0, source_shift: float | None = None,
                       generator: torch.Generator | None = None) -> Tensor:
    """One ``sigma_t`` per sample strictly inside ``(lower, upper)`` (upstream's three policies):

    - ``actual_uniform``: uniform in sigma;
    - ``conditional_logit_normal``: the logit-normal ``sigmoid(N(logit_mean, logit_std^2))`` truncated
      to the interval (inverse-CDF sampling in float64);
    - ``source_uniform``: uniform in the unshifted coordinate ``u`` of the rollout's flow shift
      ``sigma = s u / (1 + (s - 1) u)`` (``source_shift`` = s), mapped back.
    """
    lo, hi = lower.double(), upper.double()
    if not bool(((0 <= lo) & (lo < hi) & (hi <= 1)).all()):
        raise ValueError("TDM query intervals need 0 <= lower < upper <= 1")
    tiny = torch.finfo(torch.float64).eps
    f = torch.rand(lo.shape, generator=generator, dtype=torch.float64).to(lo.device).clamp(tiny, 1 - tiny)
    if distribution == "actual_uniform":
        out = lo + f * (hi - lo)
    elif distribution == "source_uniform":
        if source_shift is None or not source_shift > 0:
            raise ValueError("source_uniform needs the rollout's positive flow shift")
        inv = lambda s: s / (source_shift - (source_shift - 1) * s)  # noqa: E731
        u_lo, u_hi = inv(lo), inv(hi)
        out = _shift(u_lo + f * (u_hi - u_lo), source_shift)
    elif distribution == "conditional_logit_normal":
        normal = torch.distributions.Normal(torch.zeros((), dtype=torch.float64), torch.ones((), dtype=torch.float64))
        z_lo = (torch.logit(lo.clamp(tiny, 1 - tiny)) - logit_mean) / logit_std
        z_hi = (torch.logit(hi.clamp(tiny, 1 - tiny)) - logit_mean) / logit_std
        c_lo, c_hi = normal.cdf(z_lo), normal.cdf(z_hi)
        p = (c_lo + f * (c_hi - c_lo)).clamp(tiny, 1 - tiny)
        out = torch.sigmoid(logit_mean + logit_std * normal.icdf(p))
    else:
        raise ValueError(f"tdm_query_distribution must be one of {QUERY_DISTRIBUTIONS}, got {distribution!r}")
    # strictly inside the open interval, as upstream keeps it
    out = torch.minimum(torch.maximum(out, torch.nextafter(lo, hi)), torch.nextafter(hi, lo))
    return out.to(lower.dtype if lower.is_floating_point() else torch.float32)


def conditional_renoise(x0: Tensor, model_noise: Tensor, sigma_mid: Tensor | float, sigma_t: Tensor | float,
                        importance_clip: float = 20.0, fresh: Tensor | None = None,
                        generator: torch.Generator | None = None, eps: float = 1e-6) -> tuple[Tensor, Tensor, Tensor]:
    """TDM's conditional diffusion of the student's stage output to ``sigma_t`` (module docstring, 3 and
    5): returns ``x_t`` (B, ...), the mixed noise ``eps_mix`` with ``x_t = (1 - sigma_t) x0 + sigma_t eps_mix``,
    and the clipped, detached importance ratio (B,). ``x0`` and ``model_noise`` are used detached."""
    x0, model_noise = x0.detach().float(), model_noise.detach().float()
    s_mid, s_t = as_batch_column(sigma_mid, x0), as_batch_column(sigma_t, x0)
    if not bool(((s_mid >= 0) & (s_mid < s_t) & (s_t < 1)).all()):
        raise ValueError("TDM renoising needs 0 <= sigma_mid < sigma_t < 1")
    if not importance_clip > 0:
        raise ValueError(f"tdm_importance_clip must be > 0, got {importance_clip}")
    ratio = (1 - s_t) / (1 - s_mid).clamp_min(eps)
    kept = ratio * s_mid
    beta = (s_t**2 - kept**2).clamp_min(0).sqrt()
    if fresh is None:
        fresh = torch.randn(x0.shape, generator=generator, dtype=torch.float32).to(x0.device)
    fresh = fresh.float()
    mixed = (kept * model_noise + beta * fresh) / s_t.clamp_min(eps)
    x_t = (1 - s_t) * x0 + s_t * mixed
    log_ratio = -0.5 * mean_over_sample(mixed**2) + 0.5 * mean_over_sample(fresh**2)
    bound = math.log(importance_clip)
    return x_t, mixed, torch.exp(log_ratio.clamp(-bound, bound)).detach()


def snr_weight(sigma: Tensor, snr_gamma: float = 5.0) -> Tensor:
    """``min(SNR, gamma)`` with ``SNR = (1 - sigma)^2 / sigma^2`` (Min-SNR weighting), (B,)."""
    s = sigma.float().reshape(-1)
    return torch.clamp((1 - s) ** 2 / (s**2).clamp_min(1e-6), max=float(snr_gamma))


def tdm_fake_loss(x0_fake: Tensor, x0_target: Tensor, sigma_t: Tensor, importance: Tensor,
                  snr_gamma: float = 5.0) -> Tensor:
    """Scalar fake-score loss: ``mean_B r min(SNR, gamma) mean_elems (x0_fake - x0_target)^2`` with the
    fake score's clean prediction ``x0_fake`` (with gradient) and the student's detached ``x0_target``."""
    per_sample = mean_over_sample((x0_fake.float() - x0_target.detach().float()) ** 2)
    return (per_sample * importance.detach().float() * snr_weight(sigma_t, snr_gamma)).mean()


def revised_x0_loss(x0: Tensor, correction: Tensor, normaliser_reference: Tensor, use_huber: bool = False,
                    huber_c: float = 1e-3, eps: float = 1e-6) -> Tensor:
    """Regress the live ``x0`` towards ``sg(x0 + correction)``, per sample divided by
    ``max(mean|x0 - normaliser_reference|, eps)`` (no gradient), squared (``d^2/2``) or pseudo-Huber
    (``sqrt(d^2 + c^2) - c``), batch mean. Its gradient moves ``x0`` along ``correction``. Every TDM and
    TDM-R1 generator term has this form (upstream's ``revised_x0_loss``)."""
    x = x0.float()
    normaliser = mean_over_sample((x.detach() - normaliser_reference.detach().float()).abs()).clamp_min(eps)
    d = x - (x.detach() + correction.detach().float())
    residual = torch.sqrt(d**2 + huber_c**2) - huber_c if use_huber else 0.5 * d**2
    return (mean_over_sample(residual) / normaliser).mean()


def tdm_generator_loss(x0: Tensor, x0_real: Tensor, x0_fake: Tensor, use_huber: bool = True,
                       huber_c: float = 1e-3, eps: float = 1e-6) -> Tensor:
    """TDM's generator loss: ``x0`` revised by ``x0_real - x0_fake``, normalised by ``mean|x0 - x0_real|``."""
    return revised_x0_loss(x0, x0_real.detach().float() - x0_fake.detach().float(), x0_real, use_huber, huber_c, eps)
