"""What the weight broadcaster does to a generator's label, for tests that stand in for it."""

from __future__ import annotations

import httpx


def set_label(url: str, label: str) -> None:
    """``POST /update_weight_version`` without aborting anything, as the broadcaster and a joining
    worker send it (SGLang's default would abort every request)."""
    r = httpx.post(
        url + "/update_weight_version",
        json={"new_version": label, "abort_all_requests": False},
        timeout=10,
    )
    assert r.status_code == 200 and r.json()["new_version"] == label, r.text


def get_label(url: str) -> str:
    return httpx.get(url + "/model_info", timeout=10).json()["weight_version"]
