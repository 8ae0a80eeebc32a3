"""ShapeBench, every algorithm against the others over training seeds.

The CPU analogue of the Flow-Factory paper's reward curves:

    python bench/shapebench_compare.py                        # 8 algorithms x seeds 0 1 2, 8192 samples each
    python bench/shapebench_compare.py --algorithms nft dgpo --seeds 0 1 2 3
    python bench/shapebench_compare.py --smoke --algorithms grpo-fast --seeds 0    # end to end in minutes
    python bench/shapebench_compare.py --estimate                 # time one epoch of each, print the estimate
    python bench/shapebench_compare.py --threads 1 --resume   # go on from an earlier sitting's results.json
    python bench/shapebench_compare.py --report runs/shapebench_compare/results.json   # table and figure again

Each algorithm trains the committed ShapeBench pipeline (assets/shapebench/sd3) from
examples/shapebench_grpo.yaml (the `make demo` run), changed only where the algorithm needs it
(``ALGORITHMS``), on the same training prompts and the same number of rollout samples
(``--samples``), once per training seed (``--seeds``: the run's seed, so its prompt draws,
rollout noise and training draws; the held-out noise follows it too). The held-out set is the 256
prompts of test.txt, each sampled ``--eval-samples / 256`` times with its own noise (ODE, 10 steps,
cfg 2), measured before training and ``--evals`` times along the way.

It prints, per algorithm, the mean over seeds and its 95 % t-interval (``seed_statistics``):

* held-out strict and partial accuracy at equal samples (after the whole budget);
* the same at equal training time: every run's curve read at T, the training time of the quickest
  run of all (training time only: sampling, rewards and optimisation, not the evaluations),
  linear between the evaluations around it;
* seconds per epoch.

Training time is the process's CPU time when every run used one torch thread (``--threads 1``):
on one thread it is the wall time a quiet machine would take, and other work on the machine
hardly moves it, so runs from several sittings (``--resume``) and a shared machine compare
fairly. Otherwise it is wall time, fair only for runs made together on a quiet machine.

``--out``/shapebench_compare.png shows held-out accuracy against samples, one curve per algorithm
(the mean over seeds) with its interval as a band; ``--out``/results.json keeps every run's curve,
so ``--report`` makes the table and figure again without training. Before training, one epoch of
each algorithm is timed for an estimate of the whole (``--estimate`` stops there); after each run it
prints the time so far and what is left. One process, fp32. results.json is rewritten after each
run, so a sitting that is stopped keeps its finished runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from flow_factory.checkpoint import write_atomic  # noqa: E402
from flow_factory.config import load_config  # noqa: E402
from flow_factory.trainer import Trainer  # noqa: E402

# a sibling module: python puts bench/ on sys.path for the script, pytest's pythonpath for the tests
from seed_statistics import t_interval, value_at  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "shapebench_grpo.yaml"
PROMPTS = ROOT / "examples" / "data" / "shapebench_prompts"
METRICS = {"strict": "eval/reward/shapebench_strict", "partial": "eval/reward/shapebench"}

# What each algorithm changes in the demo config. grpo-fast is the demo itself (one SDE step, at step 0,
# where the committed model decides its background, and the rest ODE: Flow-GRPO-Fast's window);
# grpo-guard is the same window with GRPO-Guard's re-normalised ratio; grpo noises and trains every step
# from independent starting noise, as Flow-GRPO does. The decoupled algorithms sample with the ODE and
# train on the forward process at two timesteps per sample; only the windowed ones have untrained steps,
# so only they keep the demo's outside_kl_beta. crd's KL teacher stays at the rollouts' cfg 2
# (kl_cfg 1), dgpo takes dpo_beta 10 (Flow-Factory's PickScore example).
ODE_ROLLOUTS = ["scheduler.dynamics_type=ODE", "scheduler.noise_level=0", "scheduler.sde_steps=null",
                "scheduler.num_sde_steps=null", "train.same_latent=false",  # same start + ODE: identical samples
                "train.outside_kl_beta=0"]
DECOUPLED = [*ODE_ROLLOUTS, "train.num_train_timesteps=2", "train.learning_rate=1e-4"]
ALGORITHMS: dict[str, list[str]] = {
    "grpo": ["scheduler.sde_steps=null", "scheduler.num_sde_steps=null", "train.same_latent=false",
             "train.outside_kl_beta=0"],
    "grpo-fast": [],
    "grpo-guard": ["train.trainer_type=grpo-guard"],
    "nft": ["train.trainer_type=nft", *DECOUPLED, "train.ema_decay=0.9"],
    "awm": ["train.trainer_type=awm", *DECOUPLED, "train.ema_decay=0.9"],
    "dpo": ["train.trainer_type=dpo", *DECOUPLED],
    "dgpo": ["train.trainer_type=dgpo", *DECOUPLED, "train.dpo_beta=10"],
    "crd": ["train.trainer_type=crd", *DECOUPLED, "train.kl_cfg=1"],
    # nft with its rollouts through diffusers' Pyramid Attention Broadcast (train.rollout_cache, lossy; SD3
    # takes no FirstBlockCache): its time per epoch and accuracy against nft's
    "nft-pab": ["train.trainer_type=nft", *DECOUPLED, "train.ema_decay=0.9", "train.rollout_cache=pyramid",
                "train.rollout_cache_params={spatial_attention_block_skip_range: 2}"],
    # the same through TaylorSeer at diffusers' defaults: whole blocks predicted between refreshes (the policy
    # that saved the most and departed the most in bench/rollout_cache_speed.py)
    "nft-taylorseer": ["train.trainer_type=nft", *DECOUPLED, "train.ema_decay=0.9", "train.rollout_cache=taylorseer",
                       "train.rollout_cache_params={}"],
}
SMOKE = {"samples": 256, "eval_samples": 64, "evals": 1}  # 2 epochs, 64 held-out samples: minutes


def write_dataset(folder: Path, eval_samples: int) -> Path:
    """The demo's prompts, with test.txt's 256 lines repeated to ``eval_samples`` (each repeat is a
    sample of its own: eval seeds noise by position)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.txt").write_text((PROMPTS / "train.txt").read_text())
    held_out = (PROMPTS / "test.txt").read_text().splitlines()
    repeats = -(-eval_samples // len(held_out))
    (folder / "test.txt").write_text("\n".join((held_out * repeats)[:eval_samples]) + "\n")
    return folder


def trainer_for(name: str, seed: int, epochs: int, eval_freq: int, out: Path, save_dir: Path) -> Trainer:
    overrides = ALGORITHMS[name] + [
        f"seed={seed}", f"scheduler.seed={seed}", f"train.max_epochs={epochs}", f"eval.eval_freq={eval_freq}",
        f"data.dataset_dir={out / 'data'}", f"data.cache_dir={out / 'prompt_cache'}", f"log.save_dir={save_dir}",
        f"log.run_name={name}_seed{seed}", "log.save_freq=0", "log.logging_backend=none", "log.overwrite=true"]
    return Trainer(load_config(CONFIG, overrides))


def run(name: str, seed: int, epochs: int, evals: int, out: Path) -> dict:
    """One training run: its held-out curve against samples, and the training seconds before each
    evaluation on two clocks: wall time, and this process's CPU time. With one torch thread the CPU
    time is what the wall time would be on a quiet machine, and it hardly moves when other work
    shares the machine, so the equal-time columns can be read from runs made under different loads."""
    trainer = trainer_for(name, seed, epochs, max(1, epochs // evals), out, out / "runs")
    per_epoch = trainer.cfg.samples_per_epoch
    cpu_before_eval: dict[int, float] = {}  # epoch -> training CPU seconds so far
    spent_evaluating = [0.0]
    evaluate, started = trainer.evaluate, time.process_time()

    def timed_evaluate(epoch: int):
        begin = time.process_time()
        cpu_before_eval[epoch] = begin - started - spent_evaluating[0]
        try:
            return evaluate(epoch)
        finally:
            spent_evaluating[0] += time.process_time() - begin

    trainer.evaluate = timed_evaluate  # the trainer calls self.evaluate at each eval_freq and at the end
    load_before = os.getloadavg()[0]
    trainer.train()
    spent = [0.0]  # wall training seconds before each epoch (an eval at epoch e follows e epochs)
    for record in trainer.history:
        spent.append(spent[-1] + record["time/epoch"])
    curve = [{"epoch": e["epoch"], "samples": e["epoch"] * per_epoch, "train_s": spent[e["epoch"]],
              "train_cpu_s": cpu_before_eval[e["epoch"]], **{k: e[key] for k, key in METRICS.items()}}
             for e in trainer.eval_history]
    del trainer
    gc.collect()
    return {"algorithm": name, "seed": seed, "epochs": epochs, "epoch_s": spent[-1] / epochs,
            "epoch_cpu_s": curve[-1]["train_cpu_s"] / epochs, "commit": commit(), "date": time.strftime("%Y-%m-%d"),
            "threads": torch.get_num_threads(), "load_average": [load_before, os.getloadavg()[0]], "curve": curve}


def calibrate(name: str, out: Path) -> dict:
    """One epoch of ``name``, without evaluation: its seconds, and the part of them spent sampling."""
    start = time.perf_counter()
    trainer = trainer_for(name, 0, 1, 0, out, out / "calibration")
    trainer.train()
    record = trainer.history[0]
    evaluated = ("time/sampling", "time/decode", "time/reward")  # what an evaluation also does, per sample
    timing = {"epoch_s": record["time/epoch"], "sampling_s": sum(record.get(k, 0.0) for k in evaluated),
              "start_s": time.perf_counter() - start - record["time/epoch"],
              "samples_per_epoch": trainer.cfg.samples_per_epoch}
    del trainer
    gc.collect()
    return timing


def run_seconds(timing: dict, epochs: int, evals: int, eval_samples: int) -> float:
    """The estimated wall time of one run: its epochs, its evaluations (ODE sampling at the rollouts'
    cost per sample) and its start."""
    eval_freq = max(1, epochs // evals)
    num_evals = len(set(range(0, epochs, eval_freq)) | {epochs})
    eval_s = timing["sampling_s"] * eval_samples / timing["samples_per_epoch"]
    return epochs * timing["epoch_s"] + num_evals * eval_s + timing["start_s"]


CLOCKS = {"cpu": ("train_cpu_s", "epoch_cpu_s"), "wall": ("train_s", "epoch_s")}


def clock_of(runs: list[dict]) -> str:
    """CPU time where every run has it and ran on one torch thread (where it stands for quiet wall time),
    wall time otherwise."""
    return "cpu" if all("epoch_cpu_s" in r and r.get("threads") == 1 for r in runs) else "wall"


def summarize(runs: list[dict], clock: str = "wall") -> tuple[float, dict[str, dict]]:
    """Per algorithm: t-intervals over its seeds of strict / partial accuracy at equal samples (the last
    evaluation) and at equal training time T (the shortest run's, on ``clock``), and of seconds per epoch."""
    at, per_epoch = CLOCKS[clock]
    budget = min(r["curve"][-1][at] for r in runs)
    rows = {}
    for name in dict.fromkeys(r["algorithm"] for r in runs):
        mine = [r for r in runs if r["algorithm"] == name]
        row = {"seeds": [r["seed"] for r in mine], "samples": mine[0]["curve"][-1]["samples"],
               "before": t_interval([r["curve"][0]["strict"] for r in mine]),
               "epoch_s": t_interval([r[per_epoch] for r in mine])}
        for metric in METRICS:
            row[f"{metric}_samples"] = t_interval([r["curve"][-1][metric] for r in mine])
            row[f"{metric}_time"] = t_interval([value_at([p[at] for p in r["curve"]],
                                                         [p[metric] for p in r["curve"]], budget) for r in mine])
        rows[name] = row
    return budget, rows


def print_table(budget: float, rows: dict[str, dict], clock: str = "wall") -> None:
    samples = {row["samples"] for row in rows.values()}
    time_name = "CPU time (one thread)" if clock == "cpu" else "wall time"
    print(f"\nShapeBench held-out accuracy ({CONFIG.name} on assets/shapebench/sd3; {', '.join(map(str, samples))} "
          f"samples each; mean over seeds [95 % t-interval]; equal {time_name} = {budget:.0f} s of training)")
    head = ["algorithm", "seeds", "before (strict)", "strict, equal samples", "partial, equal samples",
            "strict, equal time", "partial, equal time", f"{clock} s / epoch"]
    print(" | ".join(head))
    for name, row in rows.items():
        cells = [name, " ".join(map(str, row["seeds"])), str(row["before"]), str(row["strict_samples"]),
                 str(row["partial_samples"]), str(row["strict_time"]), str(row["partial_time"]), str(row["epoch_s"])]
        print(" | ".join(cells))


def plot(runs: list[dict], path: Path) -> None:
    """Held-out strict and partial accuracy against samples: a curve per algorithm (the mean over its
    seeds) and its 95 % t-interval as a band (none with one seed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.8), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    for ax, metric in zip(axes, METRICS):
        for name in dict.fromkeys(r["algorithm"] for r in runs):
            mine = [r for r in runs if r["algorithm"] == name]
            xs = [p["samples"] for p in mine[0]["curve"]]
            if any([p["samples"] for p in r["curve"]] != xs for r in mine):
                raise ValueError(f"{name}: its seeds were evaluated at different sample counts")
            intervals = [t_interval([r["curve"][i][metric] for r in mine]) for i in range(len(xs))]
            (line,) = ax.plot(xs, [iv.mean for iv in intervals], marker="o", markersize=3,
                              label=f"{name} ({len(mine)} seed{'s' if len(mine) > 1 else ''})")
            if len(mine) > 1:
                ax.fill_between(xs, [iv.low for iv in intervals], [iv.high for iv in intervals],
                                color=line.get_color(), alpha=0.15, linewidth=0)
        ax.set_title(f"held-out {metric} accuracy")
        ax.set_xlabel("rollout samples")
        ax.set_ylabel(f"{metric} accuracy")
        ax.grid(alpha=0.3)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=4, fontsize="small")
    fig.savefig(path)


def commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def report(results: dict, out: Path) -> None:
    runs = results["runs"]
    clock = clock_of(runs)
    budget, rows = summarize(runs, clock)
    print_table(budget, rows, clock)
    commits = sorted({r.get("commit", results.get("commit", "unknown")) for r in runs})
    if len(commits) > 1:
        print(f"the runs were made at {len(commits)} commits: {', '.join(commits)}")
    plot(results["runs"], out / "shapebench_compare.png")
    print(f"\nfigure: {out / 'shapebench_compare.png'}; every run's curve: {out / 'results.json'}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=list(ALGORITHMS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="training seeds (at least 3 for an "
                   "interval worth reading)")
    p.add_argument("--samples", type=int, default=8192, help="rollout samples per run (the demo's 64 epochs)")
    p.add_argument("--eval-samples", type=int, default=512, help="held-out samples per evaluation (test.txt's 256 "
                   "prompts, repeated)")
    p.add_argument("--evals", type=int, default=4, help="held-out evaluations after the one before training")
    p.add_argument("--smoke", action="store_true", help=f"a tiny budget that shows the pipeline works: {SMOKE}")
    p.add_argument("--estimate", action="store_true", help="time one epoch of each algorithm, print the estimate "
                   "of the whole and stop")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "shapebench_compare")
    p.add_argument("--resume", action="store_true", help="keep the runs already in --out/results.json (same "
                   "samples, held-out set and threads) and make only the missing ones: the comparison may be made "
                   "over several sittings")
    p.add_argument("--report", type=Path, nargs="+", default=None, help="results.json files to print and plot "
                   "again, without training; several are merged")
    args = p.parse_args(argv)
    if args.report is not None:
        parts = [json.loads(path.read_text()) for path in args.report]
        report({**parts[0], "runs": [r for part in parts for r in part["runs"]]}, args.report[0].parent)
        return
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.out.resolve()
    write_dataset(out / "data", args.eval_samples)
    per_epoch = load_config(CONFIG).samples_per_epoch
    epochs = max(1, args.samples // per_epoch)
    world = {"samples": epochs * per_epoch, "eval_samples": args.eval_samples, "evals": args.evals,
             "threads": torch.get_num_threads()}
    results = {**world, "commit": commit(), "date": time.strftime("%Y-%m-%d"), "timings": {}, "runs": []}
    if args.resume and (out / "results.json").exists():
        results = resumed(out / "results.json", world)
    done = {(r["algorithm"], r["seed"]) for r in results["runs"]}
    planned = [(seed, name) for seed in args.seeds for name in args.algorithms  # a seed of every algorithm first
               if (name, seed) not in done]
    start = time.perf_counter()
    print(f"{len(args.algorithms)} algorithms x {len(args.seeds)} seeds, {len(planned)} runs to make "
          f"({len(done)} already in {out / 'results.json'}), {epochs} epochs of {per_epoch} samples, "
          f"{args.evals + 1} evaluations of {args.eval_samples} held-out samples, {torch.get_num_threads()} torch "
          f"threads; timing one epoch of each algorithm for an estimate ...", flush=True)
    timings = results["timings"]  # kept from an earlier sitting
    for name in dict.fromkeys(n for _, n in planned) if not args.estimate else args.algorithms:
        if name not in timings or args.estimate:
            timings[name] = calibrate(name, out)
    estimates = {name: run_seconds(t, epochs, args.evals, args.eval_samples) for name, t in timings.items()}
    total = sum(estimates[name] for _, name in planned)
    print("seconds per epoch: " + ", ".join(f"{n} {t['epoch_s']:.1f}" for n, t in timings.items()))
    print(f"estimate: {total / 3600:.1f} h ({total / 60:.0f} min) for the {len(planned)} runs, "
          f"after {(time.perf_counter() - start) / 60:.0f} min of timing", flush=True)
    if args.estimate:
        return

    done_estimate, runs_start = 0.0, time.perf_counter()
    for i, (seed, name) in enumerate(planned, 1):
        result = run(name, seed, epochs, args.evals, out)
        results["runs"].append(result)
        write_atomic(out / "results.json", json.dumps(results, indent=1))  # a killed sitting keeps its runs
        done_estimate += estimates[name]
        elapsed = time.perf_counter() - start
        # the estimates of the runs left, scaled by how the finished runs compared with theirs
        left = sum(estimates[n] for _, n in planned[i:]) * (time.perf_counter() - runs_start) / done_estimate
        print(f"[{i}/{len(planned)}] {name} seed {seed}: strict {result['curve'][0]['strict']:.3f} -> "
              f"{result['curve'][-1]['strict']:.3f}, {result['epoch_s']:.1f} s / epoch "
              f"({result['epoch_cpu_s']:.1f} s CPU); {elapsed / 60:.0f} min so far, about {left / 60:.0f} min left",
              flush=True)
    report(results, out)
    runs_min = (time.perf_counter() - runs_start) / 60
    print(f"took {(time.perf_counter() - start) / 60:.1f} min in all; the runs {runs_min:.1f} min (estimated "
          f"{total / 60:.0f} min)")


def resumed(path: Path, world: dict) -> dict:
    """The results of an earlier sitting, refused when they were made in another world."""
    results = json.loads(path.read_text())
    differ = {k: (results.get(k), v) for k, v in world.items() if results.get(k) != v}
    if differ:
        raise SystemExit(f"--resume: {path} was made with " + ", ".join(
            f"{k}={old} (now {new})" for k, (old, new) in differ.items()) + "; use another --out or the same settings")
    results.setdefault("timings", {})
    return results


if __name__ == "__main__":
    sys.exit(main())
