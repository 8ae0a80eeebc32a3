"""``train.reward_optimization_overlap``: the optimise phase starts while the async rewards are still scored.

Without overlap an epoch samples, waits for every reward, computes the advantages and trains. With it, sampling
leaves the rewards' job open (``Rollouts.pending_rewards``) and ``optimize_epoch`` trains with a
``StreamedAdvantages`` in place of the advantages: before each chunk of training units it asks for the advantages of
the samples it holds (``ready``), which waits only until the groups of those samples are scored. The chunks come
in the order, with the contents, the training draws and the accumulation of a run without overlap, so the update is
the same; what changes is only when each one starts. The first groups sampled are scored first: a chunk that draws
from them starts while the last groups are still being scored (``shuffle_samples: false`` puts them first; a
shuffled order starts a chunk once each of its few samples' groups is in).

That holds because each advantage is final once its own group is scored: per-group std (``global_std: false``),
the advantage of the weighted sum (``sum``), one process (``config/overlap.py`` refuses the rest). The advantages
of a group are computed from its rewards alone, as ``combine_advantages`` computes them over the whole batch.

A NaN or inf reward or advantage skips the rest of the epoch's update (the gradient accumulated so far is
dropped); steps taken before it was scored stay, where a run without overlap skips the whole epoch. Nothing
non-finite reaches the weights either way.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..advantages import combine_advantages
from ..guards import all_finite, nonfinite_rewards
from ..timer import PhaseTimer


class StreamedAdvantages:
    """An epoch's advantages while its rewards come in (``values``: NaN until a sample's group is scored)."""

    def __init__(self, job, group_ids: Tensor, weights: dict, scored: dict[str, Tensor], timer: PhaseTimer,
                 device=None):
        """``job``: the open ``RewardJob``; ``weights``: each reward's weight, a number or (N,) per sample;
        ``scored``: name -> (N,) bool, the samples each reward scores (a routed reward's datasets)."""
        self.job, self.weights, self.scored, self.timer = job, weights, scored, timer
        self.group_ids = torch.as_tensor(group_ids).reshape(-1).cpu()
        n = len(self.group_ids)
        self.values = torch.full((n,), float("nan"), dtype=torch.float32, device=device)
        self.final = torch.zeros(n, dtype=torch.bool)
        self.problem: str | None = None  # why the rest of the epoch's update is skipped

    def ready(self, indices: Tensor) -> bool:
        """Wait until the advantages of samples ``indices`` are final; False (and ``problem`` says why) when a
        reward or advantage of their groups is NaN or inf."""
        if self.problem is not None:
            return False
        indices = torch.as_tensor(indices).reshape(-1).cpu()
        waiting = indices[~self.final[indices]]
        if len(waiting) == 0:
            return True
        # every member of their groups, in batch order: the order the whole batch's sums take
        members = torch.isin(self.group_ids, self.group_ids[waiting]).nonzero().flatten()
        with self.timer.phase_within("reward", "training"):  # the wait is the reward's time
            rewards = self.job.scores_for(members)
        scored = {k: v[self.scored[k][members]] for k, v in rewards.items()}
        self.problem = nonfinite_rewards(scored)
        if self.problem is None:
            weights = {k: w[members] if isinstance(w, Tensor) else w for k, w in self.weights.items()}
            adv = combine_advantages(rewards, weights, self.group_ids[members], "sum", False)
            if not all_finite([adv]):
                self.problem = "advantages are NaN or inf (rewards too large to normalise?)"
            self.values[members.to(self.values.device)] = adv.to(self.values.device)
            self.final[members] = True
        return self.problem is None

    def finish(self, rollouts) -> Tensor | None:
        """Every reward collected into ``rollouts.rewards`` (on the advantages' device); the advantages, or None
        when the epoch's update stopped at a NaN or inf."""
        rollouts.rewards = {name: r.float().to(self.values.device) for name, r in self.job.finish().items()}
        rollouts.pending_rewards = None
        if self.problem is None and not bool(self.final.all()):  # groups no micro-batch drew from
            self.ready(torch.nonzero(~self.final).flatten())
        return None if self.problem is not None else self.values
