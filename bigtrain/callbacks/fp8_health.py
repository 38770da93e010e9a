"""FP8 health: each FP8 layer watched, and moved to BF16 by itself when FP8 hurts it.

Every forward of an FP8 layer folds its statistics into a small buffer without a host sync
(precision/fp8.py). The buffers ride along the monitor's MAX all-reduce (monitor/fp8.py), over all
ranks and, with replica groups, over the live groups before they commit, so every rank of every
group takes the same decisions. They are judged on the steps that need them:

- a checked step (every `precision.fp8.check_every`): the relative error of each layer's FP8
  result against its BF16 result on the step's first micro-batch, and the share of its nonzero
  inputs that FP8 flushes to zero. `patience` checks in a row above `max_error` or
  `max_underflow` move the layer to BF16 (`fp8_fallback`, reason `error`);
- an anomalous step (the healer replayed it) and the step's first run: a layer whose FP8 result
  turned finite inputs non-finite (a broken scale: BF16 cannot do this) moves to BF16 at once
  (reason `nonfinite`). The healer has already handled the step as any anomaly (replay, then
  skip or rollback); the rerun of the step after a rollback runs the layer in BF16.

The layers in BF16 are part of the run's state (this callback's, in checkpoints, rollback
snapshots and a rejoining group's transfer). A rollback restores an older state, but never puts
a layer back in FP8: the set only grows. With FP8 all-gather a layer that falls back also gathers
its weight in BF16 from then on; the all-gather's scales are computed for every layer before each
step's forward.
"""

from __future__ import annotations

from typing import Any

from bigtrain.config.schema import Fp8Config
from bigtrain.monitor.fp8 import Fp8Stats
from bigtrain.precision import PrecisionPolicy
from bigtrain.precision.fp8 import (
    STATS,
    gather_in_bf16,
    gathers_in_fp8,
    is_fp8_linear,
    precompute_scales,
    reset_stats,
)
from bigtrain.train.hooks import Callback
from bigtrain.train.step import StepResult
from bigtrain.utils.names import canonical_name


class Fp8Health(Callback):
    state_key = "fp8"

    def __init__(self, stats: Fp8Stats, cfg: Fp8Config, policy: PrecisionPolicy) -> None:
        """`stats`: the FP8 layers and their reduced statistics (the monitor's rider); `policy`:
        its table shows the layers in BF16 (also those a resumed run brings)."""
        self.stats, self.cfg, self.policy = stats, cfg, policy
        self.layers = stats.layers
        self.names = stats.names  # every rank's, in one order: the reduction's rows
        self.bf16: list[str] = []  # layers moved to BF16, in the order they moved
        self.strikes: dict[str, int] = {}  # failed checks in a row (error or underflow)
        self.phase_fp8 = True  # the precision phase runs the FP8 layers in FP8
        self.checked = False  # this step measures the error against BF16
        self.replayed = False  # the step ran twice (the healer's replay)
        self.model: Any = None
        self.gathers = False  # some layer gathers its weight in FP8 now (set by _apply)

    # --- hooks ----------------------------------------------------------------------------------

    def on_start(self, trainer) -> None:
        """The FP8 layers this rank runs, found again in the backend's model: a pipeline stage
        is a copy of its part of the model. The layers of other stages count as zeros."""
        self.model = trainer.backend.model
        live = {canonical_name(n): m for n, m in self.model.named_modules() if is_fp8_linear(m)}
        unknown = sorted(set(live) - set(self.names))
        assert not unknown, f"FP8 layers the build did not make: {unknown}"
        self.layers.clear()  # in place: the drills read the same dict (RunSetup.fp8_layers)
        self.layers.update(live)
        self._apply()

    def on_before_forward(self, trainer, step: int) -> None:
        self.replayed = trainer.replaying  # the first run's reduced rows are kept (monitor/fp8.py)
        if not trainer.replaying:
            self.stats.clear()
            self.phase_fp8 = trainer.phase.fp8
            self._apply()
        reset_stats(self.layers)
        every = self.cfg.check_every
        self.checked = bool(every) and step % every == 0 and self.phase_fp8
        for layer in self.layers.values():
            layer.watch = self.checked and layer.fp8
        if self.model is not None and self.gathers:
            precompute_scales(self.model)  # the weights as this step gathers them

    def on_step_end(self, trainer, result: StepResult) -> None:
        rows = self.stats.rows  # reduced over ranks and groups with the monitor's numbers
        if rows is None or not (self.checked or self.replayed or result.anomaly is not None):
            return
        names = self.names
        for name, row in zip(names, rows, strict=True):
            values = dict(zip(STATS, row, strict=True))
            if name in self.bf16:
                continue
            if values["nonfinite"] > 0:
                self._fall_back(trainer, name, "nonfinite", values, result.step)
            elif self.checked:
                self._judge_error(trainer, name, values)
        if self.checked:
            errors = {n: r[STATS.index("error")] for n, r in zip(names, rows, strict=True)}
            errors = {n: e for n, e in errors.items() if n not in self.bf16}
            worst = max(errors, key=errors.get) if errors else None
            result.telemetry.update(
                fp8_error_max=errors[worst] if worst else 0.0,
                fp8_error_layer=worst or "",
                fp8_underflow_max=max(r[STATS.index("underflow")] for r in rows),
                fp8_bf16_layers=len(self.bf16),
            )
        self.replayed = False

    # --- decisions ----------------------------------------------------------------------------

    def _judge_error(self, trainer, name: str, values: dict[str, float]) -> None:
        cfg = self.cfg
        if values["error"] <= cfg.max_error and values["underflow"] <= cfg.max_underflow:
            self.strikes.pop(name, None)
            return
        self.strikes[name] = self.strikes.get(name, 0) + 1
        trainer.event(
            "fp8_check",
            layer=name,
            error=round(values["error"], 5),
            underflow=round(values["underflow"], 5),
            strikes=self.strikes[name],
            patience=self.cfg.patience,
        )
        if self.strikes[name] >= self.cfg.patience:
            self._fall_back(trainer, name, "error", values, trainer.step)

    def _fall_back(
        self, trainer, name: str, reason: str, values: dict[str, float], seen_at: int
    ) -> None:
        """`seen_at`: the step whose numbers moved the layer (after a rollback the event's own
        step is the one the run went back to)."""
        numbers = {
            k: (v if v == v and abs(v) != float("inf") else str(v)) for k, v in values.items()
        }
        if not self.cfg.fallback:
            trainer.event(
                "fp8_fault", layer=name, reason=reason, moved=False, seen_at=seen_at, **numbers
            )
            return
        self.bf16.append(name)
        self.strikes.pop(name, None)
        self._apply()
        trainer.event(
            "fp8_fallback",
            layer=name,
            reason=reason,
            seen_at=seen_at,
            max_error=self.cfg.max_error,
            max_underflow=self.cfg.max_underflow,
            bf16_layers=len(self.bf16),
            **numbers,
        )

    def _apply(self) -> None:
        self.policy.fp8_fallen_back = tuple(self.bf16)
        for name, layer in self.layers.items():
            layer.fp8 = self.phase_fp8 and name not in self.bf16
            if name in self.bf16 and gathers_in_fp8(layer):
                gather_in_bf16(layer)
        self.gathers = any(m.fp8 and gathers_in_fp8(m) for m in self.layers.values())

    # --- state ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"bf16": list(self.bf16), "strikes": dict(self.strikes)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's or a peer's set of BF16 layers; a rollback's older set never puts a
        layer back in FP8 (the union is kept). Names this run has no FP8 layer for (the run
        resumed with other precision.fp8 modules, or without FP8) are dropped."""
        kept = [n for n in state.get("bf16", []) if n in self.names]
        self.bf16 = self.bf16 + [n for n in kept if n not in self.bf16]
        self.strikes = {n: int(c) for n, c in state.get("strikes", {}).items() if n in self.names}
        self._apply()
