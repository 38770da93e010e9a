"""RNG states of a process: taken, restored, and as JSON (a trainer state travels in trainer.json)."""

from __future__ import annotations

import base64
import random
from typing import Any

import torch


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rng_to_json(state: dict[str, Any]) -> dict[str, Any]:
    """rng_state() as JSON (a trainer state travels in trainer.json)."""

    def encode(t: torch.Tensor) -> str:
        return base64.b64encode(t.numpy().tobytes()).decode()

    version, internal, gauss = state["python"]
    out = {"torch": encode(state["torch"]), "python": [version, list(internal), gauss]}
    if "cuda" in state:
        out["cuda"] = [encode(t) for t in state["cuda"]]
    return out


def rng_from_json(data: dict[str, Any]) -> dict[str, Any]:
    def decode(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)

    version, internal, gauss = data["python"]
    state = {"torch": decode(data["torch"]), "python": (version, tuple(internal), gauss)}
    if "cuda" in data:
        state["cuda"] = [decode(t) for t in data["cuda"]]
    return state
