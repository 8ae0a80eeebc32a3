"""``ff-train CONFIG.yaml [section.key=value ...]`` (also ``python -m flow_factory.train``).

With ``num_processes > 1`` and not yet inside a distributed launch, it re-launches
itself through ``accelerate launch`` with the config's launcher settings.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from .config import ConfigError, load_config_for_cli


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ff-train", description=__doc__.split("\n")[0])
    parser.add_argument("config", help="the run's YAML file")
    parser.add_argument("overrides", nargs="*", help="section.key=value, value parsed as YAML")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return parser.parse_args(argv)


def relaunch_command(cfg, argv: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(cfg.num_processes),
           "--main_process_port", str(cfg.main_process_port)]
    if cfg.config_file:
        cmd += ["--config_file", cfg.config_file]
    else:
        cmd += ["--multi_gpu", "--num_machines", "1", "--dynamo_backend", "no",
                "--mixed_precision", cfg.mixed_precision]
    return cmd + ["-m", "flow_factory.train", *argv]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    cfg = load_config_for_cli("ff-train", args.config, args.overrides)
    if cfg is None:
        return 2
    if args.print_config:
        print(cfg.to_yaml(), end="")
        return 0
    if cfg.num_processes > 1 and "WORLD_SIZE" not in os.environ:
        # the resolved run name travels along, so every process agrees on a default one
        return subprocess.call(relaunch_command(cfg, argv + [f"log.run_name={cfg.log.run_name}"]))

    # heavy imports only once the config is known to be good
    from .data import PromptFileError
    from .rewards.async_pool import RewardError
    from .rewards.http_client import RemoteRewardError
    from .trainer import Trainer
    from .checkpoint import CheckpointError
    from .guards import NonFiniteError
    from .trainer.interrupt import TrainingInterrupted
    from .trainer.run_folder import RunFolderError

    try:
        history = Trainer(cfg).train()
    except ConfigError as err:  # what only the model folder tells (preflight)
        print(f"ff-train: config error: {err}", file=sys.stderr)
        return 2
    except (CheckpointError, RunFolderError, PromptFileError) as err:
        print(f"ff-train: error: {err}", file=sys.stderr)
        return 2
    except NonFiniteError as err:
        print(f"ff-train: stopped: {err}", file=sys.stderr)
        return 1
    except (RewardError, RemoteRewardError) as err:  # they name the reward, or the server's URL
        print(f"ff-train: reward failed: {err}", file=sys.stderr)
        return 1
    except TrainingInterrupted as stop:
        run_dir = Path(stop.checkpoint).parent.parent
        print(f"ff-train: {stop}. Resume with:\n  ff-train {args.config} model.resume_path={run_dir} "
              f"log.run_name={cfg.log.run_name}", file=sys.stderr)
        return 128 + stop.signum
    if history and int(os.environ.get("RANK", "0")) == 0:
        last = {k: round(v, 4) for k, v in history[-1].items() if k.startswith("reward/") and k.endswith("/mean")}
        print(f"ff-train: done after {history[-1]['epoch'] + 1} epochs; last rewards {last}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
