"""`csv_monitor`: one file per tag, `<output_path>/<job_name>/<tag with / and spaces as _>.csv`, with the
header `step,<last part of the tag>` (DeepSpeed's layout, which `dstrain plot` reads)."""
from __future__ import annotations

import csv
import os


class CSVMonitor:
    def __init__(self, csv_monitor):
        self.log_dir = os.path.join(csv_monitor.output_path, csv_monitor.job_name)
        os.makedirs(self.log_dir, exist_ok=True)
        self._started: set[str] = set()  # files this run has written a header to

    def path_for(self, tag: str) -> str:
        return os.path.join(self.log_dir, tag.replace("/", "_").replace(" ", "_") + ".csv")

    def write_events(self, events) -> None:
        for tag, value, step in events:
            path = self.path_for(tag)
            # Appending, as DeepSpeed does: a resumed job continues the same files (one header per run).
            with open(path, "a", newline="") as f:
                writer = csv.writer(f)
                if path not in self._started:
                    self._started.add(path)
                    writer.writerow(["step", tag.rsplit("/", 1)[-1]])
                writer.writerow([step, value])

    def close(self) -> None:
        pass
