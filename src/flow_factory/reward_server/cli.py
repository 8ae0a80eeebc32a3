"""``ff-reward-server --reward NAME [--port P]``: serve a reward over HTTP.

NAME is a ``RewardServer`` subclass (``pkg.module.Class``: only that module is
imported, so it runs without torch when it does not need it), a built-in reward name
(``PickScore``, ``CLIP``, ...) or a reward model class path.

The bearer token comes from ``--token-file PATH``, ``$FF_REWARD_SERVER_TOKEN`` or
``--token`` (which ``ps`` shows to every user of the machine); the limits on bodies and
decoded pixels are described in ``app.py``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from ..class_path import import_class
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
        try:  # looked up in the working directory, then the installed packages (flow_factory.class_path)
            obj = import_class(reward, "--reward")
        except (ImportError, ValueError) as e:
            raise SystemExit(f"ff-reward-server: {e}") from None
        if isinstance(obj, type) and issubclass(obj, RewardServer):
            try:
                server = obj(**options)
            except TypeError as e:
                raise SystemExit(f"ff-reward-server: --reward {reward!r}: cannot build it with --option "
                                 f"{sorted(options)}: {e}") from None
            server.name = server.name or reward
            return server
    from .model_server import RewardModelServer  # torch and the reward's dependencies

    return RewardModelServer(reward, **options)


def read_token(given: str | None, path: Path | None, error) -> str | None:
    """The token from --token, else --token-file, else $FF_REWARD_SERVER_TOKEN; None when none is set."""
    if given is not None and path is not None:
        error("give --token or --token-file, not both")
    if path is not None:
        try:
            token = path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            error(f"--token-file {path}: cannot read it ({e})")
        if not token or any(c.isspace() for c in token):
            error(f"--token-file {path}: expected one token without spaces, got "
                  f"{'an empty file' if not token else 'text with spaces or several lines'}")
        return token
    return given or os.environ.get("FF_REWARD_SERVER_TOKEN") or None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="ff-reward-server", description=__doc__.split("\n\n")[0])
    p.add_argument("--reward", required=True, help="built-in reward name or pkg.module.Class")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--token", help="require 'Authorization: Bearer TOKEN'. Every user of the machine sees it "
                   "in `ps`: prefer --token-file or $FF_REWARD_SERVER_TOKEN")
    p.add_argument("--token-file", type=Path, metavar="PATH",
                   help="read the token from this file (surrounding whitespace stripped)")
    p.add_argument("--max-request-mb", type=float, default=64.0, help="largest request body accepted (default 64)")
    p.add_argument("--max-request-mpx", type=float, default=128.0,
                   help="megapixels (10^6) the images of one request may hold once decoded, as their headers "
                        "declare; more is refused with 413 before decoding (default 128: 4 bytes a pixel, 512 MB)")
    p.add_argument("--max-inflight-mpx", type=float, default=256.0,
                   help="megapixels decoded across all requests being served; a request that would pass it "
                        "waits for others to be answered (default 256: about 1 GB; at least --max-request-mpx)")
    p.add_argument("--option", action="append", type=parse_option, default=[], metavar="KEY=VALUE",
                   help="constructor option of the reward (repeatable), e.g. --option device=cuda")
    args = p.parse_args(argv)
    if args.max_inflight_mpx < args.max_request_mpx:
        p.error(f"--max-inflight-mpx {args.max_inflight_mpx:g} is below --max-request-mpx "
                f"{args.max_request_mpx:g}: a request must fit alone")
    if min(args.max_request_mb, args.max_request_mpx) <= 0:
        p.error("--max-request-mb and --max-request-mpx must be > 0")
    token = read_token(args.token, args.token_file, p.error)

    from .app import serve

    serve(build_server(args.reward, dict(args.option)), args.host, args.port, token, args.max_request_mb,
          args.max_request_mpx, args.max_inflight_mpx)


if __name__ == "__main__":
    main()
