"""``ff-reward-server --reward NAME [--port P]``: serve a reward over HTTP.

NAME is a ``RewardServer`` subclass (``pkg.module.Class``: only that module is
imported, so it runs without torch when it does not need it), a built-in reward name
(``PickScore``, ``CLIP``, ...) or a reward model class path.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

from .base import RewardServer


def parse_option(text: str) -> tuple[str, object]:
    """``key=value``; the value is read as JSON when it parses (numbers, true, null), else a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--option {text!r}: expected key=value")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def build_server(reward: str, options: dict) -> RewardServer:
    if "." in reward or ":" in reward:
        module_name, _, attr = reward.partition(":") if ":" in reward else reward.rpartition(".")
        try:
            obj = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise SystemExit(f"ff-reward-server: --reward {reward!r}: cannot import it: {e}") from None
        if isinstance(obj, type) and issubclass(obj, RewardServer):
            server = obj(**options)
            server.name = server.name or reward
            return server
    from .model_server import RewardModelServer  # torch and the reward's dependencies

    return RewardModelServer(reward, **options)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="ff-reward-server", description=__doc__.split("\n\n")[0])
    p.add_argument("--reward", required=True, help="built-in reward name or pkg.module.Class")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--token", default=os.environ.get("FF_REWARD_SERVER_TOKEN"),
                   help="require 'Authorization: Bearer TOKEN' (default: $FF_REWARD_SERVER_TOKEN, else none)")
    p.add_argument("--max-request-mb", type=float, default=64.0, help="largest request body accepted")
    p.add_argument("--option", action="append", type=parse_option, default=[], metavar="KEY=VALUE",
                   help="constructor option of the reward (repeatable), e.g. --option device=cuda")
    args = p.parse_args(argv)

    import uvicorn

    from .app import create_app

    server = build_server(args.reward, dict(args.option))
    app = create_app(server, token=args.token, max_request_bytes=int(args.max_request_mb * 2**20))
    print(f"ff-reward-server: serving {server.name or type(server).__name__} on http://{args.host}:{args.port}",
          file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
