"""The controller's state across runs: loaded from --state before a run, and where its batch counter starts."""

from __future__ import annotations

import json

from klpipe.errors import StateError
from klpipe.score.config import ScoreConfig
from klpipe.score.controller import KLController
from klpipe.storage.store import Location


def load_controller(config: ScoreConfig, warnings: list[str]) -> tuple[KLController, dict | None]:
    """The controller, continued from --state where it exists (unless --reset-state); its last run's record."""
    controller = KLController(config.controller)
    if config.state is None or config.reset_state or not config.state.exists():
        return controller, None
    path = config.state
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise StateError(f"{path}: not a readable controller state file ({exc})") from None
    try:
        controller.load_state(state)
    except StateError as exc:
        raise StateError(f"{path}: {exc}; pass --reset-state to start a fresh controller") from None
    differences = controller.config_differences(state.get("config") or {})
    if differences:
        warnings.append(f"{path}: settings changed since the state was saved ({'; '.join(differences)})")
    last_run = state.get("last_run")
    return controller, last_run if isinstance(last_run, dict) else None


def batches_before(previous_run: dict | None, state_path: Location | None) -> int:
    """Controller batches scored into the state file by earlier runs: where this run's batch counter starts."""
    count = (previous_run or {}).get("controller_batches", 0)  # absent from states written before it was kept
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise StateError(f"{state_path}: last_run.controller_batches must be a non-negative integer, got {count!r}")
    return count
