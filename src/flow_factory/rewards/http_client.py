"""JSON over HTTP with timeouts, retries and backoff: shared by remote rewards and VLM judges.

Retried: connection errors, timeouts, and 502/503/504 (a server restarting or
overloaded), ``retry_attempts`` times after the first try, sleeping
``backoff * 2**k`` seconds before retry k. Not retried: any other 4xx/5xx, which would
fail the same way again; its ``detail`` is in the error.
"""

from __future__ import annotations

import time
from typing import Any

RETRY_STATUS = {502, 503, 504}


class RemoteRewardError(RuntimeError):
    pass


class JsonClient:
    def __init__(self, base_url: str, timeout: float = 60.0, retry_attempts: int = 3, backoff: float = 0.5,
                 token: str | None = None, what: str = "reward server"):
        try:
            import httpx
        except ImportError as e:
            raise ImportError("remote rewards need httpx: pip install 'flow_factory[remote]'") from e
        if not base_url or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"{what} URL must start with http:// or https://, got {base_url!r}")
        if timeout <= 0 or retry_attempts < 0 or backoff < 0:
            raise ValueError(f"timeout must be > 0, retry_attempts and backoff >= 0; got {timeout}, "
                             f"{retry_attempts}, {backoff}")
        self.base_url = base_url.rstrip("/")
        self.timeout, self.retry_attempts, self.backoff, self.what = float(timeout), int(retry_attempts), backoff, what
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        # httpx.Client is thread-safe: async workers share one connection pool
        self._httpx = httpx
        self.client = httpx.Client(timeout=self.timeout, headers=headers)

    def post(self, path: str, payload: dict[str, Any]) -> Any:
        """The JSON answer to ``payload``, or RemoteRewardError for any status but 200."""
        url, response = self._send(path, payload)
        if response.status_code != 200:
            raise RemoteRewardError(f"{self.what} {url} answered HTTP {response.status_code}: {_detail(response)}")
        try:
            return response.json()
        except ValueError:
            raise RemoteRewardError(f"{self.what} {url} answered with non-JSON: {response.text[:200]!r}") from None

    def status(self, path: str, payload: dict[str, Any]) -> int:
        """The HTTP status ``payload`` gets (after the same retries as ``post``), whatever it is."""
        return self._send(path, payload)[1].status_code

    def _send(self, path: str, payload: dict[str, Any]):
        """(url, response) of the first try that is answered with neither a retried status nor an
        error of the connection; RemoteRewardError once every try failed so."""
        url = f"{self.base_url}/{path.lstrip('/')}"
        attempts = self.retry_attempts + 1
        last = ""
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                response = self.client.post(url, json=payload)
            except self._httpx.TimeoutException:
                last = f"no answer within {self.timeout:g} s"
                continue
            except self._httpx.TransportError as e:
                last = f"{type(e).__name__}: {e}"
                continue
            if response.status_code in RETRY_STATUS:
                last = f"HTTP {response.status_code}: {_detail(response)}"
                continue
            return url, response
        raise RemoteRewardError(f"{self.what} {url} failed after {attempts} attempt(s) "
                                f"(timeout {self.timeout:g} s each): {last}")

    def close(self) -> None:
        self.client.close()


def _detail(response) -> str:
    try:
        body = response.json()
        return str(body.get("detail", body)) if isinstance(body, dict) else str(body)
    except ValueError:
        return response.text[:300]
