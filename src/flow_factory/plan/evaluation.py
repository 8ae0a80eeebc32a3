"""What a run's evaluation adds to its plan: every ``eval.eval_freq`` epochs (and the final weights) the trainer
samples each evaluated dataset's test prompts (``eval_sampling.eval_parts``: each dataset at its own size, steps and
guidance, ``eval.per_device_batch_size`` prompts a call, ODE without gradients), decodes and scores them.

Memory: the eval's largest transformer call or decode (measured as the rollout's are, at each distinct size and
batch) on top of what stays on the device through it: the networks, the reward models, the optimizer state and
the weight copies (the trainer lets an epoch's rollouts go before it evaluates). A dataset evaluated at a larger
size than training can make it the run's peak.

Work: one eval's FLOPs on the busiest process (its share of each dataset's test prompts, ``data.share_slice``:
the first processes take one more), per prompt its steps' transformer calls and its decode (the measured call's
FLOPs over its rows: every operator of these calls is per sample), and a CLIP-type eval reward's forward;
amortised over ``eval_freq`` epochs. The test prompts are counted from the test split when it can be read here;
where it cannot (a config planned away from its data), the eval's memory is still counted at the config's sizes,
its time is not, and a note says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .measure import Measured


@dataclass(frozen=True)
class EvalCall:
    """What one eval transformer call and its decode are measured at."""

    height: int
    width: int
    num_frames: int | None
    guidance: float
    rows: int  # prompts a call: eval.per_device_batch_size, or a smaller share of the prompts
    condition_size: tuple[int, int] | None = None

    def _at(self) -> str:
        frames = f"x{self.num_frames}" if self.num_frames else ""
        return f"{self.height}x{self.width}{frames}, {self.rows} rows"

    @property
    def key(self) -> str:
        """Its entry in ``Plan.calls``."""
        return f"eval {self._at()}, guidance {self.guidance:g}"

    @property
    def decode_key(self) -> str:
        return f"eval decode {self._at()}"


@dataclass(frozen=True)
class EvalPart:
    """One evaluated dataset's test prompts, as ``eval_sampling.eval_parts`` samples them."""

    dataset: str | None
    call: EvalCall
    steps: int
    prompts: int | None  # the busiest process's share; None: the test split is not readable here


@dataclass
class EvalPlan:
    eval_freq: int
    parts: list[EvalPart]
    reward_flops_per_sample: float = 0.0  # the eval rewards' (CLIP-type) forward per sample, every frame
    notes: list[str] = field(default_factory=list)

    def activations(self, calls: dict[str, Measured]) -> int:
        """The largest of the eval's calls' and decodes' own tensors."""
        return max(max(calls[p.call.key].peak, calls[p.call.decode_key].peak) for p in self.parts)

    def flops(self, calls: dict[str, Measured]) -> float:
        """FLOPs of one eval on the busiest process: each prompt's steps, its decode and its eval rewards."""
        total = 0.0
        for part in self.parts:
            if part.prompts:
                per_prompt = (part.steps * calls[part.call.key].flops + calls[part.call.decode_key].flops) \
                    / part.call.rows
                total += part.prompts * (per_prompt + self.reward_flops_per_sample)
        return total

    @property
    def counted(self) -> bool:
        """Whether every part's prompts are known (the eval's time is counted)."""
        return all(p.prompts is not None for p in self.parts)


def evaluates(cfg) -> bool:
    """Whether the run evaluates at all: an eval_freq, a reward to score with, a dataset with a test split."""
    return bool(cfg.eval.eval_freq and (cfg.eval_rewards or cfg.rewards) and cfg.data.split_sources("test"))


def evaluated_prompts(cfg, notes: list[str]) -> list | None:
    """The test prompts the run evaluates (``eval.num_samples`` of them, each dataset's together), or None with a
    note where the test split cannot be read here."""
    from ..data import load_sources
    from ..data.prompts import PromptFileError
    from ..eval_sampling import eval_items

    try:
        return eval_items(load_sources(cfg.data.split_sources("test"), "test"), cfg.eval.num_samples)
    except (PromptFileError, OSError) as err:
        notes.append(f"the eval's time (its test prompts are not readable here: {str(err).splitlines()[0][:120]}); "
                     "its memory is counted at the config's eval sizes")
        return None


def eval_plan(cfg, adapter_cls, num_processes: int, notes: list[str]) -> EvalPlan | None:
    """The eval of ``cfg`` on ``num_processes`` processes, each part at its size and batch; None without one."""
    from ..eval_sampling import eval_parts, eval_settings, eval_sizes

    if not evaluates(cfg):
        return None
    items = evaluated_prompts(cfg, notes)
    if items is None:  # each evaluated dataset at the size its config gives, its prompts unknown
        parts = [(source.name, eval_settings(cfg, source.name), None) for source in cfg.data.split_sources("test")]
    else:  # the busiest process's share of each part (data.share_slice: the first processes take one more)
        parts = [(items[part.start].dataset, s, -(-(part.stop - part.start) // num_processes))
                 for part, s in eval_parts(cfg, items, eval_sizes(cfg, items, adapter_cls))]
    out = []
    for dataset, s, share in parts:
        rows = s.batch_size if share is None else min(s.batch_size, share)
        call = EvalCall(s.height, s.width, s.num_frames, float(s.guidance_scale), rows, s.condition_size)
        out.append(EvalPart(dataset, call, s.num_steps, share))
    return EvalPlan(cfg.eval.eval_freq, out)
