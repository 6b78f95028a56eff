"""A calibrated analytic cost model: the predicted device time of one tile config on one shape.

``configs.pick_config`` uses it for shapes the tuned cache has no entry for, so a shape nobody tuned
gets the config the model ranks fastest instead of the table default. The model is a few lines of
arithmetic over the launch's own sizes (the ``pick_config`` arguments: op kind, G, M, N, K):

    tiles  = output tiles of the whole launch, rows per group drawn from the routing skew (below)
    steps  = reduction steps per tile
    T_tile = a[config] + b[config] * steps            # one program's time for one tile
    T_mma  = ceil(tiles / (SMs * ctas_per_sm)) * T_tile   # persistent grid: whole waves of tiles
    T_hbm  = (bytes touched once + gamma * operand bytes all waves load) / bw
    T      = c0 + (T_mma**p + T_hbm**p) ** (1 / p)     # a smooth max of the two bounds

a and b per config, bw, gamma, c0 and p per op kind, are fitted to measured times (``python -m
moegemm.bench --fit-model TUNE.json ...``, moegemm/bench/fit_model.py) and stored as data in
``tuned_configs/model-<target>.json``. Rows per group: group sizes live on the device and are not
known when a config is picked, so the model assumes skewed routing, each expert's share of the M rows
exponentially distributed (Dirichlet(1) shares); then E[ceil(m / B)] = 1 / (1 - exp(-B / mean)), which
is mean / B + ~0.5: each expert wastes half a tile on average.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

MODEL_DIR = Path(__file__).parent / "tuned_configs"
OP_KINDS = ("m_grouped", "k_grouped")


def expected_blocks(mean_rows: float, block: int) -> float:
    """E[ceil(m / block)] for m ~ Exponential(mean_rows): the tiles (m-grouped) or reduction steps
    (k-grouped) one expert's rows take under skewed routing."""
    if mean_rows <= 0:
        return 0.0
    return 1.0 / -math.expm1(-block / mean_rows)


@dataclasses.dataclass(frozen=True)
class Work:
    """What one launch of a config does: output tiles, reduction steps per tile, HBM bytes read or
    written once, and the operand bytes all waves of tiles load (``wave_traffic``: what L2 serves
    and, when the working set outgrows it, HBM; it falls as GROUP_M's band shares panels)."""

    tiles: float
    steps: float
    bytes_once: float
    wave_traffic: float
    slots: int  # programs running at once: SMs x the config's CTAs per SM


def wave_traffic(
    tiles: float,
    slots: int,
    band: float,
    row_tiles: float,
    col_tiles: int,
    rows: int,
    cols: int,
    depth: float,
) -> float:
    """Elements of operand panels loaded by all waves of a persistent launch. One wave is ``slots``
    concurrent tiles. Tile (i, j) of a group reads a row panel [rows, depth] and a column panel
    [cols, depth]; the swizzle runs a band of min(GROUP_M, row tiles of the group) row tiles across
    the columns, so a wave inside one band loads ``band`` row panels and slots / band column panels;
    a wave wider than a band spans whole rows and, past a group's rows, the next group's panels."""
    if tiles <= 0:
        return 0.0
    band = max(1.0, min(band, row_tiles))
    if slots <= band * col_tiles:
        row_panels, col_panels = band, math.ceil(slots / band)
    else:
        row_panels = slots / col_tiles
        col_panels = col_tiles * max(1.0, row_panels / max(row_tiles, 1.0))
    return tiles / slots * (row_panels * rows + col_panels * cols) * depth


def work(op: str, config, *, G: int, M: int, N: int, K: int, sms: int = 132, itemsize: int = 2) -> Work:
    """The launch's work under ``config`` (an MGroupedConfig for "m_grouped", KGroupedConfig for
    "k_grouped"), with the launcher's sizes: m_grouped out [M, N] += x [M, K] @ w [K, N] per group;
    k_grouped out [G, K, N] = a [M, K]^T @ b [M, N] per group."""
    mean_rows = M / max(G, 1)
    slots = sms * config.ctas_per_sm
    if op == "m_grouped":
        row_tiles = expected_blocks(mean_rows, config.block_m)  # per group
        col_tiles = math.ceil(N / config.block_n)
        tiles = G * row_tiles * col_tiles
        once = M * K + G * N * K + M * N
        traffic = wave_traffic(
            tiles, slots, config.group_m, row_tiles, col_tiles, config.block_m, config.block_n, K
        )
        return Work(tiles, math.ceil(K / config.block_k), once * itemsize, traffic * itemsize, slots)
    if op == "k_grouped":
        k_tiles, n_tiles = math.ceil(K / config.block_k), math.ceil(N / config.block_n)
        tiles = G * k_tiles * n_tiles
        once = M * K + M * N + G * K * N
        traffic = wave_traffic(
            tiles, slots, config.group_m, k_tiles, n_tiles, config.block_k, config.block_n, mean_rows
        )
        return Work(
            tiles, expected_blocks(mean_rows, config.block_r), once * itemsize, traffic * itemsize, slots
        )
    raise ValueError(f"op must be one of {OP_KINDS}, got {op!r}")


@dataclasses.dataclass(frozen=True)
class OpModel:
    """Fitted coefficients of one op kind. ``per_config`` maps a config's field tuple to (a, b) in
    seconds; bw in bytes/s; gamma the share of re-read bytes that reach HBM; c0 seconds."""

    per_config: dict[tuple, tuple[float, float]]
    bw: float
    gamma: float
    c0: float
    p: float

    def predict(self, config, *, G: int, M: int, N: int, K: int, sms: int) -> float | None:
        """Seconds, or None when the config was never calibrated."""
        coeffs = self.per_config.get(config_fields(config))
        if coeffs is None:
            return None
        return predict(coeffs, (self.bw, self.gamma, self.c0, self.p), work_of(config, G, M, N, K, sms))


def predict(coeffs, globals_, w: Work) -> float:
    """The model's formula (module docstring) for one config: coeffs (a, b), globals_ (bw, gamma, c0, p)."""
    a, b = coeffs
    bw, gamma, c0, p = globals_
    if w.tiles <= 0:
        return c0
    waves = math.ceil(w.tiles / w.slots)
    t_mma = waves * (a + b * w.steps)
    t_hbm = (w.bytes_once + gamma * w.wave_traffic) / bw
    return c0 + (t_mma**p + t_hbm**p) ** (1.0 / p)


def work_of(config, G: int, M: int, N: int, K: int, sms: int) -> Work:
    op = "m_grouped" if hasattr(config, "block_m") else "k_grouped"
    return work(op, config, G=G, M=M, N=N, K=K, sms=sms)


def config_fields(config) -> tuple:
    return tuple(dataclasses.astuple(config))


@dataclasses.dataclass(frozen=True)
class Model:
    """The fitted model of one target: SM count of the calibration device and one OpModel per op."""

    sms: int
    ops: dict[str, OpModel]
    calibrated_on: str = ""

    def rank(
        self, op: str, candidates: list, *, G: int, M: int, N: int, K: int
    ) -> list[tuple[float, object]]:
        """(predicted seconds, config) for every calibrated candidate, fastest first."""
        model = self.ops.get(op)
        if model is None:
            return []
        scored = []
        for config in candidates:
            t = model.predict(config, G=G, M=M, N=N, K=K, sms=self.sms)
            if t is not None:
                scored.append((t, config))
        return sorted(scored, key=lambda item: item[0])

    def to_json(self) -> dict:
        return {
            "calibrated_on": self.calibrated_on,
            "sms": self.sms,
            "ops": {
                op: {
                    "bw": m.bw,
                    "gamma": m.gamma,
                    "c0": m.c0,
                    "p": m.p,
                    "configs": [{"fields": list(k), "a": a, "b": b} for k, (a, b) in m.per_config.items()],
                }
                for op, m in self.ops.items()
            },
        }

    @classmethod
    def from_json(cls, data: dict) -> Model:
        ops = {
            op: OpModel(
                per_config={tuple(c["fields"]): (c["a"], c["b"]) for c in m["configs"]},
                bw=m["bw"],
                gamma=m["gamma"],
                c0=m["c0"],
                p=m["p"],
            )
            for op, m in data["ops"].items()
        }
        return cls(sms=data["sms"], ops=ops, calibrated_on=data.get("calibrated_on", ""))


def model_path(target: str) -> Path:
    return MODEL_DIR / f"model-{target}.json"


@functools.lru_cache(maxsize=4)
def load(target: str) -> Model | None:
    """The committed model of ``target`` ("sm90"), or None if there is none."""
    path = model_path(target)
    return Model.from_json(json.loads(path.read_text())) if path.exists() else None
