"""docs/rewards.md's request to ff-reward-server runs as written against a live server.

The blocks of the doc's "A request" section are read from the markdown, so the doc and this test
cannot drift: the server is started with the doc's ``--reward`` and its token in
``$FF_REWARD_SERVER_TOKEN``, as the doc starts it; the curl and Python examples run unchanged, given
the server's address in ``REWARD_SERVER_URL``, the variable they read; both must get the reply the
doc shows.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from reward_servers import free_port, start_server, stop_server

REWARDS_DOC = Path(__file__).resolve().parents[1] / "docs" / "rewards.md"
TOKEN = "doc-example-token"


def request_section_blocks() -> dict[str, str]:
    """The fenced blocks of the doc's "### A request" section, by what they are: the server's start,
    the curl request, the Python request and the reply."""
    text = REWARDS_DOC.read_text(encoding="utf-8")
    section = re.search(r"^### A request\n(.*?)^#", text, flags=re.M | re.S).group(1)
    blocks = re.findall(r"^```(\w+)\n(.*?)^```", section, flags=re.M | re.S)
    (start,) = [code for lang, code in blocks if lang == "bash" and "ff-reward-server" in code]
    (curl,) = [code for lang, code in blocks if lang == "bash" and code.startswith("curl")]
    (python,) = [code for lang, code in blocks if lang == "python"]
    (reply,) = [code for lang, code in blocks if lang == "json"]
    return {"start": start, "curl": curl, "python": python, "reply": reply}


@pytest.fixture(scope="module")
def doc_server():
    """The doc's server on a free port; yields the environment its clients run in."""
    reward = re.search(r"--reward (\S+)", request_section_blocks()["start"]).group(1)
    port = free_port()
    proc = start_server(reward, port, env={"FF_REWARD_SERVER_TOKEN": TOKEN})
    yield {**os.environ, "REWARD_SERVER_URL": f"http://127.0.0.1:{port}", "FF_REWARD_SERVER_TOKEN": TOKEN}
    stop_server(proc)


def assert_is_the_docs_reply(reply: dict) -> None:
    shown = json.loads(request_section_blocks()["reply"])
    assert set(reply) == {"rewards"} and len(reply["rewards"]) == 1
    assert reply["rewards"] == pytest.approx(shown["rewards"], rel=1e-6)


def test_the_docs_python_request_gets_the_docs_reply(doc_server):
    run = subprocess.run([sys.executable, "-"], input=request_section_blocks()["python"], env=doc_server,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert_is_the_docs_reply(ast.literal_eval(run.stdout.strip()))  # it prints reply.json()


def test_the_docs_curl_request_gets_the_docs_reply(doc_server):
    if shutil.which("curl") is None:
        pytest.skip("no curl on this machine")
    run = subprocess.run(["bash", "-c", request_section_blocks()["curl"]], env=doc_server, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert_is_the_docs_reply(json.loads(run.stdout))


def test_the_token_the_doc_sends_is_what_admits_the_request(doc_server):
    url = f"{doc_server['REWARD_SERVER_URL']}/score"
    refused = httpx.post(url, json={"prompts": ["a"]}, headers={"Authorization": "Bearer wrong"}, timeout=30)
    assert refused.status_code == 401 and "Authorization: Bearer" in refused.json()["detail"]
