"""What the pipeline runs and reports: params.yaml `grid`, read by DVC (dvc.yaml's seeded stages are `foreach` /
`matrix` over it) and by the report and the promotion gate, so the three cannot list different models.

- `seeds`: every trained model downstream of SFT runs once per grid seed: RCTP (`rctp@<seed>`), its pool
  (`pool_rctp@<seed>`), its controllability check, every RL cell and every evaluation of these models. A run's
  own seed is its section's seed + the grid seed (`ops.config.seeded`), so seed 0 is the single-seed pipeline. The SFT
  model, its samples and its pool are shared by every seed (the data stages are not re-drawn): the interval
  over seeds is training variance from RCTP on, not the data's.
- `rl`: the RL cells, init -> algorithms (`sft: [grpo]` = the cell `sft-grpo`); dvc.yaml runs `rl_<init>`
  over seeds x algorithms. The default is the paper's comparison: SFT+GRPO, RCTP+GRPO, RCTP+RC-GRPO.
- `evaluate`: the models evaluated once (not per seed), label -> {model, adapter, dep, reward_token, flags}
  (the evaluate stage's arguments: `dep` is what DVC tracks when the model folder alone does not name the
  model; `flags`: more options): base and SFT by default. Each seed's RCTP model and RL cells are evaluated by
  `evaluate_rctp` and `evaluate_rl_<init>`.
"""

from __future__ import annotations

from dataclasses import dataclass

from rcgrpo_tasks.ops.names import ALGOS, INITS, SEEDED_MODELS

EVAL_KEYS = ("model", "adapter", "dep", "reward_token", "flags")


@dataclass(frozen=True)
class GridConfig:
    seeds: tuple[int, ...]
    """Grid seeds: RCTP, its pool and check, the RL cells and their evaluations run once per seed."""
    rl: dict
    """RL cells: init (`INITS`) -> algorithms (`ALGOS`); the cell of init i and algorithm a is `i-a`."""
    evaluate: dict
    """Models evaluated once: label -> {model, adapter, dep, reward_token, flags}."""

    def __post_init__(self) -> None:
        if not self.seeds or len(set(self.seeds)) != len(self.seeds) or any(
                not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in self.seeds):
            raise ValueError(f"seeds: distinct integers >= 0, at least one, got {list(self.seeds)}")
        if set(self.rl) != set(INITS):
            raise ValueError(f"rl: one list of algorithms per init {list(INITS)} (empty: none), got {sorted(self.rl)}")
        for init, algos in self.rl.items():
            if not isinstance(algos, list) or any(a not in ALGOS for a in algos) or len(set(algos)) != len(algos):
                raise ValueError(f"rl.{init}: a list of distinct algorithms from {list(ALGOS)}, got {algos!r}")
        if not self.cells:
            raise ValueError("rl: no cell (every init's list is empty)")
        for label, item in self.evaluate.items():
            if not isinstance(item, dict) or set(item) != set(EVAL_KEYS):
                raise ValueError(f"evaluate.{label}: expected keys {list(EVAL_KEYS)}, got {item!r}")
            if not label.replace("-", "").replace("_", "").isalnum():
                raise ValueError(f"evaluate.{label}: a label names folders: letters, digits, '-' and '_' only")
            if label in self.seeded_labels:
                raise ValueError(f"evaluate.{label}: a seeded model (evaluated per seed by its own stage)")

    @property
    def cells(self) -> list[str]:
        """The RL cells `<init>-<algo>`, in init order."""
        return [f"{init}-{algo}" for init in INITS for algo in self.rl[init]]

    @property
    def seeded_labels(self) -> list[str]:
        """What each seed evaluates: its RCTP model and every RL cell."""
        return [*SEEDED_MODELS, *self.cells]

    @property
    def labels(self) -> list[str]:
        """The models evaluated once."""
        return list(self.evaluate)
