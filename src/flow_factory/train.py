"""``ff-train CONFIG.yaml [section.key=value ...] [--num_processes N ...]`` (also ``python -m flow_factory.train``).

With ``num_processes > 1`` and not yet inside a distributed launch, it re-launches
itself through ``accelerate launch`` with the launcher settings. Those come, first found
first, from Flow-Factory's flags (``--num_processes --num_machines --machine_rank
--main_process_ip --main_process_port``), then the environment a cluster scheduler sets
(``LAUNCH_ENV``; read only when it names a master address and more than one machine, as
Flow-Factory does), then the config's top-level keys.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

from . import launcher, own_process
from .config import ConfigError, load_config_for_cli
from .launch_configs import resolve as resolve_launch_config
from .start_checks import start_problems


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ff-train", description=__doc__.split("\n")[0])
    parser.add_argument("config", help="the run's YAML file")
    parser.add_argument("overrides", nargs="*", help="section.key=value, value parsed as YAML")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--plan", action="store_true", help="estimate memory per GPU and time per epoch from the "
                        "config alone (no weights, no GPU) and exit: 0 if it fits, 1 if not")
    parser.add_argument("--gpu", choices=PLAN_GPUS, default="h100", help="--plan: the GPU planned for")
    parser.add_argument("--json", action="store_true", help="--plan: print the plan as JSON")
    parser.add_argument("--utilisation", type=float, default=0.4, help="--plan: share of the GPU's bf16 peak "
                        "the transformer calls reach")
    for key, kind in LAUNCH_KEYS.items():
        parser.add_argument(f"--{key}", type=kind, default=None, help=f"overrides the config's {key}")
    return parser.parse_intermixed_args(argv)  # overrides may follow the flags


PLAN_GPUS = ("h100", "h200", "a100-80", "a100-40", "l40s")  # flow_factory.plan.gpus.GPUS, without importing torch
LAUNCH_KEYS = {"num_processes": int, "num_machines": int, "machine_rank": int, "main_process_ip": str,
               "main_process_port": int}
# the variables cluster schedulers set, as Flow-Factory reads them (first set wins)
LAUNCH_ENV = {"main_process_ip": ("MASTER_IP", "MASTER_ADDR", "CHIEF_IP"), "main_process_port": ("MASTER_PORT",),
              "machine_rank": ("MACHINE_RANK", "NODE_RANK", "INDEX"),
              "num_machines": ("NUM_MACHINES", "NUM_NODES", "HOST_NUM"),
              "gpus_per_node": ("GPUS_PER_NODE", "HOST_GPU_NUM")}


def launch_overrides(args: argparse.Namespace, environ) -> list[str]:
    """``key=value`` overrides of the launcher keys from the flags, else from the environment."""
    found = {}
    for key, names in LAUNCH_ENV.items():
        value = next((environ[n] for n in names if environ.get(n)), None)
        if value is not None:
            found[key] = value
    multi_node = found.get("main_process_ip") and int(found.get("num_machines", "1")) > 1
    from_env = {k: v for k, v in found.items() if k != "gpus_per_node"} if multi_node else {}
    if multi_node and "gpus_per_node" in found:
        from_env["num_processes"] = str(int(found["num_machines"]) * int(found["gpus_per_node"]))
    given = {key: getattr(args, key) for key in LAUNCH_KEYS if getattr(args, key) is not None}
    return [f"{key}={value}" for key, value in {**from_env, **given}.items()]


LAUNCHED = "FLOW_FACTORY_LAUNCHED"  # set in the relaunched processes: they train instead of launching again


def needs_launch(cfg, environ) -> bool:
    """Through ``accelerate launch`` when several processes run or a launch config is named (FSDP or
    DeepSpeed on one GPU still needs accelerate's setup), unless this process was launched already."""
    launched = LAUNCHED in environ or "WORLD_SIZE" in environ
    return not launched and (cfg.num_processes > 1 or cfg.config_file is not None)


def relaunch_command(cfg, argv: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "flow_factory.launcher", "--num_processes", str(cfg.num_processes),
           "--num_machines", str(cfg.num_machines), "--machine_rank", str(cfg.machine_rank),
           "--main_process_port", str(cfg.main_process_port)]
    if cfg.main_process_ip:
        cmd += ["--main_process_ip", cfg.main_process_ip]
    if cfg.config_file:  # a shipped config by name, or the user's file (checked with the config)
        cmd += ["--config_file", str(resolve_launch_config(cfg.config_file))]
    else:
        cmd += ["--multi_gpu", "--dynamo_backend", "no"]
    return cmd + ["--mixed_precision", cfg.mixed_precision, "-m", "flow_factory.train", *argv]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    overrides = launch_overrides(args, os.environ) + args.overrides
    cfg = load_config_for_cli("ff-train", args.config, overrides)
    if cfg is None:
        return 2
    if args.print_config:
        print(cfg.to_yaml(), end="")
        return 0
    if args.plan:  # before any check of this machine or launch: a plan needs neither
        from .plan.report import run as plan
        return plan(args.config, overrides, args.gpu, args.num_processes, args.json, args.utilisation)
    if not launcher.launched():  # a launched process: its launcher checked
        problems = start_problems(cfg, any(o.startswith("num_processes=") for o in overrides))
        if problems:
            print(f"ff-train: {args.config} cannot start:", *(f"  {p}" for p in problems), sep="\n",
                  file=sys.stderr)
            return 2
    if needs_launch(cfg, os.environ):
        # the resolved run name travels along, so every process agrees on a default one
        return launcher.run(relaunch_command(cfg, argv + [f"log.run_name={cfg.log.run_name}"]),
                            {**os.environ, LAUNCHED: "1"})
    try:
        return train(cfg, args.config)
    except Exception as crash:
        if launcher.launched():
            return launcher.report_crash(crash)
        raise


def train(cfg, config_path: str) -> int:
    """Train in this process; the exit status, its last message reported (``launcher.report``)."""
    # heavy imports only once the config is known to be good
    from .data import PromptFileError
    from .rewards.async_pool import RewardError
    from .rewards.http_client import RemoteRewardError
    from .trainer import Trainer
    from .trainer.backends import end_process_group
    from .checkpoint import CheckpointError
    from .guards import NonFiniteError
    from .algorithms.distillation.replay import ReplayMismatch
    from .trainer.interrupt import TrainingInterrupted
    from .trainer.run_folder import RunFolderError

    own_process.imports_done()
    trainer = None
    try:
        trainer = Trainer(cfg)
        history = trainer.train()
        run_dir = trainer.run_dir
    except ConfigError as err:  # what only the model folder tells (preflight)
        return launcher.report(f"ff-train: config error: {err}", 2)
    except (CheckpointError, RunFolderError, PromptFileError) as err:
        return launcher.report(f"ff-train: error: {err}", 2)
    except (NonFiniteError, ReplayMismatch) as err:  # ReplayMismatch: a distillation run's rollout check
        return launcher.report(f"ff-train: stopped: {err}", 1)
    except (RewardError, RemoteRewardError) as err:  # they name the reward, or the server's URL
        return launcher.report(f"ff-train: reward failed: {err}", 1)
    except TrainingInterrupted as stop:
        run_dir = Path(stop.checkpoint).parent.parent
        return launcher.report(f"ff-train: {stop}. Resume with:\n  ff-train {config_path} "
                               f"model.resume_path={run_dir} log.run_name={cfg.log.run_name}", 128 + stop.signum)
    finally:
        trainer = None  # the run's objects go before the process group they hold
        crash = sys.exc_info()[1]  # on its way to main's report: its frames hold the Trainer too
        if crash is not None:
            traceback.clear_frames(crash.__traceback__)  # the lines stay, for the report; the locals go
        end_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print(finished(config_path, run_dir, history), file=sys.stderr, flush=True)
    return 0


def finished(config_path: str, run_dir: Path, history: list[dict]) -> str:
    """What a run left and the commands that use it: the last lines a finished run prints."""
    from .checkpoint import list_checkpoints

    last = {k.split("/")[1]: round(v, 4) for k, v in (history[-1] if history else {}).items()
            if k.startswith("reward/") and k.endswith("/mean")}
    lines = [f"ff-train: done after {history[-1]['epoch'] + 1 if history else 0} epochs; last rewards {last}",
             f"  run folder:      {run_dir} (reward_curve.png, history.json, samples/)"]
    checkpoints = list_checkpoints(run_dir)
    if checkpoints:
        checkpoint = checkpoints[-1]
        lines += [f"  last checkpoint: {checkpoint}",
                  f"  sample it:       ff-sample --checkpoint {checkpoint} --prompts \"a prompt\" "
                  f"--out {run_dir}/samples_cli",
                  f"  evaluate it:     ff-eval {config_path} --checkpoint {checkpoint}"]
    return "\n".join(lines)


def cli() -> int:
    """The ``ff-train`` command: ``main`` in a process of its own (``own_process``)."""
    own_process.start()
    return main()


if __name__ == "__main__":
    sys.exit(cli())
