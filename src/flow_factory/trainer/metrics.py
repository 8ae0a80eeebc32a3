"""What an epoch logs (its rewards, per dataset too, its advantages, peak memory and the time of each phase), what
an evaluation logs (its rewards and its grid of samples), and what the run folder shows of the whole run:
``reward_curve.png`` and ``history.json``."""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch

from ..checkpoint import write_atomic
from ..data.sources import per_source_means, source_indices
from ..media import eval_grid, plot_curves, save_grid
from ..timer import PhaseTimer


def reward_metrics(gathered: dict[str, torch.Tensor], reward_set, datasets: list[str] | None,
                   source_names: list[str], group_size: int) -> dict[str, float]:
    """Each reward's mean and spread over the samples it scored (``gathered``: every process's scores, ``datasets``:
    each sample's dataset when there are several), the non-finite ones counted; per dataset, its rewards' means and
    its number of groups."""
    metrics = {}
    for name, scores in gathered.items():
        scores = scores[reward_set.scored_mask(name, datasets, len(scores)).to(scores.device)]
        finite = scores[torch.isfinite(scores)]  # a skipped epoch still plots its finite rewards
        if len(finite):
            metrics[f"reward/{name}/mean"] = finite.mean().item()
            metrics[f"reward/{name}/std"] = finite.std(unbiased=False).item()
        if len(finite) < len(scores):
            metrics[f"reward/{name}/nonfinite"] = len(scores) - len(finite)
    if datasets is not None:
        sources = torch.tensor([source_names.index(d) for d in datasets])
        metrics.update(per_source_means(gathered, sources, source_names, "source/{source}/reward/{reward}/mean"))
        metrics.update({f"source/{name}/groups": int((sources == s).sum()) // group_size
                        for s, name in enumerate(source_names)})
    return metrics


def advantage_metrics(advantages: torch.Tensor) -> dict[str, float]:
    return {"advantage/mean": advantages.mean().item(), "advantage/std": advantages.std(unbiased=False).item(),
            "advantage/abs_max": advantages.abs().max().item()}


def memory_metrics(device: torch.device) -> dict[str, float]:
    """What the epoch's busiest moment held on this process's GPU (nothing on CPU); the peak restarts."""
    if device.type != "cuda":
        return {}
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    torch.cuda.reset_peak_memory_stats(device)
    return {"memory/peak_allocated_gib": peak}


def time_metrics(timer: PhaseTimer) -> dict[str, float]:
    """Seconds per phase, ``other`` for the rest of the epoch."""
    seconds = dict(timer.seconds)
    total = seconds.pop("epoch")
    seconds["other"] = total - sum(seconds.values())
    return {**{f"time/{k}": v for k, v in seconds.items()}, "time/epoch": total}


def eval_means(every: dict[str, torch.Tensor], items: list, reward_set, source_names: list[str]) -> dict[str, float]:
    """Each eval reward's mean over the test prompts it scored (``every``: every prompt's scores, in ``items``'
    order), and per dataset when there are several."""
    datasets = [it.dataset for it in items] if source_names else None
    means = {f"eval/reward/{k}": v[reward_set.scored_mask(k, datasets, len(v))].mean().item()
             for k, v in every.items()}
    if source_names:
        means.update(per_source_means(every, source_indices(items, source_names), source_names,
                                      "eval/source/{source}/reward/{reward}"))
    return means


def save_eval_grid(samples: list[tuple], path: Path, video_format: str, fps: int):
    """The eval's ``samples`` (``eval_sampling.grid_samples``: each dataset's), captioned with their rewards and beside
    their conditions: a PNG, or for a video model an mp4 or an animated GIF (``log.video_format``); returns (the
    grid, its file)."""
    grid = eval_grid(samples)
    return grid, save_grid(grid, path, video_format, fps)


def headline(record: dict, weights: dict[str, float]) -> float:
    """The weighted sum of an epoch's mean rewards, as the progress bar shows it."""
    return sum(v * weights[k.split("/")[1]] for k, v in record.items()
               if k.startswith("reward/") and k.endswith("/mean"))


def write_history(run_dir: Path, history: list[dict], eval_history: list[dict]) -> None:
    """The reward curves (train means, eval) as a PNG, and every epoch's metrics as JSON; a history written
    already (the run's end after its last epoch's save, without a final eval) is not drawn again."""
    text = json.dumps({"train": history, "eval": eval_history}, indent=1)
    written = run_dir / "history.json"
    if written.exists() and (run_dir / "reward_curve.png").exists() and written.read_text() == text:
        return
    series: dict[str, list] = {}
    for record in history + eval_history:
        for k, v in record.items():
            if k.startswith("eval/reward/") or (k.startswith("reward/") and k.endswith("/mean")):
                series.setdefault(k, []).append((record["epoch"], v))
    png = io.BytesIO()
    plot_curves(series, "reward per epoch").save(png, format="PNG")
    write_atomic(run_dir / "reward_curve.png", png.getvalue())
    write_atomic(written, text)
