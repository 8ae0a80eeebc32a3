"""Seconds per epoch, by phase, and peak memory, on a tiny SD3 pipeline (CPU, offline); with
``--baseline REV``, the same runs of another git revision of this project side by side.

    python bench/epoch_speed.py [--cases grpo nft] [--repeats 3] [--baseline main] [--this HEAD]
                                [--floor] [--stages] [--set train.steps_per_call=all] [--models all]

The world (fixed; change it only with a new entry in the experiment log): a random-init
SD3 pipeline built from config, float32, LoRA rank 4, 64x64, 10 steps, 16 rollouts an
epoch (4 prompts x group 4), per_device_batch_size 4, 2 optimizer steps an epoch, the
jpeg-compressibility reward, no eval, 5 epochs of which 2-5 are counted. Cases: grpo with
Flow-SDE 0.7 on every step; grpo with a 2-step window; nft and awm on ODE rollouts, with
their default training timesteps.

Each run is a fresh process (so peak RSS is its own); the two revisions alternate run by run
so that a noisy machine slows both alike, and each figure is the median over the repeats.
"startup" is config to a built Trainer; "launch" is the process's launch to its first epoch
(imports, the Trainer, everything before the first epoch: what a user waits for), "launch_cpu" the
CPU seconds the process spent by then (a loaded machine slows it far less than the wall clock) and
"start_rss_mb" its peak RSS by then; "peak_rss_mb" is the whole run's, the final save included
(both the process's VmHWM), and "exit_rss_mb" the peak as the kernel counts it once the process
has ended (wait4's, what ``/usr/bin/time`` prints).
Each child starts as ff-train starts its process (``command_process``), then builds the Trainer itself.
Each tree is compiled to bytecode first, as an installed package is (where PYTHONDONTWRITEBYTECODE
is set, every launch would otherwise compile each of our modules again). ``--floor`` also imports,
alone and in the same order, the third-party modules each revision's run held at its first epoch:
the CPU seconds and memory that no change of Flow-Factory's own code can save; ``--stages`` prints
where the first case's RSS and CPU seconds went, stage by stage of its start. "Outside model"
is the epoch's time minus the time spent inside the transformer, text encoders, VAE decode,
backward and optimizer step (timed by hooks): the framework's own cost.
``--this REV`` runs a committed revision in place of the working tree (a tree others are editing
may not import mid-change). ``--set`` overrides apply to this checkout only (a key the baseline
lacks would not load there).
``--models`` runs the same world on other families' tiny pipelines (video: 32x32, 5 frames; each
family's usual guidance), one table row per family, to show a family whose adapter adds overhead.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = ("grpo", "grpo-window2", "nft", "awm")
EPOCHS = 5
# tiny pipeline (flow_factory.testing) -> (model_type, resolution, num_frames, guidance_scale);
# sd3-5's row is the fixed world above
FAMILIES = {"sd3-5": ("sd3-5", 64, None, 4.5), "flux1": ("flux1", 64, None, 3.5),
            "wan2_t2v": ("wan2_t2v", 32, 5, 5.0), "wan2.2-a14b": ("wan2_t2v", 32, 5, 4.0),
            "wan2.2-ti2v-5b": ("wan2_t2v", 32, 5, 5.0), "qwen-image": ("qwen-image", 64, None, 4.0),
            "z-image": ("z-image", 64, None, 0.0), "flux2": ("flux2", 64, None, 4.0),
            "flux2-klein": ("flux2-klein", 64, None, 1.0), "hunyuanvideo15": ("hunyuanvideo15", 32, 5, 6.0),
            "ltx2_t2av": ("ltx2_t2av", 32, 9, 4.0)}


def case_config(case: str, tmp: Path, model: Path, family: str = "sd3-5") -> dict:
    data = tmp / "data"
    data.mkdir(exist_ok=True)
    (data / "train.txt").write_text("\n".join(f"prompt number {i}: a red circle" for i in range(16)) + "\n")
    model_type, resolution, frames, guidance = FAMILIES[family]
    train = {"resolution": resolution, "num_inference_steps": 10, "guidance_scale": guidance, "per_device_batch_size": 4,
             "group_size": 4, "unique_sample_num_per_epoch": 4, "gradient_step_per_epoch": 2,
             "max_epochs": EPOCHS, "ema_decay": 0.0, **({"num_frames": frames} if frames else {})}
    scheduler = {"dynamics_type": "ODE"}
    if case.startswith("grpo"):
        train["trainer_type"] = "grpo"
        scheduler = {"dynamics_type": "Flow-SDE", "noise_level": 0.7}
        if case == "grpo":
            scheduler.update(sde_steps=list(range(10)), num_sde_steps=None)
        else:
            scheduler.update(num_sde_steps=2)
    else:
        train["trainer_type"] = case
    return {
        "seed": 0,
        "data": {"dataset_dir": str(data)},
        "model": {"model_name_or_path": str(model), "model_type": model_type,
                  "lora_rank": 4, "lora_alpha": 4},
        "scheduler": scheduler,
        "train": train,
        "eval": {"eval_freq": 0},
        "log": {"run_name": "speed", "save_dir": str(tmp / "saves"), "logging_backend": "none", "save_freq": 0},
        "rewards": [{"reward_model": "jpeg_compressibility"}],
    }


def apply_overrides(config: dict, overrides: list[str]) -> dict:
    for item in overrides:
        key, _, raw = item.partition("=")
        section, _, name = key.partition(".")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        config.setdefault(section, {})[name] = value
    return config


def run_one(case: str, model: Path, family: str, overrides: list[str], launched_at: float,
            modules_out: str | None = None) -> dict:
    """One training run in this process (whichever flow_factory is importable); returns its figures.
    ``launched_at``: the wall-clock time the parent started this process. ``modules_out``: a file to
    write the third-party modules held at the first epoch to (``import_floor`` imports them alone).
    "stages": RSS, peak RSS and CPU seconds after each step of the start and at each epoch's start."""
    stages = {}

    def stage(name):
        stages[name] = (rss_mb("VmRSS"), peak_rss_mb(), cpu_seconds())
    stage("python started")
    own_process = command_process()
    import torch
    stage("import torch")
    from flow_factory.config import parse_config
    stage("import flow_factory.config")
    from flow_factory.trainer import Trainer
    if own_process:
        own_process.imports_done()
    stage("import flow_factory.trainer")
    from model_clock import ModelClock  # bench/, this script's folder

    torch.set_num_threads(1)  # the same on every machine, and two runs never fight for cores
    clock = ModelClock()

    with tempfile.TemporaryDirectory() as tmp:
        config = apply_overrides(case_config(case, Path(tmp), model, family), overrides)
        start = time.perf_counter()
        trainer = Trainer(parse_config(config))
        startup = time.perf_counter() - start
        stage("Trainer built")
        clock.watch_trainer(trainer)
        per_epoch_inside, at_first_epoch = [], {}
        original = trainer.sample_epoch

        def sample_epoch(epoch):  # model time per epoch: the hook totals at each epoch's start
            if not per_epoch_inside:
                at_first_epoch.update(process_figures(launched_at, modules_out))
            stage(f"epoch {epoch + 1} starts")
            per_epoch_inside.append(clock.total())
            return original(epoch)
        trainer.sample_epoch = sample_epoch
        history = trainer.train()
    stage("trained and saved")
    per_epoch_inside.append(clock.total())
    model_time = [b - a for a, b in zip(per_epoch_inside, per_epoch_inside[1:])]
    counted = history[1:]
    phases = {p: statistics.mean(r[f"time/{p}"] for r in counted)
              for p in ("sampling", "decode", "reward", "training", "other")}
    epoch = statistics.mean(r["time/epoch"] for r in counted)
    return {"epoch": epoch, "first_epoch": history[0]["time/epoch"], "startup": startup, **at_first_epoch,
            **phases, "outside_model": epoch - statistics.mean(model_time[1:]),
            "peak_rss_mb": peak_rss_mb(), "stages": stages}


def command_process():
    """Start this process as ff-train starts its own (``flow_factory.own_process``: full collections held off until
    the trainer's imports are done, then what they left frozen), in a revision that has it: that module, or None."""
    try:
        from flow_factory import own_process
    except ImportError:  # an older revision: its ff-train started as a plain process
        return None
    own_process.start()
    return own_process


OWN_MODULES = ("flow_factory", "epoch_speed", "model_clock", "__main__", "__mp_main__")


def rss_mb(field: str) -> float:
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith(f"{field}:")).split()[1]) / 1024


def peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM). Not ``ru_maxrss``: that one survives exec, so a child would report
    at least the RSS of the parent that forked it (this bench's, with the tiny pipelines built)."""
    return rss_mb("VmHWM")


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def process_figures(launched_at: float, modules_out: str | None) -> dict:
    """At the first epoch: seconds since launch, CPU seconds (what a loaded machine slows least), and the
    peak RSS so far (imports and the built Trainer); the third-party modules held, to ``modules_out``."""
    if modules_out:
        held = [m for m in sys.modules if not m.startswith(OWN_MODULES)]
        Path(modules_out).write_text(json.dumps(held))
    return {"launch": time.time() - launched_at, "launch_cpu": cpu_seconds(),
            "start_rss_mb": peak_rss_mb()}


def import_floor(modules_file: str) -> dict:
    """Import, in the order a run did, the third-party modules it held at its first epoch, and nothing of
    Flow-Factory's: what any run that uses these libraries pays before its first epoch."""
    import importlib

    for name in json.loads(Path(modules_file).read_text()):
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - a few entries (lazy modules' aliases) cannot be imported by name
            pass
    return {"launch_cpu": cpu_seconds(), "start_rss_mb": peak_rss_mb()}


def checkout(rev: str, where: Path) -> Path:
    """The tree of ``rev`` in ``where`` (git archive: no worktree left behind)."""
    where.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    return where


def spawn(src: Path, args: list[str], what: str) -> dict:
    """This script as a child on ``src``'s flow_factory, with ``args``: its figures, and "exit_rss_mb", its
    peak RSS as the kernel counts it when the process ends (what ``/usr/bin/time`` prints). That one is read
    from ``wait4``, so this parent must stay small: a child's count starts from the RSS of the process that
    forked it (it survives exec)."""
    env = {**os.environ, "PYTHONPATH": str(src), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen([sys.executable, __file__, *args], env=env, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        if child.returncode:
            raise SystemExit(f"{what} with {src} failed:\n{err.read()[-3000:]}")
        return {**json.loads(out.read().strip().splitlines()[-1]), "exit_rss_mb": usage.ru_maxrss / 1024}


def spawn_run(src: Path, case: str, model: Path, family: str, overrides: list[str], modules_out=None) -> dict:
    args = ["--child", case, "--model", str(model), "--family", family, "--launched-at", repr(time.time()),
            *sum([["--set", o] for o in overrides], []), *(["--modules-out", str(modules_out)] if modules_out else [])]
    return spawn(src, args, f"{family} {case}")


def compiled(src: Path) -> Path:
    """``src`` with its bytecode written, as an installed package has it: a child then reads it, also where
    PYTHONDONTWRITEBYTECODE is set (which would compile every module at every launch)."""
    compileall.compile_dir(str(src), quiet=1)
    return src


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--repeats", type=int, default=3, help="runs of each case per revision")
    parser.add_argument("--baseline", metavar="REV", help="a git revision to run side by side (e.g. main, HEAD~3)")
    parser.add_argument("--this", metavar="REV", help="run this git revision's tree instead of the working tree")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="config override for this checkout's runs (JSON values)")
    parser.add_argument("--models", nargs="+", default=["sd3-5"], metavar="FAMILY",
                        help=f"tiny families to run: {', '.join(FAMILIES)}, or all")
    parser.add_argument("--floor", action="store_true", help="also import, alone, the third-party modules each "
                        "revision's run held at its first epoch: the part of the launch no code of ours can save")
    parser.add_argument("--stages", action="store_true", help="also print, for the first case, RSS, peak RSS and "
                        "CPU seconds after each step of the start and at each epoch's start, by revision")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--modules-out", help=argparse.SUPPRESS)
    parser.add_argument("--floor-of", help=argparse.SUPPRESS)
    parser.add_argument("--family", default="sd3-5", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--launched-at", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_one(args.child, Path(args.model), args.family, args.set, args.launched_at,
                                 args.modules_out)))
        return
    if args.floor_of:
        print(json.dumps(import_floor(args.floor_of)))
        return
    families = list(FAMILIES) if args.models == ["all"] else args.models
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        parser.error(f"--models: {', '.join(unknown)} unknown; expected {', '.join(FAMILIES)} or all")

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        sides = {"this": checkout(args.this, tmp / "this") / "src" if args.this else ROOT / "src"}
        if args.baseline:
            sides[args.baseline] = checkout(args.baseline, tmp / "baseline") / "src"
        sides = {side: compiled(src) for side, src in sides.items()}
        models = {family: tmp / family for family in families}
        for family, where in models.items():  # in a child: this process imports no torch (see spawn)
            subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; from flow_factory.testing "
                            "import build_tiny_pipeline; build_tiny_pipeline(sys.argv[1], Path(sys.argv[2]))",
                            family, str(where)], env={**os.environ, "PYTHONPATH": str(sides["this"])},
                           check=True, capture_output=True)
        rows = [(family, case) for family in families for case in args.cases]
        results, floors = measure(args, sides, models, rows, tmp)
    report(args, families, rows, list(sides), results, floors)
    print(f"took {time.perf_counter() - started:.0f} s")


def print_stages(row: tuple, sides: list, names: dict, results: dict) -> None:
    """Medians over the repeats, a line a stage: RSS MB (peak MB) and CPU s, each revision side by side."""
    print(f"\nstart-up by stage, {row[0]} {row[1]}: RSS MB (peak MB) CPU s")
    print(f"{'stage':<28}" + "".join(f"{side:>28}" for side in sides))
    for name in names:
        cells = []
        for side in sides:
            rss, peak, cpu = (statistics.median(run["stages"][name][i] for run in results[row, side]
                                                if name in run["stages"]) for i in range(3))
            cells.append(f"{rss:7.1f} ({peak:7.1f}) {cpu:6.2f} s")
        print(f"{name:<28}" + "".join(f"{c:>28}" for c in cells))


def alternating(sides: dict, r: int):
    return list(sides.items()) if r % 2 == 0 else list(reversed(sides.items()))


def measure(args, sides: dict, models: dict, rows: list, tmp: Path) -> tuple[dict, dict]:
    """Every run, the two revisions alternating run by run; with ``--floor``, each revision's import floor
    as often, alternating too (the modules are those of its first run of the first row)."""
    results = {(row, side): [] for row in rows for side in sides}
    modules = {side: tmp / f"modules-{i}.json" for i, side in enumerate(sides)}
    for r in range(args.repeats):
        for family, case in rows:
            for side, src in alternating(sides, r):
                overrides = args.set if side == "this" else []
                runs = results[(family, case), side]
                first = args.floor and r == 0 and (family, case) == rows[0]
                runs.append(spawn_run(src, case, models[family], family, overrides, modules[side] if first else None))
                print(f"  repeat {r + 1}/{args.repeats} {family:<15} {case:<13} {side:<10} "
                      f"{runs[-1]['epoch']:.3f} s/epoch", file=sys.stderr, flush=True)
    floors = {side: [] for side in sides} if args.floor else {}
    for r in range(args.repeats if args.floor else 0):
        for side, src in alternating(sides, r):
            floors[side].append(spawn(src, ["--floor-of", str(modules[side])], "the import floor"))
    return results, floors


def report(args, families: list, rows: list, sides: list, results: dict, floors: dict) -> None:
    def median(row, side, key):
        return statistics.median(run[key] for run in results[row, side])

    print(f"tiny {', '.join(families)}; {EPOCHS} epochs (2-{EPOCHS} counted), median of {args.repeats} runs, "
          "one thread" + (f"; overrides on this checkout: {' '.join(args.set)}" if args.set else ""))
    cols = ["epoch", "sampling", "training", "other", "first_epoch", "startup", "launch", "launch_cpu",
            "outside_model", "start_rss_mb", "peak_rss_mb", "exit_rss_mb"]
    print(f"{'family':<16}{'case':<14}{'revision':<12}" + "".join(f"{c:>14}" for c in cols))
    for row in rows:
        for side in sides:
            print(f"{row[0]:<16}{row[1]:<14}{side:<12}" + "".join(f"{median(row, side, c):>14.3f}" for c in cols))
        epoch = median(row, "this", "epoch")
        print(f"{'':<42}outside model {median(row, 'this', 'outside_model') / epoch:.1%} of the epoch; "
              f"first epoch {median(row, 'this', 'first_epoch') / epoch:.2f}x the others")
        if args.baseline:
            ratio = {c: median(row, "this", c) / median(row, args.baseline, c)
                     for c in ("epoch", "peak_rss_mb", "exit_rss_mb", "launch", "launch_cpu")}
            print(f"{'':<42}this / {args.baseline}: epoch {ratio['epoch']:.2f}x, peak RSS {ratio['peak_rss_mb']:.2f}x "
                  f"(at exit {ratio['exit_rss_mb']:.2f}x), launch to first epoch {ratio['launch']:.2f}x (its CPU "
                  f"seconds {ratio['launch_cpu']:.2f}x)")
    if args.stages:
        print_stages(rows[0], sides, results[rows[0], sides[0]][0]["stages"], results)
    for side, runs in floors.items():
        cpu, rss = (statistics.median(f[k] for f in runs) for k in ("launch_cpu", "start_rss_mb"))
        print(f"import floor of {side} (the third-party modules its {rows[0][0]} {rows[0][1]} run held at its "
              f"first epoch, imported alone): {cpu:.3f} CPU s, {cpu / median(rows[0], side, 'launch_cpu'):.0%} "
              f"of its launch's; {rss:.1f} MB, {rss / median(rows[0], side, 'start_rss_mb'):.0%} of its RSS then")
    if len(families) > 1:
        print("\nframework overhead per epoch (time outside model compute), by family:")
        print(f"{'family':<16}{'case':<14}{'epoch s':>10}{'outside s':>11}{'outside %':>11}")
        for row in rows:
            epoch, outside = median(row, "this", "epoch"), median(row, "this", "outside_model")
            print(f"{row[0]:<16}{row[1]:<14}{epoch:>10.3f}{outside:>11.3f}{outside / epoch:>11.1%}")


if __name__ == "__main__":
    main()
