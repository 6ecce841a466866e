"""Step-time model T(B, k, W) = T_propose + T_verify: profiled table, least-squares fit, online correction.

Three layers, each deterministic (no clock is read here):

1. **Profile** (`CostProfile`): the measured seconds of every compiled step shape (B, k, W) of the
   menu on one device for one model/draft pair (`jaxspec profile`). JSON, keyed by `ProfileKey`.
2. **Fit** (`LinearCostFit`): non-negative least squares over the profile with features

       propose:  k             (sequential draft launches)
                 B·k           (draft tokens)
       verify:   1             (fixed per-step overhead)
                 B·(k+1)       (padded verified tokens)
                 B·(k+1)·W/1024 (attention over the window)

   It prices shapes the profile lacks and splits a step into T_propose + T_verify.
3. **Online correction**, in log space. An observed step of shape s gives ρ = log(observed /
   model time), clipped to [−log c, log c]. All evidence decays by (1 − w) per observation;
   shape s keeps its evidence n_s and the mean m_s of its ρ. Two corrections shared by every
   shape, the device factor d and a draft slope b on the shape's propose share π_s (the fit's
   T_propose / T at s; 0 at k = 0), and a residual per shape come from the ridge least squares

       min_{d,b}  Σ_s a_s·(m_s − d − b·π_s)² + τ₀·d² + λ·b²,     a_s = n_s·τ / (n_s + τ)
       r_s = n_s / (n_s + τ) · (m_s − d − b·π_s)
       T_s = exp(d + b·π_s + r_s) · model time                  (exponent clipped to ±log c)

   A device that runs uniformly faster or slower than its profile moves d, which corrects every
   shape, also those the policy has not run lately: a per-shape correction alone makes the
   shapes the policy runs look cheap and locks it onto them (onto k = 0 on a device faster than
   its profile). A draft that is slower or faster relative to the target than profiled shows as a
   trend of ρ with π and moves b, so it is not charged to k = 0. A shape's own deviation is its
   residual, trusted as its evidence outgrows τ; a shape's weight a_s in (d, b) saturates at τ,
   so the shape the policy runs most does not drown the others.

   The priors are in the units of that saturated weight, the variance σ_r² of a shape's own
   deviation: τ₀ = σ_r²/σ_d², λ = σ_r²/σ_b². d is nearly free (τ₀ = 10⁻³: a device may run at
   any speed). b's prior is one-sided: a draft slower than profiled (b > 0) is believed from little
   evidence (λ₊ = 10⁻⁴), one faster than profiled (b < 0) only from much (λ₋ = 0.1: a draft more
   than ~1.6× faster relative to the target, σ_b ≈ 0.5, is as unlikely as a shape ~15 % off on its
   own, σ_r ≈ 0.15, the size measured on this CPU). The sign of b does not depend on λ, so the fit
   takes λ₊ or λ₋ by it. Why one-sided: k = 0 is the one shape without drafting, so its price
   rests on d alone, extrapolated to π = 0 when goodput speculates. A slope fitted through a few
   noisy shapes extrapolates far: two shapes with nearby π (a B = 4 step at k = 1 observed 1.45×
   its profile, k = 3 as profiled) gave d = 0.88, b = −1.9 and priced the never-run k = 0 at
   2.2× its cost, so goodput speculated where `none` was faster (a bench's decision log;
   docs/benchmarks.md, "Goodput against fixed k, with intervals": the draft slope). A negative
   slope overprices k = 0, a positive one underprices it: the one-sided prior errs toward the
   plain step, the option goodput promises never to lose to.

The shape of a step (its padded k and attention window from per-row lengths and caps) is
decided by `jaxspec.menu.step_shape`, the function the engine runs steps with.

Per-row pricing. A padded step of shape (B, k) verifies B·(k+1) token slots; a row capped at
k_i < k uses k_i + 1 of them. With real tokens r = Σ_i (k_i + 1) (live rows only),

    T(B, k, W, r) = factor · (T_pad(B, k, W) − c_real · (B·(k+1) − r))

where c_real ≥ 0 (`real_token_s`) is the cost of one verified token that only real tokens pay
(0 on a purely padded executable; the profiler measures it by capping all rows but one at 0).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

from jaxspec.menu import StepShape, menu_step_shapes, step_shape

FORMAT = "jaxspec-cost-profile"
VERSION = 1
_FORGOTTEN = 1e-6  # evidence below this is dropped (a shape not observed for ~14/w steps)
FEATURES = ("draft_steps", "draft_tokens", "step", "verify_tokens", "attention")
_PROPOSE_FEATURES = 2  # the first two features are the propose part


class CostModelError(ValueError):
    """A shape the cost model cannot price, or an inconsistent profile."""


@dataclasses.dataclass(frozen=True)
class ProfileKey:
    """What a profile is valid for: device kind, model, draft (or proposer), the menu and the dtype of
    weights and KV cache (a bfloat16 step costs differently from a float32 one), the device mesh and how
    the steps attend (`EngineAPI.kernels.attention`: the XLA:CPU cache kernel changes what a window costs)."""

    device_kind: str
    model: str
    draft: str
    batch_buckets: tuple[int, ...]
    k_menu: tuple[int, ...]
    window_buckets: tuple[int, ...]
    dtype: str = "float32"  # profiles written before this field were all float32
    mesh: str = "data=1,model=1"  # jaxspec.mesh.MeshSpec; profiles written before this field were unsharded
    attention: str = "xla"  # EngineAPI.kernels.attention; profiles written before this field attended in the XLA form

    def __post_init__(self):
        for name in ("batch_buckets", "k_menu", "window_buckets"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))

    def filename(self) -> str:
        """`<device>__<model>__<dtype>__<draft>__<menu hash>.json`, filesystem-safe."""
        menu = json.dumps([self.batch_buckets, self.k_menu, self.window_buckets]
                          + ([self.mesh] if self.mesh != "data=1,model=1" else [])
                          + ([self.attention] if self.attention != "xla" else []))
        digest = hashlib.sha256(menu.encode()).hexdigest()[:10]
        safe = lambda s: re.sub(r"[^A-Za-z0-9._-]+", "-", s).strip("-") or "none"  # noqa: E731
        return f"{safe(self.device_kind)}__{safe(self.model)}__{safe(self.dtype)}__{safe(self.draft)}__{digest}.json"


@dataclasses.dataclass(frozen=True)
class CostEntry:
    """Median seconds of `samples` timed steps of shape (batch bucket, k, window)."""

    batch: int
    k: int
    window: int
    seconds: float
    samples: int = 1

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.batch, self.k, self.window


@dataclasses.dataclass(frozen=True)
class CostProfile:
    """A device profile of the step menu. `real_token_s`: c_real (see module doc)."""

    key: ProfileKey
    entries: tuple[CostEntry, ...]
    real_token_s: float = 0.0
    created_unix: float = 0.0

    def __post_init__(self):
        if not self.entries:
            raise CostModelError("a cost profile needs at least one entry")
        shapes = [e.shape for e in self.entries]
        if len(set(shapes)) != len(shapes):
            raise CostModelError("duplicate (B, k, W) entries in the cost profile")
        for e in self.entries:
            if not (e.seconds > 0 and math.isfinite(e.seconds)):
                raise CostModelError(f"non-positive or non-finite time in {e}")
        if self.real_token_s < 0:
            raise CostModelError(f"real_token_s must be >= 0, got {self.real_token_s}")

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "key": dataclasses.asdict(self.key),
                "real_token_s": self.real_token_s, "created_unix": self.created_unix,
                "entries": [dataclasses.asdict(e) for e in self.entries]}

    @classmethod
    def from_json(cls, data: Mapping) -> CostProfile:
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise CostModelError(f"not a {FORMAT} v{VERSION} file (format={data.get('format')!r}, "
                                 f"version={data.get('version')!r})")
        return cls(key=ProfileKey(**data["key"]), entries=tuple(CostEntry(**e) for e in data["entries"]),
                   real_token_s=float(data["real_token_s"]), created_unix=float(data["created_unix"]))

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, expect: ProfileKey | None = None) -> CostProfile:
        """Read a profile; with `expect`, raise unless it was made for exactly that key."""
        profile = cls.from_json(json.loads(Path(path).read_text()))
        if expect is not None and profile.key != expect:
            raise CostModelError(f"profile {path} is for {profile.key}, not {expect}")
        return profile


def default_profile_dir() -> Path:
    """$JAXSPEC_PROFILE_DIR, else ~/.cache/jaxspec/profiles."""
    env = os.environ.get("JAXSPEC_PROFILE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "jaxspec" / "profiles"


def load_matching_profile(key: ProfileKey, directory: str | os.PathLike | None = None) -> CostProfile | None:
    """The saved profile for `key`, or None if there is none (the caller then profiles)."""
    path = Path(directory or default_profile_dir()) / key.filename()
    return CostProfile.load(path, expect=key) if path.exists() else None


# --- least-squares fit -------------------------------------------------------------------

def features(batch: int, k: int, window: int) -> np.ndarray:
    """φ(B, k, W) in the order of FEATURES."""
    return np.array([k, batch * k, 1.0, batch * (k + 1), batch * (k + 1) * window / 1024.0], np.float64)


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min ‖a·x − b‖ subject to x ≥ 0 (Lawson–Hanson active set; tiny problems only)."""
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, bool)
    for _ in range(3 * n + 10):
        w = a.T @ (b - a @ x)
        candidates = ~passive & (w > 1e-12 * max(1.0, np.abs(w).max()))
        if not candidates.any():
            break
        passive[np.argmax(np.where(candidates, w, -np.inf))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            gap = x[neg] - z[neg]
            step = np.min(np.divide(x[neg], gap, out=np.zeros_like(gap), where=gap > 0))
            x = x + step * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
    return x


class CatchUpCost:
    """Seconds of a draft catch-up: a·calls + b·tokens (the calls' chunks, padded), a, b ≥ 0 fitted to the last
    `window` catch-ups the engine reported; 0 until one has been seen. A call pays its launch and its whole chunk:
    on this CPU an 8-token chunk of the shipped draft took 1.25 ms and a 256-token one 16 ms (docs/benchmarks.md,
    "Right-sized draft catch-up"), so neither a price per call nor one per token fits both."""

    def __init__(self, window: int = 32):
        if window < 1:
            raise ValueError(f"the catch-up cost window must be >= 1, got {window}")
        self._seen: collections.deque[tuple[int, int, float]] = collections.deque(maxlen=window)
        self.per_call_s = 0.0
        self.per_token_s = 0.0

    def observe(self, calls: int, tokens: int, seconds: float) -> None:
        """One step's catch-up: its calls, their chunks' padded tokens, and the wall seconds they took."""
        if calls <= 0:
            return
        self._seen.append((calls, tokens, seconds))
        a = np.array([(c, t) for c, t, _ in self._seen], np.float64)  # [N, 2]: calls, tokens
        s = np.array([s for _, _, s in self._seen], np.float64)  # [N]
        if np.ptp(a[:, 1] / a[:, 0]) == 0:
            # one mix of chunks alone (a run's first catch-ups: whole prompts) cannot tell a launch from its
            # tokens: priced per token, a few-token catch-up is priced low and speculating measures it, where a
            # price per call would price it as a prompt's and keep it unmeasured
            self.per_call_s, self.per_token_s = 0.0, float(a[:, 1] @ s / (a[:, 1] @ a[:, 1]))
            return
        scale = np.linalg.norm(a, axis=0)  # [2]: columns of like size for the solver
        x = _nnls(a / scale, s) / scale  # [2]
        self.per_call_s, self.per_token_s = float(x[0]), float(x[1])

    def seconds(self, calls: int, tokens: int) -> float:
        return calls * self.per_call_s + tokens * self.per_token_s


@dataclasses.dataclass(frozen=True)
class LinearCostFit:
    """T(B, k, W) ≈ Σ_f coef_f · φ_f(B, k, W), coefficients ≥ 0 (seconds per feature unit)."""

    coef: tuple[float, ...]

    @classmethod
    def fit(cls, entries: Iterable[CostEntry]) -> LinearCostFit:
        """Non-negative least squares on relative error (rows weighted by 1/seconds)."""
        entries = list(entries)
        if not entries:
            raise CostModelError("cannot fit a cost model to no entries")
        a = np.stack([features(e.batch, e.k, e.window) for e in entries])
        t = np.array([e.seconds for e in entries])
        w = 1.0 / t
        return cls(coef=tuple(float(c) for c in _nnls(a * w[:, None], t * w)))

    def propose(self, batch: int, k: int, window: int) -> float:
        phi = features(batch, k, window)
        return float(np.dot(self.coef[:_PROPOSE_FEATURES], phi[:_PROPOSE_FEATURES]))

    def verify(self, batch: int, k: int, window: int) -> float:
        phi = features(batch, k, window)
        return float(np.dot(self.coef[_PROPOSE_FEATURES:], phi[_PROPOSE_FEATURES:]))

    def __call__(self, batch: int, k: int, window: int) -> float:
        return float(np.dot(self.coef, features(batch, k, window)))


# --- the model the policy queries -----------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class OnlineCostConfig:
    """Online correction (module doc, layer 3).

    ema_weight:     w, evidence forgetting: all evidence decays by (1 − w) per observed step
                    (memory ≈ 1/w steps); ≤ 0.1.
    residual_prior: τ, pseudo-observations behind "this shape runs like the shared correction
                    says"; a shape's own evidence must outgrow it before its residual is trusted.
    device_prior:   τ₀, ridge weight of "the device runs as profiled" (d = 0).
    draft_prior:    λ₊, ridge weight of "the draft/target balance is as profiled" (b = 0) against a
                    draft slower than profiled (b > 0).
    faster_draft_prior: λ₋, the same against a draft faster than profiled (b < 0): σ_r²/σ_b² (module
                    doc, layer 3).
    ratio_clip:     c, each observed/model ratio, and each correction, is clipped to [1/c, c].
    """

    ema_weight: float = 0.05
    residual_prior: float = 1.0
    device_prior: float = 1e-3
    draft_prior: float = 1e-4
    faster_draft_prior: float = 0.1
    ratio_clip: float = 4.0

    def __post_init__(self):
        if not 0.0 <= self.ema_weight <= 0.1:
            raise ValueError(f"ema_weight must be in [0, 0.1], got {self.ema_weight}")
        for name in ("residual_prior", "device_prior", "draft_prior", "faster_draft_prior"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.ratio_clip < 1.0:
            raise ValueError(f"ratio_clip must be >= 1, got {self.ratio_clip}")


class CostModel:
    """Prices a step: profiled table first, then the fit; times the online correction."""

    def __init__(self, table: Mapping[tuple[int, int, int], float], fit: LinearCostFit | None = None, *,
                 window_buckets: tuple[int, ...] | None = None, real_token_s: float = 0.0,
                 online: OnlineCostConfig = OnlineCostConfig()):
        """table: (B, k, W) -> seconds. fit: prices shapes missing from the table (None: a miss
        raises). window_buckets: the engine's attention windows (None: W = the positions needed)."""
        if window_buckets is not None and list(window_buckets) != sorted(set(window_buckets)):
            raise ValueError(f"window_buckets must be increasing, got {window_buckets}")
        if real_token_s < 0:
            raise ValueError(f"real_token_s must be >= 0, got {real_token_s}")
        self.table = {tuple(int(v) for v in key): float(s) for key, s in table.items()}
        self.fit = fit
        self.window_buckets = tuple(window_buckets) if window_buckets is not None else None
        self.real_token_s = float(real_token_s)
        self.online = online
        self._evidence: dict[tuple[int, int, int], tuple[float, float]] = {}  # shape -> (n_s, Σ ρ), decayed
        self._log_device = 0.0  # d (module doc), refitted after every observation
        self._draft_slope = 0.0  # b (module doc)
        self._residual: dict[tuple[int, int, int], float] = {}  # r_s per observed shape
        self._shares: dict[tuple[int, int, int], float] = {}  # π_s, memoised
        self.observations = 0

    @classmethod
    def from_profile(cls, profile: CostProfile, online: OnlineCostConfig = OnlineCostConfig()) -> CostModel:
        return cls({e.shape: e.seconds for e in profile.entries}, LinearCostFit.fit(profile.entries),
                   window_buckets=profile.key.window_buckets, real_token_s=profile.real_token_s, online=online)

    # --- shapes ------------------------------------------------------------------------

    def shape(self, context_lens: Sequence[int], row_caps: Sequence[int] | None, k: int,
              k_menu: Sequence[int]) -> StepShape:
        """The shape the engine runs a step at (`step_shape` over this model's windows); raises
        CostModelError if no window holds it (the engine's capacity check)."""
        shape = step_shape(context_lens, row_caps, k, k_menu, self.window_buckets)
        if shape.window is None:
            raise CostModelError(f"no window bucket >= {shape.needed} in {self.window_buckets}")
        return shape

    def menu_shapes(self, context_lens: Sequence[int], row_caps: Sequence[int], k_menu: Sequence[int]
                    ) -> list[StepShape]:
        """The shape of a step at every k of the menu (`menu_step_shapes` over this model's windows), increasing;
        a shape no window holds has window None."""
        return menu_step_shapes(context_lens, row_caps, k_menu, self.window_buckets)

    # --- prices ------------------------------------------------------------------------

    def base_time(self, batch: int, k: int, window: int) -> float:
        """Uncorrected padded-step seconds: the profiled value, else the fit."""
        t = self.table.get((batch, k, window))
        if t is None:
            if self.fit is None:
                raise CostModelError(f"shape (B={batch}, k={k}, W={window}) is not profiled and there is no fit")
            t = self.fit(batch, k, window)
        if not t > 0:
            raise CostModelError(f"non-positive time {t} for (B={batch}, k={k}, W={window})")
        return t

    def factor(self, batch: int, k: int, window: int) -> float:
        """Online correction of a shape: exp(d + b·π_s + r_s), clipped to [1/c, c] (module doc)."""
        bound = math.log(self.online.ratio_clip)
        log_factor = self.shared_log_correction(batch, k, window) + self._residual.get((batch, k, window), 0.0)
        return math.exp(min(max(log_factor, -bound), bound))

    def shared_log_correction(self, batch: int, k: int, window: int) -> float:
        """d + b·π_s: what the shared corrections say of a shape (all a never-observed shape gets)."""
        return self._log_device + self._draft_slope * self.propose_share(batch, k, window)

    def padded_time(self, batch: int, k: int, window: int) -> float:
        """factor · T_pad: every row at k."""
        return self.factor(batch, k, window) * self.base_time(batch, k, window)

    def _uncorrected(self, batch: int, k: int, window: int, real_tokens: int | None) -> float:
        """T_pad − c_real·(B·(k+1) − r), validated."""
        padded = batch * (k + 1)
        r = padded if real_tokens is None else real_tokens
        if not 0 < r <= padded:
            raise CostModelError(f"real tokens {r} outside (0, B·(k+1) = {padded}]")
        t = self.base_time(batch, k, window) - self.real_token_s * (padded - r)
        if not t > 0:
            raise CostModelError(f"step time {t} <= 0 at (B={batch}, k={k}, W={window}, r={r}): "
                                 f"real_token_s={self.real_token_s} is too large for this profile")
        return t

    def step_time(self, batch: int, k: int, window: int, real_tokens: int | None = None) -> float:
        """T(B, k, W, r) = factor · (T_pad − c_real·(B·(k+1) − r)); r defaults to B·(k+1)."""
        return self.factor(batch, k, window) * self._uncorrected(batch, k, window, real_tokens)

    def real_token_time(self, batch: int, k: int, window: int) -> float:
        """∂T/∂r = factor · c_real: seconds one more real verified token adds to a step of this shape."""
        return self.factor(batch, k, window) * self.real_token_s

    def split(self, batch: int, k: int, window: int) -> tuple[float, float]:
        """(T_propose, T_verify) of a padded step: the fit's shares of the corrected time."""
        if self.fit is None:
            raise CostModelError("splitting a step needs a fit")
        p, v = self.fit.propose(batch, k, window), self.fit.verify(batch, k, window)
        total = self.padded_time(batch, k, window)
        return (total * p / (p + v), total * v / (p + v)) if p + v > 0 else (0.0, total)

    # --- online --------------------------------------------------------------------------

    def observe(self, batch: int, k: int, window: int, seconds: float, real_tokens: int | None = None) -> None:
        """Fold one measured step into the correction (module doc, layer 3)."""
        if not (seconds > 0 and math.isfinite(seconds)):
            raise ValueError(f"observed step time must be positive and finite, got {seconds}")
        bound = math.log(self.online.ratio_clip)
        rho = min(max(math.log(seconds / self._uncorrected(batch, k, window, real_tokens)), -bound), bound)
        keep = 1.0 - self.online.ema_weight
        # decay all evidence; a shape whose evidence has faded away is forgotten (priced as never seen)
        self._evidence = {s: (n * keep, total * keep) for s, (n, total) in self._evidence.items()
                          if n * keep > _FORGOTTEN}
        n, total = self._evidence.get((batch, k, window), (0.0, 0.0))
        self._evidence[(batch, k, window)] = (n + 1.0, total + rho)
        self._refit()
        self.observations += 1

    def propose_share(self, batch: int, k: int, window: int) -> float:
        """π_s: the fit's share of a shape's time spent proposing (0 at k = 0 or without a fit)."""
        key = (batch, k, window)
        if key not in self._shares:
            p = self.fit.propose(batch, k, window) if self.fit is not None else 0.0
            v = self.fit.verify(batch, k, window) if self.fit is not None else 0.0
            self._shares[key] = p / (p + v) if p + v > 0 else 0.0
        return self._shares[key]

    def _refit(self) -> None:
        """d, b and r_s from the evidence: the ridge least-squares solution of the module doc."""
        tau, tau0 = self.online.residual_prior, self.online.device_prior
        saa = sap = spp = sam = spm = 0.0
        for s, (n, total) in self._evidence.items():
            a, pi, m = n * tau / (n + tau), self.propose_share(*s), total / n  # a_s ≤ τ, π_s, m_s
            saa, sap, spp, sam, spm = saa + a, sap + a * pi, spp + a * pi * pi, sam + a * m, spm + a * pi * m
        # [Σa + τ₀, Σaπ; Σaπ, Σaπ² + λ] [d; b] = [Σa·m; Σaπ·m]; b's numerator, so its sign, does not depend on λ
        slope_numerator = (saa + tau0) * spm - sap * sam
        lam = self.online.draft_prior if slope_numerator >= 0 else self.online.faster_draft_prior
        det = (saa + tau0) * (spp + lam) - sap * sap
        self._log_device = (sam * (spp + lam) - sap * spm) / det
        self._draft_slope = slope_numerator / det
        self._residual = {s: n / (n + tau) * (total / n - self._log_device - self._draft_slope * self.propose_share(*s))
                          for s, (n, total) in self._evidence.items()}
