"""`MonitorMaster`: the configured monitors behind one `write_events` (DeepSpeed's class name)."""
from __future__ import annotations

import importlib
from typing import Iterable

Event = tuple[str, float, int]


def require(module: str, key: str, extra: str):
    """Import an optional library a monitor needs, or fail with one line naming the key and the fix."""
    try:
        return importlib.import_module(module)
    except ImportError:
        from schemas import ConfigError
        raise ConfigError([f"{key}: true needs the `{module.split('.')[0]}` package, which is not installed: "
                           f"pip install 'dstrain[{extra}]' (or set {key} to false)"]) from None


class MonitorMaster:
    """Writes each event to every enabled monitor; `enabled` is False when there is none (or off rank 0)."""

    def __init__(self, monitors: list):
        self.monitors = monitors
        self.enabled = bool(monitors)

    def write_events(self, event_list: Iterable[Event]) -> None:
        events = [(str(tag), float(value), int(step)) for tag, value, step in event_list]
        for monitor in self.monitors:
            monitor.write_events(events)

    def close(self) -> None:
        for monitor in self.monitors:
            monitor.close()


def build_monitors(config, rank: int) -> MonitorMaster:
    """The monitors the config enables, on global rank 0; none elsewhere."""
    if rank != 0:
        return MonitorMaster([])
    from .comet_monitor import CometMonitor
    from .csv_monitor import CSVMonitor
    from .tensorboard_monitor import TensorBoardMonitor
    from .wandb_monitor import WandbMonitor
    tensorboard, csv_monitor, wandb, comet = config.tensorboard, config.csv_monitor, config.wandb, config.comet
    monitors = [TensorBoardMonitor(tensorboard) if tensorboard.enabled else None,
                CSVMonitor(csv_monitor) if csv_monitor.enabled else None,
                WandbMonitor(wandb) if wandb.enabled else None,
                CometMonitor(comet) if comet.enabled else None]
    return MonitorMaster([m for m in monitors if m is not None])


def any_monitor_enabled(config) -> bool:
    return any(section.enabled for section in (config.tensorboard, config.csv_monitor, config.wandb, config.comet))
