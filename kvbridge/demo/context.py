"""The state ``kvbridge demo``'s sections share."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class DemoContext:
    """State shared by the demo's sections: inputs, file paths, per-entry latents and checks."""

    tokens: int
    workdir: Path
    seed: int = 0
    source_path: Path | None = None
    target_path: Path | None = None
    latents: dict[str, torch.Tensor] = field(default_factory=dict)
    checks: list[dict] = field(default_factory=list)

    def check(self, name: str, passed: bool, detail: str) -> None:
        self.checks.append({"check": name, "passed": bool(passed), "detail": detail})
