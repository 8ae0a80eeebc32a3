"""A toy 2-D flow for the few-step distillation tests and benches (issue 39): seconds on a CPU.

The teacher is exact: the data are a Gaussian mixture (``MODES``, std ``MODE_STD``), whose
flow-matching velocity at ``x_t = (1 - sigma) x0 + sigma eps`` is closed-form (``teacher_velocity``),
and the teacher's distribution is what 20 Euler steps of it sample (``teacher_samples``). Students,
fake scores and surrogates are that velocity plus a small MLP residual whose last layer starts at
zero (``ResidualVelocity``): every role starts as the teacher, as LoRA roles on one base do. A
K-step student samples with K Euler steps of its velocity on the uniform schedule ``1, ..., 1/K, 0``.

``distill_dmd2`` / ``distill_tdm`` / ``reinforce_tdm_r1`` run the losses of
``flow_factory.algorithms.distillation`` with upstream's phases (``ttur_fake_updates`` fake passes,
then (TDM-R1) the surrogate, then the generator) and toy-sized Adam steps; ``sliced_wasserstein``
measures how far a student's samples are from the teacher's.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from flow_factory.algorithms.distillation import (add_noise, clean_from_velocity, conditional_renoise,
                                                  denoising_errors, dmd2_generator_loss, fake_score_loss,
                                                  query_interval, sample_perturbation_sigma, sample_query_sigma,
                                                  TDMR1Settings,
                                                  student_prediction, surrogate_loss, tdm_fake_loss,
                                                  tdm_generator_loss, tdm_r1_generator_loss, time_weight,
                                                  slow_surrogate_decay)

MODES = torch.tensor([[2.0, 0.0], [0.0, 2.0], [-2.0, 0.0], [0.0, -2.0]])
MODE_STD = 0.3


def teacher_velocity(x: Tensor, sigma: Tensor | float) -> Tensor:
    """The exact flow-matching velocity ``E[eps - x0 | x_t]`` of the mixture (equal weights):
    given mode k, ``x_t ~ N(a mu_k, (a^2 s^2 + sigma^2) I)`` with ``a = 1 - sigma``, and
    ``E[x0 | x_t, k] = mu_k + a s^2 / var_k (x_t - a mu_k)``, ``E[eps | x_t, k] = sigma / var_k (x_t - a mu_k)``."""
    shape, x = x.shape, x.float().reshape(-1, 2)
    s = torch.as_tensor(sigma, dtype=torch.float32).reshape(-1, 1).expand(len(x), 1)
    a = 1 - s
    var = a**2 * MODE_STD**2 + s**2  # (B, 1)
    diff = x[:, None, :] - a[:, None, :] * MODES[None]  # (B, K, 2)
    w = torch.softmax(-(diff**2).sum(-1) / (2 * var), dim=1)[..., None]  # (B, K, 1): equal weights and variances
    v_k = (s[:, None, :] - a[:, None, :] * MODE_STD**2) / var[:, None, :] * diff - MODES[None]
    return (w * v_k).sum(1).reshape(shape)


def euler_sample(velocity, z: Tensor, steps: int) -> Tensor:
    """``steps`` Euler steps of ``velocity(x, sigma)`` from sigma 1 to 0 on the uniform schedule."""
    x, sigmas = z.float(), torch.linspace(1.0, 0.0, steps + 1)
    for k in range(steps):
        x = x + (sigmas[k + 1] - sigmas[k]) * velocity(x, sigmas[k].expand(x.shape[:-1]))
    return x


def teacher_samples(n: int, seed: int, steps: int = 20) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return euler_sample(teacher_velocity, torch.randn(n, 2, generator=g), steps)


def sliced_wasserstein(a: Tensor, b: Tensor, projections: int = 256, seed: int = 0) -> float:
    """Sliced Wasserstein-1 distance between two equal-size sample sets: the mean over random unit
    directions of the 1-D Wasserstein distance of the projections (sorted differences)."""
    g = torch.Generator().manual_seed(seed)
    d = torch.randn(a.shape[1], projections, generator=g)
    d = d / d.norm(dim=0, keepdim=True)
    pa, pb = (a.float() @ d).sort(0).values, (b.float() @ d).sort(0).values
    return (pa - pb).abs().mean().item()


class ResidualVelocity(nn.Module):
    """The teacher's velocity plus an MLP residual of ``(x, sigma)`` whose last layer starts at zero, for
    ``members`` independent models at once (one per seed; batched matrix products, so three seeds cost
    about what one does): ``x`` (members, N, 2), ``sigma`` (members, N) -> (members, N, 2). Member ``e``'s
    hidden layers are initialised from ``torch.manual_seed(seeds[e])``."""

    def __init__(self, seeds=(0,), hidden: int = 64):
        super().__init__()
        shapes = ((3, hidden), (hidden, hidden), (hidden, 2))
        weights, biases = [[] for _ in shapes], [[] for _ in shapes]
        for seed in seeds:
            torch.manual_seed(seed)
            for i, (n_in, n_out) in enumerate(shapes):
                layer = nn.Linear(n_in, n_out)
                weights[i].append(layer.weight.detach().T.clone() * (i < 2))
                biases[i].append(layer.bias.detach().clone() * (i < 2))
        self.weights = nn.ParameterList(nn.Parameter(torch.stack(w)) for w in weights)
        self.biases = nn.ParameterList(nn.Parameter(torch.stack(b)[:, None, :]) for b in biases)

    def residual(self, x: Tensor, sigma: Tensor) -> Tensor:
        h = torch.cat([x.float(), sigma.float()[..., None]], dim=-1)
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            h = torch.baddbmm(b, h, w)
            if i < len(self.weights) - 1:
                h = nn.functional.silu(h)
        return h

    def forward(self, x: Tensor, sigma: Tensor) -> Tensor:
        sigma = torch.as_tensor(sigma, dtype=torch.float32).expand(x.shape[:-1])
        return teacher_velocity(x, sigma) + self.residual(x, sigma)


def student_rollout(generator: nn.Module, z: Tensor, steps: int) -> tuple[Tensor, Tensor]:
    """The student's deterministic rollout without gradient: states (K + 1, members, B, 2), sigmas (K + 1,)."""
    sigmas = torch.linspace(1.0, 0.0, steps + 1)
    states = [z.float()]
    with torch.no_grad():
        for k in range(steps):
            v = generator(states[-1], sigmas[k].expand(z.shape[:-1]))
            states.append(states[-1] + (sigmas[k + 1] - sigmas[k]) * v)
    return torch.stack(states), sigmas


def _adam(module: nn.Module, lr: float, betas=(0.9, 0.999)) -> torch.optim.Optimizer:
    return torch.optim.Adam(module.parameters(), lr=lr, betas=betas, foreach=True)


def _step(optimizer: torch.optim.Optimizer, loss: Tensor) -> None:
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def _decay(optimizers, iteration: int, iterations: int, final: float = 0.1) -> None:
    """Learning rates decayed linearly to ``final`` of their start over the run (a toy's last steps
    should not jitter at the first steps' size)."""
    for opt in optimizers:
        for group in opt.param_groups:
            group.setdefault("initial_lr", group["lr"])
            group["lr"] = group["initial_lr"] * (1 - (1 - final) * iteration / max(iterations - 1, 1))


def _rows(t: Tensor) -> Tensor:
    """(members, N, ...) -> (members * N, ...): the losses see every member's samples as one batch, which
    scales each member's gradient by 1 / members and leaves its Adam steps as if trained alone."""
    return t.reshape(-1, *t.shape[2:])


def sample(generator: nn.Module, steps: int, n: int, seed: int) -> Tensor:
    """(members, n, 2) samples of a K-step student from the same noise for every member."""
    z = torch.randn(n, 2, generator=torch.Generator().manual_seed(seed))
    members = generator.weights[0].shape[0]
    with torch.no_grad():
        return euler_sample(generator, z.expand(members, n, 2), steps)


def distill_dmd2(seeds=(0, 1, 2), steps: int = 1, iterations: int = 150, batch: int = 256,
                 ttur_fake_updates: int = 5, lr: float = 1e-2, fake_lr: float = 1e-2,
                 sigma_range=(0.02, 0.98), hidden: int = 64, lr_final: float = 0.1) -> nn.Module:
    """DMD2 (``dmd2.py``, ``fake_score.py``): per generator step one fresh rollout; the replay matches the
    clean prediction at one step drawn uniformly from the student's K; ``ttur_fake_updates`` fake passes
    on fresh noisings of those predictions first. Returns the generator (one member per seed)."""
    generator, fake = ResidualVelocity(seeds, hidden), ResidualVelocity([s + 1000 for s in seeds], hidden)
    opt_g, opt_f = _adam(generator, lr), _adam(fake, fake_lr)
    torch.manual_seed(seeds[0] + 10_000)
    shape, sigmas = (len(seeds), batch), torch.linspace(1.0, 0.0, steps + 1)
    n = len(seeds) * batch
    for it in range(iterations):
        _decay((opt_g, opt_f), it, iterations, lr_final)
        states, _ = student_rollout(generator, torch.randn(*shape, 2), steps)
        k = int(torch.randint(steps, (1,)))
        x_k, s_k = states[k], sigmas[k].expand(shape)
        with torch.no_grad():  # the generator does not move during the fake passes
            x0 = clean_from_velocity(_rows(x_k), _rows(generator(x_k, s_k)), _rows(s_k))
        for _ in range(ttur_fake_updates):
            sigma, noise = sample_perturbation_sigma(n, sigma_range), torch.randn(n, 2)
            v_fake = _rows(fake(add_noise(x0, noise, sigma).reshape(*shape, 2), sigma.reshape(shape)))
            _step(opt_f, fake_score_loss(v_fake, x0, noise))
        x0 = clean_from_velocity(_rows(x_k), _rows(generator(x_k, s_k)), _rows(s_k))
        sigma, noise = sample_perturbation_sigma(n, sigma_range), torch.randn(n, 2)
        x_t = add_noise(x0.detach(), noise, sigma)
        with torch.no_grad():
            x0_real = clean_from_velocity(x_t, teacher_velocity(x_t, sigma), sigma)
            x0_fake = clean_from_velocity(x_t, _rows(fake(x_t.reshape(*shape, 2), sigma.reshape(shape))), sigma)
        _step(opt_g, dmd2_generator_loss(x0, x0_real, x0_fake))
    return generator


def _tdm_prediction(generator: nn.Module, states: Tensor, sigmas: Tensor, live: bool):
    """Every transition of a rollout at once, as rows ``(members, K * B)``: the student's clean
    predictions (with gradient when ``live``) and implied noises, and each row's stage ``(sigma_{k+1},
    sigma_k)``, where upstream's defaults (trajectory interval) draw the query level."""
    steps, members, batch = states.shape[0] - 1, states.shape[1], states.shape[2]
    x_k = states[:-1].permute(1, 0, 2, 3).reshape(members, steps * batch, 2)
    s_k = sigmas[:-1].repeat_interleave(batch).expand(members, steps * batch)
    s_mid = sigmas[1:].repeat_interleave(batch).expand(members, steps * batch)
    with torch.set_grad_enabled(live):
        x0, eps_s = student_prediction(_rows(x_k), _rows(generator(x_k, s_k)), _rows(s_k))
    lower, upper = query_interval(_rows(s_mid), _rows(s_k), "trajectory")
    return x0, eps_s, lower, upper


def _tdm_query(x0: Tensor, eps_s: Tensor, lower: Tensor, upper: Tensor):
    """A query level per row (``actual_uniform``) and the conditional renoising there: ``x_t``, sigma, ratio."""
    sigma_t = sample_query_sigma(lower, upper, "actual_uniform")
    x_t, _, importance = conditional_renoise(x0, eps_s, lower, sigma_t)
    return x_t, sigma_t, importance


def _fake_x0(fake: nn.Module, x_t: Tensor, sigma_t: Tensor, members: int) -> Tensor:
    v = fake(x_t.reshape(members, -1, 2), sigma_t.reshape(members, -1))
    return clean_from_velocity(x_t, _rows(v), sigma_t)


def tdm_fake_phase(generator, fake, opt_f, states, sigmas, ttur_fake_updates: int, snr_gamma: float = 5.0) -> None:
    """``ttur_fake_updates`` fake passes over every transition (the generator's predictions, which do not
    change during the phase, computed once; a fresh query level and renoising each pass)."""
    members = states.shape[1]
    x0, eps_s, lower, upper = _tdm_prediction(generator, states, sigmas, live=False)
    for _ in range(ttur_fake_updates):
        x_t, sigma_t, importance = _tdm_query(x0, eps_s, lower, upper)
        _step(opt_f, tdm_fake_loss(_fake_x0(fake, x_t, sigma_t, members), x0, sigma_t, importance, snr_gamma))


def distill_tdm(seeds=(0, 1, 2), steps: int = 2, iterations: int = 150, batch: int = 256,
                ttur_fake_updates: int = 5, lr: float = 1e-2, fake_lr: float = 1e-2, use_huber: bool = True,
                huber_c: float = 1e-3, hidden: int = 64, lr_final: float = 0.1):
    """TDM (``tdm.py``): per generator step one fresh K-step rollout; all K transitions train together
    (upstream accumulates them into one step), ``ttur_fake_updates`` fake passes first. Returns the
    generator and the fake score (one member per seed)."""
    generator, fake = ResidualVelocity(seeds, hidden), ResidualVelocity([s + 1000 for s in seeds], hidden)
    opt_g, opt_f = _adam(generator, lr), _adam(fake, fake_lr)
    torch.manual_seed(seeds[0] + 20_000)
    members = len(seeds)
    for it in range(iterations):
        _decay((opt_g, opt_f), it, iterations, lr_final)
        states, sigmas = student_rollout(generator, torch.randn(members, batch, 2), steps)
        tdm_fake_phase(generator, fake, opt_f, states, sigmas, ttur_fake_updates)
        x0, eps_s, lower, upper = _tdm_prediction(generator, states, sigmas, live=True)
        x_t, sigma_t, _ = _tdm_query(x0, eps_s, lower, upper)
        with torch.no_grad():
            x0_real = clean_from_velocity(x_t, teacher_velocity(x_t, sigma_t), sigma_t)
            x0_fake = _fake_x0(fake, x_t, sigma_t, members)
        _step(opt_g, tdm_generator_loss(x0, x0_real, x0_fake, use_huber, huber_c))
    return generator, fake


def reward(x: Tensor) -> Tensor:
    """The toy's non-differentiable reward: 1 for a sample in the right-hand mode's half-plane ``x > 1``,
    else 0 (the teacher scores about 1/4)."""
    return (x[..., 0] > 1.0).float()


def group_advantages(rewards: Tensor, group_size: int, clip: float = 5.0) -> Tensor:
    """(members, B) rewards -> advantages: minus each group's mean, over each member's batch std
    (upstream's TDM-R1 default ``global_std: true``), clipped to ``advantage_clip_range``."""
    members, batch = rewards.shape
    grouped = rewards.reshape(members, batch // group_size, group_size)
    centred = (grouped - grouped.mean(-1, keepdim=True)).reshape(members, batch)
    return (centred / rewards.std(dim=1, keepdim=True).clamp_min(1e-6)).clamp(-clip, clip)


def reinforce_tdm_r1(generator: nn.Module, fake: nn.Module, steps: int = 2, iterations: int = 100,
                     settings: TDMR1Settings = TDMR1Settings(), lrs=(3e-3, 1e-2, 1e-2),
                     decay=(1e-3, 0.3), seed: int = 0) -> list[float]:
    """TDM-R1 (``tdm_r1.py``) from a (distilled) generator and its fake score, in place: per step one
    rollout scored by ``reward``, ``ttur_fake_updates`` fake passes, one surrogate pass (the K transitions
    accumulated, each with its time weight), the slow surrogate's EMA, one generator pass. The surrogate
    starts as the teacher (zero residual); the teacher is the frozen reference, queried without guidance
    (the toy is unconditional: no guidance reward). ``lrs``: the generator's, fake score's and surrogate's
    Adam learning rates; ``decay``: ``surrogate_slow_decay_min`` and ``_max``. Batches of 256 per member in
    groups of 8, 5 fake passes. Returns each step's mean reward over all members."""
    batch, group_size, ttur_fake_updates = 256, 8, 5
    lr, fake_lr, surrogate_lr = lrs
    members = generator.weights[0].shape[0]
    surrogate = ResidualVelocity([seed + 2000 + m for m in range(members)])
    slow = copy.deepcopy(surrogate).requires_grad_(False)
    opt_g, opt_f, opt_s = _adam(generator, lr), _adam(fake, fake_lr), _adam(surrogate, surrogate_lr)
    torch.manual_seed(seed + 30_000)
    groups = (torch.arange(members * batch) // group_size)
    history = []
    for step in range(iterations):
        states, sigmas = student_rollout(generator, torch.randn(members, batch, 2), steps)
        rewards = reward(states[-1])
        history.append(rewards.mean().item())
        advantages = _rows(group_advantages(rewards, group_size))
        tdm_fake_phase(generator, fake, opt_f, states, sigmas, ttur_fake_updates)
        opt_s.zero_grad(set_to_none=True)
        for k in range(steps):  # the surrogate scores each stored boundary x_{k+1} in its stage
            x_next = _rows(states[k + 1])
            sigma = sample_query_sigma(sigmas[k + 1].expand(len(x_next)), sigmas[k].expand(len(x_next)))
            noise = torch.randn_like(x_next)
            x_t = add_noise(x_next, noise, sigma)
            shaped = (x_t.reshape(members, batch, 2), sigma.reshape(members, batch))
            err = denoising_errors(_rows(surrogate(*shaped)), x_next, noise)
            with torch.no_grad():
                err_ref = denoising_errors(teacher_velocity(x_t, sigma), x_next, noise)
                err_slow = denoising_errors(_rows(slow(*shaped)), x_next, noise)
            loss, _ = surrogate_loss(err, err_ref, advantages, groups, group_size, settings, err_slow,
                                     time_weight(k, steps))
            loss.backward()
        opt_s.step()
        d = slow_surrogate_decay(step, *decay)
        with torch.no_grad():
            for p_slow, p in zip(slow.parameters(), surrogate.parameters()):
                p_slow.mul_(d).add_(p, alpha=1 - d)
        x0, eps_s, lower, upper = _tdm_prediction(generator, states, sigmas, live=True)
        x_t, sigma_t, _ = _tdm_query(x0, eps_s, lower, upper)
        with torch.no_grad():
            x0_real = clean_from_velocity(x_t, teacher_velocity(x_t, sigma_t), sigma_t)
            x0_fake = _fake_x0(fake, x_t, sigma_t, members)
            x0_sur = _fake_x0(surrogate, x_t, sigma_t, members)
        loss, _ = tdm_r1_generator_loss(x0, x0_real, x0_fake, x0_sur, settings)
        _step(opt_g, loss)
    return history
