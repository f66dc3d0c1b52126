"""The rollout function TRL calls: BFCL episodes (either task) on the project engine.

- `EngineRollout`: TRL's `rollout_func`. Per call it takes the rollouts' reward tokens the trainer drew
  (`rcgrpo.RCGRPOTrainer.reward_tokens`: the library's seeded draw, `reward_goal_place: external`), draws each
  group's sampling seed (`advantages`), decodes every group of the call in ONE engine session on the current policy
  (`engine.rollout.run_seeded_groups`: the same rollouts as one `run_group` per group), records the rollout
  diagnostics and the step's price (rollouts generated and trained on, groups dropped, tokens per useful
  group) on the trainer and hands TRL prompt ids (system + first user message, with the rollout's own
  reward token), completion ids (everything after: model and environment tokens, ending at the model's
  end-of-turn where it ended the episode itself), `env_mask` (environment tokens carry no loss), the
  sampling log-probs (the trainer measures and corrects the mismatch: `train.rl.offpolicy`) and every reward
  (`env.rewards.REWARDS`).
- Dynamic sampling (algo `dynamic`, DAPO's): a group without reward spread is dropped and its slot refilled
  by a group of another train entry, for at most `dynamic_max_rounds` generation rounds; groups still
  without spread are not trained on (their `env_mask` is all 0: no loss, no KL term), and a step with none
  left makes no update (the pipeline trainer skips it). A refilled group draws its own tokens (the
  library's draw at call 2 x round). Departures from DAPO: the batch
  keeps its size (TRL's layout), so an unfilled slot is masked rather than removed, and TRL's `grpo` loss
  still averages over every sequence of the batch, masked ones counting as 0.
- The policy it samples from: a merged low-precision copy on the policy's own device, refreshed every
  generation, or the live model; with vLLM, TRL's engine (`rollout_policy`).
The settings (`RLConfig`) are in `config.py`, the trainer (`build_trainer`) in `trainer.py`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import sys
import time

from rcgrpo import draw, group_metrics
from rcgrpo.draw import group_tokens, token_seed
from rcgrpo_tasks.engine import rollout as engine_rollout
from rcgrpo_tasks.engine.backend import stop_token_ids
from rcgrpo_tasks.engine.hf import HFBackend
from rcgrpo_tasks.env.prompt import ProtocolConfig
from rcgrpo_tasks.env.rewards import REWARDS, reward_value
from rcgrpo_tasks.env.tasks import task_of
from rcgrpo_tasks.train.common import distributed
from rcgrpo_tasks.train.rl import advantages as adv
from rcgrpo_tasks.train.rl.config import RLConfig
from rcgrpo_tasks.train.rl.diagnostics import failure_shares
from rcgrpo_tasks.train.rl.rollout_policy import policy_snapshot, rollout_dtype, trl_vllm_backend


def _n_calls(result) -> int:
    return sum(len(step) for turn in result for step in turn)


def _env_errors(messages) -> int:
    return sum(m.get("role") == "tool" and str(m.get("content", "")).startswith("Error during execution")
               for m in messages)


class EngineRollout:
    """TRL `rollout_func`: one group per run of identical entry ids in the (per-process) batch, all groups of a
    call (and of each refill round) decoded in one engine session (`groups`).

    `levels`: the reward tokens (label_rewards.tokens, lowest first); `protocol`: the episode settings
    (params `prompt` with `max_outputs`); `dynamic`: drop and refill groups without reward spread (module
    docstring); `mask_low`: the lowest token's rollouts count in their group's mean and spread (the
    advantage of every rollout is RC-GRPO's) but carry no loss (an all-0 `env_mask`), so RL never trains
    the low-conditioned policy directly (algo `rc_lowmask`: a decomposition of RC-GRPO; the shared weights
    still carry the high token's gradient to the low condition, as under GRPO).

    Across processes: TRL hands process p the p-th contiguous share of whole groups of the step's batch and
    each process decodes its own groups (no communication while decoding). A group's reward tokens and
    sampling seed depend on its index in the whole batch, never on the process decoding it, so N processes
    roll out exactly the groups one process would. Refill draws, the diagnostics and the price are
    computed from every process's groups (`distributed.gather`), identically on each."""

    def __init__(self, cfg: RLConfig, protocol: ProtocolConfig, mode: draw.Conditioning, levels: tuple[str, ...],
                 entries: dict, tokenizer, dynamic: bool = False, mask_low: bool = False):
        self.cfg, self.protocol, self.mode, self.levels = cfg, protocol, mode, tuple(levels)
        self.entries, self.tokenizer, self.dynamic, self.mask_low = entries, tokenizer, dynamic, mask_low
        self.last: list = []  # this process's trajectories of the latest call (tests, debugging)
        self.last_kept: list[bool] = []  # per group of this process in the latest call: trained on
        self.records: list[dict] = []  # every process's rollouts of the latest call, batch order (rollout_record)
        self.snapshot = None  # CPU: merged low-precision copy of the policy that the engine samples from
        self.generated_tokens = 0  # model tokens of every rollout this process generated in the latest call

    @functools.cached_property
    def end_ids(self) -> set[int]:
        """The engine's end-of-turn ids (EOS and the chat template's turn end)."""
        return stop_token_ids(self.tokenizer)

    def backend(self, trainer):
        """The engine backend over the current policy: TRL's vLLM, the refreshed snapshot, or the live model."""
        if trainer.use_vllm:
            return trl_vllm_backend(trainer, self.tokenizer)
        model = trainer.accelerator.unwrap_model(trainer.model)
        dtype = rollout_dtype(self.cfg.rollout_dtype)
        if dtype is not None:
            self.snapshot = policy_snapshot(model, dtype, self.snapshot)
            model = self.snapshot
        return HFBackend.from_model(model, self.tokenizer)

    def group_specs(self, entry_ids: list[str], step: int, slots: list[int], call: int,
                    tokens: list[list] | None = None) -> list[tuple]:
        """(entry, reward tokens, sampling) of one group of G rollouts per entry id; `slots`: each group's index
        in the step's whole batch; `tokens`: each group's reward tokens (the trainer's draw), None = drawn here
        as the library draws them, from (run seed, step, slot, call 2 x `call`). The sampling seed is drawn
        from (run seed, step, slot, call 2 x `call` + 1): a resumed run, or a run on another number of
        processes, regenerates the same groups."""
        g = self.cfg.num_generations
        specs = []
        for i, (eid, slot) in enumerate(zip(entry_ids, slots)):
            toks = tokens[i] if tokens is not None else group_tokens(
                g, self.mode, self.cfg.p_high, self.cfg.seed, step, slot, levels=self.levels, draw=self.cfg.token_draw,
                call=2 * call)
            sampling = self.cfg.decode.sampling(token_seed(self.cfg.seed, step, slot, call=2 * call + 1))
            specs.append((self.entries[eid], list(toks), sampling))
        return specs

    def groups(self, backend, entry_ids: list[str], step: int, slots: list[int], call: int,
               tokens: list[list] | None = None) -> list[list]:
        """The `group_specs` groups, every one decoded in ONE engine session (`engine.rollout.run_seeded_groups`):
        the backend batches all their rows and prefills each distinct prompt prefix once, and every group
        keeps the seeds it would have alone (the same rollouts as one `run_group` per group)."""
        specs = self.group_specs(entry_ids, step, slots, call, tokens)
        out = engine_rollout.run_seeded_groups(backend, specs, self.protocol)
        self.generated_tokens += sum(t.n_model_tokens for grp in out for t in grp)
        return out

    def _spread(self, group) -> bool:
        rewards = [reward_value(t.score, self.cfg.reward) if t.score else float("nan") for t in group]
        return group_metrics.spread_groups([float("nan") if r is None else r for r in rewards], len(group))[0]

    def refill(self, backend, groups: list[list], spread: list[bool], ids: list[str], step: int,
               first: int) -> dict:
        """Dynamic sampling: replace, in place, the groups without reward spread (`spread`, per group of this
        process, kept up to date; `first`: the batch index of its first group) by groups of train entries
        not used yet in the step, for up to `dynamic_max_rounds - 1` more rounds. Each round draws, with a
        seed of (run seed, step, round), one fresh entry per flat group of the WHOLE batch (every process
        draws the same list and decodes its own slots); rounds go on while any process has a flat group.
        Returns {rounds, spread flags of every group this process generated}."""
        generated = list(spread)
        used = {eid for part in distributed.gather(ids) for eid in part}
        rounds = 1
        while rounds < self.cfg.dynamic_max_rounds:
            flat = [j for j, ok in enumerate(f for part in distributed.gather(spread) for f in part) if not ok]
            if not flat:
                break
            rng = random.Random(draw.token_seed(self.cfg.seed, step, -1, call=rounds))
            pool = sorted(set(self.entries) - used) or sorted(self.entries)
            fresh = [pool[j] for j in rng.sample(range(len(pool)), len(flat))] if len(pool) >= len(flat) \
                else [rng.choice(pool) for _ in flat]
            used.update(fresh)
            mine = [(j - first, eid) for j, eid in zip(flat, fresh) if first <= j < first + len(groups)]
            new = self.groups(backend, [eid for _, eid in mine], step, [first + i for i, _ in mine], call=rounds)
            for (i, _), grp in zip(mine, new):
                groups[i], spread[i] = grp, self._spread(grp)
                generated.append(spread[i])
            rounds += 1
        return {"rounds": rounds, "generated": generated}

    def __call__(self, prompts: list, trainer) -> dict:
        step, acc = trainer.state.global_step, trainer.accelerator
        g = self.cfg.num_generations
        ids = []
        for start in range(0, len(prompts), g):
            group = prompts[start : start + g]
            if len(group) != g or len(set(group)) != 1:  # TRL lays out whole groups; check, never guess
                raise RuntimeError(f"rollout batch is not whole groups of G={g}: {prompts}")
            ids.append(group[0])
        first = acc.process_index * len(ids)  # every process holds the same number of groups (check_world)
        drawn = list(getattr(trainer, "reward_tokens", None) or [])
        tokens = ([drawn[i * g:(i + 1) * g] for i in range(len(ids))] if len(drawn) == len(prompts)
                  else None)  # the trainer's draw; None: no draw (conditioning none) or a bare TRL trainer
        model = trainer.model
        was_training = model.training
        model.eval()  # no dropout when sampling from the live model; TRL reads its mode before and after
        t0, self.generated_tokens = time.perf_counter(), 0
        try:
            backend = self.backend(trainer)
            groups = self.groups(backend, ids, step, [first + i for i in range(len(ids))], call=0, tokens=tokens)
            spread = [self._spread(grp) for grp in groups]
            if self.dynamic:
                gen = self.refill(backend, groups, spread, ids, step, first)
                kept = list(spread)
            else:
                gen = {"rounds": 1, "generated": list(spread)}
                kept = [True] * len(groups)
        finally:
            model.train(was_training)
        elapsed = time.perf_counter() - t0
        trajs = [t for grp in groups for t in grp]
        self.last, self.last_kept = trajs, kept
        trained = [kept[i // g] and not self.masked(t) for i, t in enumerate(trajs)]
        mine = [rollout_record(t, step, first + i // g, trained[i], self.failure(t)) for i, t in enumerate(trajs)]
        parts = distributed.gather((mine, elapsed, spread, kept, gen["generated"], self.generated_tokens))
        self.records = [r for p in parts for r in p[0]]
        kept_all = [k for p in parts for k in p[3]]
        for name, value in self.metrics(self.records, max(p[1] for p in parts)).items():
            trainer.record_metric(name, value)
        for name, value in self.price([s for p in parts for s in p[2]], kept_all, [f for p in parts for f in p[4]],
                                      gen["rounds"], sum(p[5] for p in parts),
                                      sum(r["trained"] for r in self.records)).items():
            trainer.record_metric(name, value)
        if self.dynamic and not any(kept_all) and acc.is_main_process:
            print(f"rl: step {step + 1}: no group with reward spread after {gen['rounds']} generation round(s); "
                  "nothing to train on, the step makes no update", file=sys.stderr, flush=True)
        return self.to_trl(trajs, trained)

    def masked(self, t) -> bool:
        """Whether a rollout carries no loss under `mask_low` (the lowest token's)."""
        return self.mask_low and t.reward_token == self.levels[0]

    def failure(self, t) -> str | None:
        """What a rollout's failure is made of (`env.failures`; None: a success or an unscored rollout): a
        failure is an answer the paper reward scores 0, whatever reward RL trains on."""
        if not t.score:
            return None
        entry = self.entries[t.entry_id]
        return task_of(entry).failure_kind(entry, t.result, reward_value(t.score, "paper_reward") == 1.0)

    def price(self, spread: list[bool], kept: list[bool], flags: list[bool], rounds: int, gen_tokens: int,
              trained: int | None = None) -> dict:
        """What the step's learning signal cost (`rc/...`): rollouts generated (all rounds) and trained on
        (`trained`: the rollouts with loss; None: every rollout of a kept group),
        groups dropped, useful groups (trained on, with reward spread), generation rounds, model tokens
        generated per useful group (NaN with none), and the zero-variance share of every generated group
        (`flags`: the spread of each)."""
        g = self.cfg.num_generations
        useful = sum(k and s for s, k in zip(spread, kept))
        return {
            "rc/rollouts_generated": len(flags) * g,
            "rc/rollouts_trained": sum(kept) * g if trained is None else trained,
            "rc/groups_dropped": sum(not f for f in flags) if self.dynamic else 0,
            "rc/useful_groups": useful,
            "rc/gen_rounds": rounds,
            "rc/gen_tokens_per_useful_group": gen_tokens / useful if useful else float("nan"),
            "rc/frac_zero_std_generated": sum(not f for f in flags) / len(flags),
        }

    def to_trl(self, trajs, trained: list[bool] | None = None) -> dict:
        """TRL's rollout fields, plus `r_<reward>` for every reward (TRL passes them to the reward functions).
        A rollout not `trained` on gets an all-zero `env_mask`: no token of it enters the loss. A rollout the
        model ended itself ends at its end-of-turn token (`advantages.end_at_stop`; `end_ids` are added to
        TRL's EOS ids), so TRL's `clipped_ratio` counts the rollouts cut by a budget."""
        keys = ("prompt_ids", "completion_ids", "logprobs", "env_mask", "reward_token", "entry_id")
        out: dict[str, list] = {k: [] for k in keys + tuple(f"r_{name}" for name in REWARDS)}
        for i, t in enumerate(trajs):
            p, c, m, lp = adv.trajectory_fields(t.token_ids, t.prompt_len, t.completion_mask, t.logprobs)
            if t.termination in adv.FINISHED:
                c, m, lp = adv.end_at_stop(c, m, lp, self.end_ids)
            if not c:  # nothing generated (context limit at once): one masked token keeps TRL's shapes; not an
                c, m, lp = [p[-1]], [0], [0.0]  # end-of-turn id, so TRL counts the rollout as truncated
            if trained is not None and not trained[i]:
                m = [0] * len(c)
            out["prompt_ids"].append(p)
            out["completion_ids"].append(c)
            out["env_mask"].append(m)
            out["logprobs"].append(lp)
            for name in REWARDS:
                out[f"r_{name}"].append(reward_value(t.score, name))
            out["reward_token"].append(t.reward_token)
            out["entry_id"].append(t.entry_id)
        return out

    def metrics(self, records: list[dict], elapsed: float) -> dict:
        """Rollout diagnostics of one call over every process's rollouts (`rollout_record`s; `elapsed`: the
        slowest process's rollout time), as `rc/...`: model tokens, calls, steps, environment errors, rollout
        speed, and each token level's failures by kind (`diagnostics.failure_shares`: `rc/fail_<kind>_<level>`).
        Rewards per token, the gap and the zero-variance shares are the trainer's (`rcgrpo.group_metrics`)."""
        n_tok = sum(r["model_tokens"] for r in records)
        n = len(records)
        return {
            "rc/model_tokens": n_tok / n,
            "rc/n_calls": sum(r["calls"] for r in records) / n,
            "rc/n_steps": sum(r["steps"] for r in records) / n,
            "rc/env_errors": sum(r["env_errors"] for r in records) / n,
            "rc/frac_terminated_error": sum(r["termination"] == "error" for r in records) / n,
            "rc/rollout_tokens_per_s": n_tok / elapsed if elapsed > 0 else float("nan"),
            "rc/rollout_s": elapsed,
            **failure_shares(records, self.levels),
        }


def rollout_record(t, step: int, group: int, kept: bool, failure: str | None = None) -> dict:
    """What the run logs of one rollout (`grpo.ROLLOUTS_FILE`, diagnostics): step, the group's index
    in the step's batch, entry, reward token, every reward, model tokens, calls, steps, environment errors,
    termination, whether it was trained on, what its failure is made of (`EngineRollout.failure`) and a hash
    of its token ids (the same rollout on any process)."""
    return {"step": step, "group": group, "entry_id": t.entry_id, "reward_token": t.reward_token,
            "rewards": {name: reward_value(t.score, name) if t.score else None for name in REWARDS},
            "model_tokens": t.n_model_tokens, "calls": _n_calls(t.result), "steps": t.n_steps,
            "env_errors": _env_errors(t.messages), "termination": t.termination, "trained": kept,
            "failure": failure,
            "tokens_sha1": hashlib.sha1(json.dumps(list(t.token_ids)).encode()).hexdigest()}
