"""Progress a person can watch: planning (layers, ILPs, stage DP) and training steps.

Owns two small renderers built on tqdm, both silent unless asked and on a
terminal (``interactive()``), so logs and pipes stay clean:

- ``PlanProgress``: a callable to pass as ``progress=`` to ``parallelize`` or
  ``stage_dp.search.plan``. It reads the planner's messages (the only channel the
  planner has) and shows one bar: "capture", then ILPs solved of the expected
  total (distinct layers x logical meshes, from the planner's first message;
  grown if the memory-lean variants add more), then the stage DP, then the plan.
- ``TrainProgress``: one bar over the training steps with the loss and samples/s.

Planner messages it understands (``stage_dp/search.py``, ``stage_dp/stage_costs.py``)::

    "{L} layers ({D} distinct), {M} meshes, B in [..]"   -> expect D x M ILPs
    "ILP {n}: layer ..."                                  -> n ILPs solved
    "no plan fits; adding least-memory ILP variants ..."  -> more ILPs to come
    "planned in {s} s: {summary}"                         -> done

Any other message is shown as the bar's status text. What it does not own: the
planner or the runtime; it only renders what they say.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from typing import IO

log = logging.getLogger(__name__)

_LAYERS = re.compile(r"^(\d+) layers \((\d+) distinct\), (\d+) meshes, B in \[([\d, ]*)\]")
_ILP = re.compile(r"^ILP (\d+): (.*)")
_PLANNED = re.compile(r"^planned in ([\d.]+) s: (.*)")


def interactive(stream: IO | None = None) -> bool:
    """True when both stdout and ``stream`` (default stderr) are terminals."""
    stream = stream or sys.stderr
    return bool(getattr(sys.stdout, "isatty", lambda: False)() and getattr(stream, "isatty", lambda: False)())


class PlanProgress:
    """Renders planner messages as a tqdm bar on ``stream`` (stderr); a no-op when disabled.

    ``enabled=None`` means "on a terminal only". Every message is also logged at DEBUG.
    Use as a context manager, or call ``close()``.
    """

    def __init__(self, enabled: bool | None = None, stream: IO | None = None):
        self.stream = stream or sys.stderr
        self.enabled = interactive(self.stream) if enabled is None else bool(enabled)
        self.num_layers = self.distinct_layers = self.num_meshes = 0
        self.ilps_solved = 0
        self.expected_ilps = 0
        self.microbatch_candidates: list[int] = []
        self.summary = ""
        self.messages: list[str] = []
        self._bar = None
        self._t0 = time.perf_counter()

    # ------------------------------------------------------------ phases the caller announces
    def phase(self, text: str) -> None:
        """Show ``text`` (e.g. 'capturing the step') as the current phase."""
        self._status(text)

    # ------------------------------------------------------------ planner messages
    def __call__(self, message: str) -> None:
        log.debug("planner: %s", message)
        self.messages.append(message)
        if m := _LAYERS.match(message):
            self.num_layers, self.distinct_layers, self.num_meshes = (int(m[1]), int(m[2]), int(m[3]))
            self.microbatch_candidates = [int(b) for b in m[4].split(",") if b.strip()]
            self.expected_ilps = self.distinct_layers * self.num_meshes
            self._status(f"{self.num_layers} layers ({self.distinct_layers} distinct) x {self.num_meshes} meshes: "
                         "solving ILPs", total=self.expected_ilps)
        elif m := _ILP.match(message):
            self.ilps_solved = int(m[1])
            self.expected_ilps = max(self.expected_ilps, self.ilps_solved)
            self._advance(self.ilps_solved, self.expected_ilps, f"ILP {m[2]}")
        elif message.startswith("no plan fits"):
            self.expected_ilps += self.distinct_layers * self.num_meshes
            self._status("nothing fits: solving least-memory ILPs", total=self.expected_ilps)
        elif m := _PLANNED.match(message):
            self.summary = m[2]
            self._status(f"planned: {m[2]}")
        else:
            self._status(message)

    def ilps_done(self) -> bool:
        return self.expected_ilps > 0 and self.ilps_solved >= self.expected_ilps

    # ------------------------------------------------------------ rendering
    def _ensure_bar(self, total: int | None):
        if not self.enabled:
            return None
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=total, file=self.stream, unit="ILP", leave=False, **_width(),
                             bar_format="{desc} |{bar}| {n_fmt}/{total_fmt} ILPs [{elapsed}]")
        elif total is not None:
            self._bar.total = total
            self._bar.refresh()
        return self._bar

    def _status(self, text: str, total: int | None = None) -> None:
        bar = self._ensure_bar(total)
        if bar is not None:
            bar.set_description_str(_clip(text), refresh=True)

    def _advance(self, done: int, total: int, text: str) -> None:
        bar = self._ensure_bar(total)
        if bar is None:
            return
        bar.n = done
        desc = "stage DP" if done >= total else text
        if done >= total and self.microbatch_candidates:
            desc = f"stage DP over B in {self.microbatch_candidates} (ILP {done}/{total} done)"
        bar.set_description_str(_clip(desc), refresh=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> PlanProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TrainProgress:
    """A bar over ``total_steps`` training steps showing the loss and samples/s (terminal only)."""

    def __init__(self, total_steps: int, batch_size: int, enabled: bool | None = None, stream: IO | None = None):
        self.stream = stream or sys.stderr
        self.enabled = interactive(self.stream) if enabled is None else bool(enabled)
        self.batch_size = batch_size
        self._bar = None
        if self.enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, file=self.stream, unit="step", leave=True, desc="train", **_width())

    def update(self, step: int, loss: float, step_s: float) -> None:
        """Report step ``step`` (0-based) with its loss and wall time."""
        if self._bar is None:
            return
        rate = "capture, plan, start-up" if step == 0 else f"{samples_per_s(self.batch_size, step_s):.1f} samples/s"
        self._bar.set_postfix_str(f"loss {loss:.5f}, {rate}", refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> TrainProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _width() -> dict:
    """Follow the terminal's size; a fixed 100 x 40 where it reports none (a pty without a size,
    where tqdm would draw nothing)."""
    import shutil

    return {"dynamic_ncols": True} if shutil.get_terminal_size((0, 0)).columns > 0 else {"ncols": 100, "nrows": 40}


def samples_per_s(batch_size: int, step_s: float) -> float:
    return batch_size / step_s if step_s > 0 else float("inf")


def _clip(text: str, width: int = 70) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"
