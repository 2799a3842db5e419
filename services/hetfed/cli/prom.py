"""Prometheus's HTTP query API, and the PNG metadata key the pictures drawn from it carry."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

PNG_KEY = "hetfed-report"  # the PNG text chunk holding a plot's description (axes labels, lines)


def prom_query(url: str, query: str, at: float | None = None, timeout: float = 10.0) -> list[dict[str, Any]]:
    """An instant query's result vector (``at``: evaluation time, default now)."""
    params = {"query": query, **({"time": f"{at:.3f}"} if at is not None else {})}
    return _prom_get(url, "/api/v1/query", params, timeout)


def prom_range(url: str, query: str, start: float, end: float, step: float,
               timeout: float = 30.0) -> list[dict[str, Any]]:
    """A range query's result matrix."""
    params = {"query": query, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"}
    return _prom_get(url, "/api/v1/query_range", params, timeout)


def _prom_get(url: str, path: str, params: dict[str, str], timeout: float) -> list[dict[str, Any]]:
    full = url.rstrip("/") + path + "?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(full, timeout=timeout) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        raise ValueError(f"Prometheus refused {params['query']!r}: {exc.code} {detail}") from None
    if body.get("status") != "success":
        raise ValueError(f"Prometheus answered {body.get('errorType')}: {body.get('error')}")
    return list(body["data"]["result"])


