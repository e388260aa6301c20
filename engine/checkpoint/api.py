"""The engine's checkpoint surface: `save`, `load`, periodic saving and auto-resume (one per engine)."""
from __future__ import annotations

from pathlib import Path

from . import format as fmt
from .placement import global_rank_and_world
from .reader import resolve
from .restore import load_into
from .snapshot import Arena, take_snapshot
from .writer import CheckpointWriter


class Checkpointing:
    """Owns the engine's checkpoint writer (and its gloo group) and the `checkpoint.*` config."""

    def __init__(self, eng):
        self.eng = eng
        self.cfg = eng.config.checkpoint
        self.writer = CheckpointWriter(global_rank_and_world()[1])  # every process writes (placement.py)
        self.arena = Arena()  # async snapshots, reused from save to save (snapshot.py's note: packing)
        self.resumed: tuple[str | None, dict | None] = (None, None)

    def save(self, save_dir, tag=None, client_state=None, save_latest: bool = True) -> bool:
        eng = self.eng
        tag = fmt.validate_tag(tag if tag is not None else f"global_step{eng.global_steps}")
        save_dir = Path(save_dir)
        background = self.cfg.async_save
        self.writer.wait()  # one save in flight; its error surfaces here
        keep_last = self.cfg.keep_last if self._is_configured_dir(save_dir) else None
        snap = take_snapshot(eng, save_dir, tag, client_state, save_latest, keep_last,
                             arena=self.arena if background else None, tag_validation=self.cfg.tag_validation,
                             world_comm=self.writer.comm())
        self.writer.submit(snap, background)
        return True

    def _is_configured_dir(self, save_dir: Path) -> bool:
        return self.cfg.save_dir is not None and Path(self.cfg.save_dir).resolve() == save_dir.resolve()

    def load(self, load_dir, tag=None, load_module_strict: bool = True, load_optimizer_states: bool = True,
             load_lr_scheduler_states: bool = True, load_module_only: bool = False):
        self.writer.wait()
        path = resolve(load_dir, tag)
        if path is None:
            return None, None
        client_state = load_into(self.eng, path, load_module_strict, load_optimizer_states,
                                 load_lr_scheduler_states, load_module_only, world_comm=self.writer.comm())
        return str(path), client_state

    def after_step(self) -> None:
        """Periodic saving: every `checkpoint.save_interval` optimizer steps into `checkpoint.save_dir`."""
        interval = self.cfg.save_interval
        if interval and self.eng.global_steps % interval == 0:
            self.save(self.cfg.save_dir)

    def auto_resume(self):
        """`checkpoint.auto_resume`: load `<save_dir>/latest` if it exists; quiet when it does not."""
        save_dir = Path(self.cfg.save_dir)
        if fmt.read_latest(save_dir) is None:
            return None, None
        self.resumed = self.load(save_dir)
        if self.eng.comm.rank == 0 and self.resumed[0] is not None:
            print(f"[dstrain] auto_resume: resumed from {self.resumed[0]} at step {self.eng.global_steps}", flush=True)
        return self.resumed

    def wait(self) -> None:
        self.writer.wait()
